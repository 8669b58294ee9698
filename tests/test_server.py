"""dspark.serve's app under uvicorn in this process (tiny checkpoint): outputs equal the engine's,
400s that name the field, OpenAI's error schema, disconnects abort, engine failures reported,
chunked request bodies, a client that half-closes, /metrics; and examples/server.py's own
route. Clients are stdlib http.client and raw sockets; every wait is bounded."""
import http.client
import importlib.util
import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from dspark import Engine, SamplingParams  # noqa: E402
from dspark.async_engine import AsyncEngine  # noqa: E402
from dspark.serve import build_app  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 30
TEXTS = ["Hello world! Streaming text, one token at a time.", "你好，世界。今天天气很好。",
         "Emoji: 😀🎉👍🏽 🚀✨ done.", "naïve café über — “quotes” ½ ∑"]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint plus a byte-level BPE tokenizer.json (vocab < 1024) so string
    prompts work."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out = tmp_path_factory.mktemp("tiny_tok")
    for name in os.listdir(tiny_ckpt):
        os.symlink(os.path.join(tiny_ckpt, name), out / name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    return str(out)


def _engine(path):
    return Engine(path, device="cpu", dtype="fp32", kv_cache_dtype="fp32", max_model_len=64)


class UvicornThread:
    """An ASGI app under uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app):
        import uvicorn

        from dspark.serve.http import config
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, TIMEOUT)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def server(ckpt):
    eng = _engine(ckpt)
    ae = AsyncEngine(eng)
    srv = UvicornThread(build_app(ae, "tiny"))
    srv.engine, srv.ae = eng, ae
    try:
        yield srv
    finally:
        srv.stop()
        ae.close(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ref(ckpt):
    return _engine(ckpt)


def request(port, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def parse_sse(payload: bytes):
    events = [e for e in payload.decode("utf-8").replace("\r\n", "\n").split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def completion(port, body):
    """POST /v1/completions; returns (status, text, token_ids, finish_reason, n_chunks)."""
    status, ctype, payload = request(port, "POST", "/v1/completions", body)
    if status != 200:
        return status, json.loads(payload), None, None, 0
    if body.get("stream"):
        assert ctype.startswith("text/event-stream")
        chunks = parse_sse(payload)
        usage = [c["usage"] for c in chunks if not c["choices"]]
        chunks = [c for c in chunks if c["choices"]]
        if (body.get("stream_options") or {}).get("include_usage"):
            assert len(usage) == 1
            assert usage[0]["completion_tokens"] == sum(len(c["choices"][0]["token_ids"])
                                                        for c in chunks)
        else:
            assert not usage
        text = "".join(c["choices"][0]["text"] for c in chunks)
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        return status, text, ids, chunks[-1]["choices"][0]["finish_reason"], len(chunks)
    assert ctype.startswith("application/json")
    obj = json.loads(payload)
    assert obj["object"] == "text_completion" and obj["model"] == "tiny"
    ch = obj["choices"][0]
    assert obj["usage"]["completion_tokens"] == len(ch["token_ids"])
    return status, ch["text"], ch["token_ids"], ch["finish_reason"], 1


def metrics(port) -> dict:
    status, ctype, payload = request(port, "GET", "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    out = {}
    for line in payload.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
            out[name] = float(value)
    return out


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_concurrent_burst_matches_engine(server, ref):
    bodies = []
    for i in range(12):
        prompt = TEXTS[i % len(TEXTS)] if i % 3 else [5 + i, 17, 300 + i, 2]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4 + i % 8, "temperature": 0,
                "stream": i % 2 == 0}
        if i % 4 == 1:
            body.update(top_k=-1, top_p=1.0, seed=i, ignore_eos=True)
        if i % 4 == 2:
            body.update(stream_options={"include_usage": True})
        bodies.append(body)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda b: completion(server.port, b), bodies, timeout=4 * TIMEOUT))
    expected = ref.generate([b["prompt"] for b in bodies],
                            [SamplingParams(temperature=0, max_tokens=b["max_tokens"],
                                            ignore_eos=b.get("ignore_eos", False))
                             for b in bodies])
    for body, (status, text, ids, reason, n_chunks), exp in zip(bodies, results, expected):
        assert status == 200, text
        assert ids == exp.token_ids
        assert text == exp.text == ref.tokenizer.decode(exp.token_ids)
        assert reason == exp.finish_reason
        if body["stream"] and len(ids) > 1:
            assert n_chunks >= 2                   # tokens really arrive incrementally
    m = metrics(server.port)
    assert m['dspark_requests_total{finish_reason="length"}'] + \
        m['dspark_requests_total{finish_reason="stop"}'] >= len(bodies)
    assert m['dspark_spec_rounds_total'] > 0
    # one-time costs (Engine.compile_stats) are exported; no CUDA graphs on CPU
    assert m["dspark_cuda_graph_captures_total"] == 0 and "dspark_triton_compiles_total" in m
    assert 0.0 <= m["dspark_spec_acceptance_rate"] <= 1.0
    assert m["dspark_spec_mean_accepted_length"] >= 1.0
    # fixed policy verifies γ drafts, fewer only where a block is clipped to max_tokens
    assert 0 < m["dspark_spec_verify_budget_mean"] <= server.ae.gamma
    assert m['dspark_spec_verify_budget_per_request_count'] >= len(bodies)
    assert m['dspark_spec_accepted_length_bucket{le="+Inf"}'] == m["dspark_spec_rounds_total"]
    assert m["dspark_queue_depth"] == 0 and m["dspark_running_requests"] == 0
    assert m["dspark_engine_up"] == 1
    assert m["dspark_kv_cache_pages_in_use"] == 0
    assert m["dspark_prompt_tokens_total"] > 0 and m["dspark_generation_tokens_total"] > 0


BAD = [
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ({"prompt": [1, 2], "max_tokens": 100}, "max_tokens", "at most 62 can be generated"),
    ({"prompt": [1, 2], "temperature": -0.5}, "temperature", "[0, 2]"),
    ({"prompt": [1, 2], "temperature": 5}, "temperature", "[0, 2]"),
    ({"prompt": [1, 2], "top_p": 1.5}, "top_p", "top_p=1.5"),
    ({"prompt": [1, 2], "top_k": "many"}, "top_k", "top_k='many'"),
    ({"prompt": [1, 2], "n": 0}, "n", "n=0"),
    ({"prompt": [1, 2], "presence_penalty": 9}, "presence_penalty", "[-2, 2]"),
    ({"prompt": [1, 2], "logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"prompt": [1, 2], "logit_bias": {"9999": 1}}, "logit_bias", "[0, 1024)"),
    ({"prompt": [1, 2], "logprobs": 50}, "logprobs", "[0, 20]"),
    ({"prompt": [1, 2], "stop_token_ids": "2"}, "stop_token_ids", "list of integer"),
    ({"prompt": [1, 2], "stop_token_ids": [5000]}, "stop_token_ids", "[0, 1024)"),
    ({"prompt": [1, 2], "stop": 3}, "stop", "string or a list"),
    ({"prompt": [1, 2], "stream": "yes"}, "stream", "true or false"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"prompt": [1, 2], "echo": True}, "echo", "not supported"),
    ({"prompt": [1, 2], "suffix": "x"}, "suffix", "not supported"),
    ({"prompt": [1, 2], "best_of": 3}, "best_of", "best_of"),
    ({"prompt": [1, 2], "frobnicate": 1}, "frobnicate", "unsupported field(s) ['frobnicate']"),
    ({"prompt": [1, 2], "model": "gpt-4"}, "model", "model 'gpt-4' is not served"),
    ({"prompt": []}, "prompt", "empty prompt"),
    ({"prompt": ""}, "prompt", "empty prompt"),
    ({"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
    ({"prompt": list(range(64))}, "prompt", "max_model_len"),
    ({"prompt": [1, 2.5]}, "prompt", "token ids"),
    ({"prompt": [1, True]}, "prompt", "token ids"),
    ({"prompt": "é" * 100_000}, "prompt", "too long"),
    ({"prompt": ["a", "b"]}, "prompt", "batched"),
    ({"prompt": 7}, "prompt", "prompt"),
    ({"max_tokens": 3}, "prompt", "missing required field 'prompt'"),
    ([1, 2, 3], None, "JSON object"),
]


def test_bad_requests_get_400_naming_the_field(server):
    port = server.port
    for body, param, needle in BAD:
        status, err, *_ = completion(port, body)
        assert status == 400, (body, err)
        e = err["error"]
        assert set(e) == {"message", "type", "param", "code"}
        assert e["type"] == "invalid_request_error" and e["param"] == param, (body, e)
        assert needle in e["message"], (needle, e)
    status, _, payload = request(port, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and b"invalid JSON" in payload
    chat = [({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "hi"}],
                                               "tools": [{"type": "function"}]}, "tools"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
            ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
            ({"messages": [{"role": "user", "content": "hi"}], "functions": []}, "functions")]
    for body, param in chat:
        status, _, payload = request(port, "POST", "/v1/chat/completions", body)
        assert status == 400 and json.loads(payload)["error"]["param"] == param, payload
    status, _, payload = request(port, "GET", "/nope")
    assert status == 404 and json.loads(payload)["error"]["message"] == "no route for /nope"
    assert request(port, "GET", "/v1/completions")[0] == 405
    status, _, payload = request(port, "GET", "/health")
    assert status == 200 and json.loads(payload) == {"status": "ok"}
    status, _, payload = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(payload)["data"]] == ["tiny"]
    # still serving normally, nothing left behind
    status, text, ids, reason, _ = completion(port, {"prompt": [3, 4], "max_tokens": 3,
                                                     "temperature": 0, "ignore_eos": True})
    assert status == 200 and len(ids) == 3 and reason == "length"
    assert not server.engine.requests


def _raw(port, head: bytes, body_parts, half_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
            time.sleep(0.01)
        if half_close:
            s.shutdown(socket.SHUT_WR)          # done sending; still reading
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk


def _dechunk(payload: bytes) -> bytes:
    out, rest = b"", payload
    while rest:
        size, rest = rest.split(b"\r\n", 1)
        n = int(size, 16)
        if n == 0:
            return out
        out, rest = out + rest[:n], rest[n + 2:]
    return out


def test_chunked_body_and_half_close(server, ref):
    body = json.dumps({"prompt": TEXTS[0], "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    exp = ref.generate(TEXTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    parts = [body[i:i + 7] for i in range(0, len(body), 7)]
    chunked = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    for half_close in (False, True):
        got = _raw(server.port, head, chunked, half_close)
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        headers, payload = got.split(b"\r\n\r\n", 1)
        if b"transfer-encoding: chunked" in headers.lower():
            payload = _dechunk(payload)
        assert payload, (half_close, got)
        chunks = parse_sse(payload)
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == exp.token_ids
    # a plain Content-Length body from a client that half-closes right after sending
    plain = dict(json.loads(body), stream=False)
    raw = json.dumps(plain).encode()
    got = _raw(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
               b"application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(raw),
               [raw], half_close=True)
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["choices"][0]["token_ids"] == exp.token_ids


def test_client_disconnect_aborts_request(server):
    port, ae = server.port, server.ae
    before = ae.stats()["requests_total"].get("abort", 0)
    body = json.dumps({"prompt": [9, 9, 9], "max_tokens": 40, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:                 # headers and the first event
            chunk = s.recv(4096)
            assert chunk, "server closed early"
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
    # the client is gone: the request must be aborted and all its state freed
    assert wait_for(lambda: ae.stats()["requests_total"].get("abort", 0) > before
                    and ae.num_unfinished() == 0 and not server.engine.requests)
    assert wait_for(lambda: metrics(port)["dspark_active_requests"] == 0)


def test_engine_failure_is_reported_and_server_survives(server, monkeypatch):
    port, real_step = server.port, server.engine.step

    def broken_step():
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(server.engine, "step", broken_step)
    status, err, *_ = completion(port, {"prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 500 and "simulated device fault" in err["error"]["message"]
    assert err["error"]["type"] == "server_error"
    status, _, payload = request(port, "POST", "/v1/completions",
                                 {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
    events = parse_sse(payload)
    assert status == 200 and "simulated device fault" in events[-1]["error"]["message"]
    monkeypatch.setattr(server.engine, "step", real_step)
    status, text, ids, reason, _ = completion(port, {"prompt": [3, 4], "max_tokens": 3,
                                                     "temperature": 0, "ignore_eos": True})
    assert status == 200 and len(ids) == 3
    m = metrics(port)
    assert m["dspark_engine_step_errors_total"] >= 2
    assert m['dspark_requests_total{finish_reason="error"}'] >= 2
    assert request(port, "GET", "/health")[0] == 200


def test_example_embeds_the_engine(ckpt, ref):
    spec = importlib.util.spec_from_file_location("dspark_example_server",
                                                  os.path.join(ROOT, "examples", "server.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ae = AsyncEngine(_engine(ckpt))
    srv = UvicornThread(mod.make_app(ae, "tiny"))
    try:
        status, _, payload = request(srv.port, "POST", "/generate",
                                     {"prompt": TEXTS[1], "max_tokens": 5})
        exp = ref.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=5))
        assert status == 200 and payload.decode() == exp.text
        status, _, payload = request(srv.port, "POST", "/generate", {"prompt": "", "max_tokens": 5})
        assert status == 400 and "empty prompt" in json.loads(payload)["error"]
        assert completion(srv.port, {"prompt": [3, 4], "max_tokens": 2})[0] == 200  # /v1 too
    finally:
        srv.stop()
        ae.close(timeout=TIMEOUT)
