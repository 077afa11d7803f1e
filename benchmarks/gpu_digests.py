"""The GPU record of the digest suite (``bijax check --record``) on the presets that travel to the
GPU: ``smollm2-shape`` and ``llama3-8b`` (random weights from seed 0), bfloat16 and float32.

    PYTHONPATH=. python3 benchmarks/gpu_digests.py            # compare with benchmarks/digests/
    PYTHONPATH=. python3 benchmarks/gpu_digests.py --write    # (re)write the records there

Re-run it after any kernel change, in the same session as the change: a MISMATCH on an unchanged
NUMERICS_VERSION means GPU bits moved. A record of this device class from an older
NUMERICS_VERSION is reported as "vN record: digest SAME / DIFFERS" (a bump that changed CPU bits
only, as 7 did, should give SAME; then ``--write`` re-records). Each configuration also runs the suite twice in one
engine (run to run). The records carry the device fingerprint (``bijax.digest.fingerprint``); a
record from another device class is not a MATCH / MISMATCH; where this device class has none,
the row says which other classes' records its digest equals or differs from (the H100 gave the
H200 records' digests, session 42).
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import bijax
from bijax import digest

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digests")
CONFIGS = [(m, d) for m in ("smollm2-shape", "llama3-8b") for d in ("bfloat16", "float32")]
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160, seed=0)


def record_path(directory: str, model: str, dtype: str, device_class: str) -> str:
    kind = device_class.split(":")[1].replace(" ", "-").replace("/", "-").lower()
    return os.path.join(directory, f"{kind}-{model}-{dtype}.json")


def other_classes(directory: str, model: str, dtype: str, got: str) -> str:
    """' (digest equals: <class>, ...; differs: <class>, ...)' over the records of other device
    classes for ``model`` / ``dtype`` under this NUMERICS_VERSION, or '' where there are none."""
    same, other = [], []
    for path in sorted(glob.glob(os.path.join(directory, f"*-{model}-{dtype}.json"))):
        old = digest.load_record(path)
        if old.get("model", {}).get("name") != model or old.get("model", {}).get("dtype") != dtype:
            continue  # (another preset whose name ends like this one's)
        if old.get("numerics_version") != bijax.NUMERICS_VERSION:
            continue  # (other numerics: not comparable)
        (same if old["digest"] == got else other).append(old["fingerprint"]["device_class"])
    parts = [f"{what}: {', '.join(c)}" for what, c in (("digest equals", same), ("differs", other)) if c]
    return f" ({'; '.join(parts)})" if parts else ""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="write the records instead of comparing")
    p.add_argument("--dir", default=HERE, help="where the records live (default benchmarks/digests)")
    p.add_argument(
        "--prefill-kernel",
        choices=("tiles", "tiles_mgpu"),
        help="the kernel attention's 'auto' runs for prefill steps (attention_triton.PREFILL_KERNEL; "
        "default: as committed) - the records must MATCH either way",
    )
    from benchmarks.ab import SWITCHES

    launches = SWITCHES["prefill-launch"]
    p.add_argument(
        "--prefill-launch",
        choices=sorted(launches),
        help="how the Mosaic GPU prefill kernel launches (a side of benchmarks/ab.py's prefill-launch "
        "switch; default: as committed) - the records must MATCH either way",
    )
    args = p.parse_args()
    if args.prefill_kernel:
        from pallas_kernels import attention_triton

        attention_triton.PREFILL_KERNEL = args.prefill_kernel
        print(f"# prefill kernel: {args.prefill_kernel}", flush=True)
    if args.prefill_launch:
        from pallas_kernels import attention_triton

        ((_, name, value),) = launches[args.prefill_launch]
        setattr(attention_triton, name, value)
        print(f"# Mosaic GPU prefill launch: {args.prefill_launch} {value}", flush=True)
    cls = digest.device_class()
    print(f"# {time.strftime('%Y-%m-%d')} {digest.describe(digest.fingerprint())}", flush=True)
    rows = []
    for model, dtype in CONFIGS:
        t0 = time.perf_counter()
        llm = bijax.LLM(model, dtype=dtype, **ENGINE)
        first = digest.run_suite(llm)
        again = digest.run_suite(llm)
        record = digest.make_record(llm, model, outputs=first)
        run_to_run = "same" if digest.digest(again) == record["digest"] else "DIFFERENT"
        path = record_path(args.dir, model, dtype, cls)
        if args.write:
            os.makedirs(args.dir, exist_ok=True)
            digest.write_record(record, path)
            status = "written"
        elif not os.path.exists(path):
            status = "no record" + other_classes(args.dir, model, dtype, record["digest"])
        else:
            old = digest.load_record(path)
            if old["fingerprint"]["device_class"] != cls:
                status = f"recorded on {old['fingerprint']['device_class']}"
            elif old["numerics_version"] != bijax.NUMERICS_VERSION:  # did a bump move this device's bits?
                same = old["digest"] == record["digest"]
                status = f"v{old['numerics_version']} record: digest {'SAME' if same else 'DIFFERS'}"
            else:
                digest.check_compatible(old, llm, path)
                diffs = digest.compare(old, first)
                status = "MATCH" if not diffs else f"MISMATCH {len(diffs)}/{len(old['completions'])}"
        secs = time.perf_counter() - t0
        rows.append((model, dtype, record["digest"][:16], run_to_run, status, secs))
        print(
            f"{model} {dtype}: {record['digest']} run-to-run {run_to_run}, {status} ({secs:.0f}s)", flush=True
        )
        llm.close()
        del llm, first, again
    print("\n| model | dtype | digest | run to run | vs record | s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]}... | {r[3]} | {r[4]} | {r[5]:.0f} |")


if __name__ == "__main__":
    main()
