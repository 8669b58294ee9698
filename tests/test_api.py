"""The Python API as vLLM users drive it: SamplingParams checked at construction, prompt inputs,
RequestOutput.outputs[], stop strings (streamed with hold-back), n samples, logprobs from the
target, and the same prompt errors from generate, add_request and AsyncEngine."""
import asyncio

import numpy as np
import pytest
import torch

from dspark import Engine, SamplingParams
from dspark.async_engine import AsyncEngine
from dspark.outputs import TextStream, stop_prefix_len

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def eng():
    """The shipped default model (byte-level BPE tokenizer, DSpark drafter) on CPU."""
    return Engine(device="cpu", max_model_len=256, kv_cache_dtype="fp32")


@pytest.fixture(scope="module")
def off():
    return Engine(device="cpu", max_model_len=256, kv_cache_dtype="fp32", speculative="none")


# ---- SamplingParams ----------------------------------------------------------------------

@pytest.mark.parametrize("kw, field, fix", [
    (dict(n=0), "n", "an int >= 1"), (dict(n=1.5), "n", "an int"),
    (dict(min_p=1.5), "min_p", "[0, 1]"), (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens", "at most max_tokens=4"),
    (dict(stop=[""]), "stop", "non-empty strings"), (dict(stop=[3]), "stop", "strings"),
    (dict(logprobs=-1), "logprobs", "k >= 0"), (dict(logprobs=True), "logprobs", "an int"),
    (dict(prompt_logprobs=1.0), "prompt_logprobs", "an int"),
    (dict(presence_penalty=3), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty", "> 0"),
    (dict(logit_bias={"5": 1.0}), "logit_bias", "token id keys"),
    (dict(logit_bias={5: 200}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias=[1, 2]), "logit_bias", "a dict"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output", "a bool"),
    (dict(temperature=True), "temperature", "0 = greedy"),
])
def test_sampling_params_checked_at_construction(kw, field, fix):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    msg = str(e.value)
    assert f"SamplingParams.{field}=" in msg and fix in msg, msg


def test_sampling_params_normalise_and_vocab_checks():
    p = SamplingParams(stop="\n", top_k=-1, logit_bias={3: -1.0})
    assert p.stop == ("\n",) and p.top_k == 0 and p.adjusts_logits and hash(p) == hash(
        SamplingParams(stop=["\n"], logit_bias={3: -1.0}))
    assert not SamplingParams().adjusts_logits
    assert SamplingParams(temperature=5.0).temperature == 5.0   # the Python API allows > 2
    with pytest.raises(ValueError, match=r"logit_bias=\{600: 1.0\}.*\[0, 512\)"):
        SamplingParams(logit_bias={600: 1.0}).validate(vocab_size=512)


# ---- prompts -----------------------------------------------------------------------------

BAD_PROMPTS = [
    ("", "empty prompt: pass at least one character or token id"),
    ([], "empty prompt"),
    ([True, False], "prompt[0]=True (bool) is not a token id: token ids are ints in [0, 512)"),
    ([1, 2.0], "prompt[1]=2.0 (float) is not a token id"),
    ([1, 512], "outside the vocabulary [0, 512) (first at prompt[1]): use ids of this model's"),
    ([1, -3], "outside the vocabulary"),
    (torch.tensor([1.0, 2.0]), "integer dtype, got torch.float32: convert it with .long()"),
    (torch.ones(2, 3, dtype=torch.long), "must be 1-D, got shape (2, 3)"),
    ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids[1]=2.5"),
    ({"prompt": [1, 2]}, "takes a string, got list: use {'prompt_token_ids': ids}"),
    ({"text": "hi"}, "exactly one of the keys 'prompt'"),
    ("x" * 2_000_000, "prompt is too long: 2000000 bytes cannot fit in max_model_len=256 tokens"),
    ("x" * 20_000, "shorten the prompt or raise Engine(max_model_len=...)"),
]


@pytest.mark.parametrize("prompt, needle", BAD_PROMPTS)
def test_bad_prompts_named_the_same_everywhere(eng, prompt, needle):
    with pytest.raises(ValueError) as e1:
        eng.generate(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError) as e2:
        eng.add_request(prompt, SamplingParams(max_tokens=2))

    async def via_async():
        ae = AsyncEngine(eng)
        try:
            with pytest.raises(ValueError) as e3:
                await ae.add_request(prompt, SamplingParams(max_tokens=2))
            return str(e3.value)
        finally:
            await ae.shutdown()

    msgs = [str(e1.value), str(e2.value), asyncio.run(via_async())]
    assert all(needle in m for m in msgs), msgs
    assert not eng.requests and not eng.has_unfinished()


def test_too_long_string_rejected_before_tokenizing(eng, monkeypatch):
    calls = []
    monkeypatch.setattr(eng.tokenizer, "encode", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="too long"):
        eng.add_request("y" * 5_000_000)
    assert not calls


def test_prompt_forms_agree(eng):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = eng.generate(PROMPT, sp)
    ids = ref.prompt_token_ids
    assert ref.prompt == PROMPT
    for form in (ids, tuple(ids), torch.tensor(ids), np.array(ids), {"prompt": PROMPT},
                 {"prompt_token_ids": ids}):
        out = eng.generate(form, sp)
        assert out.token_ids == ref.token_ids and out.prompt_token_ids == ids
    outs = eng.generate([PROMPT, {"prompt_token_ids": ids}, ids], sp)
    assert [o.token_ids for o in outs] == [ref.token_ids] * 3
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        eng.add_request(PROMPT, {"temperature": 0})


# ---- outputs -----------------------------------------------------------------------------

def test_request_output_shape(eng):
    out = eng.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    (c,) = out.outputs
    assert c.index == 0 and c.token_ids == out.token_ids and c.text == out.text
    assert c.finish_reason == out.finish_reason == "length" and c.stop_reason is None
    assert c.text == eng.tokenizer.decode(c.token_ids) and c.logprobs is None
    assert out.metrics.rounds > 0


def test_eos_ends_output_and_is_not_text(eng):
    """logit_bias forces EOS first: the output is the EOS id, finish "stop", no text; with
    min_tokens the stop ids are masked until then."""
    out = eng.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logit_bias={1: 100}))
    assert out.token_ids == [1] and out.finish_reason == "stop" and out.text == ""
    assert out.stop_reason is None                # EOS, not a user stop
    out = eng.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                              logit_bias={1: 100}))
    assert len(out.token_ids) == 4 and out.token_ids[3] == 1 and 1 not in out.token_ids[:3]
    out = eng.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[1],
                                              logit_bias={1: 100}, ignore_eos=True))
    assert out.token_ids == [1] and out.stop_reason == 1


def test_stop_strings_end_output_and_stream_holds_back(eng):
    free = eng.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = free.text
    stop = text[6:9]                       # a stop string that spans tokens somewhere inside
    assert stop and stop in text
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "never here"])
    out = eng.generate(PROMPT, sp)
    cut = text.index(stop)
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    # ends with the token that completed the stop string
    n = len(out.token_ids)
    assert stop in eng.tokenizer.decode(out.token_ids) and \
        stop not in eng.tokenizer.decode(out.token_ids[:n - 1])
    assert out.token_ids == free.token_ids[:n]
    deltas = [o.text_delta for o in eng.stream(PROMPT, sp)]
    assert "".join(deltas) == out.text
    assert all(stop not in d for d in deltas)
    incl = eng.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                               stop=stop, include_stop_str_in_output=True))
    assert incl.text == text[:cut + len(stop)]


def test_text_stream_hold_back_unit():
    class Chars:                           # a tokenizer whose ids are characters
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    ts = TextStream(Chars(), stop=("END",))
    got = []
    for ch in "abEN":
        ts.push([ord(ch)])
        got.append(ts.take())
    assert got == ["a", "b", "", ""]       # "EN" may start "END": held back
    used, hit = ts.push([ord(c) for c in "Dzz"])
    assert (used, hit) == (1, "END") and ts.take() == "" and ts.text == "ab"
    ts = TextStream(Chars(), stop=("END",))
    ts.push([ord(c) for c in "xEN"])
    assert ts.take() == "x" and ts.flush() == "EN"      # ended: the held-back text is final
    assert stop_prefix_len("abcab", ["abd", "b"]) == 2


def test_n_samples(eng):
    sp = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7, ignore_eos=True)
    out = eng.generate(PROMPT, sp)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    # sample k is the request with seed + k
    for c in out.outputs:
        alone = eng.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=8, seed=7 + c.index,
                                                    ignore_eos=True))
        assert c.token_ids == alone.token_ids and c.text == alone.text
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    rid = eng.add_request(PROMPT, sp)
    assert eng.abort(rid) and not eng.requests and not eng.has_unfinished()


def test_logprobs_are_the_targets(eng, off):
    sp = SamplingParams(temperature=0.9, max_tokens=10, seed=3, logprobs=3, prompt_logprobs=2,
                        ignore_eos=True)
    out = eng.generate(PROMPT, sp)
    ids, toks = out.prompt_token_ids, out.token_ids
    assert eng.speculative == "dspark" and out.metrics.verified > 0
    ref = torch.log_softmax(off.score(ids + toks).double(), -1)     # target-only reference
    lps = out.outputs[0].logprobs
    assert len(lps) == len(toks)
    for j, (tok, d) in enumerate(zip(toks, lps)):
        row = ref[len(ids) - 1 + j]
        assert abs(d[tok].logprob - row[tok].item()) < 1e-3
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(d) and len(d) <= 4
        assert d[tok].decoded_token == eng.tokenizer.decode([tok], skip_special_tokens=False)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        assert abs(plp[p][ids[p]].logprob - ref[p - 1][ids[p]].item()) < 1e-3


def test_prompt_logprobs_with_chunked_prefill(off):
    chunked = Engine(device="cpu", max_model_len=256, kv_cache_dtype="fp32", speculative="none",
                     max_num_batched_tokens=8)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)
    out = chunked.generate(prompt, sp)
    ids = out.prompt_token_ids
    assert len(ids) > 16                           # prefilled over several steps
    ref = torch.log_softmax(off.score(ids).double(), -1)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None and all(len(d) == 1 for d in plp[1:])
    for p in range(1, len(ids)):
        assert abs(plp[p][ids[p]].logprob - ref[p - 1][ids[p]].item()) < 1e-3


def test_defaults_users_expect(tiny_ckpt, tiny_quant_ckpt):
    import re

    import dspark
    from dspark import ModelConfig
    from dspark.build import auto_weight_format
    setup = open(__file__.replace("tests/test_api.py", "setup.py")).read()
    assert re.match(r"^\d+\.\d+\.\d+", dspark.__version__) and "version=VERSION" in setup
    # FP8 / FP4 checkpoints keep their quantized weights where the kernels run (CUDA)
    quant, plain = ModelConfig.from_path(tiny_quant_ckpt), ModelConfig.from_path(tiny_ckpt)
    assert auto_weight_format(quant, "cuda") == "quantized"
    assert auto_weight_format(quant, "cpu") == "bf16"
    assert auto_weight_format(plain, "cuda") == "bf16"
    assert Engine(tiny_quant_ckpt, device="cpu", speculative="none").weight_format == "bf16"
    with pytest.raises(ValueError, match="weight_format='fp4' is not supported: one of 'auto', 'bf16', 'quantized'"):
        Engine(tiny_ckpt, device="cpu", weight_format="fp4")
    with pytest.raises(ValueError, match="looks like a Hugging Face Hub id.*huggingface-cli "
                                         "download deepseek-ai/DeepSeek-V4-Flash"):
        Engine("deepseek-ai/DeepSeek-V4-Flash")
    with pytest.raises(ValueError, match="does not exist: pass the checkpoint directory"):
        Engine("/no/such/checkpoint")


def test_progress_bar_by_default_in_a_terminal(eng, monkeypatch, capsys):
    import sys
    sp = SamplingParams(temperature=0, max_tokens=2)
    eng.generate([PROMPT, PROMPT], sp)
    assert "generate" not in capsys.readouterr().err        # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    eng.generate([PROMPT, PROMPT], sp)
    assert "generate: 100%" in capsys.readouterr().err
    eng.generate(PROMPT, sp)                                 # one prompt: no bar
    assert "generate" not in capsys.readouterr().err
