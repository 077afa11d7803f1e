"""What every checkpoint loader shares (HF safetensors, GGUF, orbax): the model built with no
weights allocated, a parameter addressed by its dotted path, and the check that a file holds
exactly the tensors the config expects (missing / unexpected tensors are clear errors), and the
check that every loaded weight is finite."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.configs import LlamaConfig
from models.llama import Llama, RopeTable, param_state, rope_table


def abstract_model(config: LlamaConfig, dtype, k_shards: int) -> Llama:
    """A model with no weights allocated yet (shapes only); the RoPE table filled in."""
    model = nnx.eval_shape(lambda: Llama(config, dtype=dtype, k_shards=k_shards))
    model.rope = RopeTable(jnp.asarray(rope_table(config)))
    return model


def variable(model: nnx.Module, path: str) -> nnx.Variable:
    """The parameter at a dotted path such as ``layers.3.attn.wq``."""
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def check_tensor_names(
    found: Iterable[str], expected: Collection[str], where: str, ignore=lambda name: False
):
    """ValueError naming the first unexpected tensor (one in ``found`` that is neither expected
    nor ignored), else the first missing one."""
    found = list(found)
    unexpected = [n for n in found if n not in expected and not ignore(n)]
    if unexpected:
        raise ValueError(
            f"unexpected tensor {unexpected[0]!r} in {where} ({len(unexpected)} unexpected in all)"
        )
    have = set(found)
    missing = [n for n in expected if n not in have]
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is missing from {where} ({len(missing)} missing in all)")


_all_finite = jax.jit(lambda x: jnp.isfinite(x).all())  # one fused pass, no bool copy
_CHUNK = 1 << 24  # elements a host check looks at at once (its bool temporary: 16 MB)


def _finite(x):
    """Whether ``x`` holds only finite values: a device scalar on accelerators (read back later,
    all together); on CPU devices a host pass over the same memory (no compile: a reduction
    compiled per weight shape cost ~0.5-1 s of a CPU start)."""
    if any(d.platform != "cpu" for d in x.devices()):
        return _all_finite(x)
    flat = np.asarray(x).reshape(-1)
    return all(np.isfinite(flat[i : i + _CHUNK]).all() for i in range(0, flat.size, _CHUNK))


def check_finite(model: Llama, where: str) -> None:
    """ValueError naming the first parameter that holds a NaN or an infinity (and how many do):
    a damaged checkpoint, or one cast into a dtype it overflows, would otherwise serve NaN
    logprobs and arbitrary tokens. One pass over each parameter where it lives (a llama3-8b's
    16 GB: ~5 ms of HBM reads on the H200), read back once."""
    bad = non_finite(param_state(model))
    if bad:
        raise ValueError(
            f"{where}: parameter {bad[0]!r} holds NaN or infinite values ({len(bad)} such parameters in "
            "all) - the checkpoint is damaged, or its values overflow the dtype it was loaded in"
        )


def check_same_layout(want: dict, got: dict, what: str = "weights", ref: str = "the model's") -> None:
    """``got``'s leaves (key path -> array) against the model's ``want``: the same key paths,
    each an array of the same shape and dtype, none deleted - ValueError / TypeError naming
    the first that is not (``what``: how the message names ``got``, ``ref``: ``want``)."""
    name = jax.tree_util.keystr
    missing = [name(k) for k in want if k not in got]
    extra = [name(k) for k in got if k not in want]
    if missing or extra:
        raise ValueError(f"{what} do not have {ref} structure: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, old in want.items():
        new = got[k]
        if not isinstance(new, (jax.Array, np.ndarray)):  # (a ShapeDtypeStruct has no values)
            raise TypeError(f"{what}{name(k)} must be an array, got {type(new).__name__}")
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"{what}{name(k)} has shape {tuple(new.shape)}, {ref} is {tuple(old.shape)}")
        if new.dtype != old.dtype:
            raise ValueError(f"{what}{name(k)} has dtype {new.dtype}, {ref} is {old.dtype}")
        if isinstance(new, jax.core.Tracer):  # (called inside jax.jit / grad: no values to load)
            raise TypeError(
                f"{what}{name(k)} is a traced value: update the weights outside jax.jit, with the "
                "arrays a jitted train step returned"
            )
        if isinstance(new, jax.Array) and new.is_deleted():
            raise ValueError(f"{what}{name(k)} has been deleted (donated to a jitted step?)")


def non_finite(tree) -> list[str]:
    """The dotted names of the array leaves of ``tree`` (a model's param state or its pure
    dict) that hold a NaN or an infinity: one pass over each where it lives, read back once."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    flags = jax.device_get([_finite(x) for _, x in leaves])
    names = [jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value") for p, _ in leaves]
    return [name for name, ok in zip(names, flags, strict=True) if not ok]
