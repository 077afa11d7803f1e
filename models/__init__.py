"""Model code (Flax NNX Llama family), presets, checkpoint loading, tokenizers.

Models call kernels only through ``pallas_kernels``. (Filled in by the model issues.)
"""
