"""Qwen3-MoE: a token's bits do not depend on which or how many other tokens chose its experts.

On ``tiny-moe`` (8 experts, top 2, a dense layer between two sparse ones), float32: through the
engine a request alone == in a batch (its prompt chunked differently), generate's logprobs ==
``score`` (prefill vs decode) == the trainer's ``bijax.logprobs``; at the model level a token's
logits are the same decoded alone, in prefill chunks, and among sequences made of its own tokens
(every expert it uses shared with many others); the MoE block alone vs among 63 tokens routed
to the same experts. Negative controls: the XLA path (``lax.ragged_dot``) differs on the same
checks. Parity of 16 greedy tokens with transformers (fixture ``qwen3_moe``), the invariance
audit of the step, bad checkpoints, tensor parallelism refused.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bijax
from bijax import SamplingParams as SP
from bijax.sampler import SamplingRows
from bijax.step_programs import sample_program
from models.loading import load_hf, load_model
from models.ops import moe
from models.paged import PagedBatch
from models.safetensors import SafetensorsFile, save_file
from tests.bijax.test_audit import forward_jaxprs, reductions_outside_kernels
from tests.conftest import bits
from tests.models.harness import Paged, chunked, interleaved

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "models", "fixtures", "qwen3_moe")
KW = dict(dtype=jnp.float32, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=40)
PROMPTS = [[5, 9, 13] * 9, [7, 3] * 5, [11, 17, 23, 29] * 10, [2, 4, 6, 8]]
SPS = [SP(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True) for i in range(4)]


@functools.cache
def _llm():
    return bijax.LLM("tiny-moe", **KW)


def _same(a, b) -> bool:
    return a.outputs[0].token_ids == b.outputs[0].token_ids and np.array_equal(
        bits(a.outputs[0].logprobs), bits(b.outputs[0].logprobs)
    )


def test_engine_alone_equals_batched_equals_score_and_trainer():
    llm = _llm()
    assert llm.model.config.is_moe
    batch = llm.generate(PROMPTS, SPS, use_tqdm=False)
    alone = [llm.generate([p], [s], use_tqdm=False)[0] for p, s in zip(PROMPTS, SPS, strict=True)]
    assert all(_same(a, b) for a, b in zip(alone, batch, strict=True))
    # prefill vs decode: score() over prompt + completion gives generate's logprobs
    seqs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, batch, strict=True)]
    scored = llm.score(seqs, prompt_lens=[len(p) for p in PROMPTS], temperature=0.8)
    for s, o in zip(scored, batch, strict=True):
        np.testing.assert_array_equal(bits(s), bits(o.outputs[0].logprobs))
    # the trainer side: bijax.logprobs of a right-padded batch == generate's, bit for bit
    width = max(len(s) for s in seqs)
    tokens = np.asarray([s + [0] * (width - len(s)) for s in seqs], np.int32)
    lp = np.asarray(bijax.logprobs(llm.model, tokens, temperature=0.8))
    for row, p, o in zip(lp, PROMPTS, batch, strict=True):
        np.testing.assert_array_equal(bits(row[len(p) : len(p) + 6]), bits(o.outputs[0].logprobs))
    # control: the XLA path's trainer logprobs of the same tokens are other bits
    xla = np.asarray(bijax.logprobs(llm.model, tokens, temperature=0.8, invariant=False))
    assert not np.array_equal(bits(xla), bits(lp))


def _routes(model, *, invariant: bool):
    """A sequence's logits by several routes: the full forward alone and in a batch of 4; paged,
    alone token by token and in prefill chunks of 3 and 17; and paged, interleaved with three
    sequences built from its own tokens (so every expert it picks is shared with many tokens of
    the same step), at another slot. The first is the reference."""
    rng = np.random.default_rng(0)
    a = rng.integers(3, 512, 24).astype(np.int32)
    others = [np.roll(a, 5), a[::-1].copy(), np.concatenate([a[:12], a[:12]])]
    fwd = jax.jit(lambda m, t: m.forward(t, invariant=invariant))
    out = {"full": np.asarray(fwd(model, jnp.asarray(a[None])))[0]}
    out["full batch"] = np.asarray(fwd(model, jnp.asarray(np.stack([*others, a]))))[3]
    p = Paged(model, seed=1)
    out["decode"] = p.run([a], chunked(0, 24, 1), invariant=invariant)[0]
    out["chunks"] = p.run([a], [[(0, 3)], [(0, 17)], [(0, 4)]], invariant=invariant)[0]
    seqs = [*others, a]
    steps = interleaved([len(s) for s in seqs], [7, 5, 9, 6])
    out["shared"] = p.run(seqs, steps, invariant=invariant, slots=[0, 1, 2, 3])[3]
    return out


def test_model_token_logits_identical_alone_chunked_and_with_shared_experts():
    out = _routes(_llm().model, invariant=True)
    for route in ("full batch", "decode", "chunks", "shared"):
        np.testing.assert_array_equal(bits(out[route]), bits(out["full"]), err_msg=route)


def test_negative_control_xla_path_differs_across_the_same_routes():
    out = _routes(_llm().model, invariant=False)
    ref = bits(out.pop("full"))
    assert any(not np.array_equal(bits(o), ref) for o in out.values())


@pytest.mark.parametrize("invariant,dtype", [(True, jnp.float32), (True, jnp.bfloat16), (False, jnp.float32)])
def test_moe_block_token_alone_vs_among_tokens_sharing_its_experts(invariant, dtype):
    """The MoE block on one token, and on that token among 63 copies of it and of a second token
    (every group of its experts 64 rows instead of 1): same bits on the invariant path; the
    XLA path (ragged_dot) differs - the control."""
    layer = _llm().model.layers[0].mlp
    c = _llm().model.config
    w = [layer.router[...], layer.experts_gate[...], layer.experts_up[...], layer.experts_down[...]]
    w = [a.astype(dtype) for a in w]
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, c.hidden_size), np.float32)).astype(dtype)
    fn = jax.jit(
        lambda x: moe(x, *w, top_k=2, norm_topk_prob=True, invariant=invariant, k_shards=1),
    )
    alone = bits(fn(x[:1]))
    many = bits(fn(jnp.concatenate([x[:1], jnp.tile(x, (31, 1)), x[1:]])))
    assert np.array_equal(alone, many[:1]) == invariant


def test_greedy_tokens_match_transformers():
    ref = np.load(os.path.join(FIXTURE, "reference.npz"), allow_pickle=False)
    llm = bijax.LLM(load_hf(FIXTURE), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    outs = llm.generate(
        [list(map(int, p)) for p in ref["greedy_prompts"]],
        SP(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == ref["greedy_tokens"].tolist()


def test_engine_step_has_no_reduction_outside_the_kernels():
    r = _llm().engine.runner
    sampling = SamplingRows.greedy(4)
    sampling.temperature[:] = 1.0

    def found(invariant):
        smp = lambda lg, s: sample_program(lg, s, invariant=invariant, num_logprobs=0, filters=True)  # noqa: E731
        jaxprs = [
            *forward_jaxprs(r, 4, 32, invariant),
            jax.make_jaxpr(smp)(r._logits_spec(4), sampling).jaxpr,
        ]
        return [x for j in jaxprs for x in reductions_outside_kernels(j)]

    assert found(True) == []
    assert {"sort", "dot_general"} <= set(found(False))  # the control


def test_sparse_layer_rule_and_hf_config_keys():
    """HF's rule: (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers; the released
    checkpoints' ``num_experts`` and transformers 5's ``num_local_experts`` both read."""
    from models.configs import LlamaConfig

    hf = json.loads(open(os.path.join(FIXTURE, "config.json")).read())
    hf.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg = LlamaConfig.from_hf(hf)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    hf["num_experts"] = hf.pop("num_local_experts")
    assert LlamaConfig.from_hf(hf) == cfg
    with pytest.raises(ValueError, match="num_experts_per_tok .* exceeds num_experts"):
        LlamaConfig.from_hf({**hf, "num_experts_per_tok": 9})


def test_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        bijax.LLM("tiny-moe", tensor_parallel_size=2, **KW)
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        load_model("tiny-moe", tensor_parallel_size=2)


# --------------------------------------------------------------------------- bad checkpoints


def _copy_fixture(tmp_path, drop=None, rename=None, config=None):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.names() if n != drop}
    if rename:
        tensors[rename[1]] = tensors.pop(rename[0])
    del f
    save_file(tensors, d / "model.safetensors")
    if config:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_missing_expert_tensor_is_named(tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=f"tensor '{name}' is missing"):
        load_hf(_copy_fixture(tmp_path, drop=name))


def test_fewer_experts_in_config_than_in_checkpoint_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"experts\.4\.gate_proj\.weight.*num_experts=4"):
        load_hf(_copy_fixture(tmp_path, config={"num_local_experts": 4}))


def test_more_experts_in_config_than_in_checkpoint_is_named(tmp_path):
    with pytest.raises(
        ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight' is missing"
    ):
        load_hf(_copy_fixture(tmp_path, config={"num_local_experts": 16}))


def test_misshaped_router_and_missing_config_keys(tmp_path):
    d = _copy_fixture(tmp_path, config={"moe_intermediate_size": 16})
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight' has shape \(32, 64\)"):
        load_hf(d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks num_experts_per_tok"):
        load_hf(d)


def test_bijax_check_passes_on_tiny_moe_and_control_detects(capsys):
    from bijax import cli

    args = ["--model", "tiny-moe", "--dtype", "float32", "--requests", "4", "--max-tokens", "5"]
    args += ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "128"]
    rc = cli.main(["check", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    dims = (
        "batch 1 vs N",
        "needle in a batch",
        "prefill vs decode",
        "chunk sizes",
        "prefix cache",
        "preemption",
    )
    for dim in dims:
        assert " PASS " in next(x for x in out.splitlines() if x.startswith(dim)), dim
    assert next(x for x in out.splitlines() if x.startswith("negative control")).split()[2] == "DETECTED"


def test_paged_forward_lowers_to_the_grouped_kernel_on_cuda():
    from flax import nnx

    from models.configs import preset
    from models.llama import Llama
    from models.paged import init_kv_cache
    from pallas_kernels.runtime import cuda_export

    model = Llama(preset("tiny-moe"), dtype=jnp.bfloat16, seed=0)
    graphdef, state = nnx.split(model)
    cache = init_kv_cache(model.config, 16, 16, jnp.bfloat16)

    def step(state, cache, tok, seq, pos, slot, tables, lens):
        batch = PagedBatch(tok, seq, pos, slot, tables, lens)
        return nnx.merge(graphdef, state).forward_paged(batch, cache)

    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = (
        jax.tree.map(spec, state),
        jax.tree.map(spec, cache),
        i32(8),
        i32(8),
        i32(8),
        i32(8),
        i32(4, 8),
        i32(4),
    )
    text = cuda_export(step, *args)
    for kernel in ("bijax_grouped_matmul", "bijax_matmul", "bijax_softmax_stats", "bijax_attention_tiles"):
        assert f'name = "{kernel}"' in text, kernel
