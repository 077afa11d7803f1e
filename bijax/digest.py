"""Prove two machines or installs give the same bits: a fixed request suite, its digest, and the
device fingerprint it was computed on.

``bijax check --record FILE`` runs the suite on a model and writes a JSON record; ``bijax check
--against FILE`` runs it again here and reports MATCH, or which requests differ (the first token
that differs and the largest |dlogprob|). A record from another NUMERICS_VERSION, model, dtype or
k_shards is refused (``IncompatibleRecord``): those change the bits by design, so a comparison
would say nothing about the machine.

What is a device class (the unit within which bits are promised): the platform, the device
model and the JAX build. On CPU the model of the x86-64 processor does NOT matter once XLA runs
with consistent CPU math (``pallas_kernels.runtime``): measured on AVX-512 Zen 4 and, under
qemu-x86_64, AVX2 Haswell and Zen 2 - so the class is the architecture and its required ISA
(x86-64 with AVX2+FMA). On GPU it is the device kind (``NVIDIA H200``). The test suite's golden
digests (tests/bijax/golden.json) are keyed by ``device_class()``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys

import numpy as np

FORMAT = "bijax-digest/1"
# The request suite's version: bump when _requests changes (old records are then refused).
SUITE = 1


class IncompatibleRecord(ValueError):
    """The record cannot be compared with this run (another NUMERICS_VERSION, model, dtype,
    k_shards or suite; or not a bijax digest record at all)."""


# --------------------------------------------------------------------------- the suite


def suite_requests():
    """The fixed suite: 4 prompts of random token ids in [3, 500) (1, 9, 40 and 77 tokens),
    greedy and seeded sampling with top-p, top-k + min-p and n=2; 8 tokens each, EOS ignored."""
    from bijax.sampling_params import SamplingParams as SP

    rng = np.random.default_rng(2026)
    prompts = [list(map(int, rng.integers(3, 500, n))) for n in (1, 9, 40, 77)]
    params = [
        SP(temperature=0, max_tokens=8, ignore_eos=True),
        SP(temperature=0.8, top_p=0.9, max_tokens=8, seed=1, ignore_eos=True),
        SP(temperature=1.0, top_k=20, min_p=0.02, max_tokens=8, seed=2, ignore_eos=True),
        SP(temperature=0.6, max_tokens=8, seed=3, n=2, ignore_eos=True),
    ]
    return prompts, params


def suite_keys() -> list[tuple[int, int]]:
    """The suite's completions as (request, sample), in the order the digest takes them."""
    return [(i, j) for i, sp in enumerate(suite_requests()[1]) for j in range(sp.n)]


def _sha256(completions) -> str:
    """The digest's formula: SHA-256 of each (token ids, float32 logprob bits) in order, the ids
    as int64 and the bits as uint32."""
    h = hashlib.sha256()
    for ids, bits in completions:
        h.update(np.asarray(ids, np.int64).tobytes())
        h.update(np.asarray(bits, np.uint32).tobytes())
    return h.hexdigest()


def digest(outputs) -> str:
    """SHA-256 of every completion's token ids (int64) and float32 logprob bits, in order."""
    return _sha256(
        (c.token_ids, np.asarray(c.logprobs, np.float32).view(np.uint32)) for o in outputs for c in o.outputs
    )


def run_suite(llm):
    """The suite's outputs on ``llm`` (a ``bijax.LLM``)."""
    prompts, params = suite_requests()
    vocab = llm.model.config.vocab_size
    if vocab < 500:
        raise ValueError(f"the digest suite uses token ids up to 499; this model's vocabulary has {vocab}")
    need = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    if llm.config.max_model_len < need:  # (the suite's prompts are fixed: name the limit, not a prompt)
        raise ValueError(
            f"the digest suite needs max_model_len >= {need} (its longest prompt and tokens); this "
            f"engine has {llm.config.max_model_len}"
        )
    return llm.generate(prompts, params, use_tqdm=False)


# --------------------------------------------------------------------------- fingerprint


def _cpu_info() -> dict:
    info = {"arch": platform.machine(), "model": platform.processor() or "unknown", "flags": []}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and info["model"] in ("unknown", "", info["arch"]):
            info["model"] = value.strip()
        elif key == "flags":
            have = set(value.split())
            info["flags"] = sorted(have & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx_vnni"})
            break
    info["cores"] = os.cpu_count()
    return info


def device_class(fp: dict | None = None) -> str:
    """The class within which bits are promised: ``cpu:x86_64-avx2-fma:jaxlib-0.11.2``,
    ``gpu:NVIDIA H200:jaxlib-0.11.2``. A CPU without consistent XLA math gets its own class."""
    fp = fp or fingerprint()
    if fp["platform"] == "cpu":
        cpu = fp["cpu"]
        kind = cpu["arch"]
        if kind in ("x86_64", "AMD64") and {"avx2", "fma"} <= set(cpu["flags"]):
            kind = "x86_64-avx2-fma"
        if not fp.get("consistent_cpu_math", False):
            kind += "-platform-math"
    else:
        kind = fp["device_kind"]
    return f"{fp['platform']}:{kind}:jaxlib-{fp['jaxlib']}"


def fingerprint() -> dict:
    """This process's device and software: what a record is tagged with."""
    import jax
    import jaxlib

    import bijax
    import pallas_kernels as pk

    backend = jax.default_backend()
    devices = jax.devices()
    fp = {
        "platform": "cpu" if backend == "cpu" else "gpu" if backend in ("gpu", "cuda", "rocm") else backend,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "bijax": bijax.__version__,
        "numerics_version": bijax.NUMERICS_VERSION,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_info(),
    }
    if fp["platform"] == "cpu":
        fp["consistent_cpu_math"] = pk.cpu_math_is_consistent()
    fp["device_class"] = device_class(fp)
    return fp


# --------------------------------------------------------------------------- model identity


def model_identity(llm) -> dict:
    """What a record must share with a run to be comparable: the weights (SHA-256 of every
    parameter's shape, dtype and first 4096 values - enough to tell checkpoints and preset
    seeds apart without reading 16 GB), the dtype and k_shards."""
    import jax
    from flax import nnx

    model = llm.model
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        a = leaf.value if hasattr(leaf, "value") else leaf
        h.update(f"{jax.tree_util.keystr(path)}:{a.shape}:{a.dtype}".encode())
        head = np.asarray(jax.device_get(a.reshape(-1)[:4096]))
        h.update(head.view(np.uint8).tobytes())
    c = model.config
    return {
        "weights_sha256": h.hexdigest(),
        "dtype": str(np.dtype(model.dtype)),
        "k_shards": int(model.k_shards),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
    }


# --------------------------------------------------------------------------- record / compare


def _completions(outputs) -> list[dict]:
    rows = []
    for i, o in enumerate(outputs):
        for j, c in enumerate(o.outputs):
            bits = np.asarray(c.logprobs, np.float32).view(np.uint32)
            rows.append(
                {
                    "request": i,
                    "sample": j,
                    "token_ids": [int(t) for t in c.token_ids],
                    "logprobs_f32": [f"{int(b):08x}" for b in bits],
                }
            )
    return rows


def make_record(llm, model_name: str, outputs=None) -> dict:
    """The JSON-able record of the suite on ``llm``."""
    import bijax

    outputs = run_suite(llm) if outputs is None else outputs
    cfg = llm.config
    return {
        "format": FORMAT,
        "suite": SUITE,
        "numerics_version": bijax.NUMERICS_VERSION,
        "digest": digest(outputs),
        "model": {"name": model_name, **model_identity(llm)},
        "engine": {
            "max_model_len": cfg.max_model_len,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "block_size": cfg.block_size,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "seed": cfg.seed,
        },
        "fingerprint": fingerprint(),
        "completions": _completions(outputs),
    }


def write_record(record: dict, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def load_record(path: str | os.PathLike) -> dict:
    """Reads a record; IncompatibleRecord when the file is not one."""
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IncompatibleRecord(f"{path}: not a bijax digest record ({e})") from None
    need = ("format", "suite", "numerics_version", "digest", "model", "fingerprint", "completions")
    if not isinstance(record, dict) or record.get("format") != FORMAT or any(k not in record for k in need):
        raise IncompatibleRecord(f"{path}: not a bijax digest record (expected format {FORMAT!r})")
    _check_completions(record, path)
    return record


_HEX32 = re.compile(r"[0-9a-f]{8}")


def _check_completions(record: dict, path) -> None:
    """IncompatibleRecord unless the record's completions are well formed, are the suite's (when
    it is this install's suite) and give the record's own digest: a record cut short, edited
    or with another digest is refused, never compared as far as it goes."""

    def bad(why):
        return IncompatibleRecord(f"{path}: not a bijax digest record ({why})")

    rows = record["completions"]
    if not isinstance(rows, list):
        raise bad("its completions are not a list")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or any(
            k not in r for k in ("request", "sample", "token_ids", "logprobs_f32")
        ):
            raise bad(f"completion {i} lacks request, sample, token_ids or logprobs_f32")
        ids, lps = r["token_ids"], r["logprobs_f32"]
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise bad(f"completion {i}'s token_ids are not a list of ints")
        if (
            not isinstance(lps, list)
            or len(lps) != len(ids)
            or not all(isinstance(x, str) and _HEX32.fullmatch(x) for x in lps)
        ):
            raise bad(f"completion {i}'s logprobs_f32 are not one 8-digit hex string per token")
    keys = [(r["request"], r["sample"]) for r in rows]
    if record["suite"] == SUITE and keys != suite_keys():
        raise bad(f"it holds {len(rows)} completions {keys}, the suite makes {suite_keys()}")
    mine = _sha256((r["token_ids"], [int(x, 16) for x in r["logprobs_f32"]]) for r in rows)
    if mine != record["digest"]:
        raise IncompatibleRecord(
            f"{path}: its digest {str(record['digest'])[:16]}... is not the one of its completions "
            f"({mine[:16]}...): the file was edited or cut; record it again"
        )


def check_compatible(record: dict, llm, path: str = "the record") -> None:
    """IncompatibleRecord naming what differs when ``record`` cannot be compared with ``llm``."""
    import bijax

    if record["numerics_version"] != bijax.NUMERICS_VERSION:
        raise IncompatibleRecord(
            f"{path} was recorded at NUMERICS_VERSION {record['numerics_version']}, this install is at "
            f"{bijax.NUMERICS_VERSION}: bits changed by design between them; record again with this install"
        )
    if record["suite"] != SUITE:
        raise IncompatibleRecord(
            f"{path} used request suite {record['suite']}, this install runs suite {SUITE}"
        )
    mine = model_identity(llm)
    theirs = record["model"]
    for key in ("dtype", "k_shards", "vocab_size", "hidden_size", "num_layers", "weights_sha256"):
        if theirs.get(key) != mine[key]:
            what = "weights" if key == "weights_sha256" else key
            raise IncompatibleRecord(
                f"{path} is for another model or settings: {what} {theirs.get(key)!r} there, {mine[key]!r} "
                f"here (recorded with model {theirs.get('name')!r}); use the same model, --dtype and --k-shards"
            )


def compare(record: dict, outputs) -> list[dict]:
    """Per completion that differs: request, sample, first differing token index (None when
    the ids agree) and max |dlogprob| over the positions both have. Empty: MATCH."""
    diffs = []
    now = {(r["request"], r["sample"]): r for r in _completions(outputs)}
    for then in record["completions"]:
        key = (then["request"], then["sample"])
        cur = now.get(key)
        if cur is None:
            diffs.append({"request": key[0], "sample": key[1], "first_token": 0, "max_abs_dlogprob": None})
            continue
        if cur["token_ids"] == then["token_ids"] and cur["logprobs_f32"] == then["logprobs_f32"]:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(cur["token_ids"], then["token_ids"], strict=False)) if a != b),
            None
            if len(cur["token_ids"]) == len(then["token_ids"])
            else min(len(cur["token_ids"]), len(then["token_ids"])),
        )
        a = np.array([int(x, 16) for x in cur["logprobs_f32"]], np.uint32).view(np.float32)
        b = np.array([int(x, 16) for x in then["logprobs_f32"]], np.uint32).view(np.float32)
        n = min(len(a), len(b))
        d = float(np.max(np.abs(a[:n].astype(np.float64) - b[:n].astype(np.float64)))) if n else None
        diffs.append({"request": key[0], "sample": key[1], "first_token": first, "max_abs_dlogprob": d})
    return diffs


def describe(fp: dict) -> str:
    """One line naming a fingerprint's machine and software."""
    where = fp.get("device_kind", "?")
    if fp.get("platform") == "cpu":
        cpu = fp.get("cpu", {})
        where = f"{cpu.get('model', '?')} ({cpu.get('arch', '?')}, {','.join(cpu.get('flags', [])) or 'no flags'})"
    return f"{fp.get('device_class', '?')} - {where}; jax {fp.get('jax', '?')}, bijax {fp.get('bijax', '?')}"


__all__ = [
    "IncompatibleRecord",
    "check_compatible",
    "compare",
    "describe",
    "device_class",
    "digest",
    "fingerprint",
    "load_record",
    "make_record",
    "model_identity",
    "run_suite",
    "suite_requests",
    "write_record",
]

if __name__ == "__main__":  # pragma: no cover - a quick look at this machine's class
    json.dump(fingerprint(), sys.stdout, indent=1)
    print()
