"""Whether a Pallas Triton kernel's SwiGLU has the bits of the XLA fusion the model runs now
(``Decoder.swiglu``: SiLU(g) * u in float32 from the bf16 projections, rounded once to bf16).

A probe for issue 19's "SiLU(gate) * up" fusion into a matmul kernel (gate/up's epilogue or
down's prologue): such a fusion is a launch change - the same bits, no NUMERICS_VERSION - only
if the kernel's sigmoid and products round as XLA's do. Pallas Triton lowers ``logistic`` to
``1 / (1 + exp(-x))`` (``__nv_expf``, IEEE divide); how XLA's GPU fusion computes it is what this
measures, on every bf16 value of g (NaN and infinities included) against four sets of u, and
the sigmoid alone in float32. Prints the mismatch counts (0 everywhere: the fusion keeps the
bits) and a few examples.

  PYTHONPATH=. python3 benchmarks/swiglu_bits.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

F32 = jnp.float32


def swiglu(g, u):
    """The model's formula (``models.llama.Decoder.swiglu``), float32 result."""
    g, u = g.astype(F32), u.astype(F32)
    return g * jax.nn.sigmoid(g) * u


def sigmoid(g, u):
    del u
    return jax.nn.sigmoid(g.astype(F32))


def regrouped(g, u):
    """The control: the products grouped the other way (other roundings somewhere)."""
    g, u = g.astype(F32), u.astype(F32)
    return g * (jax.nn.sigmoid(g) * u)


def in_kernel(fn, out_dtype):
    def kernel(g_ref, u_ref, o_ref):
        o_ref[...] = fn(g_ref[...], u_ref[...]).astype(o_ref.dtype)

    def call(g, u):
        return pl.pallas_call(
            kernel,
            grid=(g.shape[0] // 16,),
            in_specs=[pl.BlockSpec((16, g.shape[1]), lambda i: (i, 0))] * 2,
            out_specs=pl.BlockSpec((16, g.shape[1]), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(g.shape, out_dtype),
        )(g, u)

    return jax.jit(call)


def main() -> int:
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    g = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(256, 256))
    failures = 0
    for name, fn, out_dtype in (
        ("sigmoid, float32", sigmoid, F32),
        ("SwiGLU, float32", swiglu, F32),
        ("SwiGLU, rounded to bf16 (the model's)", swiglu, jnp.bfloat16),
    ):
        xla = jax.jit(lambda g, u, fn=fn, dt=out_dtype: fn(g, u).astype(dt))
        kern = in_kernel(fn, out_dtype)
        for seed in range(4 if "SwiGLU" in name else 1):
            u = (jax.random.normal(jax.random.key(seed), g.shape, F32) * 2).astype(jnp.bfloat16)
            a, b = np.asarray(xla(g, u)), np.asarray(kern(g, u))
            view = np.uint16 if a.dtype.itemsize == 2 else np.uint32
            same_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
            bad = (a.view(view) != b.view(view)) & ~same_nan
            failures += int(bad.sum())
            print(f"{name}, u set {seed}: {int(bad.sum())} of {bad.size} differ", flush=True)
            for i in np.flatnonzero(bad)[:4]:
                gi = np.asarray(g).reshape(-1)[i]
                print(f"  g={float(gi)!r} xla={a.reshape(-1)[i]!r} kernel={b.reshape(-1)[i]!r}")
    # Control: the check sees a change of rounding (XLA's formula against the kernel's other grouping)
    u = (jax.random.normal(jax.random.key(0), g.shape, F32) * 2).astype(jnp.bfloat16)
    a = np.asarray(jax.jit(lambda g, u: swiglu(g, u))(g, u)).view(np.uint32)
    b = np.asarray(in_kernel(regrouped, F32)(g, u)).view(np.uint32)
    control = int(((a != b) & ~(np.isnan(a.view(np.float32)) & np.isnan(b.view(np.float32)))).sum())
    print(f"control (the kernel's products grouped the other way): {control} differ", flush=True)
    print("SWIGLU BITS", "SAME" if failures == 0 else f"DIFFER ({failures} elements)", "| control", control)
    return 0 if control else 1


if __name__ == "__main__":
    raise SystemExit(main())
