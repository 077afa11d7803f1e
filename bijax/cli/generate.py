"""``bijax generate``: text (streamed in request order) or JSON lines with token ids and logprobs."""

from __future__ import annotations

import argparse
import json
import sys
import time

from bijax.cli.common import engine_args, info, make_llm, sampling_args, sizes, warmup


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text (streams to the terminal)")
    g.add_argument("prompt", nargs="*", help="prompts (default: one prompt read from stdin)")
    g.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--json", action="store_true", help="one JSON line per request: token ids, logprobs, text")
    g.add_argument("--no-invariant", action="store_true", help="plain XLA ops (batch-variant baseline)")
    g.add_argument(
        "--no-warmup", action="store_true", help="compile buckets on first use instead of up front"
    )
    sampling_args(g)
    engine_args(g, presets=False)
    g.set_defaults(func=run)


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if not prompts:
        if sys.stdin.isatty():
            raise ValueError("give a prompt argument, or pipe the prompt on stdin")
        text = sys.stdin.read()
        if not text.strip():
            raise ValueError("the prompt read from stdin is empty (or only whitespace)")
        prompts = [text.rstrip("\n")]
    for i, p in enumerate(prompts):
        if not p.strip():
            raise ValueError(f"prompt {i} is empty (or only whitespace)")
    return prompts


def _json_output(out, index: int, prompt: str) -> dict:
    """One request's JSON line; ``prompt``: the text given (a chat's user message: its
    template-rendered ids are in prompt_token_ids)."""
    return {
        "request_id": str(index),
        "prompt": prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "seed": out.seed,
        "outputs": [
            {
                "index": o.index,
                "text": o.text,
                "token_ids": o.token_ids,
                # float32 -> Python float is exact; float32(x) gives the bits back.
                "logprobs": [float(x) for x in o.logprobs],
                "finish_reason": o.finish_reason,
                **({"top_logprobs": o.top_logprobs} if o.top_logprobs is not None else {}),
            }
            for o in out.outputs
        ],
    }


class _Streamer:
    """Prints the requests' text in order: the earliest unfinished one streams live, later
    ones are held and printed (then streamed) when their turn comes."""

    def __init__(self, prompts, headers: bool):
        self.prompts, self.headers = prompts, headers
        self.latest: dict[int, object] = {}
        self.cur, self.shown = 0, 0
        self.headed = -1  # the last request whose header is printed

    def _text(self, out) -> str:
        if len(out.outputs) > 1:  # n > 1: printed whole when finished
            return ""
        return out.outputs[0].text

    def update(self, i: int, out) -> None:
        self.latest[i] = out
        while self.cur in self.latest:
            out = self.latest[self.cur]
            if self.headers and self.headed != self.cur:
                self.headed = self.cur
                sys.stdout.write(f"\n--- [{self.cur}] {self._short(self.prompts[self.cur])}\n")
            text = self._text(out)
            if out.finished:
                if len(out.outputs) > 1:
                    for o in out.outputs:
                        sys.stdout.write(f"[sample {o.index}, seed {out.seed}] {o.text}\n")
                else:
                    sys.stdout.write(text[self.shown :] + "\n")
                sys.stdout.flush()
                self.cur, self.shown = self.cur + 1, 0
                continue
            # (a partial output's text is a prefix of the final one: ``detokenize.partial_text``)
            if len(text) > self.shown:
                sys.stdout.write(text[self.shown :])
                sys.stdout.flush()
                self.shown = len(text)
            break

    @staticmethod
    def _short(p: str) -> str:
        p = " ".join(p.split())
        return p if len(p) <= 70 else p[:67] + "..."


def run(args: argparse.Namespace) -> int:
    from bijax import SamplingParams
    from models.loading import is_preset

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    if is_preset(args.model):  # (before building its weights: llama3-8b's take a while)
        raise ValueError(
            f"--model {args.model} is a preset (random weights, no tokenizer): generate takes text "
            "prompts, so it needs a model with a tokenizer (an embedded model, a .gguf file or a HF "
            "directory); presets run in bijax check and bijax bench"
        )
    if args.logprobs is not None and not args.json:
        raise ValueError("--logprobs needs --json (the text output shows no logprobs)")
    prompts = _prompts(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        n=args.n,
        max_tokens=args.max_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    t0 = time.perf_counter()
    s, t = sizes(args, len(prompts) * args.n)
    llm = make_llm(args, max_num_seqs=s, max_num_batched_tokens=t)
    info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s")
    tok = llm.tokenizer
    if tok is None:
        raise ValueError(f"model {args.model!r} has no tokenizer: text prompts need one")
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        ids = [tok.encode_chat(system + [{"role": "user", "content": p}]) for p in prompts]
        inputs = [{"prompt_token_ids": x} for x in ids]
    else:
        inputs = prompts
    # Prompt tokens of every sequence: the most a step holds here, so the warm-up's bound (a
    # recompute after preemption or a verify step may need more: that bucket compiles then).
    work, lens = 0, []
    for i, p in enumerate(inputs):  # all checked before anything compiles or runs
        try:
            lens.append(len(llm.engine.validate(p, params).token_ids))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        work += lens[-1] * args.n
    if len(lens) == 1 and args.n == 1:  # its steps are known: the prompt's chunks, then 1 token
        chunk = llm.engine.config.max_num_batched_tokens
        full, rest = divmod(lens[0], chunk)
        steps = ([chunk] if full else []) + ([rest] if rest else [])
        if not llm.engine.compiles_in_background:  # (else decoding runs in the prompt's bucket
            steps.append(1)  # while its own compiles: the first token sooner, the same bits)
        warmup(llm, args, logprobs=bool(args.logprobs), step_tokens=steps)
    else:
        warmup(llm, args, logprobs=bool(args.logprobs), max_step_tokens=max(work, s))
    stream = None if args.json else _Streamer(prompts, headers=len(prompts) > 1)

    def on_output(i, out):
        if stream is not None:
            stream.update(i, out)
        if out.finished and args.json:
            print(json.dumps(_json_output(out, i, prompts[i])), flush=True)

    t1 = time.perf_counter()
    results = llm.generate(inputs, params, use_tqdm=False, on_output=on_output)
    n_tokens = sum(len(o.token_ids) for out in results for o in out.outputs)
    dt = time.perf_counter() - t1
    seeds = ", ".join(str(results[i].seed) for i in range(len(prompts)))
    info(f"{n_tokens} tokens in {dt:.2f}s ({n_tokens / dt:.1f} tok/s); seeds: {seeds}")
    pending = llm.engine.pending_upgrades()  # tiered (the GPUs' default): whole forwards compiling
    if pending:
        info(
            f"exiting once the whole-forward compiles in flight finish ({pending} not ready; "
            "what finishes is cached: the next start loads it)"
        )
    return 0
