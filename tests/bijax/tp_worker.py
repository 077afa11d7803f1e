"""One process of the two-process tensor-parallel check (tests/bijax/test_tp_multiprocess.py).

``python -m tests.bijax.tp_worker PORT PROCESS_ID OUT.json``: joins a 2-process
``jax.distributed`` job on 127.0.0.1:PORT with one CPU device (CPU collectives: gloo), serves
the fixed requests at tensor_parallel_size=2 and writes ``record(llm)`` to OUT.json, with the
same record of the XLA path (invariant=False) as a negative control.

``record`` is also what the test computes in one process at tensor_parallel_size=1.
"""

from __future__ import annotations

import json
import sys

import numpy as np

ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, seed=1)


def model():
    import jax.numpy as jnp

    from models.configs import preset
    from models.llama import Llama

    return Llama(preset("tiny"), dtype=jnp.float32, k_shards=8, seed=0)


def requests():
    """Three token-id prompts (5, 20 and 40 tokens: under the 32-token budget the last one's
    prefill spans three steps, beside the others' decodes), greedy and seeded sampling. The
    lengths make every step of generate and score one of three compiled buckets (cold compiles
    dominate this test's time): the decodes end together, and score's prefixes are cached."""
    from bijax import SamplingParams as SP

    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(3, 512, n))) for n in (5, 20, 40)]
    params = [
        SP(temperature=0, max_tokens=5, ignore_eos=True),
        SP(temperature=0.8, top_p=0.9, seed=7, max_tokens=5, ignore_eos=True),
        SP(temperature=1.0, top_k=40, seed=8, max_tokens=3, ignore_eos=True),
    ]
    return prompts, params


def _u32(a) -> list[int]:
    a = np.asarray(a)
    assert a.dtype == np.float32, a.dtype  # the engine's logprobs are float32: compare their bits
    return a.view(np.uint32).tolist()


def record(llm) -> dict:
    """Token ids, logprob bits and score() bits (float32 viewed as uint32) of the fixed requests."""
    prompts, params = requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seqs = [c for o in outs for c in o.outputs]
    full = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    scored = llm.score(full, [len(o.prompt_token_ids) for o in outs], temperature=1.0)
    return dict(
        token_ids=[list(map(int, c.token_ids)) for c in seqs],
        logprob_bits=[_u32(c.logprobs) for c in seqs],
        score_bits=[_u32(s) for s in scored],
    )


def main(port: int, process_id: int, out: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default in jax 0.11; explicit
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    import bijax

    assert jax.process_count() == 2 and jax.process_index() == process_id
    assert jax.local_device_count() == 1 and jax.device_count() == 2, jax.devices()
    m = model()
    llm = bijax.LLM(m, tensor_parallel_size=2, **ENGINE)
    rec = dict(invariant=record(llm))
    wq = m.layers[0].attn.wq[...]  # the weights really are split over the two processes
    rec.update(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        collectives=jax.config.jax_cpu_collectives_implementation,
        mesh_processes=sorted(d.process_index for d in llm.engine.runner.mesh.devices.flat),
        wq_shape=list(wq.shape),
        wq_local_shards=[list(s.data.shape) for s in wq.addressable_shards],
        wq_fully_addressable=wq.is_fully_addressable,
    )
    # The negative control: the XLA path (the library's all-reduce over gloo), same requests,
    # from the same model (its weights already split over the processes).
    rec["xla"] = record(bijax.LLM(m, tensor_parallel_size=2, invariant=False, **ENGINE))
    with open(out, "w") as f:
        json.dump(rec, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
