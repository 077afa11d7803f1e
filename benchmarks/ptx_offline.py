"""ptxas's view of the Mosaic GPU prefill kernel, on a machine without a GPU.

XLA's CUDA plugin compiles ahead of time for a GPU it does not have: a CUDA topology made from
a target description (an H100 80GB's; sm_90a, as the H200's) takes ``jit(...).lower()
.compile()``, which runs Mosaic GPU's whole pipeline (MLIR -> NVVM -> PTX) and ptxas as on the
device, and with ``MOSAIC_GPU_DUMP_TO`` set writes the PTX and ptxas's report. This prints, per
launch, what the device's ``mgpu-*-ptxas`` steps print - registers, spills, ptxas's "wgmma
serialized" notes (C7514 / C7515) - in seconds and without device time (session 58: the same
report as the device's for both forms of the deferred p @ v launch, since removed).

Set-up, once (~150 MB): ``make ptx-tools`` - this jax version's jax-cuda13 plugin and PJRT
wheels unpacked into ``.ptx-tools/site``, and ptxas 13.0 (the device's CUDA) from the
nvidia-cuda-nvcc wheel. Then::

    PYTHONPATH=. .venv/bin/python benchmarks/ptx_offline.py [--launch "overlap=True,k_ahead=True"]...
        [--heads 32/8 28/4 9/3] [--keep DIR]

Each ``--launch`` is tiles_mgpu launch arguments over the engine's ``MGPU_PREFILL_LAUNCH``
(none: the engine's alone; ``default``: tiles_mgpu's defaults). The kernel is compiled on a
whole 4096-token prompt in 16-token pages, as the device's ptxas step does. ``--keep``: each
launch's PTX is copied there (``ptxas -arch=sm_90a`` and ``cuobjdump -sass`` make its SASS).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, ".ptx-tools", "site")
# An H100 80GB HBM3 as XLA describes a GPU (compute capability 9.0 with its accelerated features,
# sm_90a: what the kernels are compiled for on the H100 and the H200 alike)
TARGET = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
HEADS = {"32/8": (32, 8, 128), "28/4": (28, 4, 128), "9/3": (9, 3, 64)}


def _setup():
    """The plugin on the path and the CPU as jax's platform - before jax is imported (else the
    plugin's CUDA check fails without a word, and the topology is refused later)."""
    if "jax" in sys.modules:
        raise SystemExit("ptx_offline: import this module before jax")
    if not os.path.isdir(os.path.join(TOOLS, "jax_plugins")):
        raise SystemExit(f"ptx_offline: no CUDA plugin under {TOOLS}: run `make ptx-tools` first")
    sys.path.insert(0, TOOLS)
    os.environ["JAX_PLATFORMS"] = "cpu"
    nvcc_bin = os.path.join(TOOLS, "nvidia", "cu13", "bin")
    if os.path.exists(os.path.join(nvcc_bin, "ptxas")):  # ptxas 13.0, as on the device
        os.environ["PATH"] = nvcc_bin + os.pathsep + os.environ.get("PATH", "")
        os.environ.setdefault("MOSAIC_GPU_CUDA_ROOT", os.path.dirname(nvcc_bin))


def report(text: str) -> tuple[str, str, int]:
    """(registers, spill stores / loads, serialized-wgmma notes) from ptxas's output."""
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    notes = len(re.findall(r"\(C751[45]\)", text))
    return ",".join(regs) or "?", ",".join(f"{a}/{b}" for a, b in spills) or "0/0", notes


def compile_launch(launch: dict, heads: str, keep: str | None, name: str) -> tuple[str, str, int]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from benchmarks.attention import BS
    from pallas_kernels import attention_mgpu
    from pallas_kernels.attention_math import AttentionSpec

    hq, hkv, d = HEADS[heads]
    tokens, pages = 4096, 4096 // BS
    device = topologies.get_topology_desc(platform="cuda", target_config=TARGET, topology="1x1x1").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    cache = arg((pages + 1, BS, hkv, d), jnp.bfloat16)
    args = (
        arg((tokens, hkv, hq // hkv, d), jnp.bfloat16),
        cache,
        cache,
        arg((1, pages), jnp.int32),
        arg((1,), jnp.int32),
        arg((tokens,), jnp.int32),
        arg((tokens,), jnp.int32),
    )
    spec = AttentionSpec.create(d)

    def fn(q, k, v, tables, lens, seqs, pos):
        return attention_mgpu.tiles_mgpu(
            q, k, v, (tables, lens, seqs, pos), spec=spec, pv="into", rounding="two", **launch
        )

    out = tempfile.mkdtemp(prefix="ptx-offline-")
    os.environ["MOSAIC_GPU_DUMP_TO"] = out
    os.environ["MOSAIC_GPU_DUMP_PTX"] = os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    try:
        jax.jit(fn).trace(*args).lower().compile()
    finally:
        for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS"):
            del os.environ[k]
    text = "".join(open(f).read() for f in sorted(glob.glob(os.path.join(out, "*.ptxas"))))
    if not text.strip():
        raise SystemExit(f"ptx_offline: no ptxas report written under {out} (is ptxas on PATH?)")
    for line in text.splitlines():
        if "(C751" in line:
            print(f"  [{name}, {heads}] {line.strip()}")
    if keep:
        os.makedirs(keep, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", f"{name}-{heads}".lower()).strip("-")
        for i, f in enumerate(sorted(glob.glob(os.path.join(out, "*.ptx")))):
            shutil.copy(f, os.path.join(keep, f"{slug}{'-' + str(i) if i else ''}.ptx"))
    shutil.rmtree(out, ignore_errors=True)
    return report(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--launch", action="append", default=None, help="launch arguments over the engine's; 'default'"
    )
    ap.add_argument("--heads", nargs="+", default=["32/8"], choices=sorted(HEADS))
    ap.add_argument("--keep", default=None, help="copy each launch's PTX into this folder")
    a = ap.parse_args()
    _setup()
    from benchmarks.kernel_modules import parse_launch
    from pallas_kernels import attention_triton

    rows = []
    for text in a.launch or [""]:
        if text == "default":
            name, launch = "default launch", {}
        else:
            name = "engine" + (f" + {text}" if text else "")
            launch = {**dict(attention_triton.MGPU_PREFILL_LAUNCH), **parse_launch(text)}
        for heads in a.heads:
            try:
                rows.append((name, heads, *compile_launch(launch, heads, a.keep, name)))
            except ValueError as err:  # a launch this shape refuses (shared memory): say so
                rows.append((name, heads, f"refused: {err}", "", ""))
    print("\n| launch | heads | registers | spill stores / loads (bytes) | wgmma serialized notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
