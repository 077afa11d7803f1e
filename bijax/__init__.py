"""bijax: batch-invariant LLM inference for JAX.

``LLM`` / ``SamplingParams`` / ``RequestOutput`` / ``Engine`` follow vLLM's names; the
kernels they run on are in ``pallas_kernels``. See docs/design.md for the invariance contract.
"""

__version__ = "0.1.0"

# Bumped whenever a change alters output bits (kernels, reduction plans, sampling).
# 5: GPU attention folds its splits in Triton (tiles and tokens kernels); CPU bits as in 4.
# 6: attention's exponentials as 2**(x log2 e): on the GPU one ex2.approx.ftz instruction in
#    every kernel instead of libdevice's exact expf (GPU bits changed); CPU bits as in 5 (XLA
#    compiles jnp.exp2(x * log2 e) to the same exp(x)).
# 7: the CPU attention folds its splits in a scan: unrolled, XLA's fusion of the fold changed
#    with the split count (the block-table width: max_model_len, the trainer's row length), so a
#    token past its first split (512 keys) had other bits at another width. CPU bits changed
#    past 512 tokens of context only; the GPU programs did not change.
NUMERICS_VERSION = 7

from pallas_kernels.runtime import request_xla_flag  # noqa: E402

# XLA runs a warmed-up GPU program as a CUDA graph and re-records the graph on the host (~1 ms for
# a llama3-8b forward) before a run whenever one of the program's buffers moved since the last
# run. SKIP_TEMP keeps XLA's scratch buffer at the same virtual addresses (XLA's VMM allocator);
# with the step inputs kept in place too (``ModelRunner._staged``, ``BIJAX_STAGED_INPUTS=1``) a
# decode step's graph is recorded once (benchmarks/RESULTS.md, session 36). Staging is off by
# default since session 41 (its copy made the host wait and no step was faster): the inputs are
# then new buffers every step and XLA updates the graph whatever the mode, and SKIP_TEMP alone
# made no step faster (single stream, ms a step: H100 6.61 vs 6.64 under XLA's default,
# session 42; H200 5.10 vs 5.04, session 39) while its VMM allocator keeps no memory
# statistics. So the flag is asked for only with staging on (``BIJAX_STAGED_INPUTS=1`` set
# before bijax is imported), before JAX starts its GPU backend; a user's own setting of the
# flag wins (README, Limits). No effect on CPU or on bits.
GPU_GRAPH_UPDATE_MODE = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"

from bijax.step_programs import staged_inputs  # noqa: E402

if staged_inputs():
    request_xla_flag(GPU_GRAPH_UPDATE_MODE)

from bijax import compile_cache  # noqa: E402

compile_cache.enable()  # before anything compiles: JAX decides once per process

from bijax.config import EngineConfig  # noqa: E402
from bijax.llm import LLM, WarmupReport  # noqa: E402
from bijax.llm_engine import Engine, EngineStats, ValidPrompt  # noqa: E402
from bijax.outputs import CompletionOutput, RequestOutput  # noqa: E402
from bijax.rl import logprobs  # noqa: E402
from bijax.sampling_params import SamplingParams  # noqa: E402

__all__ = [
    "LLM",
    "NUMERICS_VERSION",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "ValidPrompt",
    "WarmupReport",
    "logprobs",
]

# The sources' digest that names saved step programs (``step_cache``), taken now: it must
# describe the code this process runs, not files changed on disk after it started.
from bijax import step_cache as _step_cache  # noqa: E402

_step_cache._source_digest()
