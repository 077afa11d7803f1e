"""Make the Hugging Face transformers reference fixtures for tiny random Llama-family models.

Writes, for each config in CONFIGS, ``tests/models/fixtures/<name>/``:

- ``config.json``        HF's own ``config.save_pretrained`` output,
- ``model.safetensors``  ``save_pretrained(..., safe_serialization=True)``, float32, one file,
- ``reference.npz``      ``input_ids`` int32 [S, L], ``position_ids`` int32 [S, L] (0..L-1 in each row),
                         ``logits`` float32 [S, L, vocab]: transformers' float32 logits for each
                         sequence run ALONE (batch 1, no attention mask, eager attention, eval, no_grad).

and ``tests/models/fixtures/README.md`` (what each fixture is, versions, tensor names/shapes, sizes).

The weights are re-initialised after construction (HF's std-0.02 init gives near-uniform logits,
which would make a parity test weak): every parameter, norms and biases included, gets O(1)-scale
values; see ``reinit``. Everything is seeded, so re-running gives the same bytes.

Not a test (pytest never collects it) and not run by CI: it needs torch + transformers, which the
project's own (Python 3.12, JAX) environment does not have. To re-make the fixtures, from the repo root:

    $(pyenv root)/versions/3.11.7/bin/python3.11 -m venv /work/venv311
    /work/venv311/bin/pip install --upgrade pip
    # torch's CPU build (a local wheel on the project's machines; elsewhere add
    #   --index-url https://download.pytorch.org/whl/cpu  and drop the "+cpu")
    /work/venv311/bin/pip install "torch==2.13.0+cpu"
    /work/venv311/bin/pip install "torch==2.13.0+cpu" transformers==5.24.0 safetensors==0.8.0 \\
        numpy==2.4.6 gguf==0.19.0 sentencepiece==0.2.3 tokenizers==0.23.3 jinja2==3.1.6 protobuf==7.36.2
    /work/venv311/bin/python tests/models/make_fixtures.py

The script then reloads every saved directory with ``AutoModelForCausalLM.from_pretrained`` and
checks that the logits reproduce bit for bit; it exits non-zero if any check fails.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import safetensors
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

OUT = Path(__file__).resolve().parent / "fixtures"
SEED = 1234
S, L = 3, 24  # sequences, tokens per sequence

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # bijax attention supports head_dim 64 and 128
    vocab_size=256,
    max_position_embeddings=256,
    hidden_act="silu",
    initializer_range=0.02,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# name -> (config class, model class, config kwargs, description)
CONFIGS = {
    "llama2": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False),
        "Llama-2 style: rope_theta 1e4, plain RoPE, untied lm_head, no biases.",
    ),
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=False),
        "Llama-3.1 style: rope_theta 5e5, 'llama3' RoPE scaling (factor 8, low 1, high 4, "
        "original_max_position_embeddings 64, so it changes 7 of the 8 frequencies), untied lm_head.",
    ),
    "smollm2": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True),
        "SmolLM2 style (LlamaConfig): rope_theta 1e5, plain RoPE, lm_head TIED to embed_tokens.",
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling=None,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
        "Qwen2 style: q/k/v projections WITH bias (o_proj and MLP without), rope_theta 1e6, "
        "rms_norm_eps 1e-6, untied lm_head, no sliding window.",
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling=None,
            tie_word_embeddings=False,
            use_sliding_window=False,
            attention_bias=False,
        ),
        "Qwen3 dense: an RMSNorm over each head's q and k (q_norm / k_norm, weights [head_dim], "
        "re-initialised away from 1) before RoPE, no q/k/v bias, rope_theta 1e6, untied lm_head.",
    ),
}

# Re-initialisation scales (see reinit).
QK_GAIN = 1.5  # attention scores ~N(0, 1.5^2) rather than ~N(0, 1): less uniform attention
LOGIT_STD = 2.5  # target std of the logits across the vocab
BIAS_STD = 0.5  # q/k/v biases (qwen2): large enough that a dropped bias is glaring
NORM_STD = 0.1  # norm weights ~ 1 + 0.1 N(0, 1)


def make_config(cfg_cls, kw):
    kw = dict(kw)
    scaling = kw.pop("rope_scaling")
    theta = kw.pop("rope_theta")
    # transformers 5 keeps rope_theta and the scaling together in `rope_parameters`.
    rope = (
        {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    )
    return cfg_cls(**TINY, **kw, rope_parameters=rope, dtype="float32")


@torch.no_grad()
def reinit(model, gen: torch.Generator) -> None:
    """Give every parameter O(1)-scale values, in named_parameters order, from one generator.

    Pre-norm blocks see inputs with RMS ~ 1, so a linear weight ~ N(0, gain^2 / fan_in) keeps its
    outputs ~ N(0, gain^2). embed_tokens ~ N(0, 1); the lm_head (or, when tied, the shared embedding)
    is scaled so logits have std ~ LOGIT_STD. Norm weights ~ 1 + NORM_STD N(0,1), biases ~ BIAS_STD N(0,1).
    """
    cfg = model.config
    tied = cfg.tie_word_embeddings
    for name, p in model.named_parameters():  # a tied lm_head is the same Parameter: listed once
        z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("embed_tokens.weight"):
            std = LOGIT_STD / math.sqrt(cfg.hidden_size) if tied else 1.0
        elif name == "lm_head.weight":
            std = LOGIT_STD / math.sqrt(cfg.hidden_size)
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + NORM_STD * z)
            continue
        elif name.endswith(".bias"):
            std = BIAS_STD
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            std = QK_GAIN / math.sqrt(p.shape[1])
        elif name.endswith(".weight") and p.ndim == 2:
            std = 1.0 / math.sqrt(p.shape[1])
        elif p.ndim == 3:  # stacked MoE experts [E, out, in] (make_moe_fixture.py)
            std = 1.0 / math.sqrt(p.shape[2])
        else:
            raise ValueError(f"no init rule for {name} {tuple(p.shape)}")
        p.copy_(std * z)


@torch.no_grad()
def logits_alone(model, input_ids: np.ndarray) -> np.ndarray:
    """float32 logits [S, L, V], each sequence run by itself (batch 1, no mask)."""
    out = []
    for row in input_ids:
        ids = torch.from_numpy(row.astype(np.int64))[None]
        pos = torch.arange(ids.shape[1], dtype=torch.int64)[None]
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert logits.dtype == torch.float32, logits.dtype
        out.append(logits[0].numpy().copy())
    return np.stack(out)


def check_llama3_rope(model) -> str:
    rot = model.model.rotary_emb
    cfg = model.config
    theta = cfg.rope_parameters["rope_theta"]
    d = cfg.head_dim
    plain = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaled = rot.inv_freq
    changed = int((scaled != plain).sum())
    assert changed > 0, "llama3 rope scaling changed no frequency"
    ratio = (plain / scaled).tolist()
    return f"llama3 rope: {changed}/{len(plain)} inv_freq changed; plain/scaled = " + ", ".join(
        f"{r:.3f}" for r in ratio
    )


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def main() -> int:
    torch.set_num_threads(1)  # one summation order for the reference, whatever the machine
    torch.use_deterministic_algorithms(True)
    OUT.mkdir(parents=True, exist_ok=True)
    ok = True
    report = {}
    for idx, (name, (cfg_cls, model_cls, kw, desc)) in enumerate(CONFIGS.items()):
        torch.manual_seed(SEED + idx)
        np.random.seed(SEED + idx)
        config = make_config(cfg_cls, kw)
        config._attn_implementation = "eager"
        model = model_cls(config).to(torch.float32).eval()
        gen = torch.Generator().manual_seed(SEED + 100 + idx)
        reinit(model, gen)
        if config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight, "lm_head not tied"
        ids_gen = torch.Generator().manual_seed(SEED + 200 + idx)
        input_ids = torch.randint(0, config.vocab_size, (S, L), generator=ids_gen).numpy().astype(np.int32)
        position_ids = np.tile(np.arange(L, dtype=np.int32), (S, 1))

        logits = logits_alone(model, input_ids)
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        # save_pretrained also writes generation_config.json; keep only what the fixture promises.
        for extra in d.iterdir():
            if extra.name not in ("config.json", "model.safetensors"):
                extra.unlink()
        np.savez(d / "reference.npz", input_ids=input_ids, position_ids=position_ids, logits=logits)

        # --- checks ---
        lines = [f"{name}: {desc}"]
        spread = logits.std(axis=-1)  # std across the vocab, per position
        z = np.exp(logits - logits.max(-1, keepdims=True))
        top_p = (z / z.sum(-1, keepdims=True)).max(-1)
        lines.append(
            f"  logits std across vocab: min {spread.min():.3f} mean {spread.mean():.3f}; "
            f"|logits| max {np.abs(logits).max():.2f}; top softmax prob mean {top_p.mean():.3f}"
        )
        if spread.min() <= 0.5:
            lines.append("  FAIL: logits spread too small")
            ok = False
        if name == "llama3":
            lines.append("  " + check_llama3_rope(model))

        with safetensors.safe_open(d / "model.safetensors", "pt") as f:
            tensors = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
            meta = f.metadata()
        if any(dt != "F32" for _, dt in tensors.values()):
            lines.append("  FAIL: non-F32 tensor saved")
            ok = False
        if name == "qwen2":
            biases = [k for k in tensors if k.endswith(".bias")]
            want = {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"}
            if set(biases) != want:
                lines.append(f"  FAIL: qwen2 biases {biases}")
                ok = False
        if config.tie_word_embeddings and "lm_head.weight" in tensors:
            lines.append("  note: tied model still saves lm_head.weight")

        # reload and compare bit for bit
        re = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        logits2 = logits_alone(re, input_ids)
        same = np.array_equal(logits.view(np.uint32), logits2.view(np.uint32))
        lines.append(f"  reload bit-exact: {same}")
        ok &= same
        sd_re = re.state_dict()
        for k, v in model.state_dict().items():
            if not torch.equal(sd_re[k], v):
                lines.append(f"  FAIL: reloaded {k} differs")
                ok = False

        sizes = {p.name: p.stat().st_size for p in sorted(d.iterdir())}
        report[name] = dict(
            desc=desc,
            tensors=tensors,
            metadata=meta,
            sizes=sizes,
            sha={p.name: sha(p) for p in sorted(d.iterdir())},
            spread=(float(spread.min()), float(spread.mean())),
            extra=[ln.strip() for ln in lines[2:] if "rope" in ln],
            params=sum(int(np.prod(s)) for s, _ in tensors.values()),
        )
        print("\n".join(lines), flush=True)

    write_readme(report)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"total fixture size: {total} bytes ({total / 2**20:.2f} MiB)")
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def write_readme(report) -> None:
    v = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
    md = [
        "# HF transformers reference fixtures (tiny random Llama-family models)",
        "",
        "Made by `tests/models/make_fixtures.py` (its docstring says how to rebuild the venv and re-run it;",
        "the output is deterministic). Do not edit by hand.",
        "",
        "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + f"; torch threads 1; seed {SEED}.",
        "",
        "## Layout",
        "",
        "Each `<name>/` holds:",
        "",
        "- `config.json`: `config.save_pretrained` output (transformers 5 format: rope in `rope_parameters`).",
        "- `model.safetensors`: `save_pretrained(safe_serialization=True)`, all tensors F32, one file.",
        "- `reference.npz` (`np.savez`, no pickle; load with `allow_pickle=False`):",
        f"  - `input_ids` int32 [{S}, {L}]: random token ids in [0, vocab) (fixed seed), no padding;",
        f"  - `position_ids` int32 [{S}, {L}]: 0..{L - 1} in every row;",
        f"  - `logits` float32 [{S}, {L}, {TINY['vocab_size']}]: transformers' float32 logits for each row run ALONE",
        '    (batch 1, no attention mask => plain causal, `attn_implementation="eager"`, `model.eval()`,',
        "    `torch.no_grad()`, `torch.set_num_threads(1)`).",
        "",
        "All four: hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads (GQA 2:1), head_dim 64,",
        "vocab 256, max_position_embeddings 256, SiLU MLP, float32.",
        "",
        "Weights are NOT HF's init: after construction every parameter is re-drawn (seeded) so activations",
        "and logits are O(1): embed_tokens ~ N(0,1) (tied: N(0, (2.5/sqrt(64))^2)); q/k_proj ~ N(0, 1.5^2/fan_in);",
        "other linears ~ N(0, 1/fan_in); lm_head ~ N(0, 2.5^2/64) (logit std ~2.5); norm weights ~ 1 + 0.1 N(0,1);",
        "q/k/v biases (qwen2) ~ 0.5 N(0,1).",
        "",
        "## Fixtures",
        "",
    ]
    for name, r in report.items():
        md += [
            f"### `{name}`",
            "",
            r["desc"],
            "",
            f"{r['params']} parameters stored. Logit std across vocab: min {r['spread'][0]:.2f}, "
            f"mean {r['spread'][1]:.2f}.",
        ]
        for e in r["extra"]:
            md.append(f"{e[0].upper()}{e[1:]}.")
        md += [
            "",
            "Files: " + ", ".join(f"`{k}` {s} B (sha256 {r['sha'][k]}…)" for k, s in r["sizes"].items()),
            "",
            f"safetensors metadata: `{json.dumps(r['metadata'])}`",
            "",
            "| tensor | shape | dtype |",
            "| --- | --- | --- |",
        ]
        md += [f"| `{k}` | {list(s)} | {dt} |" for k, (s, dt) in r["tensors"].items()]
        md.append("")
    base = set(report["llama2"]["tensors"])
    md += [
        "## Differences in stored tensors (vs `llama2`)",
        "",
    ]
    for name, r in report.items():
        if name == "llama2":
            continue
        t = set(r["tensors"])
        extra, missing = sorted(t - base), sorted(base - t)
        md.append(f"- `{name}`: extra {extra or 'none'}; missing {missing or 'none'}.")
    md.append("")
    (OUT / "README.md").write_text("\n".join(md))


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
