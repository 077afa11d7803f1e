"""``bijax`` command line: ``generate``, ``check``, ``bench``, ``serve``.

Text and JSON go to stdout; progress bars and status lines to stderr. Bad input exits with
status 2 and a one-line error; ``check`` exits 1 when any dimension's bits differ (or, with
``--against FILE``, when the recorded digest suite's bits differ). One module per command
(``generate``, ``check``, ``bench``, ``serve``: its flags and its ``run``); ``common`` holds the engine
and sampling flags they share.
"""

from __future__ import annotations

import argparse
import sys

from bijax.cli import bench, check, generate, serve


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a bad choice, a bad value) in one line, as every
    other bad input: ``bijax generate: error: ...`` and where the usage is (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bijax", description="Batch-invariant LLM inference for JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in (generate, check, bench, serve):
        command.add_parser(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's parser (its usage is the one to read), or bijax's
        given = sys.argv[1:] if argv is None else list(argv)
        before = given[: given.index(args.command)] if args.command in given else []
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        owner = parser if any(u in before for u in unknown) else commands.choices[args.command]
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    least = {"requests": 2}  # (the check suite compares a request alone with it among others)
    for name in ("requests", "num_prompts", "input_len", "output_len", "repeats", "max_tokens"):
        v, low = getattr(args, name, None), least.get(name, 1)
        if v is not None and v < low:
            print(f"bijax: error: --{name.replace('_', '-')} must be >= {low}, got {v}", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"bijax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
