"""The OpenAI-compatible HTTP API over an AsyncEngine, on FastAPI.

    app = build_app(AsyncEngine(Engine(path)).start(), "my-model")

Routes: POST /v1/completions, POST /v1/chat/completions (plain JSON or server-sent events with
`data: [DONE]`, `stream_options.include_usage`), GET /v1/models, GET /health, GET /metrics
(Prometheus). Errors use OpenAI's schema {"error": {"message", "type", "param", "code"}}; bad
input is a 400 naming the field. A client that disconnects aborts its request."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import prompts as _prompts
from ..async_engine import AsyncEngine, EngineDeadError, EngineError
from . import protocol as P


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    return JSONResponse(P.error_body(message, kind, param, code), status_code=status)


def _bad(e: P.BadRequest):
    return _error(e.status, str(e), param=e.param, code=e.code)


def build_app(engine: AsyncEngine, model_name: str = "dspark", *,
              max_body_bytes: int = 1 << 20) -> FastAPI:
    """A FastAPI app serving `engine` (started here if it is not) under `model_name`."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from .metrics import registry

    engine.start()
    eng = engine.engine
    tok = eng.tokenizer
    reg = registry(engine, model_name)
    app = FastAPI(title="dspark", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.model_name = engine, model_name

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        msg = {404: f"no route for {request.url.path}",
               405: f"method {request.method} is not allowed for {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return _error(exc.status_code, msg, kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return _error(400, str(exc))

    @app.get("/health")
    async def health():
        if engine.running:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "error": engine.stats()["error"]}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "dspark",
                                            "max_model_len": eng.max_model_len}]}

    async def read_json(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise P.BadRequest(f"request body over {max_body_bytes} bytes", status=413)
        raw = bytearray()
        async for chunk in request.stream():      # chunked bodies too
            raw += chunk
            if len(raw) > max_body_bytes:
                raise P.BadRequest(f"request body over {max_body_bytes} bytes", status=413)
        try:
            return json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise P.BadRequest(f"invalid JSON body: {e}") from None

    def prompt_ids(prompt, max_tokens, field: str = "prompt") -> list:
        """Validated ids (the engine's own checks: the same messages as Engine.add_request),
        and max_tokens checked against the room the context leaves."""
        try:
            _, ids = _prompts.parse(prompt, tok, eng.cfg.vocab_size, eng.max_model_len, eng.path)
        except ValueError as e:
            raise P.BadRequest(str(e), param=field) from None
        if len(ids) >= eng.max_model_len:
            raise P.BadRequest(f"the prompt has {len(ids)} tokens but max_model_len is "
                               f"{eng.max_model_len}: shorten the {field}", param=field)
        room = eng.max_model_len - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise P.BadRequest(f"max_tokens={max_tokens} is too large: the prompt has {len(ids)} "
                               f"tokens and max_model_len is {eng.max_model_len}, so at most "
                               f"{room} can be generated; lower max_tokens", param="max_tokens")
        return ids

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await read_json(request)
            prompt, params, stream, usage, mt = P.parse_completion(body, model_name)
            ids = prompt_ids(prompt, mt)
        except P.BadRequest as e:
            return _bad(e)
        return await run(request, ids, params, stream, usage, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await read_json(request)
            msgs, params, stream, usage, mt, kwargs = P.parse_chat(body, model_name)
            if tok is None:
                raise P.BadRequest("this model has no tokenizer: chat needs one", param="messages")
            try:
                text = tok.apply_chat_template(msgs, **kwargs)
            except ValueError as e:
                raise P.BadRequest(str(e), param="messages") from None
            except Exception as e:       # noqa: BLE001 - the template's raise_exception / errors
                raise P.BadRequest(f"the chat template failed on these messages: {e}",
                                   param="messages") from None
            ids = tok.encode(text, add_special_tokens=False).ids
            ids = prompt_ids({"prompt_token_ids": ids}, mt, "messages")
        except P.BadRequest as e:
            return _bad(e)
        return await run(request, ids, params, stream, usage, chat=True)

    async def run(request, ids, params, stream, include_usage, chat: bool):
        try:
            params.validate(eng.cfg.vocab_size)     # token ids against this vocabulary
        except ValueError as e:
            return _bad(P.params_error(e))
        try:
            rs = await engine.add_request({"prompt_token_ids": ids}, params)
        except ValueError as e:
            return _error(400, str(e))
        except EngineDeadError as e:
            return _error(503, str(e), "server_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        fmt = _Formatter(tok, model_name, rid, created, chat, params)
        if stream:
            return StreamingResponse(_sse(rs, fmt, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        work = asyncio.ensure_future(_drain(rs))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():              # the client went away: abort the request
                work.cancel()
            rs.close()
        if work.cancelled():
            return Response(status_code=499)
        try:
            out = work.result()
        except EngineError as e:
            return _error(500, str(e), "server_error")
        except EngineDeadError as e:
            return _error(503, str(e), "server_error")
        return fmt.full(out)

    return app


async def _drain(rs):
    async for _ in rs:
        pass
    return rs.last


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read already: only a disconnect comes)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _sse(rs, fmt, include_usage: bool):
    """Server-sent events of one request; leaving early (client gone) aborts it."""
    try:
        async for out in rs:
            for chunk in fmt.chunks(out):
                yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage and rs.last is not None:
            yield f"data: {json.dumps(fmt.usage_chunk(rs.last))}\n\n"
    except (EngineError, EngineDeadError) as e:
        yield f"data: {json.dumps(P.error_body(str(e), 'server_error'))}\n\n"
    finally:
        rs.close()
    yield "data: [DONE]\n\n"


class _Formatter:
    """RequestOutputs -> OpenAI response objects (text_completion / chat.completion)."""

    def __init__(self, tok, model: str, rid: str, created: int, chat: bool, params):
        self.tok, self.model, self.rid, self.created, self.chat = tok, model, rid, created, chat
        self.top = params.logprobs
        n = params.n
        self.sent_lp, self.sent_chars = [0] * n, [0] * n
        self.started, self.ended = [False] * n, [False] * n

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c, start: int, end: int, offset: int):
        if c.logprobs is None:
            return None
        toks, lps = c.token_ids[start:end], c.logprobs[start:end]
        if self.chat:
            return P.chat_logprobs(self.tok, toks, lps, self.top)
        return P.completion_logprobs(self.tok, toks, lps, offset)

    def full(self, out) -> dict:
        choices = []
        for c in out.outputs:
            lp = self._logprobs(c, 0, len(c.token_ids), 0)
            base = {"index": c.index, "logprobs": lp, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
            if self.chat:
                choices.append({**base, "message": {"role": "assistant", "content": c.text or ""}})
            else:
                choices.append({**base, "text": c.text or "", "token_ids": c.token_ids})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": P.usage(out)}

    def chunks(self, out) -> list:
        got = []
        for c in out.outputs:
            k = c.index
            end_now = c.finish_reason is not None and not self.ended[k]
            if not (c.new_token_ids or c.text_delta or end_now):
                continue
            start = self.sent_lp[k]
            lp = self._logprobs(c, start, start + len(c.new_token_ids), self.sent_chars[k])
            self.sent_lp[k] += len(c.new_token_ids)
            self.sent_chars[k] += len(c.text_delta)
            self.ended[k] = self.ended[k] or end_now
            base = {"index": k, "logprobs": lp,
                    "finish_reason": c.finish_reason if end_now else None}
            if end_now:
                base["stop_reason"] = c.stop_reason
            if self.chat:
                delta = {"content": c.text_delta}
                if not self.started[k]:
                    delta = {"role": "assistant", **delta}
                    self.started[k] = True
                got.append({**self._head("chat.completion.chunk"),
                            "choices": [{**base, "delta": delta}]})
            else:
                got.append({**self._head("text_completion"),
                            "choices": [{**base, "text": c.text_delta,
                                         "token_ids": c.new_token_ids}]})
        return got

    def usage_chunk(self, out) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": P.usage(out)}
