"""The Llama model: parity with transformers, model-level bit invariance, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.configs import preset
from models.llama import Llama, param_state
from models.loading import load_hf
from models.paged import PagedBatch, init_kv_cache
from tests.conftest import bits
from tests.models.harness import Paged, chunked, interleaved

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE_NAMES = ("llama2", "llama3", "smollm2", "qwen2", "qwen3", "qwen3_moe")
_FWD = nnx.jit(Llama.forward, static_argnames="invariant")


def _rel(out, ref) -> float:
    """max |out - ref| / max |ref| of one position (the issue's criterion), worst over positions."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float((np.abs(out - ref).max(axis=-1) / np.abs(ref).max(axis=-1)).max())


# --------------------------------------------------------------------------- parity with transformers


@pytest.fixture(scope="module", params=FIXTURE_NAMES)
def fixture(request):
    d = os.path.join(FIXTURES, request.param)
    ref = np.load(os.path.join(d, "reference.npz"), allow_pickle=False)
    return request.param, load_hf(d), ref["input_ids"], ref["logits"]


@pytest.mark.parametrize("invariant", [True, False])
def test_full_forward_matches_transformers(fixture, invariant):
    name, model, ids, ref = fixture
    assert model.dtype == jnp.float32
    out = np.asarray(_FWD(model, jnp.asarray(ids), invariant=invariant))
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert _rel(out, ref) <= 1e-4, name


@pytest.mark.parametrize("invariant", [True, False])
def test_paged_forward_matches_transformers(fixture, invariant):
    name, model, ids, ref = fixture
    # Three sequences in mixed steps: prefill chunks of 5/7/24 tokens, then the rest.
    steps = [[(0, 5), (1, 7), (2, 24)], [(0, 19), (1, 17)]]
    out = Paged(model, seed=3).run(list(ids), steps, bucket=48, invariant=invariant)
    for o, r in zip(out, ref, strict=False):
        assert _rel(o, r) <= 1e-4, name


def test_fixture_features_are_exercised():
    """The fixtures cover what they claim: llama3 scaling, tied head, q/k/v bias."""
    cfgs = {n: load_hf(os.path.join(FIXTURES, n)).config for n in FIXTURE_NAMES}
    assert cfgs["llama2"].rope_scaling is None and not cfgs["llama2"].tie_word_embeddings
    assert cfgs["llama3"].rope_scaling is not None
    assert not np.allclose(cfgs["llama3"].inv_freq(), 1 / 500000.0 ** (np.arange(0, 64, 2) / 64))
    assert cfgs["smollm2"].tie_word_embeddings
    assert cfgs["qwen2"].attention_bias and cfgs["qwen2"].rms_norm_eps == 1e-6
    assert cfgs["qwen3"].qk_norm and not cfgs["qwen3"].attention_bias and not cfgs["qwen2"].qk_norm
    qn = np.asarray(load_hf(os.path.join(FIXTURES, "qwen3")).layers[0].attn.q_norm[...])
    assert qn.shape == (64,) and np.abs(qn - 1).max() > 0.05  # the q/k norms are not identities
    assert cfgs["llama2"].num_heads != cfgs["llama2"].num_kv_heads  # GQA
    moe = cfgs["qwen3_moe"]  # sparse layers 0 and 2, a dense layer 1, renormalised top 2 of 8
    assert moe.qk_norm and moe.norm_topk_prob and (moe.num_experts, moe.num_experts_per_tok) == (8, 2)
    assert [moe.is_moe_layer(i) for i in range(moe.num_layers)] == [True, False, True]


# --------------------------------------------------------------------------- invariance (bits)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def tiny(request):
    return Llama(preset("tiny"), dtype=request.param, seed=0)


def _routes(model, invariant: bool):
    """One sequence's logits along every route: full forward alone and batched, paged
    chunks 1 (decode) / 3 / 17 / all, and mixed with other sequences at another slot."""
    rng = np.random.default_rng(7)
    v = model.config.vocab_size
    a = rng.integers(0, v, 37)
    others = [rng.integers(0, v, n) for n in (5, 60, 23)]
    routes = {}
    routes["full"] = np.asarray(_FWD(model, jnp.asarray(a[None], jnp.int32), invariant=invariant))[0]
    batch = np.stack([np.resize(o, 37) for o in others[:2]] + [a] + [np.resize(others[2], 37)])
    routes["full batch of 4"] = np.asarray(_FWD(model, jnp.asarray(batch, jnp.int32), invariant=invariant))[2]
    paged = Paged(model, seed=1)
    for c in (1, 3, 17, 37):
        routes[f"paged chunks of {c}"] = paged.run([a], chunked(0, 37, c), invariant=invariant)[0]
    seqs = others[:2] + [a] + others[2:]
    steps = interleaved([len(s) for s in seqs], [7, 4, 5, 9])
    routes["paged mixed batch"] = paged.run(seqs, steps, invariant=invariant, slots=[3, 0, 5, 1])[2]
    return routes


def test_token_logits_identical_on_every_route(tiny):
    routes = _routes(tiny, invariant=True)
    ref = bits(routes.pop("full"))
    for name, out in routes.items():
        np.testing.assert_array_equal(bits(out), ref, err_msg=name)


def test_packed_rows_spanning_pages_match_the_paged_forward(tiny):
    """Segments longer than one 64-token page of the packed layout, starting mid-row and in
    any segment order, give each token the bits of the engine's paged forward (block size 16)."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, tiny.config.vocab_size, 150), rng.integers(0, tiny.config.vocab_size, 70)
    tok = np.concatenate([b, a, np.zeros(6, np.int64)])[None].astype(np.int32)
    seg = np.array([[1] * 70 + [0] * 150 + [-1] * 6], np.int32)
    packed = nnx.jit(Llama.forward_packed, static_argnames=("max_segments", "invariant"))(
        tiny, jnp.asarray(tok), jnp.asarray(seg), max_segments=2
    )
    paged = Paged(tiny, max_blocks=16).run([b, a], interleaved([70, 150], [40, 64]), bucket=104)
    np.testing.assert_array_equal(bits(np.asarray(packed)[0, :70]), bits(paged[0]))
    np.testing.assert_array_equal(bits(np.asarray(packed)[0, 70:220]), bits(paged[1]))


def test_negative_control_xla_path_differs():
    """The same routes through plain XLA ops do not all agree: the check can fail.

    float32: on this CPU XLA's bfloat16 path happens to agree on these shapes (its roundings
    to bfloat16 hide the order changes), so the control runs where XLA's changes show.
    """
    routes = _routes(Llama(preset("tiny"), dtype=jnp.float32, seed=0), invariant=False)
    ref = bits(routes.pop("full"))
    assert any(not np.array_equal(bits(out), ref) for out in routes.values())


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_k_shards_as_separate_partials_is_bit_identical(parts):
    """k_shards=8: o/down run as `parts` separate shard partials (one per tensor-parallel rank)
    combined by the tree give the same logits as one device."""
    cfg = preset("tiny")
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 19)), jnp.int32)
    one = Llama(cfg, dtype=jnp.bfloat16, k_shards=8, seed=0)
    split = Llama(cfg, dtype=jnp.bfloat16, k_shards=8, seed=0, tp_parts=parts)
    np.testing.assert_array_equal(bits(_FWD(split, ids)), bits(_FWD(one, ids)))


def test_k_shards_changes_the_bits():
    """Negative control for the above: k_shards is part of the numerics (8 vs 1 differ)."""
    cfg = preset("tiny")
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 19)), jnp.int32)
    a = _FWD(Llama(cfg, dtype=jnp.bfloat16, k_shards=8, seed=0), ids)
    b = _FWD(Llama(cfg, dtype=jnp.bfloat16, k_shards=1, seed=0), ids)
    assert not np.array_equal(bits(a), bits(b))


# --------------------------------------------------------------------------- random weights


_HASH = (
    "import hashlib, jax, numpy as np; from models.configs import preset; "
    "from models.llama import Llama, param_state; "
    "m = Llama(preset('tiny'), dtype='bfloat16', seed={seed}); h = hashlib.sha256(); "
    "[h.update(np.asarray(x).tobytes()) for x in jax.tree.leaves(param_state(m))]; print(h.hexdigest())"
)


def _hash_here(seed):
    import hashlib

    import jax

    h = hashlib.sha256()
    for x in jax.tree.leaves(param_state(Llama(preset("tiny"), dtype="bfloat16", seed=seed))):
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()


def test_random_weights_identical_in_another_process():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _HASH.format(seed=0)], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == _hash_here(0)
    assert _hash_here(1) != _hash_here(0)  # the seed matters


# --------------------------------------------------------------------------- bad input


def test_bad_tokens_raise_clear_errors(tiny):
    v = tiny.config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.forward(np.array([[1, v]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.forward(np.array([[-1, 2]]))
    with pytest.raises(ValueError, match="2-D"):
        tiny.forward(np.array([1, 2]))
    with pytest.raises(TypeError, match="integer"):
        tiny.forward(np.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="empty"):
        tiny.forward(np.zeros((1, 0), np.int32))
    ctx = tiny.config.max_position_embeddings  # past the RoPE table: an error, not clipped positions
    with pytest.raises(ValueError, match=f"a segment is {ctx + 1} tokens long; the model's context is {ctx}"):
        tiny.forward(np.ones((1, ctx + 1), np.int32))
    # forward_packed checks what bijax.logprobs checks (it was "trusted" before 2026-12-05)
    tok = np.ones((2, 6), np.int32)
    with pytest.raises(ValueError, match=r"segment id 1 is outside \[-1, 1\)"):
        tiny.forward_packed(tok, np.array([[0, 0, 0, 1, 1, 1], [0] * 6]), max_segments=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.forward_packed(np.array([[1, 2, -1]]), None)
    with pytest.raises(ValueError, match="segment_ids must have the shape of tokens"):
        tiny.forward_packed(tok, np.zeros((2, 5), np.int32), max_segments=1)
    with pytest.raises(ValueError, match="max_segments must be a positive int"):
        tiny.forward_packed(tok, np.zeros((2, 6), np.int32), max_segments=0)
    with pytest.raises(ValueError, match="not one contiguous run"):
        tiny.forward_packed(tok, np.array([[0, 1, 0, 1, 1, 1], [0] * 6]), max_segments=2)


def test_bad_model_arguments():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="k_shards"):
        Llama(cfg, k_shards=3)
    with pytest.raises(ValueError, match="tp_parts"):
        Llama(cfg, k_shards=2, tp_parts=4)
    with pytest.raises(TypeError, match="dtype"):
        Llama(cfg, dtype=jnp.int32)
    with pytest.raises(TypeError, match="LlamaConfig"):
        Llama({"vocab_size": 3})
    with pytest.raises(ValueError, match="num_blocks"):
        init_kv_cache(cfg, 1, 16, jnp.float32)


def test_paged_kv_cache_layer_count_checked(tiny):
    cache = init_kv_cache(tiny.config, 4, 16, tiny.dtype)[:1]
    z = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="layers"):
        tiny.forward_paged(PagedBatch(z, z, z, z, np.zeros((1, 1), np.int32), np.ones(1, np.int32)), cache)
    with pytest.raises(TypeError, match="PagedBatch"):
        tiny.forward_paged((z, z, z, z, np.zeros((1, 1), np.int32), np.ones(1, np.int32)), cache)


# --------------------------------------------------------------------------- GPU lowering


def _export_paged(invariant: bool, t: int = 24, s: int = 4) -> str:
    from pallas_kernels.runtime import cuda_export

    model = Llama(preset("tiny"), dtype=jnp.bfloat16, seed=0)
    graphdef, state = nnx.split(model)
    cfg = model.config
    cache = init_kv_cache(cfg, 16, 16, jnp.bfloat16)

    def step(state, cache, tok, seq, pos, slot, tables, lens):
        m = nnx.merge(graphdef, state)
        return m.forward_paged(PagedBatch(tok, seq, pos, slot, tables, lens), cache, invariant=invariant)

    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    args = (
        jax.tree.map(spec, state),
        jax.tree.map(spec, cache),
        i32(t),
        i32(t),
        i32(t),
        i32(t),
        i32(s, 8),
        i32(s),
    )
    return cuda_export(step, *args)


def test_paged_forward_lowers_to_the_bijax_kernels_on_cuda():
    # 24 tokens of 4 sequence rows: a prefill step, whose attention is the ``tiles`` kernel.
    kernels = ("bijax_matmul", "bijax_rms_norm", "bijax_attention_tiles")
    text = _export_paged(invariant=True)
    for kernel in kernels:
        assert f'name = "{kernel}"' in text, kernel
    # Negative control: the XLA path has none of them.
    text = _export_paged(invariant=False)
    assert not any(f'name = "{k}"' in text for k in kernels)


def test_decode_step_runs_gate_up_and_swiglu_in_one_launch_where_switched_on():
    """A decode step (16 tokens of 16 sequences) with ``mlp.FUSED`` lowers gate, up and SwiGLU
    to one ``bijax_matmul_pair`` launch, and so does a 24-token step once ``mlp.FUSED_MAX_ROWS``
    reaches it; a 24-token step under the default (gate and up in the shared launch from 17
    rows) and a decode step without the switch lower to none (controls)."""
    import importlib

    mlp = importlib.import_module("pallas_kernels.mlp")
    counts, old = {}, (mlp.FUSED, mlp.FUSED_MAX_ROWS)
    try:
        for on, t, s, rows in ((True, 16, 16, 16), (True, 24, 4, 16), (True, 24, 4, 64), (False, 16, 16, 16)):
            mlp.FUSED, mlp.FUSED_MAX_ROWS = on, rows
            jax.clear_caches()
            counts[on, t, rows] = _export_paged(invariant=True, t=t, s=s).count('name = "bijax_matmul_pair"')
    finally:
        mlp.FUSED, mlp.FUSED_MAX_ROWS = old
        jax.clear_caches()
    assert counts[True, 16, 16] >= 1 and counts[True, 24, 64] >= 1, counts
    assert counts[True, 24, 16] == 0 and counts[False, 16, 16] == 0, counts


def test_one_positive_int_rule_names_the_setting_everywhere():
    """``pallas_kernels.checks.check_positive_int`` is the one rule behind the model's, the
    kernels' and the sharding's positive-int settings: each names its setting; NumPy integers
    pass where they cannot reach a JSON record (attention's split size) and are refused where
    they can (the config). Control: valid values pass."""
    import dataclasses

    from models.sharding import check_tensor_parallel
    from pallas_kernels import AttentionSpec, group_rows

    cfg = preset("tiny")
    cases = [
        (lambda: AttentionSpec.create(64, split_size=0), "attention: split_size"),
        (lambda: AttentionSpec.create(64, sliding_window=True), "attention: sliding_window"),
        (lambda: dataclasses.replace(cfg, num_heads=np.int64(cfg.num_heads)), "LlamaConfig: num_heads"),
        (lambda: check_tensor_parallel(cfg, 2.0, 1), "tensor_parallel_size"),
        (lambda: group_rows(jnp.zeros(4, jnp.int32), num_groups=0), "group_rows: num_groups"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=f"^{name} must be a positive (Python )?int"):
            call()
    with pytest.raises(
        ValueError, match=r"must be a positive Python int \(int\(\.\.\.\) of it\), got np.int64"
    ):
        cases[2][0]()  # (a NumPy int where only a Python int goes: told what to pass)
    assert AttentionSpec.create(64, split_size=np.int64(256), sliding_window=np.int32(8)) is not None
    check_tensor_parallel(cfg, 1, 1)
    dataclasses.replace(cfg, num_heads=cfg.num_heads)
