"""What every checkpoint loader shares (HF safetensors, GGUF, orbax): the model built with no
weights allocated, a parameter addressed by its dotted path, and the check that a file holds
exactly the tensors the config expects (missing / unexpected tensors are clear errors)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import jax.numpy as jnp
from flax import nnx

from models.configs import LlamaConfig
from models.llama import Llama, RopeTable, rope_table


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
