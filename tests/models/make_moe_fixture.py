"""Make the Hugging Face transformers reference fixture for a tiny random Qwen3-MoE model.

Writes ``tests/models/fixtures/qwen3_moe/`` the way ``make_fixtures.py`` writes the dense ones
(same helpers, same weight re-initialisation, same versions; run it the same way, with
/work/venv311), and leaves the other fixtures alone:

- ``config.json``, ``model.safetensors``: ``save_pretrained`` output (float32, one file; the
  experts under HF's per-expert names ``mlp.experts.{e}.gate_proj.weight`` etc.);
- ``reference.npz``: ``input_ids`` / ``position_ids`` int32 [S, L] and ``logits`` float32
  [S, L, vocab] (each row run alone), plus ``greedy_prompts`` int32 [S, 8] and
  ``greedy_tokens`` int32 [S, 16]: 16 greedy tokens after each prompt, each the argmax of the
  last position of a full forward over everything before it (no cache, no EOS stop);
- ``README.md``: the config, tensor names and shapes, the smallest top-1 / top-2 logit gap
  of the greedy steps and the smallest router gap at the top-k boundary (how safe the
  token- and expert-level comparisons are from float noise).

    /work/venv311/bin/python tests/models/make_moe_fixture.py
"""

from __future__ import annotations

import os
import sys

import numpy as np
import safetensors
import torch
import transformers
from make_fixtures import OUT, SEED, TINY, L, S, logits_alone, make_config, reinit, sha
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

NAME = "qwen3_moe"
MOE = dict(
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling=None,
    tie_word_embeddings=False,
    use_sliding_window=False,
    attention_bias=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)
LAYERS = 3  # layers 0 and 2 sparse, layer 1 dense (mlp_only_layers)
PROMPT, NEW = 8, 16


@torch.no_grad()
def greedy(model, prompt: np.ndarray) -> tuple[np.ndarray, float]:
    """NEW greedy tokens (full forward per step) and the smallest top-1 - top-2 logit gap."""
    ids = list(int(t) for t in prompt)
    gap = np.inf
    for _ in range(NEW):
        x = torch.tensor([ids], dtype=torch.int64)
        last = model(input_ids=x, use_cache=False).logits[0, -1]
        top = torch.topk(last, 2).values
        gap = min(gap, float(top[0] - top[1]))
        ids.append(int(torch.argmax(last)))
    return np.asarray(ids[len(prompt) :], np.int32), gap


@torch.no_grad()
def router_gap(model, input_ids: np.ndarray) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability over every token and sparse layer."""
    gaps = []
    k = model.config.num_experts_per_tok

    def hook(_module, _inp, out):
        probs = torch.softmax(out[0].float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    for row in input_ids:
        model(input_ids=torch.from_numpy(row.astype(np.int64))[None], use_cache=False)
    for h in hs:
        h.remove()
    return min(gaps)


def main() -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    idx = 10  # seeds distinct from make_fixtures.py's five
    torch.manual_seed(SEED + idx)
    config = make_config(Qwen3MoeConfig, dict(MOE))
    config.num_hidden_layers = LAYERS
    config._attn_implementation = "eager"
    assert TINY["num_hidden_layers"] != LAYERS
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    reinit(model, torch.Generator().manual_seed(SEED + 100 + idx))
    ids_gen = torch.Generator().manual_seed(SEED + 200 + idx)
    input_ids = torch.randint(0, config.vocab_size, (S, L), generator=ids_gen).numpy().astype(np.int32)
    position_ids = np.tile(np.arange(L, dtype=np.int32), (S, 1))
    logits = logits_alone(model, input_ids)
    prompts = input_ids[:, :PROMPT]
    outs = [greedy(model, p) for p in prompts]
    tokens = np.stack([o[0] for o in outs])
    token_gap = min(o[1] for o in outs)
    rgap = router_gap(model, input_ids)

    d = OUT / NAME
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    for extra in d.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    np.savez(
        d / "reference.npz",
        input_ids=input_ids,
        position_ids=position_ids,
        logits=logits,
        greedy_prompts=prompts,
        greedy_tokens=tokens,
    )
    ok = True
    re = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    same = np.array_equal(logits.view(np.uint32), logits_alone(re, input_ids).view(np.uint32))
    ok &= same
    with safetensors.safe_open(d / "model.safetensors", "pt") as f:
        tensors = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    experts = sorted(k for k in tensors if ".experts." in k)
    ok &= len(experts) == 2 * 8 * 3  # 2 sparse layers x 8 experts x gate/up/down
    spread = logits.std(axis=-1)
    ok &= spread.min() > 0.5
    lines = [
        f"reload bit-exact: {same}; {len(experts)} expert tensors; logits std min {spread.min():.3f}",
        f"greedy: smallest top-1/top-2 logit gap {token_gap:.4f}; router: smallest k/k+1 probability gap {rgap:.2e}",
    ]
    print("\n".join(lines))
    write_readme(config, tensors, d, token_gap, rgap, spread)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def write_readme(config, tensors, d, token_gap, rgap, spread) -> None:
    v = f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}"
    md = [
        "# `qwen3_moe`: HF transformers reference fixture (tiny random Qwen3-MoE)",
        "",
        "Made by `tests/models/make_moe_fixture.py` (deterministic; do not edit by hand), with the",
        f"helpers and weight re-initialisation of `make_fixtures.py`. Versions: {v}; torch threads 1.",
        "",
        f"`Qwen3MoeForCausalLM`: hidden 64, {LAYERS} layers - 0 and 2 mixture-of-experts, 1 dense",
        "(`mlp_only_layers: [1]`, intermediate 128) - 8 experts, top 2 per token, `norm_topk_prob: true`,",
        "moe_intermediate_size 32; 4 heads / 2 KV heads of 64 with q/k norms; vocab 256; float32.",
        "Router weights ~ N(0, 1/64) (router logits ~ N(0, 1)), expert weights ~ N(0, 1/fan_in).",
        "",
        "`reference.npz`: `input_ids`, `position_ids` int32 [3, 24]; `logits` float32 [3, 24, 256]",
        "(each row alone, eager attention, eval, no_grad); `greedy_prompts` int32 [3, 8] (the first 8",
        "ids of each row) and `greedy_tokens` int32 [3, 16]: 16 greedy tokens after each prompt, each",
        "the argmax of a full no-cache forward's last position (no EOS stop).",
        "",
        f"Smallest top-1 / top-2 logit gap over the greedy steps: {token_gap:.4f}; smallest gap between",
        "the 2nd and 3rd router probability over every token of `input_ids` and both sparse layers:",
        f"{rgap:.2e} (float noise ~1e-6 cannot flip a token or an expert choice). Logit std across the",
        f"vocabulary: min {spread.min():.2f}, mean {spread.mean():.2f}.",
        "",
        "Files: "
        + ", ".join(f"`{p.name}` {p.stat().st_size} B (sha256 {sha(p)}…)" for p in sorted(d.iterdir())),
        "",
        "| tensor | shape |",
        "| --- | --- |",
    ]
    md += [f"| `{k}` | {list(s)} |" for k, s in sorted(tensors.items())]
    md.append("")
    (d / "README.md").write_text("\n".join(md))


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
