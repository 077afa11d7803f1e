"""Tensor parallelism on 8 fake CPU devices: the fixed-order collective, bit-identical output at
tensor_parallel_size 1, 2, 4 and 8 (k_shards=8), no all-reduce in the compiled step, errors.

(The engine's invariance checks at sizes 2 and 4 run in test_engine.py; two processes over
jax.distributed in test_tp_multiprocess.py.)"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import bijax
import pallas_kernels as pk
from bijax import SamplingParams as SP
from models.configs import preset
from models.llama import Llama
from tests.conftest import bits

SIZES = (1, 2, 4, 8)
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, seed=1)


def _mesh(p):
    return Mesh(np.array(jax.devices()[:p]), ("tp",))


def _reduce(p, method):
    """Rank r's partial is parts[r]; returns every rank's result, [P, ...]."""
    return jax.jit(
        jax.shard_map(
            lambda x: pk.tree_psum(x[0], "tp", method=method)[None],
            mesh=_mesh(p),
            in_specs=P("tp"),
            out_specs=P("tp"),
            check_vma=False,
        )
    )


def _psum(p):
    return jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x[0], "tp")[None], mesh=_mesh(p), in_specs=P("tp"), out_specs=P("tp")
        )
    )


def test_eight_devices():
    assert jax.device_count() >= 8, "tests/conftest.py asks for 8 CPU devices"


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 13), (5, 1, 11), (37, 129)])
@pytest.mark.parametrize("method", ["gather", "scatter", "auto"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_collective_equals_tree_upper_levels(p, method, shape):
    rng = np.random.default_rng(p * 100 + len(shape))
    # Values of mixed magnitude, so the order of the additions shows in the bits.
    parts = (rng.standard_normal((p,) + shape) * 10.0 ** rng.integers(-3, 4, (p,) + shape)).astype(np.float32)
    want = bits(pk.tree_sum([jnp.asarray(x) for x in parts]))
    got = bits(_reduce(p, method)(jnp.asarray(parts)))
    for r in range(p):  # every rank holds the same bits, equal to the tree on one device
        np.testing.assert_array_equal(got[r], want)


def test_collective_negative_control():
    """A left-to-right sum of the same partials differs from the tree somewhere (so the equality
    above can fail), and so does the library's psum on 8 ranks."""
    rng = np.random.default_rng(0)
    parts = (rng.standard_normal((8, 4096)) * 10.0 ** rng.integers(-3, 4, (8, 4096))).astype(np.float32)
    tree = bits(pk.tree_sum([jnp.asarray(x) for x in parts]))
    fold = parts[0]
    for x in parts[1:]:
        fold = fold + x
    assert (bits(fold) != tree).any()
    assert (bits(_psum(8)(jnp.asarray(parts))[0]) != tree).any()


def test_collective_bad_input():
    with pytest.raises(ValueError, match="method"):
        pk.tree_psum(jnp.ones(3), "tp", method="ring")
    with pytest.raises(TypeError, match="float32"):
        pk.tree_psum(jnp.ones(3, jnp.bfloat16), "tp")
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        pk.tree_psum(jnp.ones(3), "tp")
    with pytest.raises(ValueError, match="power of two"):
        jax.shard_map(
            lambda x: pk.tree_psum(x, "tp"),
            mesh=_mesh(3),
            in_specs=P("tp"),
            out_specs=P("tp"),
            check_vma=False,
        )(jnp.ones(6))


@functools.cache
def _model(dtype_name: str):
    return Llama(preset("tiny"), dtype=jnp.dtype(dtype_name), k_shards=8, seed=0)


def _prompts():
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(3, 512, n))) for n in (1, 6, 40, 19)]
    params = [
        SP(temperature=0, max_tokens=7, ignore_eos=True),
        SP(temperature=0.8, top_p=0.9, seed=4, max_tokens=7, ignore_eos=True, logprobs=3),
        SP(temperature=1.0, top_k=30, seed=5, max_tokens=5, ignore_eos=True),
        SP(temperature=0.6, seed=6, n=2, max_tokens=6, ignore_eos=True),
    ]
    return prompts, params


def _run(size, dtype_name="float32", invariant=True):
    """Token ids, float32 logprob bits and score() bits of the fixed requests at one TP size."""
    llm = bijax.LLM(_model(dtype_name), tensor_parallel_size=size, invariant=invariant, **ENGINE)
    prompts, params = _prompts()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seqs = [c for o in outs for c in o.outputs]
    full = [list(o.prompt_token_ids) + o.outputs[0].token_ids for o in outs]
    scored = llm.score(full, [len(o.prompt_token_ids) for o in outs], temperature=1.0)
    return (
        [c.token_ids for c in seqs],
        [bits(c.logprobs) for c in seqs],
        [bits(s) for s in scored],
        llm,
    )


def _equal(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for i in (1, 2) for x, y in zip(a[i], b[i], strict=True))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_tp_sizes_bit_identical(dtype_name, monkeypatch):
    # 1 after 8: the model's shards go back. bfloat16 at the two ends only (2 and 4 in float32:
    # the same code paths; CI time)
    order = (8, 2, 1, 4) if dtype_name == "float32" else (8, 1)
    runs = {p: _run(p, dtype_name) for p in order}
    for p in sorted(runs)[1:]:
        assert _equal(runs[p], runs[1]), f"tensor_parallel_size={p} differs from 1 ({dtype_name})"
    if dtype_name != "float32":
        return
    # The model keeps its shards (the last engine's, TP=4): 1/4 of q's columns per device.
    wq = runs[4][3].model.layers[0].attn.wq[...]
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], wq.shape[1] // 4)}
    k0 = runs[4][3].engine.runner.cache[0][0]  # the KV cache is created split: 2 of 8 KV heads each
    assert {s.data.shape[2] for s in k0.addressable_shards} == {k0.shape[2] // 4}
    # the forward as one program (the GPU's form) with the step's inputs staged in place over
    # the mesh (the GPUs' defaults): the same bits (one run for both: CI time)
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", "whole")
    monkeypatch.setenv("BIJAX_STAGED_INPUTS", "1")
    staged = _run(2, dtype_name)
    assert staged[3].engine.runner._staging and _equal(staged, runs[1])


def test_tp_negative_control_xla_path_differs():
    """The baseline (invariant=False: XLA dots and the library's all-reduce) changes bits with
    the TP size, so the equality above is not vacuous. (Size 4: on this CPU XLA happens to
    give size 2 the bits of size 1 in bfloat16.)"""
    assert not _equal(_run(4, invariant=False), _run(1, invariant=False))


@pytest.mark.parametrize("programs", ["layers", "whole"])
def test_compiled_step_has_no_all_reduce(programs, monkeypatch):
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", programs)  # the chain of programs, or one
    inv = bijax.LLM(_model("float32"), tensor_parallel_size=2, **ENGINE).engine.runner
    assert {k[0] for k in inv.forward_keys(4, 32, 4)} == (
        {"forward"} if programs == "whole" else {"embed", "block", "head"}
    )
    text = inv.compiled_text(4, 32)
    assert "all-gather" in text  # the collective is there ...
    assert "all-reduce" not in text  # ... and it never lets the library add
    # Negative control: the XLA path's step does all-reduce (the check can see one).
    xla = bijax.LLM(_model("float32"), tensor_parallel_size=2, invariant=False, **ENGINE).engine.runner
    assert "all-reduce" in xla.compiled_text(4, 32)


def test_k_shards_1_is_the_default_and_runs_at_size_1():
    llm = bijax.LLM("tiny", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=32)
    assert llm.model.k_shards == 1 and llm.engine.runner.mesh is None
    out = llm.generate([[1, 2, 3]], SP(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(tensor_parallel_size=3, k_shards=8), ValueError, "does not divide the model's num_heads"),
        (dict(tensor_parallel_size=16, k_shards=8), ValueError, "only 8 cpu device"),
        (dict(tensor_parallel_size=2), ValueError, "does not divide k_shards=1"),
        (dict(tensor_parallel_size=4, k_shards=2), ValueError, "does not divide k_shards=2"),
        (dict(tensor_parallel_size=0, k_shards=8), ValueError, "positive int"),
        (dict(tensor_parallel_size="2", k_shards=8), ValueError, "positive int"),
    ],
)
def test_tp_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        bijax.LLM("tiny", **kwargs)


def test_kv_heads_must_divide():
    model = Llama(
        dataclasses.replace(preset("tiny"), num_kv_heads=2, num_heads=8), k_shards=8
    )  # 8 q / 2 kv heads
    with pytest.raises(ValueError, match="num_kv_heads"):
        bijax.LLM(model, tensor_parallel_size=4, **ENGINE)


def test_k_shards_must_divide_column_widths():
    with pytest.raises(ValueError, match="intermediate_size"):
        Llama(dataclasses.replace(preset("tiny"), intermediate_size=772), k_shards=8)


def test_update_weights_under_tp():
    """Weights from a trainer (whole arrays on one device) go onto the mesh: the TP=2 engine then
    gives the bits of a one-device engine built with those weights."""
    new = Llama(preset("tiny"), dtype=jnp.float32, k_shards=8, seed=9)
    llm = bijax.LLM(
        Llama(preset("tiny"), dtype=jnp.float32, k_shards=8, seed=0), tensor_parallel_size=2, **ENGINE
    )
    llm.update_weights(new)
    ref = bijax.LLM(Llama(preset("tiny"), dtype=jnp.float32, k_shards=8, seed=9), **ENGINE)
    prompts, params = _prompts()
    a = llm.generate(prompts, params, use_tqdm=False)
    b = ref.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and np.array_equal(bits(x.logprobs), bits(y.logprobs))
    wq = llm.model.layers[0].attn.wq[...]
    assert len(wq.sharding.device_set) == 2
    # the model holds the engine's own (sharded) arrays: no generate takes them again
    assert not llm.engine.changed_in_place(llm.model)
