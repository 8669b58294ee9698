"""examples/server.py: OpenAI-style /v1/completions (plain and SSE), errors, /metrics, /health.

The server runs in-process on 127.0.0.1 with an ephemeral port (plus one short command-line
start in a subprocess); clients are stdlib http.client in a few threads. Every wait is bounded."""
import asyncio
import http.client
import importlib.util
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dspark import Engine, SamplingParams
from dspark.async_engine import AsyncEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_PY = os.path.join(ROOT, "examples", "server.py")
TIMEOUT = 30
TEXTS = ["Hello world! Streaming text, one token at a time.", "你好，世界。今天天气很好。",
         "Emoji: 😀🎉👍🏽 🚀✨ done.", "naïve café über — “quotes” ½ ∑"]


def _load_server_module():
    spec = importlib.util.spec_from_file_location("dspark_example_server", SERVER_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


class ServerThread:
    """The example server on its own event loop in a background thread."""

    def __init__(self, mod, engine):
        self.ae = AsyncEngine(engine)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = mod.CompletionServer(self.ae, "tiny")
        self.host, self.port = self.call(self.server.start("127.0.0.1", 0))
        assert self.host == "127.0.0.1"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def stop(self):
        try:
            self.call(self.server.stop())
            self.call(self.ae.shutdown(timeout=TIMEOUT))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(TIMEOUT)
            self.loop.close()


@pytest.fixture(scope="module")
def server(ckpt):
    mod = _load_server_module()
    eng = _engine(ckpt)
    srv = ServerThread(mod, eng)
    srv.engine, srv.mod = eng, mod
    try:
        yield srv
    finally:
        srv.stop()


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
    events = [e for e in payload.decode("utf-8").split("\n\n") if e]
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
            out[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(value)
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
    if server.ae.stats()["pages_total"] is not None:        # paged KV cache present
        assert m["dspark_kv_cache_pages_in_use"] == 0
    assert m["dspark_prompt_tokens_total"] > 0 and m["dspark_generation_tokens_total"] > 0


def test_bad_requests_get_400(server):
    port = server.port
    cases = [
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "temperature": -0.5}, "temperature"),
        ({"prompt": [1, 2], "top_p": 1.5}, "top_p"),
        ({"prompt": [1, 2], "top_k": "many"}, "top_k"),
        ({"prompt": [1, 2], "stop_token_ids": "2"}, "stop_token_ids"),
        ({"prompt": [1, 2], "stop_token_ids": [5000]}, "stop_token_ids"),
        ({"prompt": [1, 2], "stream": "yes"}, "stream"),
        ({"prompt": []}, "empty prompt"),
        ({"prompt": ""}, "empty prompt"),
        ({"prompt": [1, 99999]}, "outside the vocabulary"),
        ({"prompt": list(range(64))}, "max_model_len"),
        ({"prompt": [1, 2.5]}, "token ids"),
        ({"prompt": ["a", "b"]}, "batched"),
        ({"prompt": 7}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": [1, 2], "n": 2}, "n=1"),
        ({"prompt": [1, 2], "stop": ["\n"]}, "stop_token_ids"),
        ([1, 2, 3], "JSON object"),
    ]
    for body, needle in cases:
        status, err, *_ = completion(port, body)
        assert status == 400, (body, err)
        assert err["error"]["type"] == "invalid_request_error"
        assert needle in err["error"]["message"], (needle, err)
    status, _, payload = request(port, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and b"invalid JSON" in payload
    assert request(port, "GET", "/nope")[0] == 404
    assert request(port, "GET", "/v1/completions")[0] == 405
    status, _, payload = request(port, "GET", "/health")
    assert status == 200 and json.loads(payload) == {"status": "ok"}
    # still serving normally
    status, text, ids, reason, _ = completion(port, {"prompt": [3, 4], "max_tokens": 3,
                                                     "temperature": 0, "ignore_eos": True})
    assert status == 200 and len(ids) == 3 and reason == "length"


def test_client_disconnect_aborts_request(server):
    port, ae = server.port, server.ae
    before = ae.stats()["requests_total"].get("abort", 0)
    body = json.dumps({"prompt": [9, 9, 9], "max_tokens": 12, "temperature": 0,
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


def test_command_line_server(ckpt):
    """`python examples/server.py --model PATH --host 127.0.0.1 --port 0` starts, serves, and
    stops on SIGTERM."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, SERVER_PY, "--model", ckpt, "--host", "127.0.0.1", "--port", "0",
         "--device", "cpu", "--dtype", "fp32", "--kv-cache-dtype", "fp32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    try:
        port, log, deadline = None, [], time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(log)
                continue
            log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port, "".join(log)
        status, _, payload = request(port, "GET", "/health")
        assert status == 200
        status, text, ids, reason, n = completion(port, {"prompt": "Hello", "max_tokens": 5,
                                                         "temperature": 0, "stream": True})
        assert status == 200 and 1 <= len(ids) <= 5 and reason in ("stop", "length")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(5)
