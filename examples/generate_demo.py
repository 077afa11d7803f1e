"""Text from the embedded SmolLM2-135M-Instruct, greedy and seeded, and a batched
run that matches the solo runs bit for bit (token ids and float32 logprobs).

The issue the demo shows: serving engines batch requests together, and their kernels change
a request's arithmetic with the batch. bijax's kernels do not, so each prompt's output is the
same alone or sharing a batch with the others.
"""

from __future__ import annotations

import time

import numpy as np

import bijax

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


def main():
    t0 = time.time()
    llm = bijax.LLM("smollm2-135m", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)
    print(f"loaded smollm2-135m in {time.time() - t0:.1f}s (CPU: first runs include compilation)\n")
    chats = [
        {"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": p}])} for p in PROMPTS
    ]
    params = [
        bijax.SamplingParams(temperature=0, max_tokens=40),
        bijax.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=7),
        bijax.SamplingParams(temperature=0.7, top_k=40, max_tokens=40, seed=1234),
    ]
    solo = [llm.generate([c], p, use_tqdm=False)[0] for c, p in zip(chats, params, strict=True)]
    for prompt, p, o in zip(PROMPTS, params, solo, strict=True):
        how = "greedy" if p.temperature == 0 else f"T={p.temperature}, seed={o.seed}"
        print(f"> {prompt}  [{how}]\n{o.text.strip()}\n")
    batched = llm.generate(chats, params, use_tqdm=False)
    print("The same three requests in one batch (continuous batching, mixed prefill/decode steps):")
    all_same = True
    for i, (a, b) in enumerate(zip(solo, batched, strict=True)):
        same = a.token_ids == b.token_ids and np.array_equal(
            a.logprobs.view(np.uint32), b.logprobs.view(np.uint32)
        )
        all_same &= same
        print(
            f"  request {i}: {len(b.token_ids)} tokens, ids and logprob bits {'IDENTICAL' if same else 'DIFFER'} to the solo run"
        )
    print("\nbatched == solo, bit for bit" if all_same else "\nMISMATCH: batched != solo")
    raise SystemExit(0 if all_same else 1)


if __name__ == "__main__":
    main()
