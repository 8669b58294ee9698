"""`python -m dspark.serve` (the shipped model, CPU) on 127.0.0.1 with a free port, driven by the
official `openai` client: completions and chat, streamed and not, stop, n=2, logprobs, seed,
usage, and 400s for out-of-range values and unsupported fields. Outputs are checked against the
engine run in this process on the same inputs."""
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from dspark import Engine, SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "default"
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "A function for Fibonacci numbers."}]


@pytest.fixture(scope="module")
def port():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark.serve", "--device", "cpu", "--host", "127.0.0.1",
         "--port", "0", "--max-model-len", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    log, found, deadline = [], None, time.monotonic() + 90
    try:
        while found is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(log)
                continue
            log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+) \(model (\S+)\)", line)
            if m:
                found = int(m.group(1))
                assert m.group(2) == MODEL
        assert found, "".join(log)
        yield found
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(5)


@pytest.fixture(scope="module")
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def ref():
    return Engine(device="cpu", max_model_len=512)


def test_completions(client, ref):
    assert [m.id for m in client.models.list()] == [MODEL]
    exp = ref.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=12))
    r = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12, temperature=0)
    assert r.choices[0].text == exp.text and r.choices[0].finish_reason == exp.finish_reason
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert r.usage.completion_tokens == len(exp.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.text
    assert chunks[-1].usage.completion_tokens == len(exp.token_ids) and not chunks[-1].choices
    # stop strings, streamed and not: the text ends before the stop string
    stop = exp.text[4:7]
    cut = exp.text[:exp.text.index(stop)]
    r = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12,
                                  temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12,
                                  temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in s) == cut


def test_n_seed_logprobs(client, ref):
    kw = dict(model=MODEL, prompt="import os\n", max_tokens=6, temperature=1.0, seed=11)
    r = client.completions.create(n=2, logprobs=2, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    out = ref.generate("import os\n", SamplingParams(temperature=1.0, max_tokens=6, seed=11, n=2,
                                                     logprobs=2))
    for c in r.choices:
        o = out.outputs[c.index]
        assert c.text == o.text
        lp = c.logprobs
        assert lp.tokens == [ref.tokenizer.decode([t], skip_special_tokens=False)
                             for t in o.token_ids]
        assert all(abs(a - d[t].logprob) < 1e-4
                   for a, t, d in zip(lp.token_logprobs, o.token_ids, o.logprobs))
        assert all(len(top) >= 2 for top in lp.top_logprobs)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in out.outputs)
    again = client.completions.create(n=2, **kw)          # seed: reproducible
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    streamed = {0: "", 1: ""}
    for ch in client.completions.create(n=2, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_chat(client, ref):
    exp = ref.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, logprobs=3))
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == exp.text
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    lps = r.choices[0].logprobs.content
    assert len(lps) == len(exp.token_ids) and all(len(x.top_logprobs) == 3 for x in lps)
    for x, tok, d in zip(lps, exp.token_ids, exp.outputs[0].logprobs):
        assert x.token == ref.tokenizer.decode([tok], skip_special_tokens=False)
        assert abs(x.logprob - d[tok].logprob) < 1e-4
    ranked = [x.top_logprobs[0].logprob >= x.logprob - 1e-6 for x in lps]
    assert all(ranked)                        # greedy: the chosen token is the most likely
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == exp.text
    assert body[-1].choices[0].finish_reason == exp.finish_reason
    assert chunks[-1].usage.total_tokens == len(exp.prompt_token_ids) + len(exp.token_ids)


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=2.5), "temperature"), (dict(top_p=0), "top_p"),
    (dict(max_tokens=10 ** 6), "max_tokens"), (dict(n=0), "n"),
    (dict(presence_penalty=5), "presence_penalty"), (dict(model="gpt-4o"), "model"),
    (dict(extra_body={"guided_json": {}}), "guided_json"),
    (dict(extra_body={"logprobs": 99}), "logprobs"),
])
def test_bad_values_are_400s_naming_the_field(client, kw, param):
    args = dict(model=MODEL, prompt="x", max_tokens=3)
    args.update(kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and param in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert e.value.body["param"] == "tools"


def test_command_line_entry_points(capsys):
    from dspark.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "usage: dspark serve" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["sevre"])
    assert "unknown command 'sevre': use `dspark serve" in str(e.value.code)
    hub = subprocess.run([sys.executable, "-m", "dspark.serve", "deepseek-ai/DeepSeek-V4-Flash"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert hub.returncode == 1
    assert "'deepseek-ai/DeepSeek-V4-Flash' is not a local directory" in hub.stderr
    assert "huggingface-cli download deepseek-ai/DeepSeek-V4-Flash --local-dir" in hub.stderr
