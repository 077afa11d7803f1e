"""The numerics golden file: SHA-256 of token ids and float32 logprob bits for fixed prompts.

    python -m tests.bijax.golden          # prints the current hashes
    python -m tests.bijax.golden --write  # rewrites golden.json (only with a NUMERICS_VERSION bump)

CPU only (the file records this machine type's bits: JAX CPU, the pinned versions).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

GOLDEN = os.path.join(os.path.dirname(__file__), "golden.json")
# Engine settings of the recorded runs: test_engine.py's (they change compiles, not bits); seed=0 is
# also the preset's weight seed.
ENGINE = dict(
    dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160, seed=0
)


def _requests():
    from bijax import SamplingParams as SP

    rng = np.random.default_rng(2026)
    prompts = [list(map(int, rng.integers(3, 500, n))) for n in (1, 9, 40, 77)]
    params = [
        SP(temperature=0, max_tokens=8, ignore_eos=True),
        SP(temperature=0.8, top_p=0.9, max_tokens=8, seed=1, ignore_eos=True),
        SP(temperature=1.0, top_k=20, min_p=0.02, max_tokens=8, seed=2, ignore_eos=True),
        SP(temperature=0.6, max_tokens=8, seed=3, n=2, ignore_eos=True),
    ]
    return prompts, params


def digest(outputs) -> str:
    h = hashlib.sha256()
    for o in outputs:
        for c in o.outputs:
            h.update(np.asarray(c.token_ids, np.int64).tobytes())
            h.update(np.asarray(c.logprobs, np.float32).view(np.uint32).tobytes())
    return h.hexdigest()


def current_hashes(llms=None) -> dict[str, str]:
    """{model: sha256} for the fixed requests on `tiny` (k_shards 1 and 8: the tree and the
    column blocks of tensor parallelism) and SmolLM2 (GGUF), all float32."""
    import bijax

    prompts, params = _requests()
    out = {}
    for name in ("tiny", "tiny@k_shards=8", "smollm2-135m"):
        model, _, ks = name.partition("@k_shards=")
        llm = (llms or {}).get(name) or bijax.LLM(model, k_shards=int(ks or 1), **ENGINE)
        out[name] = digest(llm.generate(prompts, params, use_tqdm=False))
    return out


def main():
    import bijax

    hashes = current_hashes()
    record = {"numerics_version": bijax.NUMERICS_VERSION, "platform": "cpu", "hashes": hashes}
    print(json.dumps(record, indent=1))
    if "--write" in sys.argv:
        with open(GOLDEN, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
