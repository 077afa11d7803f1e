"""Model configs: a small frozen dataclass per model, built from HF ``config.json`` or a preset.

Presets without a checkpoint (``tiny``, ``llama3-8b``) get random weights drawn from a seed
(``models.llama.init_random``), identical in every process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from pallas_kernels.checks import check_positive_int

# HF model_type values whose decoder is the Llama block (RMSNorm, RoPE, SwiGLU, GQA).
# Qwen3 adds a per-head RMSNorm on q and k before RoPE (``qk_norm``); Qwen3-MoE replaces the
# MLP of its sparse layers by a routed mixture of SwiGLU experts (``num_experts`` > 0).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
# model_type -> the prefix of its HF architecture name (``LlamaForCausalLM``, ...)
_ARCHITECTURES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3Moe",
    "mistral": "Mistral",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (HF ``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        # (inv_freq divides by each of them: a zero or a negative gives NaN or meaningless
        # angles, never an error later)
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
                raise ValueError(f"rope_scaling: {name} must be a positive number, got {v!r}")
        check_positive_int(
            "rope_scaling: original_max_position_embeddings",
            self.original_max_position_embeddings,
            numpy=False,
        )
        if self.high_freq_factor <= self.low_freq_factor:  # (the band between them is smoothed)
            raise ValueError(
                f"rope_scaling: high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Qwen3-MoE).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: model size.
      num_heads, num_kv_heads, head_dim: grouped-query attention shape.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta, rope_scaling: rotary embedding base and optional Llama-3 scaling.
      rope_freq_factors: per-frequency divisors stored by GGUF files (``rope_freqs``), an
        alternative to ``rope_scaling``.
      max_position_embeddings: the model's context length.
      tie_word_embeddings: the LM head is the embedding matrix (SmolLM2).
      attention_bias: q/k/v projections carry a bias (Qwen2).
      qk_norm: an RMSNorm over each head's q and k (weights [head_dim]) before RoPE (Qwen3).
      bos_token_id, eos_token_ids: special tokens from config.json (may be empty).
      model_type: HF's model_type, for messages.
      num_experts: experts of a mixture-of-experts layer (Qwen3-MoE); 0 = a dense model.
      num_experts_per_tok: experts each token is routed to (top-k of the router's softmax).
      moe_intermediate_size: each expert's SwiGLU width.
      norm_topk_prob: the k routing weights are renormalised to sum to 1.
      decoder_sparse_step, mlp_only_layers: layer i is a MoE layer when num_experts > 0,
        (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (HF's rule); the
        others keep the dense MLP of ``intermediate_size``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_positive_int(f"LlamaConfig: {name}", getattr(self, name), numpy=False)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"LlamaConfig: rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"LlamaConfig: {len(self.rope_freq_factors)} rope_freq_factors for head_dim {self.head_dim}"
            )
        if self.rope_freq_factors is not None and not all(
            f > 0 and math.isfinite(f) for f in self.rope_freq_factors
        ):  # (the frequencies are divided by them)
            raise ValueError("LlamaConfig: rope_freq_factors must be positive and finite")
        if not (self.rope_theta > 1 and math.isfinite(self.rope_theta)):
            raise ValueError(f"LlamaConfig: rope_theta must be > 1, got {self.rope_theta!r}")
        if self.num_experts:
            for name in (
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "decoder_sparse_step",
            ):
                v = getattr(self, name)
                check_positive_int(f"LlamaConfig: {name}", v, numpy=False, why="for a MoE model")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"LlamaConfig: num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                    f"num_experts ({self.num_experts})"
                )

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` is a mixture of experts (HF Qwen3-MoE's rule)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        dense = 3 * h * i
        moe = h * self.num_experts + 3 * h * self.moe_intermediate_size * self.num_experts
        mlps = sum(moe if self.is_moe_layer(n) else dense for n in range(self.num_layers))
        layers = self.num_layers * (attn + 2 * h) + mlps
        return v * h * (1 if self.tie_word_embeddings else 2) + layers + h

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] in float64 (Llama-3 scaling applied)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_freq_factors is not None:
            return inv / np.asarray(self.rope_freq_factors, np.float64)
        s = self.rope_scaling
        if s is None:
            return inv
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, blended, scaled)

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike) -> LlamaConfig:
        """From a HF ``config.json`` dict, the file, or the checkpoint directory holding it."""
        return _from_hf_dict(hf if isinstance(hf, dict) else read_hf_config(hf))


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The dict in a HF ``config.json`` (the file, or the directory holding it)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no HF config.json at {path}")
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(hf).__name__}")
    return hf


def _from_hf_dict(hf: dict[str, Any]) -> LlamaConfig:
    model_type = hf.get("model_type")
    if model_type is None:  # (transformers needs it too): only an architecture of the family stands in
        archs = hf.get("architectures") or []
        known = {f"{name}ForCausalLM": t for t, name in _ARCHITECTURES.items()}
        types = {known.get(a) for a in archs}
        if len(types) != 1 or None in types:
            raise ValueError(
                f"config.json has no model_type (architectures {archs}); bijax supports the Llama family "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        (model_type,) = types
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; bijax supports the Llama family {SUPPORTED_MODEL_TYPES}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (Llama-family models use 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported: mlp_bias=True")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise ValueError(f"unsupported: {model_type} with use_sliding_window=True")
    # (transformers' MistralConfig takes a 4096-token window when config.json has no such key)
    if model_type == "mistral" and hf.get("sliding_window", 4096):
        raise ValueError(
            "unsupported: Mistral with a sliding window (config.json's sliding_window, "
            "4096 when the key is absent as in transformers)"
        )
    missing = [
        k
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if k not in hf
    ]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(
        _hf_number(e, "eos_token_id", int)
        for e in ([] if eos is None else eos if isinstance(eos, list) else [eos])
    )
    bos = hf.get("bos_token_id")
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        # (transformers' default for every type here)
        rms_norm_eps=_hf_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        bos_token_id=None if bos is None else _hf_number(bos, "bos_token_id", int),
        eos_token_ids=eos_ids,
        model_type=model_type,
        **(_moe_fields(hf) if model_type == "qwen3_moe" else {}),
    )


def _hf_number(value, name: str, kind=float):
    """``value`` of config.json's field ``name`` as ``kind``, or an error naming the field."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (kind is int and value != int(value))
    ):
        raise ValueError(
            f"config.json: {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        )
    return kind(value)


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, Llama-3 scaling or None) from config.json; transformers >= 5 keeps both in
    "rope_parameters", older files in "rope_theta" / "rope_scaling". A scaling block must name
    its type (transformers fails on one that does not): a factor without a type is an error,
    never dropped."""
    blocks = {}
    for key in ("rope_parameters", "rope_scaling"):
        block = hf.get(key)
        if block is not None and not isinstance(block, dict):
            raise ValueError(f"config.json: {key} must be an object, got {block!r}")
        blocks[key] = block or {}
    rp = blocks["rope_parameters"]
    theta = _hf_number(hf.get("rope_theta", rp.get("rope_theta", 10000.0)), "rope_theta")
    name = "rope_scaling" if blocks["rope_scaling"] else "rope_parameters"
    rs = blocks[name]
    kind = rs.get("rope_type", rs.get("type"))
    if kind is None and "factor" in rs:
        raise ValueError(f"config.json: {name} has a factor but no rope_type: {rs!r}")
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in fields if k not in rs]
    if missing:
        raise ValueError(f"config.json: {name} (llama3) lacks {', '.join(map(repr, missing))}")
    return theta, RopeScaling(
        *(_hf_number(rs[k], f"{name}.{k}") for k in fields[:3]),
        _hf_number(rs[fields[3]], f"{name}.{fields[3]}", int),
    )


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's router and expert settings (transformers 5 writes ``num_local_experts``)."""
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    missing = [
        k
        for k, v in (
            ("num_experts", num_experts),
            ("num_experts_per_tok", hf.get("num_experts_per_tok")),
            ("moe_intermediate_size", hf.get("moe_intermediate_size")),
        )
        if v is None
    ]
    if missing:
        raise ValueError(f"config.json of a qwen3_moe model lacks {', '.join(missing)}")
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
    )


PRESETS: dict[str, LlamaConfig] = {
    # For tests and tensor parallelism: 16 query / 8 KV heads, so TP 1, 2, 4, 8 all divide it.
    "tiny": LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_layers=2,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_ids=(2,),
        model_type="llama",
    ),
    # SmolLM2-135M's shape (random weights): the embedded model's step shapes on a machine
    # without the GGUF (e.g. the GPU box).
    "smollm2-shape": LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_ids=(2,),
        tie_word_embeddings=True,
        model_type="llama",
    ),
    # Meta-Llama-3-8B's shape (random weights: shape and speed only).
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        model_type="llama",
    ),
    # Qwen3 dense for CPU tests: per-head q/k norms, head_dim given (not hidden / heads).
    "tiny-qwen3": LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        eos_token_ids=(2,),
        qk_norm=True,
        model_type="qwen3",
    ),
    # Qwen3-8B's shape (random weights: shape and speed only).
    "qwen3-8b": LlamaConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_ids=(151645,),
        qk_norm=True,
        model_type="qwen3",
    ),
    # Qwen3-MoE for CPU tests: 8 experts, top 2, renormalised weights, and a dense layer
    # (mlp_only_layers) between sparse ones, so both layer kinds run.
    "tiny-moe": LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        eos_token_ids=(2,),
        qk_norm=True,
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        mlp_only_layers=(1,),
    ),
    # Qwen3-30B-A3B's shape (random weights: shape and speed only; 30.5B parameters, 61 GB in
    # bf16: one H200). From the HF config.json of Qwen/Qwen3-30B-A3B as remembered: 48 layers,
    # all sparse (decoder_sparse_step 1, mlp_only_layers []), 128 experts, 8 per token,
    # moe_intermediate_size 768, norm_topk_prob true; intermediate_size 6144 (unused: no dense
    # layer); 32 q / 4 KV heads of 128; vocab 151936; rope_theta 1e6; 40960 positions.
    "qwen3-30b-a3b": LlamaConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_ids=(151645,),
        qk_norm=True,
        model_type="qwen3_moe",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Meta-Llama-3-70B's shape (random weights, 141 GB in bf16: more than one H200 holds, so
    # with tensor_parallel_size > 1 it is built directly in its shards).
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        model_type="llama",
    ),
}


def preset(name: str) -> LlamaConfig:
    """The named preset config; ValueError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
