"""Writes notebooks/02_on_policy_rl.ipynb (run: python notebooks/make_02.py). The notebook is
executed in CI by tests/test_notebooks.py; `python notebooks/execute.py` stores its outputs."""

import nbformat as nbf

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
cells = [
    md("""# 02 - On-policy RL where the sampler and the trainer agree on every bit

An RL loop for LLMs (PPO, GRPO, ...) has two halves: an **inference engine** samples rollouts
and reports each sampled token's logprob, and a **trainer** recomputes those logprobs with the
policy it is differentiating. The objective weights each token by the importance ratio

$$\\rho = \\exp(\\log \\pi_{\\text{trainer}} - \\log \\pi_{\\text{sampler}})$$

which, for a truly on-policy step (same weights), should be exactly 1. On ordinary stacks it is
not: the engine and the trainer run different kernels on different batch shapes (decode rows vs
one padded training batch), their float reductions happen in different orders, and the two
logprobs disagree in the last bits - sometimes by much more, when a near-tie flips. The
"on-policy" algorithm is then quietly off-policy, and the mismatch is a known source of
instability in RL fine-tuning.

bijax's guarantee: for the same weights, tokens and temperature, the float32 logprob the engine
reports for a sampled token and the one the trainer recomputes are **the same bits**, whatever
the batch, padding or packing on either side. An RL user needs three calls:

* `LLM.generate(prompts, SamplingParams(n=..., seed=...))` - sample groups of completions
  (reproducibly from a seed) and get each sampled token's float32 logprob;
* `bijax.logprobs(model, tokens, temperature=...)` - the trainer side: per-token logprobs of a
  `[B, L]` token batch, a pure function that can be `jax.jit`-ed and `jax.grad`-ed;
* `LLM.update_weights(params)` - hand the engine the new weights after an optimizer step
  (the weights are an argument of the compiled steps: nothing recompiles).

This notebook trains the `tiny` preset (random weights, float32, no tokenizer - prompts are
token ids) with a small GRPO loop on a verifiable toy reward, and checks the sampler/trainer
agreement bit for bit at every step. It runs on a CPU in a couple of minutes."""),
    code("""import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

import bijax
import models
from bijax import SamplingParams

model = models.llama.Llama(models.configs.preset("tiny"), dtype=jnp.float32, seed=0)
engine_kw = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64, seed=0)
llm = bijax.LLM(model, **engine_kw)  # batch invariant by default

# The trainer's view of the same model: the parameters to optimise, and everything else
# (the RoPE table), kept apart so that a loss can be a function of the parameters alone.
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
print(model.config.vocab_size, "tokens of vocabulary,",
      sum(x.size for x in jax.tree_util.tree_leaves(params)), "parameters")"""),
    md("""## A verifiable toy reward

The task: generate tokens from a target set - here the 64 smallest ids of the 512-token
vocabulary. The reward of a completion is the fraction of its tokens in that set, checkable by
a one-liner (the analogue of a unit test or a math verifier). A random policy scores about
64/512 = 0.125.

Two fixed prompts (lists of token ids, of different lengths), each sampled as a group of 8
completions of 8 tokens, in one `generate` call. Each step uses its own seed, so the whole run
is reproducible."""),
    code("""TARGET = 64  # reward: fraction of generated tokens with id < TARGET
prompts = [[1, 300, 301, 302, 303, 304], [1, 410, 420, 430, 440, 450, 460, 470, 480]]
G, T = 8, 8  # completions per prompt (the GRPO group), tokens per completion


def reward(token_ids):
    return float(np.mean(np.asarray(token_ids) < TARGET))


def rollout(llm, seed):
    \"\"\"Samples a group per prompt; returns the right-padded [B, L] batch (prompt +
    completion), the mask of completion tokens, the sampler's logprobs in the same layout
    (0 elsewhere) and the rewards [B].\"\"\"
    sp = SamplingParams(n=G, temperature=1.0, seed=seed, max_tokens=T, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    L = max(len(o.prompt_token_ids) + T for o in outs)
    tokens, mask, lp, rewards = [], [], [], []
    for o in outs:
        p = list(o.prompt_token_ids)
        for c in o.outputs:
            pad = L - len(p) - len(c.token_ids)
            tokens.append(p + list(c.token_ids) + [0] * pad)
            mask.append([False] * len(p) + [True] * len(c.token_ids) + [False] * pad)
            lp.append(np.concatenate([np.zeros(len(p), np.float32), c.logprobs, np.zeros(pad, np.float32)]))
            rewards.append(reward(c.token_ids))
    return (np.array(tokens, np.int32), np.array(mask), np.stack(lp).astype(np.float32),
            np.array(rewards, np.float32))


tokens, mask, lp_sampler, rewards = rollout(llm, seed=0)
print("batch", tokens.shape, "- completion tokens:", int(mask.sum()), "- mean reward:", rewards.mean())
print("first completion:", tokens[0][mask[0]].tolist())
print("its logprobs:    ", lp_sampler[0][mask[0]])"""),
    md("""## The GRPO loss

Group-relative advantages: each completion's reward minus its group's mean, over the group's
standard deviation. The clipped PPO objective over every completion token, with the ratio
between the trainer's logprobs (differentiated) and the sampler's (constants). On-policy the
ratio is exactly 1 - with bijax literally: `lp_trainer - lp_sampler` is 0.0, not 1e-7.

`bijax.logprobs(model, tokens)` returns float32 `[B, L]` with `out[b, i] = log p(tokens[b, i] |
tokens[b, :i])` (0 at position 0). Right padding needs no `segment_ids`: causal attention never
looks at later tokens, and the mask drops the pad positions. The loss returns the trainer's
logprobs as an auxiliary output, so the check below compares exactly what the gradient used.

(On-policy the loss *value* is ~0 - the ratio is 1 and the advantages of a group sum to zero -
but its gradient, the policy gradient, is not.)"""),
    code("""EPS_CLIP, LR, STEPS = 0.2, 3e-3, 10


def advantages(r):
    g = r.reshape(len(prompts), G)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).reshape(-1)


def grpo_loss(p, tokens, mask, lp_sampler, adv):
    lp = bijax.logprobs(nnx.merge(graphdef, p, rest), tokens, temperature=1.0)  # [B, L] float32
    ratio = jnp.exp(lp - jax.lax.stop_gradient(lp_sampler))
    a = adv[:, None]
    obj = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - EPS_CLIP, 1 + EPS_CLIP) * a)
    m = mask.astype(jnp.float32)
    return -(obj * m).sum() / m.sum(), lp


train_step = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True))
opt = optax.adam(LR)
opt_state = opt.init(params)"""),
    md("""## The loop

Sample, score, check the bits, step, hand the new weights to the engine. At every step the
sampler's and the trainer's logprobs of every completion token are compared as `uint32` bit
patterns; one differing bit fails the notebook."""),
    code("""history = []
t0 = time.perf_counter()
for step in range(STEPS):
    tokens, mask, lp_sampler, rewards = rollout(llm, seed=1000 + step)
    (loss, lp_trainer), grads = train_step(params, tokens, mask, lp_sampler, advantages(rewards))
    lp_trainer = np.asarray(lp_trainer)
    s, t = lp_sampler[mask], lp_trainer[mask]
    gap = float(np.abs(s - t).max())
    differ = int((s.view(np.uint32) != t.view(np.uint32)).sum())
    assert differ == 0 and gap == 0.0, f"step {step}: {differ} logprobs differ (max gap {gap})"
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    llm.update_weights(params)  # the engine samples from the new policy next step
    history.append(float(rewards.mean()))
    print(f"step {step}: mean reward {rewards.mean():.3f}  loss {float(loss):+.1e}  "
          f"max |sampler - trainer| = {gap}  ({differ}/{s.size} logprobs differ in bits)")
print(f"{STEPS} steps in {time.perf_counter() - t0:.1f} s")"""),
    code("""fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(range(STEPS), history, "o-")
ax.axhline(TARGET / model.config.vocab_size, color="gray", ls="--", lw=0.8, label="random policy")
ax.set_xlabel("step")
ax.set_ylabel("mean reward")
ax.set_ylim(0, 1.05)
ax.legend()
plt.tight_layout()
plt.show()
assert history[-1] > history[0] + 0.2, history"""),
    md("""## No recompilation

`update_weights` swaps the arrays the compiled steps take as an argument. Count the engine's
compiled step programs before and after another weight update and a generate call: the same."""),
    code("""from bijax.model_runner import num_compiled_steps

before = num_compiled_steps()
llm.update_weights(params)
llm.generate(prompts, SamplingParams(n=G, temperature=1.0, seed=7, max_tokens=T, ignore_eos=True), use_tqdm=False)
after = num_compiled_steps()
print("compiled step programs: before", before, "after", after)
assert before == after"""),
    md("""## Negative control: the same loop on plain XLA ops

`invariant=False` is the same engine and the same trainer function on plain XLA ops (XLA's
dots, dense masked attention, `jax.nn.log_softmax`). The engine computes the rollout in decode
steps of a few rows and prefill chunks; the trainer computes it as one `[16, 17]` batch - on
XLA's path the bits then depend on those shapes. Same weights, same tokens, same temperature.

The control uses a fresh copy of the *untrained* policy (the same seed: the weights step 0
started from). The trained policy above is nearly deterministic - its logprobs are close to 0 -
which leaves the last bits little room to differ; the starting policy is the typical case."""),
    code("""start = models.llama.Llama(models.configs.preset("tiny"), dtype=jnp.float32, seed=0)  # untrained
xla_llm = bijax.LLM(start, invariant=False, **engine_kw)
tokens, mask, lp_sampler, rewards = rollout(xla_llm, seed=2024)
lp_xla = np.asarray(bijax.logprobs(start, tokens, temperature=1.0, invariant=False))
s, t = lp_sampler[mask], lp_xla[mask]
gap = float(np.abs(s - t).max())
differ = int((s.view(np.uint32) != t.view(np.uint32)).sum())
print(f"XLA: max |sampler - trainer| = {gap:.3g}; {differ}/{s.size} logprobs differ in bits")
print(f"     importance ratios on-policy: min {np.exp(t - s).min():.9f}, max {np.exp(t - s).max():.9f}")
assert gap > 0, "the XLA path agreed bit for bit: the control could not tell"
"""),
    md("""## What was shown

* Every step of a GRPO loop, the logprob bijax's engine reported for each sampled token and
  the one the JAX trainer recomputed (inside `jax.jit(jax.value_and_grad(...))`, in a
  different batch layout) were the same float32 bits: the importance ratio was exactly 1, so
  the on-policy step really was on-policy.
* `LLM.update_weights` took the optimizer's new parameters between steps with no
  recompilation, and the policy learned the toy reward.
* With `invariant=False` - the same code on ordinary XLA ops - the sampler and the trainer
  disagree, which is the mismatch RL stacks usually live with.

Nothing here is CPU-specific: the same code runs unchanged on a GPU, where bijax's kernels are
its Pallas GPU kernels (Triton; Mosaic GPU on Hopper) under the same contract - the engine and
`bijax.logprobs` share them, so the agreement is again bit for bit. For a real model, load a
checkpoint into `models.Llama` (or pass a path to `bijax.LLM` and use `llm.model`) and
train its `nnx.Param` state the same way."""),
]
nb = nbf.v4.new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
nbf.write(nb, "notebooks/02_on_policy_rl.ipynb")
