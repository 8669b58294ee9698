"""Incremental detokenization on a real byte-level BPE tokenizer: streamed deltas concatenate to
the full decode and never show a half-decoded character (U+FFFD) mid-stream."""
import os
import random

import pytest

from dspark import Engine, SamplingParams
from dspark.detok import IncrementalDetokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "Hello world! Streaming text, one token at a time.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트도 잘 나와야 합니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🚀✨ 🇫🇷 done.",
    "naïve café über — “quotes” ½ ∑ ∞ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚",
    "mixed: abc你好😀def한국🎉ghi",
]
# text the tokenizer never saw: merges are partial, so characters split across tokens
UNSEEN = ["新しい絵文字🦄🧪🫠と漢字龍", "😀😀😀 你 好 👍🏿👍🏻", "Ωμέγα ελληνικά ✓ ✗ 🀄"]


def train_bpe(vocab_size: int = 420):
    """Byte-level BPE like DeepSeek's tokenizer (every byte is a token; merges on top)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def byte_token_ids(tok):
    """byte value -> id of its single-byte token (GPT-2 style byte-to-printable-char mapping)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    ids = {b: tok.token_to_id(c) for b, c in chars.items()}
    assert None not in ids.values()
    return ids


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


def stream_text(tok, ids, rng, max_chunk=6):
    """Push ids in random chunks; return (deltas, flush text, cumulative texts after each push)."""
    d = IncrementalDetokenizer(tok)
    deltas, seen, i = [], [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        deltas.append(d.push(ids[i:i + n]))
        seen.append("".join(deltas))
        i += n
    return deltas, d.flush(), seen


def test_real_text_chunked(bpe):
    rng = random.Random(0)
    multi_byte_splits = 0
    for text in CORPUS + UNSEEN:
        ids = bpe.encode(text).ids
        full = bpe.decode(ids)
        assert full == text
        multi_byte_splits += any("\ufffd" in bpe.decode([t]) for t in ids)
        for max_chunk in (1, 2, 3, 6):
            deltas, tail, seen = stream_text(bpe, ids, rng, max_chunk)
            assert "".join(deltas) + tail == full
            assert tail == ""                   # complete text is released before the end
            assert not any("\ufffd" in d for d in deltas)
            assert all(full.startswith(s) for s in seen)
    assert multi_byte_splits >= 3               # the test really splits characters


def test_byte_by_byte_characters(bpe):
    b2id = byte_token_ids(bpe)
    text = "a😀b你€ok𝔘"
    ids = [b2id[b] for b in text.encode("utf-8")]
    assert bpe.decode(ids) == text
    d = IncrementalDetokenizer(bpe)
    out = [d.push([i]) for i in ids]
    # nothing is released until a character's last byte arrives, then exactly that character
    expected = []
    for ch in text:
        n = len(ch.encode("utf-8"))
        expected += [""] * (n - 1) + [ch]
    assert out == expected
    assert d.flush() == ""


def test_complete_text_before_a_partial_character_is_released(bpe):
    b2id = byte_token_ids(bpe)
    emoji = "🎉".encode("utf-8")
    d = IncrementalDetokenizer(bpe)
    # one step brings "ok" plus the first two bytes of an emoji: "ok" is final, the emoji is not
    assert d.push(bpe.encode("ok").ids + [b2id[emoji[0]], b2id[emoji[1]]]) == "ok"
    assert d.push([b2id[emoji[2]]]) == ""
    assert d.push([b2id[emoji[3]]] + bpe.encode("!").ids) == "🎉!"
    # generation ending inside a character: flush releases what decode() gives (U+FFFD)
    assert d.push([b2id[emoji[0]]]) == ""
    assert d.flush() == "\ufffd"


def test_random_token_sequences(bpe):
    """Arbitrary ids (invalid UTF-8 included): the stream still reproduces decode() exactly and
    never ends on a replacement character before generation ends."""
    rng = random.Random(1)
    V = bpe.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(V) for _ in range(rng.randint(1, 40))]
        deltas, tail, seen = stream_text(bpe, ids, rng)
        full = bpe.decode(ids)
        assert "".join(deltas) + tail == full
        assert not any(s.endswith("\ufffd") for s in seen)
        assert all(full.startswith(s) for s in seen)


def test_context_window_is_bounded(bpe):
    """Long generations decode a bounded window per push, not the whole history."""
    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(len(ids))
            return bpe.decode(ids)

    ids = bpe.encode(" ".join(CORPUS) * 3).ids
    d = IncrementalDetokenizer(Counting())
    text = "".join(d.push([t]) for t in ids) + d.flush()
    assert text == bpe.decode(ids)
    assert max(calls) <= 16


def test_engine_stream_text(tiny_ckpt, tmp_path, bpe):
    """End to end: Engine step outputs carry text deltas that add up to decode(token_ids)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in os.listdir(tiny_ckpt):
        os.symlink(os.path.join(tiny_ckpt, name), ckpt / name)
    bpe.save(str(ckpt / "tokenizer.json"))
    eng = Engine(str(ckpt), device="cpu", dtype="fp32", kv_cache_dtype="fp32")
    assert eng.tokenizer is not None and eng.tokenizer.get_vocab_size() <= eng.cfg.vocab_size
    prompts = ["你好😀", "Emoji: 🎉", [5, 6, 7, 8], "naïve"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(len(prompts))]
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    deltas = {i: [] for i in ids}
    finals = {}
    for _ in range(100):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            deltas[out.request_id].append(out.text_delta)
            if out.finished:
                finals[out.request_id] = out
            else:
                assert not "".join(deltas[out.request_id]).endswith("\ufffd")
    assert set(finals) == set(ids)
    for rid, out in finals.items():
        assert "".join(deltas[rid]) == out.text == eng.tokenizer.decode(out.token_ids)
        assert len(out.token_ids) == 12
    # the streaming generator gives the same text as generate
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    streamed = list(eng.stream("你好", sp))
    assert "".join(o.text_delta for o in streamed) == eng.generate("你好", sp).text
    assert not eng.requests and not eng.has_unfinished()
