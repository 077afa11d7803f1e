"""Model code: the Flax NNX Llama family on the batch-invariant kernels, presets, checkpoints.

Models call kernels only through ``pallas_kernels``.
"""

from models.configs import PRESETS, LlamaConfig, RopeScaling, preset
from models.gguf import load_gguf
from models.llama import Llama, param_state
from models.loading import DEFAULT_MODEL, embedded_model_path, load_hf, load_model, load_orbax, save_orbax
from models.paged import KVCache, PagedBatch, init_kv_cache
from models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "PagedBatch",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "Tokenizer",
    "embedded_model_path",
    "init_kv_cache",
    "load_gguf",
    "load_hf",
    "load_model",
    "load_orbax",
    "load_tokenizer",
    "param_state",
    "preset",
    "save_orbax",
]
