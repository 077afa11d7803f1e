"""Model code: the Flax NNX Llama family on the batch-invariant kernels, presets, checkpoints.

Models call kernels only through ``pallas_kernels``.
"""

from models.configs import PRESETS, LlamaConfig, RopeScaling, preset
from models.llama import Llama, init_kv_cache, param_state
from models.loading import load_hf, load_model, load_orbax, save_orbax

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "init_kv_cache",
    "load_hf",
    "load_model",
    "load_orbax",
    "param_state",
    "preset",
    "save_orbax",
]
