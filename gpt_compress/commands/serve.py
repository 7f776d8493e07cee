"""`gptc serve`: serve an exported model over an OpenAI-compatible HTTP API (continuous
batching, streaming, Prometheus metrics); see ``gpt_compress/serve``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ..fileio import write_text_atomic
from ._common import add_config_arguments, config_from_args
from .infer import backend_options

# flag -> Serve field
FLAGS = {"backend": "backend", "host": "host", "port": "port", "max_batch": "max_batch", "max_queue": "max_queue",
         "timeout": "request_timeout", "model_name": "model_name", "threads": "threads",
         "grace_period": "grace_period", "step_delay": "step_delay", "speculative_tokens": "speculative_tokens",
         "draft": "draft"}


def add_arguments(parser) -> None:
    add_config_arguments(parser)  # the Serve section: -o Serve.max_batch=8
    parser.add_argument("--model-dir", required=True, help="exported model directory (`gptc export`)")
    parser.add_argument("--backend", choices=("paddle", "onnx"), default=None, help="default: Serve.backend")
    parser.add_argument("--host", default=None, help="address to bind (default Serve.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default Serve.port; 0 picks a free one)")
    parser.add_argument("--max-batch", type=int, default=None, help="sequences decoded together (1: no batching)")
    parser.add_argument("--max-queue", type=int, default=None, help="requests waiting for a slot before 429")
    parser.add_argument("--timeout", type=float, default=None, help="per-request timeout in seconds (0: none)")
    parser.add_argument("--model-name", default=None, help="model id in /v1/models (default: directory name)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of every program (0: defaults)")
    parser.add_argument("--grace-period", type=float, default=None,
                        help="seconds SIGTERM waits for in-flight requests")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="speculative decoding: up to N draft tokens per request and step, checked in one "
                             "verify step (fused Paddle program; default Serve.speculative_tokens; 0: 5 with "
                             "--draft, else off)")
    parser.add_argument("--draft", default=None,
                        help="the draft: 'ngram' (prompt lookup, the default with --speculative-tokens), 'auto' "
                             "(the draft the export's manifest records: gptc pipeline) or an export directory "
                             "with the same tokenizer (default Serve.draft)")
    parser.add_argument("--step-delay", type=float, default=None, help=argparse.SUPPRESS)  # tests and demos only: Serve.step_delay
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $GPTC_API_KEY, see Serve.api_key_env)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the model files")
    parser.add_argument("--tp", type=int, default=1,
                        help="serve a `gptc partition` directory on its N tensor-parallel ranks (N processes; "
                             "the engine on rank 0 drives the others in lock-step)")
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)  # --tp: rank 0's listening line, for the launcher side


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown (the process then dies of it);
        a drained server exits 0 instead."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    return Server


def _paddle_serving_options(options) -> dict:
    """Paddle Inference without oneDNN for prefill and decode: oneDNN builds its kernels per input
    shape, and under continuous batching the shapes change almost every step (rows join and
    leave, prompts have any length): the rebuilds would cost more than they save, while MKL's
    batched decode is as fast as oneDNN's at the server's batch sizes
    (docs/performance.md)."""
    from ..inference.predictor import ProgramOptions, default_options

    options = dict(options or default_options())
    for role in ("prefill", "decode_batched"):
        options[role] = ProgramOptions(**{**options[role].__dict__, "onednn": False})
    return {"options": options, "batched_from": 1 << 30}


def _check_draft(cfg, manifest) -> None:
    """A draft the server cannot load fails before it binds, naming the option."""
    from ..errors import InputError
    from ..inference.manifest import read_manifest

    if cfg.draft in ("", "ngram"):
        return
    if cfg.backend != "paddle":
        raise InputError(f"--draft {cfg.draft} needs --backend paddle (the fused program's slot cache)")
    path = cfg.draft
    if path == "auto":
        recorded = manifest.data.get("draft", {}).get("path")
        if not recorded:
            raise InputError(f"--draft auto: {manifest.path} records no draft (gptc pipeline's draft stage writes "
                             "one); pass an export directory or 'ngram'")
        path = os.path.join(manifest.path, recorded)
    if not os.path.isdir(path):
        raise InputError(f"--draft {cfg.draft}: not found: {path} (give 'ngram', 'auto' or an export directory)")
    read_manifest(path)


def run(args) -> int:
    from ..inference.manifest import read_manifest
    from ..inference.runner import Generator

    cfg = config_from_args(args).serve
    changes = {field: getattr(args, flag) for flag, field in FLAGS.items() if getattr(args, flag) is not None}
    cfg = dataclasses.replace(cfg, **changes)  # __post_init__ checks the result
    if args.tp > 1:
        from ..parallel.launch import launched_world

        if launched_world()[1] == 1:
            return _launch_ranks(args)
        return _serve_rank(args, cfg)
    if os.path.isfile(os.path.join(args.model_dir, "config.json")) and \
            not os.path.isfile(os.path.join(args.model_dir, "manifest.json")):
        from ..errors import ModelDirError

        raise ModelDirError(f"--model-dir {args.model_dir} is a training checkpoint; `gptc serve` serves exported "
                            f"models: make one with `gptc export --model {args.model_dir} --output DIR`")
    manifest = read_manifest(args.model_dir)  # a wrong directory fails now, with the usual message
    _check_draft(cfg, manifest)

    def load():
        return Generator.from_dir(manifest.path, backend=cfg.backend, verify=not args.no_verify, **options)

    # Paddle: the fused program when the export has one (serve/slots.py: one slot per sequence in
    # its in-place cache); the serving options below apply when it falls back to the unfused ones.
    options = backend_options(argparse.Namespace(backend=cfg.backend, threads=cfg.threads, no_fused=False))
    if cfg.backend == "paddle":
        options.update(_paddle_serving_options(options.get("options")))
    return _serve(args, cfg, load, manifest.path)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's bound TCP socket. Created with ``IPPROTO_TCP`` and ``TCP_NODELAY``: asyncio
    turns Nagle's algorithm off only on sockets of that protocol number, and the connections
    accepted from a plain ``socket(AF_INET, SOCK_STREAM)`` (protocol 0) kept it on, so on a
    kept-alive connection every response's second segment waited for the client's delayed ACK:
    about 40 ms a request."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def _serve(args, cfg, load, model_dir: str) -> int:
    """Run the HTTP server over the ``Generator`` that ``load()`` returns until it is stopped."""
    import uvicorn

    from ..serve.app import create_app

    name = cfg.model_name or os.path.basename(model_dir.rstrip(os.sep))
    api_key = args.api_key if args.api_key is not None else os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    fatal: list[str] = []
    server: list[uvicorn.Server] = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        if server:
            server[0].should_exit = True

    app = create_app(load, cfg, name, api_key, on_fatal=on_fatal)
    sock = listening_socket(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="info" if args.access_log else "warning", access_log=args.access_log,
                            timeout_graceful_shutdown=cfg.grace_period, lifespan="on")
    server.append(_server_class()(config))
    line = json.dumps({"event": "listening", "url": f"http://{cfg.host}:{port}", "port": port, "model": name,
                       "backend": cfg.backend, "max_batch": cfg.max_batch, "api_key": bool(api_key),
                       **({"tp": args.tp} if args.tp > 1 else {})})
    print(line, flush=True)
    if args.ready_file:
        write_text_atomic(args.ready_file, line + "\n")
    server[0].run(sockets=[sock])
    if fatal:
        print(f"gptc serve: error: {fatal[0]}", flush=True)
        return 1
    return 0


def _serve_rank(args, cfg) -> int:
    """One launched rank of ``--tp N`` (serve/lockstep.py): rank 0 serves, the others follow it."""
    import paddle.distributed as dist

    from ..inference.manifest import read_tp_manifest
    from ..inference.tensor_parallel import TensorParallelBackend, tp_generator
    from ..parallel.fleet import init_mp
    from ..serve.lockstep import LockstepBackend, follow

    top = read_tp_manifest(args.model_dir)
    if int(top["mp_degree"]) != args.tp:
        from ..config import ConfigError

        raise ConfigError(f"--tp {args.tp}, but {args.model_dir} has {top['mp_degree']} ranks")
    init_mp(args.tp)
    local = TensorParallelBackend(args.model_dir, rank=dist.get_rank(), **({"threads": cfg.threads} if cfg.threads else {}))
    if dist.get_rank() != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains its requests, then releases this one
        follow(local)
        return 0
    backend = LockstepBackend(local)

    def load():
        return tp_generator(args.model_dir, backend)

    try:
        return _serve(args, cfg, load, os.path.abspath(args.model_dir))
    finally:
        backend.stop()


def _launch_ranks(args) -> int:
    """``--tp N`` as the user started it: launch the N ranks, print rank 0's listening line once it
    is up, pass SIGTERM/SIGINT on to the launcher and return its exit status."""
    from ..parallel.launch import launch_command, log_tail

    with tempfile.TemporaryDirectory(prefix="gptc-serve-tp-") as tmp:
        ready, logs = os.path.join(tmp, "ready.json"), os.path.join(tmp, "logs")
        cmd = launch_command(args.tp, [*sys.argv[1:], "--ready-file", ready], log_dir=logs)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        passed: list[int] = []

        def pass_on(sig, frame):
            passed.append(sig)
            proc.send_signal(sig)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, pass_on)
        while not os.path.isfile(ready) and proc.poll() is None:
            time.sleep(0.1)
        if os.path.isfile(ready):
            with open(ready, encoding="utf-8") as f:
                print(f.read().strip(), flush=True)
        code = proc.wait()
        if passed and code == passed[0]:  # the launcher exits with the signal it stopped the ranks for
            code = 0
        if code:
            print(f"gptc serve --tp {args.tp}: the ranks exited with {code}:\n{log_tail(logs)}", file=sys.stderr)
        return code
