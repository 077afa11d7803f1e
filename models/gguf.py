"""GGUF checkpoints (llama.cpp's format) through the ``gguf`` package.

Llama, Qwen2, Qwen3 and Qwen3-MoE metadata becomes a ``LlamaConfig``; tensors are dequantized
(``SUPPORTED_QUANTS``: F32, F16, BF16, the legacy Q4_0 ... Q8_0, llama.cpp's K-quants Q2_K ...
Q6_K and the i-quants, by the ``gguf`` package's own formulas) to the chosen dtype. GGUF stores a matrix as [out, in] rows like HF,
and llama.cpp's converter permuted the rows of Q and K of Llama models for its interleaved
RoPE; both are undone here (Qwen's NeoX RoPE needs no un-permuting). Unsupported quantizations or architectures raise ValueError naming them.
"""

from __future__ import annotations

import dataclasses
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np

from models.checkpoint import abstract_model, check_finite, check_tensor_names, variable
from models.configs import LlamaConfig
from models.llama import Llama, weight_dtype

# Every weight type the ``gguf`` package dequantizes (what llama.cpp's quantize writes for weights:
# a Q4_K_M file mixes Q4_K and Q6_K, for instance). Q8_K is only llama.cpp's activation type.
SUPPORTED_QUANTS = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    *("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"),
    *("TQ1_0", "TQ2_0"),
)
# Elements dequantized at a time (float32 scratch of ~64 MB, not a whole 128k-row embedding's).
_DEQUANT_CHUNK = 1 << 24
# GGUF architecture -> our model_type. llama.cpp permutes Q/K rows only for "llama" (its
# interleaved RoPE); the Qwen families use NeoX RoPE, which pairs halves as HF does.
SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NP = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF's dims reversed): [out, in] for matrices
    kind: str  # GGML quantization type name, e.g. "Q4_1"
    data: np.ndarray  # raw bytes (uint8), memory-mapped


class GGUFFile:
    """Metadata and tensors of a GGUF file (version 2 or 3, little-endian).

    The header is parsed here in one pass (``gguf.GGUFReader`` builds a numpy view per
    vocabulary string, ~25 s for a 49k-token vocabulary); quantization types, block sizes and
    dequantization come from the ``gguf`` package.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(raw)
        try:
            magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        except struct.error:
            raise ValueError(f"{self.path}: not a GGUF file (too short)") from None
        if magic != gguf.GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {version}")
        self._buf, self._off = buf, 24
        try:
            self.metadata = {}
            for _ in range(n_kv):
                key = self._str()
                self.metadata[key] = self._value(self._unpack("<I"))
            infos = []
            for _ in range(n_tensors):
                name = self._str()
                (ndim,) = self._unpack("<I")
                dims = struct.unpack_from(f"<{ndim}Q", buf, self._off)
                self._off += 8 * ndim
                kind, offset = self._unpack("<IQ")
                infos.append((name, dims, kind, offset))
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{self.path}: truncated or corrupt GGUF header ({e})") from None
        align = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._off // align) * align
        self.tensors = {}
        for name, dims, kind, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown GGML type {kind}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))
            row = shape[-1] if shape else 1
            if row % block:
                raise ValueError(
                    f"tensor {name!r}: row length {row} is not a multiple of {qtype.name}'s block"
                )
            rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            nbytes = rows * (row // block) * type_size
            begin = start + offset
            if begin + nbytes > len(raw):
                raise ValueError(f"{self.path}: truncated - tensor {name!r} runs past the end of the file")
            data = raw[begin : begin + nbytes].view(np.ndarray).reshape(rows, -1)
            self.tensors[name] = GGUFTensor(name, shape, qtype.name, data)
        del self._buf

    def _unpack(self, fmt):
        out = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return out

    def _str(self) -> str:
        (n,) = self._unpack("<Q")
        if self._off + n > len(self._buf):
            raise IndexError("string past the end of the file")
        s = bytes(self._buf[self._off : self._off + n]).decode("utf-8")
        self._off += n
        return s

    def _strs(self, count: int) -> list[str]:
        """``count`` strings in a row (a tokenizer's vocabulary: ~100k of them, one tight loop)."""
        buf, off, size, out = self._buf, self._off, len(self._buf), []
        for _ in range(count):
            n = int.from_bytes(buf[off : off + 8], "little")
            off += 8
            if off + n > size:
                raise IndexError("string past the end of the file")
            out.append(str(buf[off : off + n], "utf-8"))
            off += n
        self._off = off
        return out

    def _value(self, vtype):
        (vtype,) = vtype
        if vtype == 8:
            return self._str()
        if vtype in _SCALARS:
            (v,) = self._unpack(_SCALARS[vtype])
            return v
        if vtype == 9:
            itype, count = self._unpack("<IQ")
            if itype == 8:
                return self._strs(count)
            if itype in _NP:
                dt = np.dtype(_NP[itype])
                end = self._off + count * dt.itemsize
                if end > len(self._buf):
                    raise IndexError("array past the end of the file")
                arr = np.frombuffer(self._buf[self._off : end], dt).copy()
                self._off = end
                return arr.tolist()
            return [self._value((itype,)) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def field(self, key: str, default=None):
        return self.metadata.get(key, default)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)


def field(reader: GGUFFile, key: str, default=None):
    return reader.field(key, default)


def _require(reader: GGUFFile, key: str):
    v = reader.field(key)
    if v is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return v


def _check_rope_scaling(reader, a: str) -> None:
    """bijax applies no GGUF rope scaling (Llama 3's comes as the rope_freqs tensor): a file that
    scales refuses to load. As llama.cpp reads it, the factor (or the older key
    ``rope.scale_linear``) scales the frequencies unless the type is "none" (llama.cpp then
    never scales), a factor of 0 means "not set", and a missing type is linear."""
    scaling = field(reader, a + "rope.scaling.type")
    if scaling == "none":
        return
    factor = field(reader, a + "rope.scaling.factor")
    if factor in (None, 0.0):
        factor = field(reader, a + "rope.scale_linear")
    if factor in (None, 0.0, 1.0) and scaling in (None, "linear"):
        return
    kind = scaling or "linear"
    raise ValueError(
        f"unsupported GGUF rope scaling {kind!r}" + ("" if factor is None else f" (factor {factor})")
    )


def config_from_gguf(reader) -> LlamaConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if arch == "qwen3moe" and any(n.endswith("ffn_gate_inp_shexp.weight") for n in reader.tensors):
        raise ValueError("unsupported: a GGUF MoE with shared experts (ffn_*_shexp tensors)")
    a = arch + "."
    _check_rope_scaling(reader, a)
    heads = int(_require(reader, a + "attention.head_count"))
    hidden = int(_require(reader, a + "embedding_length"))
    head_dim = int(field(reader, a + "attention.key_length", hidden // heads))
    factors = None
    if "rope_freqs.weight" in reader.tensors:
        factors = tuple(float(x) for x in _dequantize(reader.tensors["rope_freqs.weight"]).reshape(-1))
    moe = {}
    if arch == "qwen3moe":
        dense = tuple(
            n
            for n in range(int(_require(reader, a + "block_count")))
            if f"blk.{n}.ffn_gate_inp.weight" not in reader.tensors
        )
        moe = dict(
            num_experts=int(_require(reader, a + "expert_count")),
            num_experts_per_tok=int(_require(reader, a + "expert_used_count")),
            moe_intermediate_size=int(_require(reader, a + "expert_feed_forward_length")),
            norm_topk_prob=bool(field(reader, a + "expert_weights_norm", True)),
            mlp_only_layers=dense,
        )
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = field(reader, a + "vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError("GGUF metadata has neither a vocab_size nor a token list")
    eos = [field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id")]
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(
            _require(reader, a + "feed_forward_length")
            if not moe
            else field(reader, a + "feed_forward_length", 1)
        ),
        num_layers=int(_require(reader, a + "block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, a + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(
            field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5 if arch == "llama" else 1e-6)
        ),
        rope_theta=float(field(reader, a + "rope.freq_base", 10000.0)),
        rope_freq_factors=factors,
        max_position_embeddings=int(field(reader, a + "context_length", 4096)),
        tie_word_embeddings="output.weight" not in reader.tensors,
        attention_bias=arch == "qwen2",  # as HF's defaults for these model types
        qk_norm=arch in ("qwen3", "qwen3moe"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        model_type=SUPPORTED_ARCHS[arch],
        **moe,
    )


def _dequantize(t: GGUFTensor) -> np.ndarray:
    """float32 values of a tensor, by the ``gguf`` package's block formula for its type, over
    chunks of whole rows (its ``dequantize`` walks rows in small groups: ~10x slower on a 135M
    model; the whole tensor at once would take several float32 copies of it)."""
    import gguf
    from gguf import quants

    if t.kind not in SUPPORTED_QUANTS:
        raise ValueError(
            f"tensor {t.name!r} uses quantization {t.kind}, which bijax does not support "
            f"(supported: {', '.join(SUPPORTED_QUANTS)})"
        )
    data = np.asarray(t.data)  # [rows, bytes of a row]
    if t.kind == "F32":
        return data.view("<f4").reshape(t.shape)
    if t.kind == "F16":
        return data.view("<f2").astype(np.float32).reshape(t.shape)
    kind = getattr(quants, t.kind)
    kind.init_grid()  # the i-quants' lookup grids (built once, by the package)
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.kind]]
    row = t.shape[-1] if t.shape else 1
    out = np.empty((data.shape[0], row), np.float32)
    step = max(1, _DEQUANT_CHUNK // row)
    for r in range(0, data.shape[0], step):
        blocks = data[r : r + step].reshape(-1, type_size)
        out[r : r + step] = kind.dequantize_blocks(blocks).reshape(-1, row)
    return out.reshape(t.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (its RoPE pairs adjacent dims; HF's pairs halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(config: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...], bool, int]]:
    """GGUF tensor name -> (our parameter path, numpy shape, transpose the last two axes?, heads
    to un-permute or 0)."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    permuted = c.model_type == "llama"  # llama.cpp's Q/K row permutation (see SUPPORTED_ARCHS)
    out = {"token_embd.weight": ("embed", (c.vocab_size, h), False, 0)}
    for n in range(c.num_layers):
        g, ours = f"blk.{n}.", f"layers.{n}."
        out[g + "attn_norm.weight"] = (ours + "attn_norm", (h,), False, 0)
        out[g + "ffn_norm.weight"] = (ours + "mlp_norm", (h,), False, 0)
        out[g + "attn_q.weight"] = (ours + "attn.wq", (c.q_dim, h), True, c.num_heads * permuted)
        out[g + "attn_k.weight"] = (ours + "attn.wk", (c.kv_dim, h), True, c.num_kv_heads * permuted)
        out[g + "attn_v.weight"] = (ours + "attn.wv", (c.kv_dim, h), True, 0)
        out[g + "attn_output.weight"] = (ours + "attn.wo", (h, c.q_dim), True, 0)
        if c.attention_bias:
            for proj, rows in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim)):
                out[g + f"attn_{proj}.bias"] = (ours + "attn.b" + proj, (rows,), False, 0)
        if c.qk_norm:
            out[g + "attn_q_norm.weight"] = (ours + "attn.q_norm", (c.head_dim,), False, 0)
            out[g + "attn_k_norm.weight"] = (ours + "attn.k_norm", (c.head_dim,), False, 0)
        if c.is_moe_layer(n):
            e, mi = c.num_experts, c.moe_intermediate_size
            out[g + "ffn_gate_inp.weight"] = (ours + "mlp.router", (e, h), True, 0)
            out[g + "ffn_gate_exps.weight"] = (ours + "mlp.experts_gate", (e, mi, h), True, 0)
            out[g + "ffn_up_exps.weight"] = (ours + "mlp.experts_up", (e, mi, h), True, 0)
            out[g + "ffn_down_exps.weight"] = (ours + "mlp.experts_down", (e, h, mi), True, 0)
            continue
        out[g + "ffn_gate.weight"] = (ours + "mlp.w_gate", (i, h), True, 0)
        out[g + "ffn_up.weight"] = (ours + "mlp.w_up", (i, h), True, 0)
        out[g + "ffn_down.weight"] = (ours + "mlp.w_down", (h, i), True, 0)
    out["output_norm.weight"] = ("final_norm", (h,), False, 0)
    if not c.tie_word_embeddings:
        out["output.weight"] = ("lm_head", (c.vocab_size, h), True, 0)
    return out


def load_gguf(
    path: str | os.PathLike, *, dtype=jnp.float32, k_shards: int = 1, progress: bool = False
) -> Llama:
    """Loads a GGUF file of a supported architecture (Llama, Qwen2, Qwen3, Qwen3-MoE),
    dequantized to ``dtype``."""
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    expected = gguf_names(config)
    tensors = reader.tensors
    check_tensor_names(tensors, expected, path, ignore=lambda n: n == "rope_freqs.weight")
    model = abstract_model(config, weight_dtype(dtype), k_shards)
    items = expected.items()
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"loading {os.path.basename(os.fspath(path))}", unit="tensor", leave=False)
    for name, (ours, shape, transpose, heads) in items:
        t = tensors[name]
        if t.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {t.shape}, the metadata implies {shape}")
        w = _dequantize(t)
        if heads:
            w = _unpermute(w, heads)
        if transpose:
            w = np.swapaxes(w, -1, -2)  # [out, in] -> [in, out]; per expert for [E, out, in]
        with np.errstate(over="ignore"):  # (an overflow is named by check_finite, below)
            w = np.ascontiguousarray(w).astype(dtype)
        variable(model, ours).set_value(jax.device_put(w))
    check_finite(model, os.fspath(path))
    return model
