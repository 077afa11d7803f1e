"""``bijax serve``: the OpenAI-compatible HTTP server (uvicorn) over one engine."""

from __future__ import annotations

import argparse
import signal
import time

from bijax.cli.common import engine_args, info, make_llm, sizes, warmup


def add_parser(sub) -> None:
    g = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (all but /health and /metrics)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model name(s) requests may give (default: --model); the first is reported",
    )
    g.add_argument(
        "--max-request-seqs",
        type=int,
        default=4096,
        help="the most sequences (prompts x n) one request may ask for (default 4096); requests are "
        "admitted first come, first served, so a larger one holds up the clients after it",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 << 20,
        help="the largest request body in bytes (default 32 MiB; 413 past it): a body is parsed "
        "before anything else, and a huge one costs every client time",
    )
    g.add_argument("--no-invariant", action="store_true", help="plain XLA ops (batch-variant baseline)")
    g.add_argument(
        "--no-warmup", action="store_true", help="compile buckets on first use instead of up front"
    )
    g.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug")
    )
    engine_args(g)
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from bijax.server import build_app

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {args.port}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.max_request_seqs < 1:
        raise ValueError(f"--max-request-seqs must be >= 1, got {args.max_request_seqs}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    # a port in use or a host with no such address fails now, not after the model has loaded
    # and compiled (port 0 too: the host is checked with an ephemeral port)
    _check_port(args.host, args.port)
    t0 = time.perf_counter()
    s, t = sizes(args, 16)
    llm = make_llm(args, max_num_seqs=s, max_num_batched_tokens=t)
    info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s ({s} seqs / {t} tokens per step)")
    warmup(llm, args, logprobs=False)
    names = args.served_model_name or [str(args.model)]
    app = build_app(
        llm,
        served_model_names=names,
        api_key=args.api_key,
        max_request_seqs=args.max_request_seqs,
        max_request_bytes=args.max_request_bytes,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    _announce_when_started(server, names[0])
    # uvicorn catches Ctrl-C / SIGTERM and stops accepting; the requests in flight are aborted
    # (their responses end with finish_reason "abort"), the engine loop is joined, and uvicorn
    # re-raises the signal to the handler found before it started: this one, so that the
    # command ends with status 0. A response still open after 5 s is cut.
    shutdown = server.shutdown

    async def abort_then_shutdown(sockets=None):  # on the event loop, not in the signal handler
        app.state.abort_all()
        await shutdown(sockets=sockets)

    server.shutdown = abort_then_shutdown
    caught = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    server.run()
    info("bijax serve: stopped" + (f" ({signal.Signals(caught[0]).name})" if caught else ""))
    return 0


def _check_port(host: str, port: int) -> None:
    """ValueError when ``host:port`` cannot be listened on (in use, no such address)."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
            sock.bind(addr)
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def _announce_when_started(server, name: str) -> None:
    """Prints the address (with the port picked for --port 0) once uvicorn listens."""
    startup = server.startup

    async def announce(sockets=None):
        await startup(sockets=sockets)
        for s in server.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                info(f"bijax serve: {name} on http://{host}:{port}/v1 (Ctrl-C stops)")

    server.startup = announce
