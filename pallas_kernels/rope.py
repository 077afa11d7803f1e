"""Rotary position embedding (the half-split convention, HF's rotate_half) and, for a paged
forward, RoPE fused with the KV-cache write.

``rope(x, cos_sin)`` rotates x [T, H, D] in float32: with x1, x2 its halves,
``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, every product rounded to float32 before its add
(no fused multiply-add), the result rounded once to x's dtype. The rounding of the products is
part of the numerics: it is the same in every program - an XLA program would otherwise fuse a
product into its add in one program (an inference step) and not in another (a trainer's step
that keeps the products for its backward), and a bit would differ.

``rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slot_mapping)`` is ``rope(q)``, and
``write_kv`` of ``rope(k)`` and v, in one op: on the GPU one Triton launch per layer (a program
per token: q rotated, k rotated into its cache slot, v copied into its slot) instead of the
five XLA kernels the two ops take - the same bits (the kernel's products are ``mul.rn.f32``,
which the compiler cannot fuse into an add). On the CPU it is the two ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import runtime
from pallas_kernels.attention import check_write_kv, write_kv
from pallas_kernels.matmul import _matmul_shared, check_shared, gpu_shared
from pallas_kernels.plan import leaf_value

# True (the default): ``rope_write_kv`` is one kernel on the GPU. False: ``rope`` and ``write_kv``
# there too (XLA's kernels, the same bits; the A/B switch of benchmarks/ab.py fusions).
FUSED = True
# True (the default): with FUSED, ``qkv_rope_write_kv``'s RoPE kernel combines the projections'
# leaf partials itself. False: the projections' results (leaves combined by XLA), then
# ``rope_write_kv`` (the same bits; the A/B switch of benchmarks/ab.py qkv-combine).
QKV_COMBINE_IN_KERNEL = True


def _rotate(x1, x2, cos, sin, products):
    """The rotated halves of x1, x2 (float32) by cos, sin: ``products`` forms the four products,
    each rounded to float32 on its own (the one formula; see the module docstring)."""
    a, b, c, d = products(((x1, cos), (x2, sin), (x2, cos), (x1, sin)))
    return a - b, c + d


def _xla_products(pairs):
    # The barrier keeps the products apart from their adds in any XLA program.
    return lax.optimization_barrier(tuple(p * q for p, q in pairs))


def _mul_rn(a, b):
    """a * b rounded to float32 (``mul.rn``: never contracted into a fused multiply-add)."""
    [out] = pltriton.elementwise_inline_asm(
        "mul.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def _triton_products(pairs):
    return tuple(_mul_rn(p, q) for p, q in pairs)


def _check_cos_sin(op: str, cos_sin, t: int, d: int) -> None:
    """cos_sin must be float32 [T, 2, D/2] (the cos and sin of each token's position)."""
    if (
        tuple(getattr(cos_sin, "shape", ())) != (t, 2, d // 2)
        or getattr(cos_sin, "dtype", None) != jnp.float32
    ):
        raise ValueError(
            f"{op}: cos_sin must be float32 of shape ({t}, 2, {d // 2}), got "
            f"{getattr(cos_sin, 'dtype', None)}{tuple(getattr(cos_sin, 'shape', ()))}"
        )


def rope(x: jax.Array, cos_sin: jax.Array) -> jax.Array:
    """x [T, H, D] rotated by cos_sin [T, 2, D/2] (float32 cos and sin of each token's position),
    in float32, the result in x's dtype."""
    if getattr(x, "ndim", None) == 3 and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"rope: x must be a floating [T, H, D] array, got {x.dtype}")
    if getattr(x, "ndim", None) != 3:
        raise ValueError(
            f"rope: x must be a floating [T, H, D] array, got {getattr(x, 'dtype', None)}"
            f"{tuple(getattr(x, 'shape', ()))}"
        )
    t, _, d = x.shape
    if d % 2:
        raise ValueError(f"rope: the head dim must be even, got {d}")
    _check_cos_sin("rope", cos_sin, t, d)
    cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]  # [T, 1, D/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    lo, hi = _rotate(x1, x2, cos, sin, _xla_products)
    return jnp.concatenate([lo, hi], axis=-1).astype(x.dtype)


# --------------------------------------------------------------------------- fused with the KV write


def _rope_kv_kernel(
    slot_ref,
    cs_ref,
    q_ref,
    k_ref,
    v_ref,
    _kc_in,
    _vc_in,
    q_out,
    kc_ref,
    vc_ref,
    *,
    products,
    heads: tuple[int, int],
    folds: tuple[int | None, int | None, int | None],
    dtype,
):
    """One token: q rotated into ``q_out``; k rotated and v into the caches' row ``slot`` (viewed
    as [slots, Hkv, D]); a padding token (slot < 0) writes no cache row. q, k, v are this token's
    [heads, D] rows in ``dtype``, or with ``folds[i]`` a matmul's float32 leaf partials [L, heads,
    D], combined and rounded to ``dtype`` as ``plan.leaf_result`` does."""
    slot = slot_ref[pl.program_id(0)]
    hq, hkv = heads
    d = q_out.shape[-1]
    half = d // 2
    cos, sin = cs_ref[0], cs_ref[1]  # [D/2]

    def load(ref, fold, n, lo, width):
        """float32 [rows, width] of columns lo.. of the token's n head rows (rows: n padded to a
        power of two, masked)."""
        rows = pl.next_power_of_2(n)
        mask = (jnp.arange(rows) < n)[:, None]

        def part(*leaf):
            return pltriton.load(ref.at[(*leaf, pl.ds(0, rows), pl.ds(lo, width))], mask=mask, other=0.0)

        if fold is None:
            return part().astype(jnp.float32), rows, mask
        return leaf_value([part(jnp.int32(leaf)) for leaf in range(ref.shape[0])], fold, dtype), rows, mask

    def rotated(ref, fold, n):
        x1, rows, mask = load(ref, fold, n, 0, half)
        x2, _, _ = load(ref, fold, n, half, half)
        c, s = (jnp.broadcast_to(a[None, :], x1.shape) for a in (cos, sin))
        lo, hi = _rotate(x1, x2, c, s, products)
        return rows, mask, (lo.astype(dtype), hi.astype(dtype))

    def store(ref, rows, mask, halves, *lead):
        for lo, value in zip((0, half), halves, strict=True):
            pltriton.store(
                ref.at[(*lead, pl.ds(0, rows), pl.ds(lo, half))], value.astype(ref.dtype), mask=mask
            )

    rows, mask, q_rot = rotated(q_ref, folds[0], hq)
    store(q_out, rows, mask, q_rot)

    @pl.when(slot >= 0)
    def _():
        rows, mask, k_rot = rotated(k_ref, folds[1], hkv)
        store(kc_ref, rows, mask, k_rot, slot)
        v, rows, mask = load(v_ref, folds[2], hkv, 0, d)
        pltriton.store(
            vc_ref.at[slot, pl.ds(0, rows), pl.ds(0, d)], v.astype(dtype).astype(vc_ref.dtype), mask=mask
        )


def _rope_kv_pallas(
    q,
    k,
    v,
    cos_sin,
    k_cache,
    v_cache,
    slots,
    *,
    interpret: bool,
    products=None,
    folds=(None, None, None),
    hq: int | None = None,
    dtype=None,
):
    """The kernel over T = len(slots) tokens. q, k, v: [T', H', D] rows (T' >= T, H' >= the
    heads), or where ``folds[i]`` is set float32 leaf partials [L, T', H', D]; ``hq``: q's heads
    (default q's H'), ``dtype``: the rows' dtype (default q's). ``products`` (default: ``mul.rn``
    on the GPU, XLA's barrier in interpret mode) is there for benchmarks/kernels.py's negative
    control only."""
    if products is None:
        products = _xla_products if interpret else _triton_products
    t = slots.shape[0]
    d = k_cache.shape[-1]
    hq = q.shape[-2] if hq is None else hq
    dtype = q.dtype if dtype is None else dtype
    num_blocks, block_size, hkv, _ = k_cache.shape
    rows = (num_blocks * block_size, hkv, d)  # the caches as one row per slot: a free reshape
    kc, vc = k_cache.reshape(rows), v_cache.reshape(rows)
    token = lambda *shape: pl.BlockSpec((pl.squeezed, *shape), lambda i: (i,) + (0,) * len(shape))  # noqa: E731
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731

    def token_rows(a, fold):
        if fold is None:
            return token(*a.shape[1:])
        return pl.BlockSpec((a.shape[0], pl.squeezed, *a.shape[2:]), lambda i: (0, i, 0, 0))

    q_rot, kc, vc = pl.pallas_call(
        functools.partial(
            _rope_kv_kernel, products=products, heads=(hq, hkv), folds=tuple(folds), dtype=dtype
        ),
        grid=(t,),
        in_specs=[
            whole(slots),
            token(2, d // 2),
            *(token_rows(a, f) for a, f in zip((q, k, v), folds, strict=True)),
            whole(kc),
            whole(vc),
        ],
        out_specs=[token(hq, d), whole(kc), whole(vc)],
        out_shape=[
            jax.ShapeDtypeStruct((t, hq, d), dtype),
            jax.ShapeDtypeStruct(kc.shape, kc.dtype),
            jax.ShapeDtypeStruct(vc.shape, vc.dtype),
        ],
        input_output_aliases={5: 1, 6: 2},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="bijax_rope_kv",
    )(slots, cos_sin, q, k, v, kc, vc)
    return q_rot, kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)


@runtime.kernel_op("rope_write_kv", static_argnames=("backend", "interpret"), donate_argnums=(4, 5))
def _rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots, *, backend, interpret):
    def cpu(q, k, v, cos_sin, k_cache, v_cache, slots):
        k_cache, v_cache = write_kv(
            k_cache, v_cache, rope(k, cos_sin).astype(k_cache.dtype), v.astype(v_cache.dtype), slots
        )
        return rope(q, cos_sin), k_cache, v_cache

    def gpu(*args):
        return _rope_kv_pallas(*args, interpret=interpret) if FUSED else cpu(*args)

    return runtime.dispatch(backend, cpu, gpu, q, k, v, cos_sin, k_cache, v_cache, slots)


def _check_heads(op: str, t: int, d: int, cos_sin, k_cache, v_cache) -> None:
    """The fused ops' checks of the head dim, ``cos_sin`` and the caches' dtypes."""
    if d < 2 or d & (d - 1):
        raise ValueError(f"{op}: the head dim must be a power of two, got {d}")
    _check_cos_sin(op, cos_sin, t, d)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
            raise TypeError(f"{op}: {name} must be bfloat16, float16 or float32, got {c.dtype}")


def rope_write_kv(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cos_sin: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    backend: str = "auto",
    interpret: bool = False,
):
    """``(rope(q, cos_sin), *write_kv(k_cache, v_cache, rope(k, cos_sin), v, slot_mapping))``
    (k and v cast to the caches' dtypes) with the same bits; on the GPU one kernel launch. A
    padding token (negative slot) writes no cache row there (``write_kv`` writes it into the
    null block 0, which no attention reads unmasked).

    q [T, Hq, D], k and v [T, Hkv, D] of one dtype; cos_sin [T, 2, D/2] float32; the caches
    [num_blocks, block_size, Hkv, D] (donated) and ``slot_mapping`` [T] as ``write_kv``'s. Not
    differentiable (an inference step's op; ``rope`` is).
    """
    for name, a, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("cos_sin", cos_sin, 3)):
        if getattr(a, "ndim", None) != nd:
            raise ValueError(f"rope_write_kv: {name} must be {nd}-D, got shape {getattr(a, 'shape', None)}")
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"rope_write_kv: q {q.shape} and k {k.shape} need one T and one head dim")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"rope_write_kv: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    check_write_kv("rope_write_kv", k_cache, v_cache, k, v, slot_mapping, cast=True)
    _check_heads("rope_write_kv", t, d, cos_sin, k_cache, v_cache)
    runtime.check_backend(backend, interpret)
    slots = jnp.asarray(slot_mapping, jnp.int32)
    return _rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots, backend=backend, interpret=interpret)


def _qkv_rows(outs, plans, ws, d):
    """``gpu_shared``'s own outputs as the RoPE kernel's inputs: each [L, M', H', D] float32
    leaf partials (fold: the plan's split_k) or [M', H', D] results (fold None)."""
    rows, folds = [], []
    for out, plan, w in zip(outs, plans, ws, strict=True):
        # whole heads: N is heads * D and its padding a whole column tile (D and tiles: powers of 2)
        assert w.shape[1] % d == 0 and out.shape[-1] % d == 0, (w.shape, out.shape, d)
        rows.append(out.reshape(*out.shape[:-1], out.shape[-1] // d, d))
        folds.append(None if out.ndim == 2 else plan.split_k)
    return rows, tuple(folds)


@runtime.kernel_op(
    "qkv_rope_write_kv", static_argnames=("cols", "backend", "interpret"), donate_argnums=(5, 6)
)
def _qkv_rope_write_kv(x, wq, wk, wv, cos_sin, k_cache, v_cache, slots, *, cols, backend, interpret):
    t, d = x.shape[0], k_cache.shape[-1]

    def ops(x, wq, wk, wv, cos_sin, k_cache, v_cache, slots, *, backend):
        ys = _matmul_shared(
            x, (wq, wk, wv), out_dtype=x.dtype, cols=cols, backend=backend, interpret=interpret
        )
        q, k, v = (y.reshape(t, -1, d) for y in ys)
        return _rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots, backend=backend, interpret=interpret)

    def gpu(x, wq, wk, wv, cos_sin, k_cache, v_cache, slots):
        ws = (wq, wk, wv)
        kw = dict(out_dtype=x.dtype, cols=cols, backend=backend, interpret=interpret, combine=False)
        rows, folds = _qkv_rows(*gpu_shared(x, ws, **kw), ws, d)
        q_rot, kc, vc = _rope_kv_pallas(
            *rows,
            cos_sin,
            k_cache,
            v_cache,
            slots,
            interpret=interpret,
            folds=folds,
            hq=wq.shape[1] // d,
            dtype=x.dtype,
        )
        return q_rot, kc, vc

    args = (x, wq, wk, wv, cos_sin, k_cache, v_cache, slots)
    if not (FUSED and QKV_COMBINE_IN_KERNEL):
        return ops(*args, backend=backend)
    return runtime.dispatch(backend, functools.partial(ops, backend="jnp"), gpu, *args)


def qkv_rope_write_kv(
    x: jax.Array,
    ws,
    cos_sin: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    col_blocks: int = 1,
    full_ns=None,
    backend: str = "auto",
    interpret: bool = False,
):
    """An attention layer's projections, RoPE and KV write: with ``q, k, v = matmul_shared(x,
    ws, col_blocks=..., full_ns=...)`` as [T, heads, D] rows, ``rope_write_kv(q, k, v, cos_sin,
    k_cache, v_cache, slot_mapping)`` - the same bits. On the GPU the RoPE kernel reads the
    projections' float32 leaf partials and combines them itself (``plan.combine_leaves``, then
    ``plan.leaf_result``'s rounding), so no XLA combine runs between the two launches.

    x [T, H]; ws = (wq [H, Hq*D], wk [H, Hkv*D], wv [H, Hkv*D]) of x's dtype (a column-parallel
    rank's shards with ``full_ns``, as ``matmul_shared``); cos_sin [T, 2, D/2] float32; the
    caches [num_blocks, block_size, Hkv, D] (donated; D and Hkv from them) and ``slot_mapping``
    [T] as ``write_kv``'s. Returns (q rotated [T, Hq, D], k_cache, v_cache). Not differentiable.
    """
    ws, out_dtype, cols = check_shared("qkv_rope_write_kv", x, ws, None, col_blocks, full_ns)
    if len(ws) != 3:
        raise ValueError(f"qkv_rope_write_kv: ws must be (wq, wk, wv), got {len(ws)} weights")
    if getattr(k_cache, "ndim", None) != 4:
        raise ValueError(
            f"qkv_rope_write_kv: k_cache must be [num_blocks, block_size, Hkv, D], got {getattr(k_cache, 'shape', None)}"
        )
    t, d = x.shape[0], k_cache.shape[-1]
    nq, nk, nv = (w.shape[1] for w in ws)
    if d % 2 or nq % d or nk != nv or nk != k_cache.shape[2] * d:
        raise ValueError(
            f"qkv_rope_write_kv: weights of {nq}, {nk}, {nv} columns do not make whole heads of the "
            f"cache's {k_cache.shape[2]} x {d} (q: a multiple of D; k, v: Hkv * D)"
        )
    kv_rows = jax.ShapeDtypeStruct((t, nk // d, d), out_dtype)
    check_write_kv("qkv_rope_write_kv", k_cache, v_cache, kv_rows, kv_rows, slot_mapping, cast=True)
    _check_heads("qkv_rope_write_kv", t, d, cos_sin, k_cache, v_cache)
    runtime.check_backend(backend, interpret)
    slots = jnp.asarray(slot_mapping, jnp.int32)
    return _qkv_rope_write_kv(
        x, *ws, cos_sin, k_cache, v_cache, slots, cols=cols, backend=backend, interpret=interpret
    )


__all__ = ["qkv_rope_write_kv", "rope", "rope_write_kv"]
