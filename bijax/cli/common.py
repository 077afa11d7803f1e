"""What the ``bijax`` commands share: engine and sampling flags (vLLM's names), building the
``LLM`` from them, warm-up, status lines on stderr."""

from __future__ import annotations

import argparse
import sys

DTYPES = ("bfloat16", "float16", "float32")


def info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def engine_args(p: argparse.ArgumentParser, *, presets: bool = True) -> None:
    """The model and engine flags; ``presets``: whether the command runs presets (random
    weights, no tokenizer) - generate does not, and its help says so."""
    from models.loading import DEFAULT_MODEL

    g = p.add_argument_group("model and engine (names as bijax.LLM / vLLM)")
    kinds = "preset (tiny, llama3-8b), " if presets else ""
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"{kinds}embedded model, .gguf file, HF or orbax directory (default {DEFAULT_MODEL})"
        + ("" if presets else "; a model with a tokenizer (presets run in bijax check and bench)"),
    )
    g.add_argument("--dtype", choices=DTYPES, help="weights/activations dtype (default: the checkpoint's)")
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        help="longest prompt + output (default: 1024 on CPU, 8192 on GPU)",
    )
    g.add_argument("--max-num-seqs", type=positive_int, help="sequences per step")
    g.add_argument(
        "--max-num-batched-tokens", type=positive_int, help="tokens per step (the prefill chunk size)"
    )
    g.add_argument("--block-size", type=positive_int, default=16, help="KV block size (default 16)")
    g.add_argument("--num-kv-blocks", type=positive_int, help="KV pool size in blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--k-shards", type=int, default=1, help="virtual K shards of o/down (1, 2, 4, 8)")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices to split the model over (a divisor of --k-shards; use --k-shards 8)",
    )
    g.add_argument(
        "--model-seed", type=int, default=0, help="engine seed (draws request seeds; preset weights)"
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read each step's tokens back before enqueueing the next (the same bits, slower)",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_dict,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(same outputs, fewer steps; see bijax.LLM)",
    )


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a 0 would otherwise read as "not given" downstream)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def token_ids(text: str) -> list[int]:
    """argparse type: token ids separated by commas or spaces."""
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be token ids separated by commas, got {text!r}") from None


def _json_dict(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at char {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (names as SamplingParams)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, help="the request's seed (default: drawn and reported)")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=token_ids, help="token ids that end a sample, e.g. '2,7'")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, help="also the top-N logprobs of each step (JSON output)")


def dtype_arg(name):
    if name is None:
        return None
    import jax.numpy as jnp

    return jnp.dtype(name)


def make_llm(
    args, *, max_num_seqs: int, max_num_batched_tokens: int, invariant: bool | None = None, model=None
):
    from bijax import LLM

    if invariant is None:
        invariant = not getattr(args, "no_invariant", False)
    kwargs = dict(
        invariant=invariant,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        k_shards=args.k_shards,
        seed=args.model_seed,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=not getattr(args, "no_async_scheduling", False),
        speculative_config=getattr(args, "speculative_config", None),
    )
    if model is not None:
        return LLM(model.model, tokenizer=model.tokenizer, **kwargs)
    return LLM(args.model, dtype=dtype_arg(args.dtype), **kwargs)


def sizes(args, num_seqs: int) -> tuple[int, int]:
    """Engine limits: the user's, else sized to the work (few buckets to compile on a CPU)."""
    s = args.max_num_seqs or min(16, pow2_at_least(num_seqs))
    t = args.max_num_batched_tokens or max(s, 64 if on_cpu() else 512)
    return s, t


def warmup(llm, args, logprobs: bool, max_step_tokens: int | None = None, step_tokens=None) -> None:
    if args.no_warmup:
        return
    from bijax import compile_cache

    took = llm.warmup(logprobs=logprobs, max_step_tokens=max_step_tokens, step_tokens=step_tokens)
    r = llm.last_warmup
    where = compile_cache.directory()
    how = f"{r.loaded_from_cache} loaded from the cache, {r.compiled} compiled, " if where else ""
    info(
        f"warm-up: {llm.engine.num_compiled_buckets} step buckets ready in {took:.1f}s "
        f"({how}{r.tracing_seconds:.1f}s of it tracing)"
    )
    if r.compiling_in_background:
        info(
            f"         ({r.compiling_in_background} faster whole-forward programs compile in the background)"
        )
    if where and r.compiled:
        info(
            f"         (steps that took over {compile_cache.MIN_COMPILE_SECONDS:g} s to compile are cached "
            f"in {where}: the next start loads them)"
        )
