"""The path that claims a kernel runs it: named pallas_calls in the CUDA lowering, none on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels.runtime import MOSAIC_GPU_CUSTOM_CALL, TRITON_CUSTOM_CALL, cuda_export

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16

CASES = {
    "matmul_decode": (
        lambda x, w: pk.matmul(x, w),
        (S((1, 4096), BF16), S((4096, 128256), BF16)),
        "bijax_matmul",
    ),
    "matmul_split_k_8_shards": (
        lambda x, w: pk.matmul(x, w, k_shards=8),
        (S((17, 14336), BF16), S((14336, 4096), BF16)),
        "bijax_matmul",
    ),
    "matmul_odd": (
        lambda x, w: pk.matmul(x, w),
        (S((7, 1536), jnp.float32), S((1536, 576), jnp.float32)),
        "bijax_matmul",
    ),
    "matmul_mosaic_gpu_prefill": (
        lambda x, w: pk.matmul(x, w),
        (S((512, 4096), BF16), S((4096, 6144), BF16)),
        "bijax_matmul_mgpu",
    ),
    "matmul_shared_decode": (
        lambda x, wq, wk, wv: pk.matmul_shared(x, (wq, wk, wv)),
        (S((1, 4096), BF16), S((4096, 4096), BF16), S((4096, 1024), BF16), S((4096, 1024), BF16)),
        "bijax_matmul_shared",
    ),
    "matmul_mosaic_gpu_mid_m": (
        lambda x, w: pk.matmul(x, w),
        (S((256, 14336), BF16), S((14336, 4096), BF16)),
        "bijax_matmul_mgpu",
    ),
    "matmul_norm_decode": (  # the norm kernel reads the matmul's float32 leaf partials
        lambda x, w, g, r: pk.matmul_norm(x, w, g, r, eps=1e-5),
        (S((1, 14336), BF16), S((14336, 4096), BF16), S((4096,), BF16), S((1, 4096), BF16)),
        "bijax_rms_norm",
    ),
    "rope_write_kv": (
        lambda q, k, v, cs, kc, vc, slots: pk.rope_write_kv(q, k, v, cs, kc, vc, slots),
        (
            S((16, 32, 128), BF16),
            S((16, 8, 128), BF16),
            S((16, 8, 128), BF16),
            S((16, 2, 64), jnp.float32),
            S((64, 16, 8, 128), BF16),
            S((64, 16, 8, 128), BF16),
            S((16,), jnp.int32),
        ),
        "bijax_rope_kv",
    ),
    "qkv_rope_write_kv_decode": (  # the RoPE kernel reads q, k, v's float32 leaf partials
        lambda x, wq, wk, wv, cs, kc, vc, slots: pk.qkv_rope_write_kv(x, (wq, wk, wv), cs, kc, vc, slots),
        (
            S((16, 4096), BF16),
            S((4096, 4096), BF16),
            S((4096, 1024), BF16),
            S((4096, 1024), BF16),
            S((16, 2, 64), jnp.float32),
            S((64, 16, 8, 128), BF16),
            S((64, 16, 8, 128), BF16),
            S((16,), jnp.int32),
        ),
        "bijax_rope_kv",
    ),
    "rms_norm_residual": (
        lambda x, g, r: pk.rms_norm(x, g, eps=1e-5, residual=r),
        (S((7, 1536), BF16), S((1536,), BF16), S((7, 1536), BF16)),
        "bijax_rms_norm",
    ),
    "log_softmax": (pk.log_softmax, (S((7, 151936), jnp.float32),), "bijax_softmax_stats"),
    "logsumexp": (pk.logsumexp, (S((3, 49152), BF16),), "bijax_softmax_stats"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_export_contains_the_named_kernel(name):
    fn, args, kernel = CASES[name]
    text = cuda_export(fn, *args)
    if kernel.endswith("_mgpu"):  # Hopper at M >= 512: the Mosaic GPU kernel, no Triton one
        assert MOSAIC_GPU_CUSTOM_CALL in text and kernel in text and TRITON_CUSTOM_CALL not in text
        return
    assert TRITON_CUSTOM_CALL in text
    assert f'name = "{kernel}"' in text


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_lowering_uses_the_fixed_shape_formulation(name):
    fn, args, kernel = CASES[name]
    text = jax.jit(fn).lower(*args).as_text()
    assert TRITON_CUSTOM_CALL not in text and kernel not in text


def test_negative_control_the_name_check_can_fail():
    """XLA's own dot, exported for CUDA, has no bijax kernel in it."""
    text = cuda_export(pk.matmul_reference, S((1, 64), BF16), S((64, 64), BF16))
    assert "bijax_matmul" not in text


def test_mosaic_gpu_path_only_on_hopper():
    """The same M=512 bf16 matmul lowers to the Triton kernel for a non-Hopper GPU."""
    args = (S((512, 4096), BF16), S((4096, 6144), BF16))
    text = cuda_export(lambda x, w: pk.matmul(x, w), *args, device_kind="NVIDIA A100-SXM4-80GB")
    assert TRITON_CUSTOM_CALL in text and MOSAIC_GPU_CUSTOM_CALL not in text
    # float32 has no wgmma path: Triton on Hopper too.
    f32 = (S((512, 4096), jnp.float32), S((4096, 6144), jnp.float32))
    text = cuda_export(lambda x, w: pk.matmul(x, w), *f32)
    assert TRITON_CUSTOM_CALL in text and MOSAIC_GPU_CUSTOM_CALL not in text


def test_shared_launch_only_where_the_weights_launches_agree():
    """q, k, v above 64 rows run the Mosaic GPU kernel on Hopper (a launch each, no shared
    kernel); up to 64 rows the shared kernel (at 33-64 rows each alone would be Mosaic: the
    shared launch was faster, session 47), or with SHARED_OVER_MGPU_ROWS 0 the Mosaic
    launches again; with the shared launch switched off, a launch per weight."""
    from pallas_kernels import matmul_triton

    ws = (S((4096, 4096), BF16), S((4096, 1024), BF16), S((4096, 1024), BF16))
    fn = lambda x, *ws: pk.matmul_shared(x, ws)  # noqa: E731
    text = cuda_export(fn, S((96, 4096), BF16), *ws)
    assert "bijax_matmul_shared" not in text and text.count(MOSAIC_GPU_CUSTOM_CALL) >= 3
    text = cuda_export(fn, S((64, 4096), BF16), *ws)
    assert "bijax_matmul_shared" in text and MOSAIC_GPU_CUSTOM_CALL not in text
    assert "bijax_matmul_shared" in cuda_export(fn, S((1, 4096), BF16), *ws)
    try:  # a module setting read when tracing: traced anew (jit caches cleared) under each value
        matmul_triton.SHARED_OVER_MGPU_ROWS = 0
        jax.clear_caches()
        old_rule = cuda_export(fn, S((64, 4096), BF16), *ws)
        matmul_triton.SHARED_OVER_MGPU_ROWS = 64
        matmul_triton.SHARED_LAUNCH = False
        jax.clear_caches()
        text = cuda_export(fn, S((1, 4096), BF16), *ws)
    finally:
        matmul_triton.SHARED_LAUNCH, matmul_triton.SHARED_OVER_MGPU_ROWS = True, 64
        jax.clear_caches()
    assert "bijax_matmul_shared" not in old_rule and old_rule.count(MOSAIC_GPU_CUSTOM_CALL) >= 3
    assert "bijax_matmul_shared" not in text and text.count('name = "bijax_matmul"') == 3


def test_fused_epilogues_leave_no_leaf_combine_to_xla():
    """``matmul_norm`` and ``qkv_rope_write_kv`` exported for CUDA at decode rows have no XLA add
    left (their kernels combine the leaf partials); the plain matmul of the same weight has (the
    combine in XLA: the check can fail)."""
    for name in ("matmul_norm_decode", "qkv_rope_write_kv_decode"):
        fn, args, _ = CASES[name]
        assert "stablehlo.add" not in cuda_export(fn, *args), name
    x, w = CASES["matmul_norm_decode"][1][:2]
    assert "stablehlo.add" in cuda_export(lambda x, w: pk.matmul(x, w), x, w)


def test_lowering_a_triton_kernel_looks_for_no_dialect_module_it_cannot_find():
    """MLIR finds the Triton dialect's module where it looks first (``runtime.
    TRITON_DIALECT_MODULE``, JAX's own module), so lowering a kernel for CUDA tries no failed
    import (it tried three per "tt" value before: 0.1-0.5 s of a decode program's export).
    Control: the spy sees a failed lookup of a "tt" module when there is one."""
    import importlib.abc
    import sys

    from jax._src.lib.triton import dialect

    from pallas_kernels import runtime

    assert sys.modules[runtime.TRITON_DIALECT_MODULE] is dialect
    tried = []

    class Spy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.rsplit(".", 1)[-1] == "tt":  # a lookup of the "tt" dialect's module
                tried.append(name)
            return None

    spy = Spy()
    sys.meta_path.insert(0, spy)
    try:
        # shapes no other test lowers (no cached lowering)
        text = cuda_export(lambda x, w: pk.matmul(x, w), S((3, 1088), BF16), S((1088, 192), BF16))
        assert TRITON_CUSTOM_CALL in text
        missed = list(tried)
        with pytest.raises(ImportError):
            __import__("jaxlib.mosaic.python.tt")  # (what MLIR tried before, after the first prefix)
    finally:
        sys.meta_path.remove(spy)
    assert not missed, sorted(set(missed))
    assert tried == ["jaxlib.mosaic.python.tt"]
