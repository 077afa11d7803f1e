"""Whether a Pallas Triton kernel's SwiGLU has the bits of the XLA fusion the model runs now
(``pk.swiglu``, run by ``Decoder.swiglu``: SiLU(g) * u in float32 from the bf16 projections,
rounded once to bf16) - the formula the fused gate/up kernel runs (``pallas_kernels.mlp``).

A probe for issue 19's "SiLU(gate) * up" fusion into a matmul kernel (gate/up's epilogue or
down's prologue): such a fusion is a launch change - the same bits, no NUMERICS_VERSION - only
if the kernel's sigmoid and products round as XLA's do. Pallas Triton lowers ``logistic`` to
``1 / (1 + exp(-x))`` (``__nv_expf``); how XLA's GPU fusion computes it is what this
measures, on every bf16 value of g (NaN and infinities included) against four sets of u, and
the sigmoid alone in float32. Prints the mismatch counts (0 everywhere: the fusion keeps the
bits) and a few examples.

Triton lowers a float32 ``/`` to ``div.full.f32`` (approximate, not IEEE). On the reading that
XLA divides IEEE the sigmoid is also tried with its division as inline ``div.rn.f32`` (and then
its products as ``mul.rn.f32``); the verdict names the first kernel formula that has XLA's bits
everywhere. Measured (H100, session 50): Pallas' own sigmoid has them on every g; the
``div.rn`` formulas do not (649 float32 sigmoid values differ) - XLA's fusion does not divide
IEEE here either.

  PYTHONPATH=. python3 benchmarks/swiglu_bits.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import mlp

F32 = jnp.float32


def swiglu(g, u):
    """The model's formula (``pk.swiglu``, what ``Decoder.swiglu`` runs), float32 result."""
    return mlp.swiglu(g.astype(F32), u.astype(F32))


def sigmoid(g, u):
    del u
    return jax.nn.sigmoid(g.astype(F32))


def _asm(op, *args):
    from jax.experimental.pallas import triton as pltriton

    [out] = pltriton.elementwise_inline_asm(
        f"{op}.f32 $0, " + ", ".join(f"${i + 1}" for i in range(len(args))) + ";",
        args=list(args),
        constraints="=f," + ",".join("f" for _ in args),
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, F32)],
    )
    return out


def sigmoid_div_rn(g):
    """1 / (1 + exp(-g)) (XLA's) with an IEEE divide (``div.rn``)."""
    return _asm("div.rn", jnp.ones_like(g), 1 + jnp.exp(-g))


def swiglu_div_rn(g, u):
    g, u = g.astype(F32), u.astype(F32)
    return g * sigmoid_div_rn(g) * u


def swiglu_div_mul_rn(g, u):
    g, u = g.astype(F32), u.astype(F32)
    return _asm("mul.rn", _asm("mul.rn", g, sigmoid_div_rn(g)), u)


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


def _differ(a, b) -> np.ndarray:
    view = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    same_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return (a.view(view) != b.view(view)) & ~same_nan


def main() -> int:
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    g = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(256, 256))
    us = [(jax.random.normal(jax.random.key(s), g.shape, F32) * 2).astype(jnp.bfloat16) for s in range(4)]
    # (what, XLA's formula, the kernel's formulas to try, output dtype, u sets)
    cases = (
        (
            "sigmoid, float32",
            sigmoid,
            (("jax.nn.sigmoid", sigmoid), ("div.rn", lambda g, u: sigmoid_div_rn(g.astype(F32)))),
            F32,
            1,
        ),
        (
            "SwiGLU, float32",
            swiglu,
            (("jax.nn.sigmoid", swiglu), ("div.rn", swiglu_div_rn), ("div.rn+mul.rn", swiglu_div_mul_rn)),
            F32,
            4,
        ),
        (
            "SwiGLU, rounded to bf16 (the model's)",
            swiglu,
            (("jax.nn.sigmoid", swiglu), ("div.rn", swiglu_div_rn), ("div.rn+mul.rn", swiglu_div_mul_rn)),
            jnp.bfloat16,
            4,
        ),
    )
    totals = {}
    for name, ref, kernels, out_dtype, sets in cases:
        xla = jax.jit(lambda g, u, fn=ref, dt=out_dtype: fn(g, u).astype(dt))
        for kname, fn in kernels:
            try:
                kern = in_kernel(fn, out_dtype)
                for seed in range(sets):
                    a, b = np.asarray(xla(g, us[seed])), np.asarray(kern(g, us[seed]))
                    bad = _differ(a, b)
                    totals[(name, kname)] = totals.get((name, kname), 0) + int(bad.sum())
                    print(
                        f"{name} | kernel {kname} | u set {seed}: {int(bad.sum())} of {bad.size} differ",
                        flush=True,
                    )
                    for i in np.flatnonzero(bad)[:3]:
                        gi = np.asarray(g).reshape(-1)[i]
                        print(f"  g={float(gi)!r} xla={a.reshape(-1)[i]!r} kernel={b.reshape(-1)[i]!r}")
            except Exception as e:  # noqa: BLE001 - a formula that does not lower is a finding
                print(f"{name} | kernel {kname}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                totals[(name, kname)] = -1
    # Control: the check sees a change of rounding (XLA's formula against the kernel's other grouping)
    a = np.asarray(jax.jit(lambda g, u: swiglu(g, u))(g, us[0]))
    b = np.asarray(in_kernel(regrouped, F32)(g, us[0]))
    control = int(_differ(a, b).sum())
    print(f"control (the kernel's products grouped the other way): {control} differ", flush=True)
    print("\n| values | kernel formula | elements that differ from XLA's |\n|---|---|---|")
    for (name, kname), n in totals.items():
        print(f"| {name} | {kname} | {'did not lower' if n < 0 else n} |")
    model = "SwiGLU, rounded to bf16 (the model's)"
    same = [
        k for (n, k), v in totals.items() if n == model and v == 0 and totals[("SwiGLU, float32", k)] == 0
    ]
    print("SWIGLU BITS", f"SAME with {same[0]}" if same else "DIFFER (every formula)", "| control", control)
    return 0 if control else 1


if __name__ == "__main__":
    raise SystemExit(main())
