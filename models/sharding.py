"""Tensor-parallel layout of a ``Llama`` over one mesh axis (docs/design.md, "k_shards").

* column-parallel, split along N: ``wq``, ``wk``, ``wv`` (and their biases), ``w_gate``,
  ``w_up`` - a rank holds whole heads (KV head r*Hkv/P ... with its query heads) and 1/P of
  the MLP's intermediate;
* row-parallel, split along K: ``wo``, ``w_down`` - the rows matching those heads / that
  intermediate slice;
* replicated: the embedding, the LM head (each rank computes its 1/P of the vocabulary from
  it), the norms and the RoPE table;
* the paged KV cache is split by KV head.

``check_tensor_parallel`` gives the errors a user can hit; ``make_mesh`` and ``shard_state``
place a model; ``to_global`` builds arrays that work the same in one process and across
processes (``jax.distributed.initialize``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.configs import LlamaConfig
from pallas_kernels.checks import check_positive_int
from pallas_kernels.runtime import pinned

AXIS = "tp"
_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
_BIAS = ("bq", "bk", "bv")
_ROW = ("wo", "w_down")


def check_tensor_parallel(config: LlamaConfig, size, k_shards: int, num_devices: int | None = None) -> None:
    """ValueError naming the problem unless ``size`` ranks can serve ``config`` with the bits
    of one device: size divides both head counts and ``k_shards``, and that many devices exist."""
    check_positive_int("tensor_parallel_size", size, numpy=False)
    if size == 1:
        return
    if config.is_moe:
        raise ValueError(
            f"tensor_parallel_size={size}: tensor parallelism is not supported for mixture-of-experts "
            f"models ({config.model_type}, {config.num_experts} experts); use tensor_parallel_size=1"
        )
    if num_devices is None:
        num_devices = jax.device_count()
    if size > num_devices:
        raise ValueError(
            f"tensor_parallel_size={size} but only {num_devices} {jax.default_backend()} device(s) are visible"
        )
    for name, heads in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads)):
        if heads % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name} ({heads})")
    if k_shards % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide k_shards={k_shards}: the k_shards tree fixes "
            "the reduction order across ranks, so build the model with k_shards=8 (the same bits at "
            "tensor_parallel_size 1, 2, 4 and 8)"
        )


def make_mesh(size: int, devices=None) -> Mesh:
    """A 1-D mesh named ``AXIS`` over the first ``size`` devices (every process's, in order)."""
    devices = jax.devices() if devices is None else list(devices)
    if size > len(devices):
        raise ValueError(f"a mesh of {size} devices but only {len(devices)} are visible")
    return Mesh(np.array(devices[:size]), (AXIS,))


def _leaf_spec(path, axis: str) -> P:
    name = None
    for entry in reversed(path):  # the last dict key (a Variable's own ``.value`` comes after it)
        key = getattr(entry, "key", None)
        if isinstance(key, str):
            name = key
            break
    if name in _COLUMN:
        return P(None, axis)
    if name in _BIAS:
        return P(axis)
    if name in _ROW:
        return P(axis, None)
    return P()


def state_specs(state, axis: str = AXIS):
    """PartitionSpecs for a model's state (``nnx.split(model)[1]``), leaf for leaf."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_spec(path, axis), state)


def kv_spec(axis: str = AXIS) -> P:
    """PartitionSpec of one paged KV cache array [num_blocks, block_size, Hkv, D]: split by KV head."""
    return P(None, None, axis, None)


def cache_specs(cache, axis: str = AXIS):
    """PartitionSpecs of a whole paged KV cache (``kv_spec`` for every array)."""
    return jax.tree_util.tree_map(lambda _: kv_spec(axis), cache)


def to_global(a, sharding: NamedSharding) -> jax.Array:
    """``a`` (an array every process holds whole and equal) as one array laid out by ``sharding``."""
    if jax.process_count() == 1:
        return jax.device_put(a, sharding)
    shape = tuple(a.shape)
    return jax.make_array_from_callback(shape, sharding, lambda idx: np.asarray(a[idx]))


def shard_state(state, mesh: Mesh, axis: str = AXIS):
    """The model state placed on ``mesh`` by ``state_specs``."""
    specs = state_specs(state, axis)
    return jax.tree_util.tree_map(lambda a, s: to_global(a, NamedSharding(mesh, s)), state, specs)


@pinned
def build_sharded(make: Callable[[], nnx.Module], mesh: Mesh, axis: str = AXIS) -> nnx.Module:
    """``make()`` (a model constructor with random weights) built directly in its shards: one
    jitted program whose outputs are laid out by ``state_specs``, so each device computes and
    holds only its shard of every weight - no whole model on one device first (a model larger
    than one device's memory can be built). JAX's partitionable random numbers make every
    value equal to the whole build's (``jax_threefry_partitionable``: JAX's default, and pinned
    on here by ``runtime.pinned`` whatever a caller set)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), state_specs(abstract, axis))
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def bytes_per_device(state, size: int, axis: str = AXIS) -> int:
    """Bytes of a model state (arrays or ``jax.ShapeDtypeStruct`` leaves, e.g. from
    ``nnx.eval_shape``) that each of ``size`` ranks holds under ``state_specs``."""
    specs = state_specs(state, axis)
    total = 0
    for a, spec in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(specs), strict=True):
        nbytes = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        total += nbytes // size if axis in tuple(spec) else nbytes
    return total


def host(a) -> np.ndarray:
    """A replicated array's value on this host (works when other processes hold copies too)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return np.asarray(a.addressable_data(0))
    return np.asarray(a)


__all__ = [
    "AXIS",
    "build_sharded",
    "bytes_per_device",
    "cache_specs",
    "check_tensor_parallel",
    "host",
    "kv_spec",
    "make_mesh",
    "shard_state",
    "state_specs",
    "to_global",
]
