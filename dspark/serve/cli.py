"""`python -m dspark.serve [MODEL] [options]`: load a checkpoint, serve it over HTTP (uvicorn).

Prints `dspark server listening on http://HOST:PORT (model NAME)` once it accepts connections
(--port 0 picks a free port, and the line says which); SIGINT / SIGTERM stop it."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys


def build_parser(prog: str = "python -m dspark.serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for dspark "
                                "(/v1/completions, /v1/chat/completions, /v1/models, /metrics)")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (default: the shipped model)")
    p.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the directory's name)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="fp32 | bf16 (default: bf16 on CUDA, else fp32)")
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--weight-format", default="auto", help="auto | bf16 | quantized")
    p.add_argument("--speculative", default=None, help="dspark | none (default: from checkpoint)")
    p.add_argument("--verify-policy", default="fixed")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft", default=None,
                   help="separate drafter checkpoint, for targets that take one (e.g. Qwen3)")
    p.add_argument("--warmup", action="store_true",
                   help="compile kernels / capture CUDA graphs before listening (Engine.warmup)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return p


def _missing_serve_extra() -> str | None:
    import importlib.util
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "jinja2")
               if importlib.util.find_spec(m) is None]
    if missing:
        return (f"dspark serve needs {', '.join(missing)}: pip install 'dspark[serve]' "
                f"(fastapi, uvicorn, prometheus_client, jinja2)")
    return None


def main(argv=None, prog: str = "python -m dspark.serve") -> None:
    args = build_parser(prog).parse_args(argv)
    problem = _missing_serve_extra()
    if problem:
        sys.exit(problem)
    import uvicorn

    from ..async_engine import AsyncEngine
    from ..engine import Engine, default_model_path
    from ..heap import freeze_heap
    from .app import build_app
    from .http import config

    path = args.model_opt or args.model or default_model_path()
    extra = {"draft": args.draft} if args.draft is not None else {}
    try:
        engine = Engine(path, device=args.device, dtype=args.dtype,
                        kv_cache_dtype=args.kv_cache_dtype, weight_format=args.weight_format,
                        speculative=args.speculative, verify_policy=args.verify_policy,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, seed=args.seed, **extra)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"dspark serve: {e}")
    name = args.served_model_name or os.path.basename(os.path.normpath(path))
    if args.warmup:
        rep = engine.warmup(progress=True)
        print(f"warm-up: {rep['requests']} dummy requests in {rep['seconds']:.1f} s", flush=True)
    # the engine lives as long as the server: its objects out of the collector's reach, so no
    # full collection over them pauses the rounds (dspark/heap.py)
    freeze_heap()
    ae = AsyncEngine(engine).start()
    app = build_app(ae, name, max_body_bytes=args.max_body_bytes)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(config(app, log_level=args.log_level, timeout_graceful_shutdown=5))

    async def serve():
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            print(f"dspark server listening on http://{host}:{port} (model {name})", flush=True)
        await task

    # uvicorn handles SIGINT / SIGTERM while it serves (a graceful shutdown), then raises the
    # signal again for the handler found before: this one lets the process exit normally
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        ae.close()
        print("dspark server stopped", flush=True)


if __name__ == "__main__":
    main()
