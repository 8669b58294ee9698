#!/usr/bin/env python
"""Embedding dspark in your own server: one AsyncEngine shared by your own routes and by the
OpenAI-compatible routes of `dspark.serve` (/v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics). The stock server is `python -m dspark.serve MODEL`; start from this file
when you need routes, auth or middleware of your own.

    python examples/server.py [MODEL] --port 8000
    curl -N localhost:8000/generate -d '{"prompt": "def fib(n):", "max_tokens": 32}'
    # OpenAI clients: base_url="http://localhost:8000/v1"
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

from fastapi import Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from dspark import Engine, SamplingParams  # noqa: E402
from dspark.async_engine import AsyncEngine  # noqa: E402
from dspark.heap import freeze_heap  # noqa: E402
from dspark.serve import build_app  # noqa: E402


def make_app(engine: AsyncEngine, name: str):
    app = build_app(engine, name)          # the OpenAI routes, /health, /metrics

    @app.post("/generate")
    async def generate(request: Request):
        """Plain-text streaming of one prompt: {"prompt": ..., "max_tokens": ..., "temperature": ...}"""
        body = await request.json()
        try:                               # bad input -> 400 with the engine's own message
            params = SamplingParams(max_tokens=body.get("max_tokens", 64),
                                    temperature=body.get("temperature", 0.0))
            stream = await engine.add_request(body.get("prompt"), params)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)

        async def text():
            async with stream:             # leaving early (client gone) aborts the request
                async for out in stream:
                    yield out.text_delta

        return StreamingResponse(text(), media_type="text/plain; charset=utf-8")

    return app


def main(argv=None):
    import uvicorn
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: shipped)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    base = Engine(args.model, device=args.device)
    freeze_heap()          # the engine lives as long as the server: no collector pause over it
    engine = AsyncEngine(base)
    name = os.path.basename(os.path.normpath(args.model)) if args.model else "default"
    from dspark.serve.http import config       # uvicorn that also serves half-closed clients
    uvicorn.Server(config(make_app(engine, name), host=args.host, port=args.port,
                          log_level="warning")).run()
    engine.close()


if __name__ == "__main__":
    main()
