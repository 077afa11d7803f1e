"""The numerics golden file: per device class, SHA-256 of token ids and float32 logprob bits of
the fixed digest suite (``bijax.digest``) on three models.

    python -m tests.bijax.golden          # prints this machine's class and hashes
    python -m tests.bijax.golden --json   # the hashes only, as one JSON line (fresh-process check)
    python -m tests.bijax.golden --write  # records them for this device class in golden.json

A device class is ``bijax.digest.device_class()``: platform, device model (on CPU: x86-64 with
AVX2+FMA, whatever the CPU model) and the jaxlib build. ``--write`` keeps the other classes'
records when NUMERICS_VERSION is unchanged, and starts a fresh file when it was bumped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

from bijax.digest import device_class, digest, suite_requests

GOLDEN = os.path.join(os.path.dirname(__file__), "golden.json")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Engine settings of the recorded runs: test_engine.py's (they change compiles, not bits); seed=0 is
# also the preset's weight seed.
ENGINE = dict(
    dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160, seed=0
)
MODELS = ("tiny", "tiny@k_shards=8", "smollm2-135m")
_requests = suite_requests


class GoldenNotRecorded(UserWarning):
    """No golden digest is recorded for this device class (the test checked fresh processes)."""


def current_hashes(llms=None) -> dict[str, str]:
    """{model: sha256} for the fixed requests on `tiny` (k_shards 1 and 8: the tree and the
    column blocks of tensor parallelism) and SmolLM2 (GGUF), all float32."""
    import bijax

    prompts, params = _requests()
    out = {}
    for name in MODELS:
        model, _, ks = name.partition("@k_shards=")
        llm = (llms or {}).get(name) or bijax.LLM(model, k_shards=int(ks or 1), **ENGINE)
        out[name] = digest(llm.generate(prompts, params, use_tqdm=False))
    return out


def fresh_process_hashes() -> dict[str, str]:
    """current_hashes() computed by a new Python process."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "tests.bijax.golden", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=REPO,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def load() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


def verify(now: dict, record: dict, cls: str, fresh=fresh_process_hashes) -> str:
    """Checks ``now`` (this process's hashes) against ``record`` for device class ``cls``.

    A recorded class must match exactly (AssertionError otherwise). An unrecorded class cannot be
    judged against a record: two fresh processes must then agree with each other and with
    ``now``, and a GoldenNotRecorded warning says how to add a record. Returns "recorded" or
    "unrecorded".
    """
    recorded = record["records"].get(cls)
    if recorded is not None:
        assert now == recorded, (
            f"output bits changed on device class {cls} without a NUMERICS_VERSION bump: bump "
            "bijax.NUMERICS_VERSION and run `python -m tests.bijax.golden --write` if the change is intended"
        )
        return "recorded"
    first, second = fresh(), fresh()
    assert first == second == now, f"two fresh processes disagree on device class {cls}: {first} vs {second}"
    warnings.warn(
        GoldenNotRecorded(
            f"no golden digest is recorded for device class {cls!r} (recorded: {sorted(record['records'])}); "
            "checked only that two fresh processes agree. To record this class: "
            "`python -m tests.bijax.golden --write`, then commit tests/bijax/golden.json"
        ),
        stacklevel=2,
    )
    return "unrecorded"


def main():
    import bijax

    hashes = current_hashes()
    if "--json" in sys.argv:
        print(json.dumps(hashes))
        return
    cls = device_class()
    print(
        json.dumps(
            {"numerics_version": bijax.NUMERICS_VERSION, "device_class": cls, "hashes": hashes}, indent=1
        )
    )
    if "--write" in sys.argv:
        try:
            record = load()
        except (OSError, json.JSONDecodeError):
            record = {}
        if record.get("numerics_version") != bijax.NUMERICS_VERSION:
            record = {"numerics_version": bijax.NUMERICS_VERSION, "records": {}}
        record["records"][cls] = hashes
        with open(GOLDEN, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {GOLDEN} ({cls})")


if __name__ == "__main__":
    main()
