"""RL evidence: seeded rollouts from ``LLM.generate``, trainer-side ``bijax.logprobs`` over the
same tokens (bit-identical, checked), a GRPO-style optax step through the custom VJPs, and
``LLM.update_weights`` - the time of each part of one RL iteration, after a warm-up iteration.

    PYTHONPATH=. python benchmarks/rl.py                      # smollm2-shape, bf16, 64 rollouts
    PYTHONPATH=. python benchmarks/rl.py --smoke              # tiny, CPU check of the script
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bijax
from bijax import SamplingParams
from bijax.model_runner import num_compiled_steps
from models.loading import load_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.dtype, a.prompts, a.n, a.prompt_len, a.max_tokens, a.iters = (
            "tiny",
            "float32",
            2,
            4,
            12,
            6,
            2,
        )
    print(f"# benchmarks/rl.py {datetime.date.today()} on {jax.devices()[0].device_kind}", flush=True)
    model = load_model(a.model, dtype=jnp.dtype(a.dtype))
    rollouts = a.prompts * a.n
    length = a.prompt_len + a.max_tokens
    llm = bijax.LLM(
        model,
        max_model_len=length,
        max_num_seqs=min(rollouts, 64),
        max_num_batched_tokens=max(512, min(rollouts, 64)),
        seed=0,
    )
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, vocab, a.prompt_len)] for _ in range(a.prompts)]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(1e-4)
    opt_state = opt.init(params)

    @jax.jit
    def score(p, tokens):
        return bijax.logprobs(nnx.merge(graphdef, p, rest), tokens, temperature=1.0)

    @jax.jit
    def train(p, s, tokens, mask, old_lp, adv):
        def loss(p):
            lp = bijax.logprobs(nnx.merge(graphdef, p, rest), tokens, temperature=1.0)
            ratio = jnp.exp(lp - old_lp)
            obj = jnp.minimum(ratio * adv[:, None], jnp.clip(ratio, 0.8, 1.2) * adv[:, None])
            return -(obj * mask).sum() / mask.sum(), lp

        (value, lp), g = jax.value_and_grad(loss, has_aux=True)(p)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, value, lp

    failures = []
    rows = []
    for it in range(a.iters + 1):
        if it == 1:
            llm.wait_for_upgrades()  # tiered (the GPU default): whole forwards ready before timing
        t0 = time.perf_counter()
        compiled = num_compiled_steps()
        outs = llm.generate(
            prompts,
            SamplingParams(n=a.n, temperature=1.0, seed=1000 + it, max_tokens=a.max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
        t1 = time.perf_counter()
        if it > 0 and num_compiled_steps() != compiled:
            failures.append(f"iter {it}: generate compiled a new step after update_weights")
        seqs = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
        tokens = np.array([p + c.token_ids for p, c in seqs], np.int32)
        sampler = np.zeros(tokens.shape, np.float32)
        mask = np.zeros(tokens.shape, np.float32)
        for r, (p, c) in enumerate(seqs):
            sampler[r, len(p) :] = c.logprobs
            mask[r, len(p) :] = 1
        reward = np.array([np.mean(np.asarray(c.token_ids) < vocab // 8) for _, c in seqs], np.float32)
        groups = reward.reshape(a.prompts, a.n)
        adv = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)).reshape(-1)
        tj, mj = jnp.asarray(tokens), jnp.asarray(mask)
        t2 = time.perf_counter()
        lp = np.asarray(score(params, tj))
        t3 = time.perf_counter()
        m = mask > 0
        same = np.array_equal(lp[m].view(np.uint32), sampler[m].view(np.uint32))
        gap = float(np.abs(lp - sampler)[mask > 0].max())
        params, opt_state, value, lp_in_grad = train(
            params, opt_state, tj, mj, jnp.asarray(sampler), jnp.asarray(adv)
        )
        jax.block_until_ready(params)
        t4 = time.perf_counter()
        lg = np.asarray(lp_in_grad)
        same_in_grad = np.array_equal(lg[m].view(np.uint32), sampler[m].view(np.uint32))
        gap = max(gap, float(np.abs(lg - sampler)[m].max()))
        llm.update_weights(params)
        t5 = time.perf_counter()
        tag = "warm-up" if it == 0 else f"iter {it}"
        print(
            f"{tag}: {len(seqs)} rollouts x {a.max_tokens} tokens; trainer==sampler bits: {same} "
            f"(inside value_and_grad: {same_in_grad}); max|sampler-trainer| = {gap}; loss {float(value):.4f}; "
            f"reward {reward.mean():.3f}; sample {t1 - t0:.3f}s score {t3 - t2:.3f}s grad+adam {t4 - t3:.3f}s "
            f"update {t5 - t4:.4f}s",
            flush=True,
        )
        if not (same and same_in_grad):
            failures.append(f"{tag}: trainer logprobs differ from the sampler's (max gap {gap})")
        if it:
            rows.append((t1 - t0, t3 - t2, t4 - t3, t5 - t4))
    med = np.median(np.array(rows), axis=0)
    print(
        f"\n| rollouts | sample s | score s | grad+adam s | update_weights s | iteration s |\n"
        f"|---|---|---|---|---|---|\n| {rollouts} x {a.max_tokens} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | "
        f"{med[3]:.4f} | {med.sum():.3f} |"
    )
    print("FAILURES:\n  " + "\n  ".join(failures) if failures else "ALL RL CHECKS PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
