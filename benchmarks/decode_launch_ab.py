"""A/B of the matmul's decode-row launch (``matmul_triton.gpu_tiles``): the engine benchmark
``benchmarks/async_scheduling.py`` (llama3-8b, 1 and 64 sequences x (64 + 128) tokens) with the
16-row, 64-column, 8-stage launch turned off (``old``) or on (``new``). Launches never change a
row's bits (``kernels.py --decode-sweep`` checks them), so only the time differs.

Run on the H200, one process per side:
  PYTHONPATH=. python3 benchmarks/decode_launch_ab.py old; PYTHONPATH=. python3 benchmarks/decode_launch_ab.py new
"""

import runpy
import sys

import pallas_kernels.matmul_triton as matmul_triton

if __name__ == "__main__":
    side = sys.argv[1] if len(sys.argv) > 1 else ""
    if side not in ("old", "new"):
        sys.exit("usage: decode_launch_ab.py old|new")
    if side == "old":
        matmul_triton._DECODE_WIDE_PROGRAMS = 1 << 30  # no weight has this many programs: rule off
    sys.argv = ["async_scheduling.py", "--model", "llama3-8b", "--seqs", "1,64", "--output-len", "128"]
    runpy.run_path("benchmarks/async_scheduling.py", run_name="__main__")
