"""OpenAI request bodies -> engine inputs, and engine outputs -> OpenAI response objects.

Every field a body may carry is listed here; anything else, or a value the server cannot honour,
is a `BadRequest` naming the field (HTTP 400 in OpenAI's error schema). Sampling fields map to
SamplingParams (vLLM's extensions top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, include_stop_str_in_output are accepted too)."""
from __future__ import annotations

from ..sampling import SERVER_MAX_TEMPERATURE, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_N = 128
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "include_stop_str_in_output", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n"}
COMMON_FIELDS = SAMPLING_FIELDS | {"model", "max_tokens", "stream", "stream_options", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                               "add_generation_prompt", "chat_template_kwargs", "response_format",
                               "tools", "tool_choice", "parallel_tool_calls"}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_fields(body, allowed: set, route: str) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unsupported field(s) {unknown} for {route}: remove them (supported: "
                         f"{', '.join(sorted(allowed))})", param=unknown[0])


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    if model != served:
        raise BadRequest(f"model {model!r} is not served here: use model={served!r} (GET "
                         f"/v1/models lists it)", param="model", code="model_not_found")


def _stream_flags(body: dict):
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("'stream_options' must be an object with 'include_usage' (a bool)",
                         param="stream_options")
    if opts.get("continuous_usage_stats"):
        raise BadRequest("stream_options.continuous_usage_stats is not supported: leave it out",
                         param="stream_options")
    if not stream:
        raise BadRequest("'stream_options' is only allowed with stream=true",
                         param="stream_options")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise BadRequest("stream_options.include_usage must be true or false",
                         param="stream_options")
    return stream, usage


def _sampling(body: dict, max_tokens, logprobs, default_max_tokens) -> SamplingParams:
    """SamplingParams from the body; server-side ranges first (OpenAI's), then the class's."""
    def get(name, default):
        v = body.get(name)
        return default if v is None else v

    t = get("temperature", 1.0)
    if _is_num(t) and not 0 <= t <= SERVER_MAX_TEMPERATURE:
        raise BadRequest(f"temperature={t!r} is out of range: use a number in [0, "
                         f"{SERVER_MAX_TEMPERATURE:g}]", param="temperature")
    n = get("n", 1)
    if _is_int(n) and not 1 <= n <= MAX_N:
        raise BadRequest(f"n={n!r} is out of range: use an int in [1, {MAX_N}]", param="n")
    stop = get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    stop = [s for s in stop if s]       # OpenAI's clients send "" for "none"
    stop_ids = get("stop_token_ids", [])
    if not isinstance(stop_ids, list):
        raise BadRequest("'stop_token_ids' must be a list of integer token ids",
                         param="stop_token_ids")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest("'logit_bias' must be an object {token id: bias}", param="logit_bias")
        parsed = {}
        for k, v in bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise BadRequest(f"logit_bias key {k!r} is not a token id: use integer token ids "
                                 f"as keys", param="logit_bias") from None
            parsed[tok] = v
        bias = parsed
    top_k = get("top_k", 0)
    try:
        return SamplingParams(
            n=n, temperature=t, top_p=get("top_p", 1.0), top_k=top_k, min_p=get("min_p", 0.0),
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=get("min_tokens", 0), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=get("include_stop_str_in_output", False),
            ignore_eos=get("ignore_eos", False), seed=body.get("seed"), logprobs=logprobs,
            presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0),
            repetition_penalty=get("repetition_penalty", 1.0), logit_bias=bias)
    except (ValueError, TypeError) as e:
        raise params_error(e) from None


def params_error(e: Exception) -> BadRequest:
    """A SamplingParams ValueError ("SamplingParams.FIELD=VALUE is invalid: ...") as a 400
    naming FIELD."""
    msg = str(e)
    field = msg.split("=", 1)[0].removeprefix("SamplingParams.") if \
        msg.startswith("SamplingParams.") else None
    return BadRequest(msg, param=field)


def _max_tokens(body: dict, name: str = "max_tokens"):
    v = body.get(name)
    if v is not None and (not _is_int(v) or v < 1):
        raise BadRequest(f"{name}={v!r} is invalid: use an int >= 1", param=name)
    return v


def parse_completion(body, served: str):
    """-> (prompt, SamplingParams, stream, include_usage, max_tokens given?)"""
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    check_model(body, served)
    if "prompt" not in body:
        raise BadRequest("missing required field 'prompt'", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                       # a batch of one prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("batched prompts are not supported: send one prompt per request "
                         "(n=... for several samples of one)", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("empty prompt: pass at least one character or token", param="prompt")
    elif isinstance(prompt, list):
        if not all(_is_int(t) for t in prompt):
            raise BadRequest("'prompt' must be a string or a list of integer token ids",
                             param="prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of integer token ids", param="prompt")
    for name, ok in (("echo", (None, False)), ("suffix", (None,))):
        if body.get(name) not in ok:
            raise BadRequest(f"'{name}' is not supported: leave it out", param=name)
    if body.get("best_of") not in (None, body.get("n") or 1):
        raise BadRequest("best_of is not supported (only best_of = n): use n", param="best_of")
    lp = body.get("logprobs")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= 20):
        raise BadRequest(f"logprobs={lp!r} is out of range: use an int in [0, 20]",
                         param="logprobs")
    stream, usage = _stream_flags(body)
    mt = _max_tokens(body)
    return prompt, _sampling(body, mt, lp, DEFAULT_COMPLETION_MAX_TOKENS), stream, usage, mt


def chat_messages(body) -> list:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects",
                         param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'",
                             param="messages")
        content = m.get("content")
        if isinstance(content, list):           # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or \
                        not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content: only text parts "
                                     f"({{'type': 'text', 'text': ...}}) are supported",
                                     param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                             param="messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise BadRequest(f"messages[{i}] has unsupported keys {sorted(extra)} (tool calls "
                             f"are not supported): send role, content and name only",
                             param="messages")
        out.append({**m, "content": content})
    return out


def parse_chat(body, served: str):
    """-> (messages, SamplingParams, stream, include_usage, max_tokens given?, template kwargs)"""
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    check_model(body, served)
    msgs = chat_messages(body)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) not in (None, [], "none", False):
            raise BadRequest(f"'{name}': tool calls are not supported: leave it out", param=name)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise BadRequest("response_format: only {'type': 'text'} is supported", param="response_format")
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise BadRequest("'logprobs' must be true or false", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= 20:
            raise BadRequest(f"top_logprobs={top!r} is out of range: use an int in [0, 20]",
                             param="top_logprobs")
        if not lp:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    gen = body.get("add_generation_prompt", True)
    if not isinstance(gen, bool):
        raise BadRequest("'add_generation_prompt' must be true or false",
                         param="add_generation_prompt")
    stream, usage = _stream_flags(body)
    mt = _max_tokens(body, "max_completion_tokens") or _max_tokens(body)
    return (msgs, _sampling(body, mt, (top or 0) if lp else None, 1 << 30), stream, usage, mt,
            dict(kwargs, add_generation_prompt=gen))


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(out) -> dict:
    done = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": done,
            "total_tokens": len(out.prompt_token_ids) + done}


def _text(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok], skip_special_tokens=False) if tokenizer is not None else str(tok)


def completion_logprobs(tokenizer, tokens: list, lps: list, offset: int) -> dict:
    """OpenAI's completions logprobs object for `tokens` (their Logprob dicts), text offsets
    counted from `offset`."""
    texts = [_text(tokenizer, t) for t in tokens]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts,
            "token_logprobs": [d[t].logprob for t, d in zip(tokens, lps)],
            "top_logprobs": [{_text(tokenizer, k): v.logprob for k, v in d.items()} for d in lps],
            "text_offset": offsets}


def chat_logprobs(tokenizer, tokens: list, lps: list, top: int) -> dict:
    def entry(tok, lp):
        s = _text(tokenizer, tok)
        return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8"))}

    content = []
    for t, d in zip(tokens, lps):
        ranked = sorted((v.rank, k) for k, v in d.items() if v.rank <= top)
        content.append({**entry(t, d[t]), "top_logprobs": [entry(k, d[k]) for _, k in ranked]})
    return {"content": content}
