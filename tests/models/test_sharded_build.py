"""Presets built directly in their tensor-parallel shards (8 fake CPU devices): the same values
as the whole build, each device holding only its part, and the llama3-70b preset's memory per
device - the path that builds a model larger than one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bijax
from models import sharding
from models.configs import PRESETS, preset
from models.llama import Llama
from models.loading import load_model
from tests.conftest import bits


def _leaves(model):
    return jax.tree_util.tree_leaves_with_path(nnx.state(model))


@pytest.mark.parametrize("size", [2, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sharded_build_equals_the_whole_build_and_splits_the_bytes(size, dtype):
    whole = load_model("tiny", dtype=dtype, k_shards=8, seed=3)
    split = load_model("tiny", dtype=dtype, k_shards=8, seed=3, tensor_parallel_size=size)
    for (path, a), (_, b) in zip(_leaves(split), _leaves(whole), strict=True):
        assert np.array_equal(bits(np.asarray(a)), bits(np.asarray(b))), jax.tree_util.keystr(path)
    wq = split.layers[0].attn.wq[...]
    assert len(wq.sharding.device_set) == size and wq.addressable_shards[0].data.shape == (
        wq.shape[0],
        wq.shape[1] // size,
    )
    # what each device holds == the layout's prediction, and less than the whole model
    state = nnx.state(split)
    per_device = [0] * size
    index = {d: i for i, d in enumerate(wq.sharding.mesh.devices.flat)}
    for leaf in jax.tree_util.tree_leaves(state):
        for shard in leaf.addressable_shards:
            per_device[index[shard.device]] += shard.data.nbytes
    assert per_device == [sharding.bytes_per_device(state, size)] * size
    whole_bytes = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(nnx.state(whole)))
    assert per_device[0] < whole_bytes


def test_a_whole_build_inside_jit_differs_without_the_barrier():
    """Control for the init's optimization barrier: folding the scale into the normal's own
    constant (what XLA does inside one jitted build) changes bits, so the check above can fail."""
    key = jax.random.PRNGKey(0)
    eager = jax.random.normal(key, (768, 256), jnp.float32) * np.float32(768**-0.5)
    fused = jax.jit(lambda: jax.random.normal(key, (768, 256), jnp.float32) * np.float32(768**-0.5))()
    assert not np.array_equal(bits(eager.astype(jnp.bfloat16)), bits(fused.astype(jnp.bfloat16)))


def test_llm_on_a_preset_in_shards_gives_the_bits_of_one_device():
    sp = bijax.SamplingParams(temperature=0.7, seed=4, max_tokens=5)
    prompts = [[5, 6, 7] * 7, [9] * 12]
    kw = dict(dtype=jnp.float32, k_shards=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    one = bijax.LLM("tiny", **kw).generate(prompts, sp, use_tqdm=False)
    llm = bijax.LLM("tiny", tensor_parallel_size=4, **kw)
    assert len(llm.model.layers[0].mlp.w_down[...].sharding.device_set) == 4
    four = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(one, four, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert np.array_equal(bits(a.outputs[0].logprobs), bits(b.outputs[0].logprobs))


def test_llama3_70b_fits_h200s_only_in_shards():
    """The 70B preset's layout without building it: 141 GB whole; per device at TP 4 and 8 what
    an H200 (141 GB) holds with room for the KV cache."""
    cfg = PRESETS["llama3-70b"]
    abstract = nnx.state(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, k_shards=8, seed=0)))
    whole = sharding.bytes_per_device(abstract, 1)
    assert 140e9 < whole < 142e9
    for size, most in ((4, 40e9), (8, 22e9)):
        sharding.check_tensor_parallel(cfg, size, 8, num_devices=8)
        assert sharding.bytes_per_device(abstract, size) < most
    with pytest.raises(ValueError, match="k_shards"):
        sharding.check_tensor_parallel(preset("llama3-70b"), 4, 1, num_devices=8)
