"""bijax: batch-invariant LLM inference for JAX.

The engine and public API (``LLM``, ``SamplingParams``, ...) are built on the
kernels in ``pallas_kernels``; see DESIGN.md for the invariance contract.
"""

__version__ = "0.1.0"

# Bumped whenever a change alters output bits (kernels, reduction plans, sampling).
NUMERICS_VERSION = 1
