"""GGUF loading: layout, Q/K un-permutation, dequantization, clear errors.

GGUF files are written here with the ``gguf`` package's own writer and quantizers from the
transformers-made HF fixtures, laid out as llama.cpp's converter does (Q/K rows permuted).
"""

from __future__ import annotations

import dataclasses
import os
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants

from models.checkpoint import variable
from models.gguf import SUPPORTED_QUANTS, gguf_names, load_gguf, open_gguf
from models.llama import param_state
from models.loading import load_hf, load_model, param_names
from models.safetensors import SafetensorsFile

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
Q = gguf.GGMLQuantizationType


def _permute(w, heads):
    """llama.cpp's convert_hf_to_gguf Q/K row permutation."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _raw_blocks(t, qtype, rng):
    """Random ``qtype`` blocks for a tensor of t's shape, for the types the ``gguf`` package only
    dequantizes (its K- and i-quants have no quantizer). Bit 6 of every byte is cleared, so
    every float16 field (the block scales) is finite and below 2 in magnitude."""
    shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
    return rng.integers(0, 256, shape, dtype=np.uint8) & np.uint8(0xBF)


def _quantized(t, qtype, rng):
    if qtype == Q.F16:
        return t.astype(np.float16)
    try:
        return quants.quantize(t, qtype)
    except NotImplementedError:
        return _raw_blocks(t, qtype, rng)


def write_gguf(
    path, name="llama2", qtype=Q.F32, arch="llama", drop=None, extra=None, meta=None, weights=None
):
    """Writes the HF fixture ``name`` (or ``weights``: (config, HF tensors)) as a GGUF file with
    matrices stored as ``qtype`` (or ``qtype(gguf name)``; F32 where a row is no whole number of
    the type's blocks, as llama.cpp's quantize falls back) and ``meta``'s keys, floats or
    strings, after the architecture's prefix. Returns the values each tensor stores."""
    if weights is None:
        d = os.path.join(FIXTURES, name)
        cfg = load_hf(d).config
        f = SafetensorsFile(os.path.join(d, "model.safetensors"))
        hf = {n: np.array(f.get(n)) for n in f.names()}
    else:
        cfg, hf = weights
        hf = dict(hf)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in (meta or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(f"{arch}.{key}", value)
    if cfg.num_experts:  # as llama.cpp's converter: experts stacked [E, out, in], router ffn_gate_inp
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                x = f"model.layers.{i}.mlp."
                for proj, g in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
                    e = [hf.pop(f"{x}experts.{k}.{proj}_proj.weight") for k in range(cfg.num_experts)]
                    hf[f"{x}{g}"] = np.stack(e)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_layers):
        for a, b in (
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
            ("mlp.gate", "ffn_gate_inp"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ):
            names[f"model.layers.{i}.{a}.weight"] = f"blk.{i}.{b}.weight"
        for proj in "qkv":
            names[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = f"blk.{i}.attn_{proj}.bias"
        for g in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            names[f"model.layers.{i}.mlp.{g}"] = f"blk.{i}.{g}.weight"
    stored = {}
    for hname, gname in names.items():
        if hname not in hf or gname == drop:
            continue
        t = hf[hname]
        if arch != "llama":
            pass  # NeoX RoPE: the converter leaves Q/K rows as they are
        elif gname.endswith("attn_q.weight"):
            t = _permute(t, cfg.num_heads)
        elif gname.endswith("attn_k.weight"):
            t = _permute(t, cfg.num_kv_heads)
        kind = qtype(gname) if callable(qtype) else qtype
        if t.ndim == 2 and kind != Q.F32 and t.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            raw = _quantized(t, kind, rng)
            w.add_tensor(gname, raw, raw_dtype=kind)
            try:
                stored[gname] = quants.dequantize(raw, kind).reshape(t.shape)
            except NotImplementedError:  # a type only the loader's refusal is tested with
                stored[gname] = None
        else:
            w.add_tensor(gname, t)
            stored[gname] = t
    for gname, t in (extra or {}).items():
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _bits_equal(a, b):
    la, lb = jax.tree.leaves(param_state(a)), jax.tree.leaves(param_state(b))
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.parametrize(
    "name, arch",
    [
        ("llama2", "llama"),
        ("smollm2", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("qwen3_moe", "qwen3moe"),
    ],
)
def test_f32_gguf_equals_the_hf_checkpoint(tmp_path, name, arch):
    """Same weights through GGUF (Llama: permuted Q/K; reversed dims; Qwen3-MoE: stacked experts)
    and safetensors: same config, same bits."""
    write_gguf(tmp_path / "m.gguf", name, arch=arch)
    ours = load_gguf(tmp_path / "m.gguf")
    ref = load_hf(os.path.join(FIXTURES, name))
    for f in ("model_type", "tie_word_embeddings", "attention_bias", "qk_norm", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "head_dim"):  # fmt: skip
        assert getattr(ours.config, f) == getattr(ref.config, f), f
    assert [ours.config.is_moe_layer(n) for n in range(ref.config.num_layers)] == [
        ref.config.is_moe_layer(n) for n in range(ref.config.num_layers)
    ]
    assert _bits_equal(ours, ref)


def test_unpermute_is_needed(tmp_path):
    """Negative control: a file whose Q rows were NOT permuted loads different weights."""
    write_gguf(tmp_path / "m.gguf")
    g = open_gguf(tmp_path / "m.gguf")
    q = np.asarray(g.tensors["blk.0.attn_q.weight"].data.view(np.float32)).reshape(256, 64)
    hf = load_hf(os.path.join(FIXTURES, "llama2"))
    assert not np.array_equal(q.T, np.asarray(hf.layers[0].attn.wq[...]))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16])
def test_quantized_tensors_dequantize_exactly(tmp_path, qtype):
    stored = write_gguf(tmp_path / "m.gguf", qtype=qtype)
    m = load_gguf(tmp_path / "m.gguf")
    w = stored["blk.1.ffn_down.weight"]  # [out, in]
    np.testing.assert_array_equal(np.asarray(m.layers[1].mlp.w_down[...]), w.T)
    q = stored["blk.0.attn_q.weight"]
    heads = m.config.num_heads
    unperm = q.reshape(heads, q.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(q.shape)
    np.testing.assert_array_equal(np.asarray(m.layers[0].attn.wq[...]), unperm.T)


def test_quantized_model_stays_close(tmp_path):
    write_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0)
    ids = jnp.asarray(np.arange(20, dtype=np.int32)[None] % 200)
    a = np.asarray(load_gguf(tmp_path / "m.gguf").forward(ids))
    b = np.asarray(load_hf(os.path.join(FIXTURES, "llama2")).forward(ids))
    assert np.abs(a - b).max() / np.abs(b).max() < 0.05


def test_dtype_and_load_model_dispatch(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    m = load_model(str(tmp_path / "m.gguf"), dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(param_state(m)))


def test_every_supported_quantization_loads_exactly(tmp_path):
    """One file with every type of SUPPORTED_QUANTS on some matrix (K- and i-quants as random
    blocks: the package has no quantizer for them), rows of 256 (the K-quants' block): each
    parameter equals the package's dequantization of what the file stores, Q/K un-permuted and
    transposed as every other GGUF tensor is."""
    cfg = dataclasses.replace(
        load_hf(os.path.join(FIXTURES, "llama2")).config, num_layers=3, hidden_size=256, intermediate_size=512
    )
    rng = np.random.default_rng(1)
    hf = {
        n: rng.standard_normal(shape).astype(np.float32) for n, (_, shape, _, _) in param_names(cfg).items()
    }
    kinds = [Q[k] for k in SUPPORTED_QUANTS if k != "F32"]
    matrices = [g for g, (_, shape, _, _) in gguf_names(cfg).items() if len(shape) == 2]
    assert len(matrices) >= len(kinds)
    kind_of = dict(zip(matrices, kinds, strict=False))
    stored = write_gguf(tmp_path / "m.gguf", qtype=lambda g: kind_of.get(g, Q.F32), weights=(cfg, hf))
    assert {open_gguf(tmp_path / "m.gguf").tensors[g].kind for g in kind_of} == {k.name for k in kinds}
    m = load_gguf(tmp_path / "m.gguf")
    for g, (ours, _, transpose, heads) in gguf_names(m.config).items():
        want = stored[g]
        if heads:
            want = want.reshape(heads, want.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(want.shape)
        want = want.T if transpose else want
        got = np.asarray(variable(m, ours)[...])
        assert (
            got.view(np.uint32).tobytes() == np.ascontiguousarray(want, np.float32).view(np.uint32).tobytes()
        ), g


def test_unsupported_quantization_named(tmp_path):
    write_gguf(tmp_path / "m.gguf", qtype=Q.Q8_1)  # llama.cpp's activation type: no weight format
    with pytest.raises(ValueError, match=r"Q8_1.*not support"):
        load_gguf(tmp_path / "m.gguf")


def test_unsupported_architecture_named(tmp_path):
    write_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        load_gguf(tmp_path / "m.gguf")


@pytest.mark.parametrize(
    "meta, refused",
    [
        ({"rope.scaling.factor": 4.0}, "'linear' (factor 4.0)"),  # llama.cpp: no type is linear
        ({"rope.scale_linear": 4.0}, "'linear' (factor 4.0)"),  # the older key
        ({"rope.scaling.type": "none", "rope.scaling.factor": 2.0}, None),  # llama.cpp: none never scales
        ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "'yarn'"),
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 1.0}, None),  # a no-op
        ({"rope.scaling.factor": 0.0}, None),  # llama.cpp's "not set"
    ],
)
def test_rope_scaling_is_refused_never_dropped(tmp_path, meta, refused):
    """A file that scales RoPE (any way llama.cpp would read it) refuses to load: bijax applies
    no GGUF scaling, and loading it unscaled gave wrong logits without a word."""
    write_gguf(tmp_path / "m.gguf", meta=meta)
    if refused is None:
        assert load_gguf(tmp_path / "m.gguf").config.rope_scaling is None
    else:
        with pytest.raises(ValueError, match=re.escape(f"unsupported GGUF rope scaling {refused}")):
            load_gguf(tmp_path / "m.gguf")


def test_missing_and_unexpected_tensors_named(tmp_path):
    write_gguf(tmp_path / "a.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*missing"):
        load_gguf(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf", extra={"blk.0.attn_q.bias": np.zeros(256, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.0\.attn_q\.bias'"):
        load_gguf(tmp_path / "b.gguf")


def test_truncated_and_bad_files(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        load_gguf(tmp_path / "m.gguf")
    (tmp_path / "m.gguf").write_bytes(data[:500])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_gguf(tmp_path / "m.gguf")
    (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04 this is a zip file, not a gguf one")
    with pytest.raises(ValueError, match="bad magic"):
        load_gguf(tmp_path / "m.gguf")
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "nope.gguf")
