"""The phenomenon and the fix, on this machine: does row 0 of a matmul change when the batch grows?

XLA's ``x @ w`` picks its algorithm from the whole batch shape, so the same row can get
different bits at different batch sizes. ``pallas_kernels.matmul`` plans its reduction
from the weight alone, so row 0 never changes. Run: ``PYTHONPATH=. python examples/kernels_demo.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

BATCHES = (1, 2, 3, 8, 16, 64, 300)


def row0_changes(fn, x) -> list[int]:
    """For each batch size b: how many of row 0's elements differ (in bits) from b = 1."""
    base = np.asarray(fn(x[:1]))[0].view(np.uint32)
    return [int(np.sum(np.asarray(fn(x[:b]))[0].view(np.uint32) != base)) for b in BATCHES]


def bit_identical(fn, x) -> bool:
    """Every row of fn(x[:b]) equals the same row of fn(x), bit for bit, for every b."""
    full = np.asarray(fn(x)).view(np.uint32)
    return all(np.array_equal(np.asarray(fn(x[:b])).view(np.uint32), full[:b]) for b in BATCHES)


def main() -> None:
    print(f"bijax kernels demo on {jax.devices()[0].platform.upper()} (jax {jax.__version__})\n")
    k, n = 576, 1536  # SmolLM2-135M's MLP up-projection
    x = jax.random.normal(jax.random.key(0), (max(BATCHES), k), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)
    xla = jax.jit(lambda x: x @ w)
    ours = jax.jit(lambda x: pk.matmul(x, w))
    print(f"Row 0 of x[:b] @ w (w: {k}x{n} float32): elements whose bits differ from batch size 1")
    print(f"{'batch size b':>14} " + " ".join(f"{b:>5}" for b in BATCHES))
    for name, fn in (("XLA x @ w", xla), ("bijax matmul", ours)):
        print(f"{name:>14} " + " ".join(f"{d:>5}" for d in row0_changes(fn, x)))
    xla_ok, ours_ok = bit_identical(xla, x), bit_identical(ours, x)
    print("\nEvery row bit-identical whatever the batch size:")
    print(f"  XLA x @ w          {xla_ok}")
    print(f"  bijax matmul       {ours_ok}")
    logits = jax.random.normal(jax.random.key(2), (max(BATCHES), 100), jnp.float32) * 3
    print(f"  XLA log_softmax    {bit_identical(jax.jit(pk.log_softmax_reference), logits)}")
    print(f"  bijax log_softmax  {bit_identical(jax.jit(pk.log_softmax), logits)}")
    if not ours_ok:
        raise SystemExit("bijax matmul changed row 0 with the batch size: this is a bug, please report it")


if __name__ == "__main__":
    main()
