#!/usr/bin/env python
"""Minimal OpenAI-compatible completions server for dspark: standard library + asyncio only.

    python examples/server.py --model PATH --host 127.0.0.1 --port 8000

Endpoints
  POST /v1/completions   model, prompt (string or token-id list), max_tokens, temperature, top_p,
                         top_k, seed, stop_token_ids, ignore_eos, stream (server-sent events:
                         `data: {...}` chunks, then `data: [DONE]`). Bad input: HTTP 400 with
                         {"error": {"message": ..., "type": "invalid_request_error"}}.
  GET  /metrics          Prometheus text format (speculative decoding, queue, finish reasons).
  GET  /health           200 {"status": "ok"} while the engine loop runs, else 503.

Every response closes its connection (HTTP/1.1 `Connection: close`); streams end when the
connection closes. A client that disconnects aborts its request. This is an example to embed
or copy, not a production server (no TLS, auth, keep-alive or request batching of prompts).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import sys
import time
import uuid

if importlib.util.find_spec("dspark") is None:   # running from a source checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dspark.async_engine import AsyncEngine, EngineDeadError, EngineError  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}
DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


# ---- request parsing ----------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_completion_request(body: dict):
    """JSON body -> (prompt, SamplingParams, stream, include_usage). Raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "prompt" not in body:
        raise BadRequest("missing required field 'prompt'", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and (
            isinstance(prompt[0], str) or isinstance(prompt[0], list)):
        prompt = prompt[0]                       # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("empty prompt: pass at least one character or token", param="prompt")
    elif isinstance(prompt, list):
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest("batched prompts are not supported: send one prompt per request",
                             param="prompt")
        if not all(_is_int(t) for t in prompt):
            raise BadRequest("'prompt' must be a string or a list of integer token ids",
                             param="prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of integer token ids", param="prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise BadRequest("only n=1 is supported", param="n")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of is not supported", param="best_of")
    if body.get("stop"):
        raise BadRequest("'stop' strings are not supported; use 'stop_token_ids'", param="stop")
    if body.get("logprobs") is not None:
        raise BadRequest("logprobs are not supported", param="logprobs")
    if body.get("echo"):
        raise BadRequest("echo is not supported", param="echo")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    include_usage = bool(opts.get("include_usage", False))

    def get(name, default):
        v = body.get(name)
        return default if v is None else v

    top_k = get("top_k", 0)
    if _is_int(top_k) and top_k == -1:           # vLLM's spelling of "off"
        top_k = 0
    stop_ids = get("stop_token_ids", [])
    if not isinstance(stop_ids, list):
        raise BadRequest("'stop_token_ids' must be a list of integer token ids",
                         param="stop_token_ids")
    try:
        params = SamplingParams(temperature=get("temperature", 1.0), top_p=get("top_p", 1.0),
                                top_k=top_k, max_tokens=get("max_tokens", DEFAULT_MAX_TOKENS),
                                stop_token_ids=tuple(stop_ids), seed=body.get("seed"),
                                ignore_eos=get("ignore_eos", False))
        params.validate()     # ranges and types; the engine re-checks ids against its vocabulary
    except (ValueError, TypeError) as e:
        field = str(e).split("=", 1)[0].removeprefix("SamplingParams.") if "=" in str(e) else None
        raise BadRequest(str(e), param=field) from None
    return prompt, params, stream, include_usage


# ---- metrics ------------------------------------------------------------------------------------

def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "NaN"
        return repr(v) if v not in (float("inf"), float("-inf")) else ("+Inf" if v > 0 else "-Inf")
    return str(int(v))


def render_metrics(stats: dict, model_name: str) -> str:
    """AsyncEngine.stats() -> Prometheus text exposition format 0.0.4."""
    lab = f'model_name="{_escape(model_name)}"'
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            ls = ",".join(x for x in (lab, labels) if x)
            lines.append(f"{name}{suffix}{{{ls}}} {_fmt(value)}")

    spec = stats["spec"]
    reasons = dict(stats["requests_total"])
    for r in ("stop", "length", "abort", "error"):
        reasons.setdefault(r, 0)
    metric("dspark_requests_total", "counter", "Finished requests by finish reason.",
           [("", f'finish_reason="{_escape(r)}"', c) for r, c in sorted(reasons.items())])
    metric("dspark_engine_up", "gauge", "1 while the engine loop is serving.",
           [("", "", 1 if stats["running"] else 0)])
    metric("dspark_queue_depth", "gauge", "Requests submitted but not yet fully prefilled.",
           [("", "", stats["queue_depth"])])
    metric("dspark_running_requests", "gauge", "Requests decoding (drafting and verifying).",
           [("", "", stats["running_requests"])])
    metric("dspark_active_requests", "gauge", "Requests submitted and not finished.",
           [("", "", stats["active_requests"])])
    if stats.get("pages_in_use") is not None:
        metric("dspark_kv_cache_pages_in_use", "gauge", "Paged KV-cache pages in use.",
               [("", "", stats["pages_in_use"])])
        metric("dspark_kv_cache_pages_total", "gauge", "Paged KV-cache pages in the pool.",
               [("", "", stats["pages_total"])])
    cs = stats.get("compile")
    if cs is not None:      # one-time costs (Engine.compile_stats): flat once warmed up
        if isinstance(cs["triton_compiles"], int):
            metric("dspark_triton_compiles_total", "counter", "Triton JIT compiles (process).",
                   [("", "", cs["triton_compiles"])])
        metric("dspark_cuda_graph_captures_total", "counter", "CUDA graphs captured.",
               [("", "", cs["graph_captures"])])
        metric("dspark_eager_fallbacks_total", "counter",
               "Graph-capable steps that ran eagerly, by reason.",
               [("", f'reason="{_escape(r)}"', n) for r, n in sorted(cs["eager_fallbacks"].items())])
    metric("dspark_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
           [("", "", stats["prompt_tokens_total"])])
    metric("dspark_generation_tokens_total", "counter", "Tokens generated by finished requests.",
           [("", "", stats["generation_tokens_total"])])
    metric("dspark_engine_steps_total", "counter", "Engine steps (DSpark rounds) run.",
           [("", "", stats["steps_total"])])
    metric("dspark_engine_step_errors_total", "counter", "Engine steps that raised.",
           [("", "", stats["step_errors_total"])])
    metric("dspark_spec_rounds_total", "counter",
           "Speculative rounds of finished requests (one per request per step).",
           [("", "", spec.rounds)])
    metric("dspark_spec_draft_tokens_total", "counter",
           "Draft tokens of finished requests: proposed (drafted), verified (sent to the target), "
           "accepted.",
           [("", f'kind="{k}"', getattr(spec, k)) for k in ("proposed", "verified", "accepted")])
    metric("dspark_spec_emitted_tokens_total", "counter",
           "Tokens emitted by speculative rounds (accepted drafts + bonus/corrected tokens).",
           [("", "", spec.emitted)])
    metric("dspark_spec_acceptance_rate", "gauge", "Accepted / verified draft tokens.",
           [("", "", float(spec.acceptance_rate))])
    metric("dspark_spec_mean_accepted_length", "gauge",
           "Mean accepted length: tokens emitted per speculative round, bonus included.",
           [("", "", float(spec.mean_accepted_length))])
    hist = list(spec.tau_hist)                    # hist[t] = rounds that emitted t tokens
    samples, cum = [], 0
    for t in range(max(len(hist), stats["gamma"] + 2)):
        cum += hist[t] if t < len(hist) else 0
        samples.append(("_bucket", f'le="{t}"', cum))
    samples += [("_bucket", 'le="+Inf"', spec.rounds), ("_sum", "", spec.emitted),
                ("_count", "", spec.rounds)]
    metric("dspark_spec_accepted_length", "histogram",
           "Tokens emitted per speculative round (accepted length).", samples)
    metric("dspark_spec_verify_budget_mean", "gauge",
           "Draft tokens verified per speculative round (the verify budget), all requests.",
           [("", "", spec.verified / spec.rounds if spec.rounds else 0.0)])
    vb = stats["verify_budget"]
    samples, cum = [], 0
    for le, c in zip(vb["le"], vb["buckets"]):
        cum += c
        samples.append(("_bucket", f'le="{_fmt(float(le))}"', cum))
    samples += [("_bucket", 'le="+Inf"', vb["count"]), ("_sum", "", float(vb["sum"])),
                ("_count", "", vb["count"])]
    metric("dspark_spec_verify_budget_per_request", "histogram",
           "Per finished request: mean draft tokens verified per round.", samples)
    return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# ---- HTTP ---------------------------------------------------------------------------------------

class CompletionServer:
    """The HTTP front end over an AsyncEngine. `await start(host, port)` binds (port 0 picks a
    free one) and returns the bound (host, port); `await stop()` closes it."""

    def __init__(self, engine: AsyncEngine, model_name: str = "dspark", *,
                 max_body_bytes: int = 1 << 20, header_timeout: float = 30.0):
        self.engine, self.model_name = engine, model_name
        self.max_body_bytes, self.header_timeout = max_body_bytes, header_timeout
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set = set()

    async def start(self, host: str = "127.0.0.1", port: int = 8000):
        self.engine.start()
        self._server = await asyncio.start_server(self._handle, host, port, limit=64 * 1024)
        return self._server.sockets[0].getsockname()[:2]

    async def stop(self) -> None:
        """Stop listening and end open connections (their requests are aborted)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    # -- connection handling --
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass

    async def _serve_one(self, reader, writer):
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout)
        except asyncio.TimeoutError:
            return await self._error(writer, 408, "timed out reading the request headers")
        except asyncio.LimitOverrunError:
            return await self._error(writer, 431, "request headers too large")
        except asyncio.IncompleteReadError:
            return
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, _version = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
        except ValueError:
            return await self._error(writer, 400, "malformed HTTP request")
        path = target.split("?", 1)[0]
        if path == "/health":
            if method != "GET":
                return await self._error(writer, 405, "use GET /health")
            ok = self.engine.running
            body = {"status": "ok"} if ok else {"status": "error",
                                                "error": self.engine.stats()["error"]}
            return await self._json(writer, 200 if ok else 503, body)
        if path == "/metrics":
            if method != "GET":
                return await self._error(writer, 405, "use GET /metrics")
            text = render_metrics(self.engine.stats(), self.model_name)
            return await self._send(writer, 200, text.encode(),
                                    "text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/models" and method == "GET":
            return await self._json(writer, 200, {"object": "list", "data": [
                {"id": self.model_name, "object": "model", "owned_by": "dspark"}]})
        if path != "/v1/completions":
            return await self._error(writer, 404, f"no route for {path}")
        if method != "POST":
            return await self._error(writer, 405, "use POST /v1/completions")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return await self._error(writer, 400, "chunked request bodies are not supported; "
                                                  "send Content-Length")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            return await self._error(writer, 400, "bad Content-Length")
        if length < 0:
            return await self._error(writer, 400, "bad Content-Length")
        if length > self.max_body_bytes:
            return await self._error(writer, 413, f"body over {self.max_body_bytes} bytes")
        try:
            raw = await asyncio.wait_for(reader.readexactly(length), self.header_timeout)
        except asyncio.TimeoutError:
            return await self._error(writer, 408, "timed out reading the request body")
        try:
            body = json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return await self._error(writer, 400, f"invalid JSON body: {e}")
        await self._completions(reader, writer, body)

    async def _completions(self, reader, writer, body):
        try:
            prompt, params, stream, include_usage = parse_completion_request(body)
            rs = await self.engine.add_request(prompt, params)
        except BadRequest as e:
            return await self._error(writer, e.status, str(e), param=e.param)
        except ValueError as e:                      # the engine's own checks
            return await self._error(writer, 400, str(e))
        except EngineDeadError as e:
            return await self._error(writer, 503, str(e), kind="server_error")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        work = asyncio.ensure_future(
            self._stream_body(writer, rs, cid, created, include_usage) if stream
            else self._full_body(writer, rs, cid, created))
        watch = asyncio.ensure_future(_wait_disconnect(reader))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():                  # the client went away (or we are stopping)
                work.cancel()
            watch.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
            rs.close()                           # aborts the request unless it finished

    def _usage(self, out):
        return {"prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(out.token_ids),
                "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}

    async def _full_body(self, writer, rs, cid, created):
        try:
            async for _ in rs:
                pass
        except EngineError as e:
            return await self._error(writer, 500, str(e), kind="server_error")
        except EngineDeadError as e:
            return await self._error(writer, 503, str(e), kind="server_error")
        out = rs.last
        await self._json(writer, 200, {
            "id": cid, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": [{"index": 0, "text": out.text or "", "token_ids": out.token_ids,
                         "logprobs": None, "finish_reason": out.finish_reason}],
            "usage": self._usage(out)})

    async def _stream_body(self, writer, rs, cid, created, include_usage):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n")
        await writer.drain()

        def chunk(choices, **extra):
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": self.model_name, "choices": choices, **extra}

        try:
            async for out in rs:
                if not (out.new_token_ids or out.text_delta or out.finished):
                    continue
                await _sse(writer, chunk([{"index": 0, "text": out.text_delta,
                                           "token_ids": out.new_token_ids, "logprobs": None,
                                           "finish_reason": out.finish_reason}]))
            if include_usage and rs.last is not None:
                await _sse(writer, chunk([], usage=self._usage(rs.last)))
        except (EngineError, EngineDeadError) as e:
            await _sse(writer, {"error": {"message": str(e), "type": "server_error",
                                          "param": None, "code": None}})
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()

    # -- responses --
    async def _send(self, writer, status: int, body: bytes, ctype: str):
        writer.write((f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"
                      f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                      f"Connection: close\r\n\r\n").encode("latin-1") + body)
        await writer.drain()

    async def _json(self, writer, status: int, obj):
        await self._send(writer, status, json.dumps(obj).encode(), "application/json")

    async def _error(self, writer, status: int, message: str, param=None,
                     kind: str = "invalid_request_error"):
        await self._json(writer, status, {"error": {"message": message, "type": kind,
                                                    "param": param, "code": None}})


async def _sse(writer, obj):
    writer.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    await writer.drain()


async def _wait_disconnect(reader: asyncio.StreamReader):
    """Returns when the client closes its side (EOF); extra bytes it sends are ignored."""
    try:
        while await reader.read(4096):
            pass
    except (ConnectionError, OSError):
        pass


# ---- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="OpenAI-compatible /v1/completions server for dspark")
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: the engine's default model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None,
                   help="name reported in responses (default: the checkpoint directory name)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="fp32 | bf16 (default: bf16 on CUDA, else fp32)")
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--speculative", default=None, help="dspark | none (default: from checkpoint)")
    p.add_argument("--verify-policy", default="fixed")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action="store_true",
                   help="compile kernels / capture CUDA graphs for the usual shapes before "
                        "listening (Engine.warmup), so first requests do not pay for them")
    p.add_argument("--draft", default=None,
                   help="separate drafter checkpoint, for targets that take one (e.g. Qwen3)")
    return p


async def serve(args) -> None:
    from dspark.engine import Engine, default_model_path
    path = args.model or default_model_path()
    extra = {"draft": args.draft} if args.draft is not None else {}
    engine = Engine(path, device=args.device, dtype=args.dtype,
                    kv_cache_dtype=args.kv_cache_dtype, speculative=args.speculative,
                    verify_policy=args.verify_policy, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, seed=args.seed, **extra)
    name = args.served_model_name or os.path.basename(os.path.normpath(path))
    if args.warmup:
        rep = engine.warmup(progress=True)
        print(f"warm-up: {rep['requests']} dummy requests in {rep['seconds']:.1f} s", flush=True)
    ae = AsyncEngine(engine).start()
    server = CompletionServer(ae, name)
    host, port = await server.start(args.host, args.port)
    print(f"dspark server listening on http://{host}:{port} (model {name})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):   # e.g. Windows
            pass
    try:
        await stop.wait()
    finally:
        await server.stop()
        await ae.shutdown()
        print("dspark server stopped", flush=True)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
