"""Batch-invariant kernels: no model knowledge, one file per op.

Each op: Pallas kernel (GPU) -> pallas_call wrapper -> fixed-shape CPU
formulation -> public entry (keyword-only static args) -> ``*_reference``
(plain XLA, batch-variant: the negative control and the speed baseline).
An op whose GPU kernel is large keeps it in a module of its own
(``matmul_triton``, ``matmul_mgpu``, ``attention_triton``; ``grouped_matmul`` reuses
matmul's plan, CPU tile and K loop; ``attention_cpu``,
``attention_math`` for what attention's paths share); ``plan`` holds the
matmul's reduction plan and fixed tree, ``runtime`` the per-platform dispatch.
"""

# ruff: noqa: I001  (runtime first: it sets XLA's CPU flags before any JAX backend starts)

from pallas_kernels.runtime import (  # first: sets XLA's CPU flags before JAX starts
    CPU_CONSISTENT_MATH,
    cpu_math_is_consistent,
    require_consistent_cpu_math,
)
from pallas_kernels.attention import (
    SPLIT_SIZE,
    AttentionSpec,
    attention,
    attention_reference,
    segment_attention_reference,
    write_kv,
)
from pallas_kernels.attention_xla import attention_xla
from pallas_kernels.collectives import gather_last, tree_psum
from pallas_kernels.grouped_matmul import group_rows, grouped_matmul, grouped_matmul_reference
from pallas_kernels.matmul import matmul, matmul_partial, matmul_reference, matmul_shared
from pallas_kernels.matmul_norm import matmul_norm
from pallas_kernels.mlp import gate_up_swiglu, swiglu
from pallas_kernels.plan import K_SHARDS, MatmulPlan, plan_matmul, tree_sum
from pallas_kernels.rms_norm import rms_norm, rms_norm_reference
from pallas_kernels.rope import qkv_rope_write_kv, rope, rope_write_kv
from pallas_kernels.sampling import (
    argmax,
    greedy_rows,
    sample,
    tempered,
    tempered_log_softmax,
    top_n,
    uses_filters,
)
from pallas_kernels.softmax import (
    log_softmax,
    log_softmax_reference,
    logsumexp,
    logsumexp_reference,
)

__all__ = [
    "K_SHARDS",
    "SPLIT_SIZE",
    "AttentionSpec",
    "attention",
    "attention_reference",
    "attention_xla",
    "segment_attention_reference",
    "write_kv",
    "CPU_CONSISTENT_MATH",
    "cpu_math_is_consistent",
    "require_consistent_cpu_math",
    "MatmulPlan",
    "argmax",
    "greedy_rows",
    "group_rows",
    "gate_up_swiglu",
    "grouped_matmul",
    "grouped_matmul_reference",
    "gather_last",
    "log_softmax",
    "log_softmax_reference",
    "logsumexp",
    "logsumexp_reference",
    "matmul",
    "matmul_norm",
    "matmul_partial",
    "matmul_reference",
    "matmul_shared",
    "plan_matmul",
    "rms_norm",
    "rms_norm_reference",
    "qkv_rope_write_kv",
    "rope",
    "rope_write_kv",
    "sample",
    "swiglu",
    "tempered",
    "tempered_log_softmax",
    "top_n",
    "tree_psum",
    "tree_sum",
    "uses_filters",
]
