"""``LLM``: the offline API (vLLM's names): ``generate``, ``score``, ``tokenizer``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bijax.config import EngineConfig, check_max_model_len
from bijax.llm_engine import Engine
from bijax.outputs import RequestOutput
from bijax.prompts import as_numpy
from bijax.sampling_params import MAX_SEED, SamplingParams
from bijax.speculative import SpeculativeConfig
from bijax.step_programs import staged_inputs
from models.checkpoint import check_same_layout, non_finite
from models.configs import PRESETS
from models.llama import Llama, param_state
from models.loading import (
    DEFAULT_MODEL,
    embedded_model_path,
    is_embedded,
    is_gguf,
    is_preset,
    load_model,
)
from models.sharding import check_tensor_parallel
from models.tokenizer import Tokenizer, UnsupportedTokenizer, load_tokenizer
from pallas_kernels.checks import check_positive_int

_CPU_KV_BYTES = 1 << 30  # the KV pool on CPU when num_kv_blocks is not given
# Every LLM made in this process (weakly): ``update_weights`` also moves the other open engines
# that run the same model object (``LLM(llm.model, ...)``) onto its new weights.
_LLMS: weakref.WeakSet = weakref.WeakSet()


def _kv_blocks(
    cfg, dtype, block_size, max_blocks_per_seq, max_num_seqs, utilization, tp: int = 1, draft=None
) -> int:
    """KV pool size in blocks; one block's bytes per device (tensor parallelism splits KV heads),
    the draft model's block included (its KV cache has as many blocks). Across processes, the
    smallest any process can hold (the pool is one global array)."""

    def block_bytes(c, dt):
        return 2 * c.num_layers * block_size * (c.num_kv_heads // tp) * c.head_dim * jnp.dtype(dt).itemsize

    per_block = block_bytes(cfg, dtype) + (0 if draft is None else block_bytes(draft.config, draft.dtype))
    want = max_num_seqs * max_blocks_per_seq + 1
    dev = jax.local_devices()[0]
    if dev.platform == "cpu":
        budget = _CPU_KV_BYTES
    else:  # vLLM's rule: the KV pool gets what is left of utilization x device memory
        limit, in_use = _device_memory(dev)
        budget = int(limit * utilization) - in_use
        if budget < 2 * per_block:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves no room for the KV cache: "
                f"{in_use / 2**30:.1f} GiB are in use of the {limit / 2**30:.1f} GiB this process may "
                "allocate on the device (XLA_PYTHON_CLIENT_MEM_FRACTION of it, default 0.75). Free what "
                "holds it (another engine: LLM.close()), raise gpu_memory_utilization or that "
                "fraction, or pass num_kv_blocks"
            )
    blocks = int(max(2, min(want, budget // per_block)))
    if dev.platform != "cpu" and jax.process_count() > 1:  # (what each process has in use may differ)
        from jax.experimental import multihost_utils

        blocks = int(np.min(multihost_utils.process_allgather(np.int32(blocks))))
    return blocks


_MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # the new name first


def _device_memory(dev) -> tuple[int, int]:
    """(bytes this process may allocate on the device, bytes in use) for sizing the KV pool:
    XLA's allocator statistics (its limit and what is allocated); where the allocator keeps none
    - XLA's VMM allocator, which ``bijax.GPU_GRAPH_UPDATE_MODE`` selects (asked for with
    ``BIJAX_STAGED_INPUTS=1`` only) - the same limit (the
    client's memory fraction of the device, XLA_CLIENT_MEM_FRACTION or its old name
    XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75: the VMM allocator's budget) and the CUDA
    driver's count of the memory in use on the device."""
    stats = dev.memory_stats() or {}
    if stats.get("bytes_limit", 0) > 0:
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    free, total = _driver_memory(dev.local_hardware_id)
    name = next((n for n in _MEM_FRACTION_VARS if os.environ.get(n, "").strip()), None)
    raw = os.environ[name].strip() if name else "0.75"
    try:
        fraction = float(raw)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {raw!r}")
    return int(total * fraction), total - free


def _driver_memory(ordinal: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device ``ordinal`` (``cuMemGetInfo`` in its primary context,
    the one XLA runs in)."""
    import ctypes

    def check(err, what):
        if err != 0:
            raise RuntimeError(f"cannot read GPU {ordinal}'s memory: {what} returned CUDA error {err}")

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(
            f"cannot read GPU {ordinal}'s memory: XLA's allocator reports no statistics and the "
            f"CUDA driver is not loadable ({e}); pass num_kv_blocks"
        ) from None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        check(cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
    return free.value, total.value


def _check_arguments(*, dtype, gpu_memory_utilization, seed, flags: dict, **counts) -> None:
    """``LLM``'s arguments, each checked by name: ``counts`` positive ints (None allowed for
    max_model_len and num_kv_blocks: sized by the engine), ``flags`` bools."""
    for name, v in counts.items():
        if name == "max_model_len":
            if v is not None:
                check_max_model_len(v)
        elif v is not None or name != "num_kv_blocks":
            check_positive_int(name, v, numpy=False)
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    g = gpu_memory_utilization
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {g!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if dtype is not None:
        try:
            ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise TypeError(
                f"dtype must be a floating-point dtype (e.g. 'bfloat16', 'float32'), got {dtype!r}"
            )


def _tokenizer_argument(tokenizer):
    """``LLM``'s ``tokenizer``: None, a ``Tokenizer``, or where to load one from (a HF
    directory or a .gguf file, as vLLM's ``tokenizer`` names one)."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        try:
            return load_tokenizer(tokenizer)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise type(e)(f"tokenizer: {e}") from None
    raise TypeError(
        "tokenizer must be a bijax Tokenizer, or a HF tokenizer directory or .gguf file to load one "
        f"from, got {type(tokenizer).__name__}"
    )


def _checkpoint_tokenizer(model):
    """The tokenizer a checkpoint carries (a GGUF file, or a directory with tokenizer.json; an
    embedded model's name), or None (a preset, a Llama, a checkpoint without one)."""
    if isinstance(model, Llama) or is_preset(model):
        return None
    path = embedded_model_path(model) if is_embedded(model) else os.fspath(model)
    if is_gguf(path):  # (load_model's rule)
        try:
            return load_tokenizer(path)
        except UnsupportedTokenizer as e:  # the model runs on token ids, as one without a tokenizer
            warnings.warn(
                f"{path}: no tokenizer loaded ({e}); give prompts as token ids, or pass "
                "tokenizer=<a HF directory with tokenizer.json>",
                stacklevel=3,
            )
            return None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return load_tokenizer(path)
    return None


def default_max_model_len(cfg) -> int:
    """``LLM``'s max_model_len when none is given: the model's context, at most 8192 (CPU: 1024,
    which keeps the attention splits, and compiles, few)."""
    return min(cfg.max_position_embeddings, 1024 if jax.default_backend() == "cpu" else 8192)


def _load(model, *, dtype, k_shards: int, seed: int, tensor_parallel_size: int, what: str = "model") -> Llama:
    """``model`` as a ``Llama`` (``what``: "model", or "draft model"): a ``Llama`` as is, else
    ``load_model``."""
    if isinstance(model, Llama):  # (loading options: a model given as is has its own)
        if dtype is not None and jnp.dtype(dtype) != model.dtype:
            raise ValueError(
                f"dtype={jnp.dtype(dtype)} but the given {what} is {model.dtype}: dtype applies to "
                "models bijax loads (convert the model, or leave dtype out)"
            )
        if k_shards != 1 and k_shards != model.k_shards:
            raise ValueError(
                f"k_shards={k_shards} but the given {what} has k_shards={model.k_shards}: k_shards "
                "applies to models bijax loads (build the model with it, or leave it out)"
            )
        return model
    if is_preset(model):  # fail before building a large model
        check_tensor_parallel(PRESETS[model], tensor_parallel_size, k_shards)
    return load_model(
        model,
        dtype=dtype,
        k_shards=k_shards,
        seed=seed,
        progress=True,
        # presets are built in their shards; checkpoints load whole, then split
        tensor_parallel_size=tensor_parallel_size if is_preset(model) else 1,
    )


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What ``LLM.warmup`` did: seconds, step programs made ready (a step is two: its forward,
    and sampling - per sampled-row count, with and without top-k / top-p), and of the programs XLA was
    asked for, how many came from the persistent cache and how many were compiled (both 0 when
    the cache is off); ``tracing_seconds``: the part of ``seconds`` spent tracing and lowering
    the steps (or reading their exported programs, or waiting for helper processes that
    lowered them) - the rest compiled or loaded them; ``lowered_in_helpers``: programs that
    helper processes lowered (``bijax.parallel_lowering``); ``compiling_in_background``: with
    ``BIJAX_STEP_PROGRAMS=tiered``, the whole-forward programs left compiling in the background
    when it returned (``LLM.wait_for_upgrades``)."""

    seconds: float
    num_programs: int
    loaded_from_cache: int
    compiled: int
    tracing_seconds: float
    lowered_in_helpers: int = 0
    compiling_in_background: int = 0


def graph_update_note(platform: str, staged: bool) -> str | None:
    """On a GPU with staged step inputs (``BIJAX_STAGED_INPUTS=1``: kept in place so that CUDA
    graphs need no update), why decode steps will take ~1 ms more host time than they could:
    XLA_FLAGS does not name the CUDA graphs' update mode (``bijax.GPU_GRAPH_UPDATE_MODE``).
    Importing bijax asks for it only when ``BIJAX_STAGED_INPUTS=1`` is set by then, and the
    request is refused once JAX has started its backend. None otherwise (without staging the
    inputs are new buffers every step, and XLA updates the graph whatever the mode)."""
    from bijax import GPU_GRAPH_UPDATE_MODE
    from pallas_kernels.runtime import xla_flag_named

    if platform != "gpu" or not staged or xla_flag_named(GPU_GRAPH_UPDATE_MODE):
        return None
    return (
        "bijax: BIJAX_STAGED_INPUTS=1 keeps a step's inputs in place, but XLA_FLAGS does not name "
        "the CUDA graphs' update mode (set BIJAX_STAGED_INPUTS after bijax was imported, or JAX "
        "started its GPU backend before), so XLA re-records a decode step's CUDA graph every step "
        "(~1 ms of host time on the H200; outputs are the same). Set BIJAX_STAGED_INPUTS=1 before "
        f"importing bijax and anything in JAX, or start Python with XLA_FLAGS={GPU_GRAPH_UPDATE_MODE}."
    )


class LLM:
    """A model plus the engine that serves it, batch invariant by default.

    ``model``: a preset (``tiny``, ``llama3-8b``; random weights from ``seed``), the embedded
    ``smollm2-135m`` (default), a ``.gguf`` file, a HF checkpoint directory, an orbax directory
    from ``models.save_orbax``, or a ``models.Llama``. ``invariant=False`` runs plain XLA ops
    (the baseline: bits then depend on the batch). ``num_kv_blocks`` overrides the KV pool size
    (on CPU it defaults to 1 GiB of blocks; on GPU to ``gpu_memory_utilization`` of free memory).
    ``max_model_len`` defaults to the model's context capped at 8192 (1024 on CPU).
    ``tensor_parallel_size`` N > 1 splits the model over the first N devices (``k_shards``
    must be a multiple of N: with ``k_shards=8`` every N in 1, 2, 4, 8 gives the same bits);
    the model then holds its shards, and weights given to ``update_weights`` are placed on
    the devices the same way. ``speculative_config`` (vLLM's names): ``{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}`` or
    ``{"method": "draft_model", "model": <anything LLM accepts>, "num_speculative_tokens": k}``
    - the same token ids and logprob bits as without it, in fewer steps (``bijax.speculative``).
    ``async_scheduling`` (default on): the host schedules and enqueues step N + 1 while the
    device runs step N, feeding N's sampled tokens to N + 1 on the device - the same bits,
    without the device waiting on the host between steps (off with a draft model;
    n-gram speculation keeps it).
    """

    def __init__(
        self,
        model: str | os.PathLike | Llama = DEFAULT_MODEL,
        *,
        invariant: bool = True,
        dtype=None,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        tensor_parallel_size: int = 1,
        k_shards: int = 1,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        tokenizer=None,
        speculative_config: dict | None = None,
        async_scheduling: bool = True,
    ):
        _check_arguments(  # before loading anything: each bad one named
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            num_kv_blocks=num_kv_blocks,
            tensor_parallel_size=tensor_parallel_size,
            k_shards=k_shards,
            seed=seed,
            flags=dict(
                invariant=invariant,
                enable_prefix_caching=enable_prefix_caching,
                async_scheduling=async_scheduling,
            ),
        )
        spec = SpeculativeConfig.create(speculative_config)  # checked before loading anything
        tokenizer = _tokenizer_argument(tokenizer)
        load = functools.partial(
            _load, dtype=dtype, k_shards=k_shards, seed=seed, tensor_parallel_size=tensor_parallel_size
        )
        self.model = load(model)
        if tokenizer is None:
            tokenizer = _checkpoint_tokenizer(model)
        self.tokenizer = tokenizer
        cfg = self.model.config
        if max_model_len is None:
            max_model_len = default_max_model_len(cfg)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's context ({cfg.max_position_embeddings})"
            )
        draft = draft_tokenizer = None
        if spec is not None and spec.method == "draft_model":
            draft = load(spec.model, what="draft model")  # its vocabulary is checked by the Engine
            if draft.config.vocab_size != cfg.vocab_size:  # then its tokenizer must show it is one
                try:
                    draft_tokenizer = _checkpoint_tokenizer(spec.model)
                except (ValueError, TypeError, FileNotFoundError) as e:
                    raise type(e)(f"the draft model's tokenizer: {e}") from None
        blocks_per_seq = -(-max_model_len // block_size)
        if num_kv_blocks is None:
            num_kv_blocks = _kv_blocks(
                cfg,
                self.model.dtype,
                block_size,
                blocks_per_seq,
                max_num_seqs,
                gpu_memory_utilization,
                tensor_parallel_size,
                draft,
            )
        self.config = EngineConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            invariant=invariant,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size,
            async_scheduling=async_scheduling,
        )
        self.engine = Engine(self.model, self.tokenizer, self.config, spec, draft, draft_tokenizer)
        self._counter = 0
        self._busy = threading.Lock()  # one generate / score / update_weights at a time
        _LLMS.add(self)
        self.last_warmup: WarmupReport | None = None
        note = graph_update_note(jax.default_backend(), staged_inputs())
        if note is not None:
            warnings.warn(note, RuntimeWarning, stacklevel=2)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        on_output=None,
    ) -> list[RequestOutput]:
        """Generates for each prompt (a str, a list of token ids, a {"prompt_token_ids": [...]}
        or {"prompt": "..."} dict, or a list of those; a numpy array: 1-D one prompt, 2-D one
        per row); returns one RequestOutput per prompt, in input order (no prompts: an empty
        list). A bad prompt or parameter raises before
        anything runs, naming it. ``on_output(i, out)``, if given, sees every RequestOutput of
        prompt ``i`` as the steps produce them (partial ones too: streaming). One call at a time
        per LLM: a second one (another thread, or ``on_output`` calling back) raises
        RuntimeError - use one LLM per thread."""
        with self._exclusive("generate"):
            return self._generate(prompts, sampling_params, use_tqdm=use_tqdm, on_output=on_output)

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Runs the body unless another generate / score / update_weights of this LLM is running
        (a thread, or a callback of the running one): RuntimeError, nothing touched."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{what}: this LLM is already running a generate, score or update_weights (from another "
                "thread, or from inside an on_output callback); one LLM runs one call at a time - use one "
                "LLM per thread"
            )
        try:
            if self.engine.closed:  # (before anything else: an empty batch too)
                raise RuntimeError(
                    f"{what}: this LLM was closed (close() freed its KV cache); build a new LLM"
                )
            yield
        finally:
            self._busy.release()

    def _generate(self, prompts, sampling_params, *, use_tqdm: bool, on_output) -> list[RequestOutput]:
        if on_output is not None and not callable(on_output):  # (before any request runs)
            raise TypeError(
                f"on_output must be a callable fn(i, out) or None, got {type(on_output).__name__}"
            )
        prompts = as_numpy(prompts)
        if isinstance(prompts, np.ndarray):  # token ids: 1-D one prompt, 2-D one per row
            if prompts.ndim not in (1, 2):
                raise ValueError(
                    f"a numpy prompt array must be 1-D or 2-D token ids, got shape {prompts.shape}"
                )
            prompts = prompts.tolist()
        if not isinstance(prompts, (str, dict)) and not hasattr(prompts, "__iter__"):
            raise TypeError(
                "prompts must be a str, a list of int token ids, a {'prompt_token_ids': [...]} dict, or a list of those, "
                f"got {type(prompts).__name__}"
            )
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Seq) and len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))
        )
        if single:
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:  # an empty batch (an RL step that filtered out every prompt), as score([], [])
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (dict, str, bytes)) or not isinstance(sampling_params, Iterable):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them (one per prompt), "
                f"got {type(sampling_params).__name__}"
            )
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        self.engine.settle()  # (steps an interrupted release left behind)
        self._follow_model("generate")
        self.engine.check_weights()
        if self.engine.has_unfinished_requests():  # (generate would step them, and drop their outputs)
            raise RuntimeError(
                "generate: the engine has requests this call did not add (engine.add_request, or final "
                "outputs a failed call kept for the next engine.step()): step the engine until "
                "has_unfinished_requests() is False, or abort them, first"
            )
        valid = []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):  # check all before adding any
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            try:
                valid.append(self.engine.validate(p, sp))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        ids, index = [], {}
        for i, v in enumerate(valid):
            rid = f"req-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, v)
            ids.append(rid)
            index[rid] = i
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", leave=False)
        others: list[RequestOutput] = []  # (requests an on_output callback added to the engine)
        try:
            while self.engine.has_unfinished_requests():  # (theirs run to their end here too)
                for out in self.engine.step(partial=on_output is not None):
                    if out.request_id not in index:
                        others.append(out)
                        continue
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                    if on_output is not None:
                        on_output(index[out.request_id], out)
        except BaseException:  # a failing step, callback or Ctrl-C: the engine stays usable
            self.engine.hand_back(others)
            others = []
            self.engine.release([r for r in ids if r not in done])
            raise
        finally:
            self.engine.hand_back(others)  # theirs: the next engine.step() returns them
            if bar is not None:
                bar.close()
        return [done[r] for r in ids]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to a conversation (a list of {"role", "content"}
        dicts) or to each of a list of conversations, through the model's chat template;
        returns one RequestOutput per conversation."""
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer, so it has no chat template: use generate with token ids"
            )
        if not isinstance(add_generation_prompt, (bool, np.bool_)):
            raise TypeError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        if isinstance(messages, Seq) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, Seq) or not messages:
            raise ValueError(
                "messages must be a non-empty list of {'role', 'content'} dicts (or a list of those)"
            )
        prompts = []
        for i, conv in enumerate(messages):
            if (
                not isinstance(conv, Seq)
                or isinstance(conv, str)
                or not all(isinstance(m, dict) for m in conv)
            ):
                raise TypeError(f"conversation {i} must be a list of {{'role', 'content'}} dicts")
            try:
                ids = self.tokenizer.encode_chat(list(conv), add_generation_prompt=add_generation_prompt)
            except (TypeError, ValueError) as e:
                raise type(e)(f"conversation {i}: {e}") from None
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def warmup(
        self,
        *,
        logprobs: bool = False,
        progress: bool = True,
        max_step_tokens: int | None = None,
        step_tokens=None,
    ) -> float:
        """Compiles the engine step for every (sequences, tokens) bucket now - ahead of time,
        several buckets at once in threads (one per CPU core, at most 8) - with a progress
        bar, so that no request waits on a compile; returns the seconds it took. With JAX's
        persistent compilation cache on (bijax turns it on at import), a second start loads
        the compiled steps from disk. ``logprobs``: also the variant that returns top
        logprobs (requests with ``SamplingParams.logprobs``). ``LLM.last_warmup`` then says
        how many step programs were loaded from the persistent cache and how many compiled.
        ``max_step_tokens``: compile only the token buckets a step of that many tokens needs
        (e.g. the prompts' total when they are known: fewer compiles; a step that needs a
        larger bucket compiles it when it comes - outputs are the same either way).
        ``step_tokens``: instead, the token counts of the steps to expect - e.g. for one prompt
        of P tokens, ``[P, 1]`` (its prefill chunk, then decoding one token a step): only their
        buckets compile, not those in between."""
        import time

        from bijax import compile_cache

        pairs = self.engine.pending_buckets(
            logprobs=logprobs, max_step_tokens=max_step_tokens, step_tokens=step_tokens
        )
        hits = compile_cache.counts()[0]
        made, helped = self.engine.programs_made(), self.engine.programs_lowered_elsewhere()
        t0 = time.perf_counter()
        bar = None
        if progress and pairs:
            from tqdm import tqdm

            total = len(pairs) * (2 if logprobs else 1)
            bar = tqdm(total=total, desc="compiling steps", unit="bucket", leave=False)

        def tick(s, t, with_logprobs):
            if bar is not None:
                bar.set_postfix_str(f"{s} seqs x {t} tokens" + (" +logprobs" if with_logprobs else ""))
                bar.update(1)

        try:
            tracing = self.engine.warmup(
                logprobs=logprobs, on_bucket=tick, max_step_tokens=max_step_tokens, step_tokens=step_tokens
            )
        finally:
            if bar is not None:
                bar.close()
        took = time.perf_counter() - t0
        made = self.engine.programs_made() - made
        loaded = compile_cache.counts()[0] - hits
        # Compiled = the rest (a program that compiles faster than the cache's threshold is
        # compiled but not written, so the cache's own miss count would leave it out).
        compiled = made - loaded if compile_cache.directory() is not None else 0
        helped = self.engine.programs_lowered_elsewhere() - helped
        background = self.engine.pending_upgrades()
        self.last_warmup = WarmupReport(took, made, loaded, compiled, tracing, helped, background)
        return took

    def wait_for_upgrades(self, timeout: float | None = None) -> float:
        """Tiered step programs (``bijax.step_programs``: the GPUs' default, or
        ``BIJAX_STEP_PROGRAMS=tiered``): ``warmup`` - and a step
        of a bucket it did not compile - leaves each bucket's faster whole-forward program
        compiling in the background (the same bits, run from when it is ready); this waits for
        all of them and returns the seconds waited (0 otherwise). Benchmarks call it before
        timing; ``timeout``: seconds, then TimeoutError."""
        return self.engine.wait_for_upgrades(timeout)

    def close(self) -> None:
        """Frees the device memory this LLM's engine holds besides the model's weights - the
        KV cache, staged inputs, its references to compiled steps - now rather than when the
        LLM is collected, so that another engine on the same model (``LLM(llm.model, ...)``)
        can size its KV pool from the memory this one held. The LLM generates nothing
        afterwards (RuntimeError). ``with LLM(...) as llm:`` closes it on leaving the block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # leaving on an error: free what can be freed, never hide that error
            self.close()
        except Exception:  # noqa: BLE001 - (e.g. still busy: the error in flight says more)
            pass

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache (vLLM's name): later prompts are computed from scratch.
        Outputs do not change (a cache hit gives the same bits); only timing does."""
        self.engine.reset_prefix_cache()

    def update_weights(self, weights) -> None:
        """Replaces the engine's weights with ``weights`` - a ``models.Llama``, its parameter
        state (``nnx.state(model, nnx.Param)``, e.g. a trainer's updated params) or that state
        as a pure dict - of the same structure, shapes and dtypes (else ValueError/TypeError
        naming the first mismatch). Nothing recompiles: the weights are an argument of the
        compiled steps. The engine keeps no reference to its old weights; the JAX arrays given
        are used as they are (not copied; under tensor parallelism they are moved onto the mesh
        unless already laid out that way; numpy arrays are copied), so a train step that donates
        them must be followed by another ``update_weights`` before the next ``generate``. The
        model object changes in place: every other open LLM on it (``LLM(llm.model, ...)``)
        runs the new weights too - so each must be idle (RuntimeError before anything changes);
        so does a draft model that is this model object, and so do states split from the model
        before (``nnx.split`` / ``nnx.state`` share its variables: copy a reference policy's
        params, ``jax.tree.map(jnp.copy, params)``, before updating). Arrays on another device
        or sharding are moved to where the model's are. Weights holding NaN or infinity are
        refused (ValueError: a diverged train step), and the engine keeps its own. A change made
        to ``llm.model`` in place (an ``nnx.Optimizer`` step on it, ``nnx.update``) is taken as
        ``update_weights(llm.model)`` at the next generate or score."""
        with self._exclusive("update_weights"):
            self._update_weights(weights)

    def _follow_model(self, what: str) -> None:
        """``llm.model``'s weights changed in place since the engine took them (an optimizer step
        on the model, ``nnx.update``): the engine takes them now, as ``update_weights(llm.model)``
        would (checked, the prefix cache emptied) - so that generate, score and the trainer-side
        logprobs of ``llm.model`` all use the same weights. Only while idle (else the call fails
        on its own check of what is in flight), and only while the engine runs ``llm.model``
        (``engine.set_weights`` with another model object: that one's weights stay)."""
        if self.engine.has_unfinished_requests() or not self.engine.changed_in_place(self.model):
            return
        try:
            self._update_weights(self.model)
        except (ValueError, TypeError, RuntimeError) as e:
            raise type(e)(
                f"{what}: llm.model's weights changed in place since the engine took them, and the "
                f"engine cannot take them: {e}"
            ) from None

    def _update_weights(self, weights) -> None:
        if self.engine.closed:  # before the model (which other engines may share) is touched
            raise RuntimeError("update_weights: this LLM was closed (close() freed its KV cache)")
        self.engine.settle()  # (steps an interrupted release left behind)
        # the other open LLMs on this model object follow it: all must be idle before it changes,
        # and stay so (their locks held: a generate starting meanwhile in another thread would
        # fail halfway through the swap and keep the old weights)
        sharing = [o for o in list(_LLMS) if o is not self and o.model is self.model and not o.engine.closed]
        busy = "update_weights runs when no generation is in flight"
        if self.engine.has_unfinished_requests():
            raise RuntimeError(busy)
        with contextlib.ExitStack() as held:
            for other in sharing:
                idle = other._busy.acquire(blocking=False)
                if idle:
                    held.callback(other._busy.release)
                if not idle or other.engine.has_unfinished_requests():
                    raise RuntimeError(busy + " (in any LLM on this model: another one is generating)")
            self._swap_weights(weights, sharing)

    def _swap_weights(self, weights, sharing) -> None:
        if isinstance(weights, Llama):
            # only its parameters are taken: a model of another config (RoPE theta, an epsilon)
            # or k_shards would run under this model's, silently giving other bits than its own
            mine, theirs = self.model.config, weights.config
            diff = [
                f"{f}={getattr(theirs, f)!r} (this LLM's model: {getattr(mine, f)!r})"
                for f in mine.__dataclass_fields__
                if getattr(mine, f) != getattr(theirs, f)
            ]
            if weights.k_shards != self.model.k_shards:
                diff.append(f"k_shards={weights.k_shards} (this LLM's model: {self.model.k_shards})")
            if diff:
                raise ValueError(
                    "weights: the given Llama differs from this LLM's model in "
                    + ", ".join(diff)
                    + "; update_weights replaces parameters only (build a new LLM for another config)"
                )
            weights = param_state(weights)
        if isinstance(weights, nnx.State):
            weights = nnx.to_pure_dict(weights)
        if not isinstance(weights, dict):
            raise TypeError(
                "weights must be a models.Llama, its nnx.State of params, or that state's pure dict, "
                f"got {type(weights).__name__}"
            )
        current = param_state(self.model)
        want = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(current)))
        check_same_layout(want, dict(jax.tree_util.tree_leaves_with_path(weights)))

        # numpy leaves are copied (the caller may change them in place later; on a CPU device_put
        # may alias a numpy buffer instead of copying it - so a private copy goes to the device);
        # arrays laid out elsewhere (another device, a trainer's sharding) are moved to where the
        # model's are (the compiled steps take them there and nowhere else)
        def placed(k, v):
            if isinstance(v, np.ndarray):
                return jax.device_put(np.array(v, copy=True), want[k].sharding)
            return v if v.sharding == want[k].sharding else jax.device_put(v, want[k].sharding)

        weights = jax.tree_util.tree_map_with_path(placed, weights)
        bad = non_finite(weights)  # a diverged train step: refused, the engine keeps its weights
        if bad:
            raise ValueError(
                f"weights[{bad[0]!r}] holds NaN or infinite values ({len(bad)} such parameters in all; "
                "a diverged train step?): the engine keeps its current weights"
            )
        nnx.replace_by_pure_dict(current, {k: v for k, v in weights.items()})
        nnx.update(self.model, current)
        self.engine.set_weights(self.model)  # also empties the prefix cache (KV of the old weights)
        for other in sharing:  # their model changed with this one's: their engines run it too
            other.engine.set_weights(other.model)

    def score(self, token_ids, prompt_lens, temperature: float = 1.0) -> list[np.ndarray]:
        """float32 logprob of each token at index >= prompt_len given the tokens before it;
        bit-equal to ``generate``'s logprobs for the same tokens and temperature."""
        with self._exclusive("score"):
            self.engine.settle()
            self._follow_model("score")
            return self.engine.score(token_ids, prompt_lens, temperature)
