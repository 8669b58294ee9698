"""Qwen3 target: parity with transformers, ragged / chunked batches, rollback, strict loading, and
the random-checkpoint tool."""
import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.models.deepseek_v4.model import Batch
from dspark.models.qwen3 import CheckpointError, ConfigError, Qwen3Config, load_qwen3
from dspark.tools.make_qwen3_checkpoint import (draft_config, main, make_qwen3_checkpoint, tap_layers,
                                                target_config, tensor_shapes)


@pytest.fixture(scope="module", params=["tied", "untied"])
def target(tmp_path_factory, request):
    out = str(tmp_path_factory.mktemp(f"q3_{request.param}"))
    make_qwen3_checkpoint(out, "tiny", "target", dtype="fp32", seed=3, tie=request.param == "tied")
    return out


def _hf(path):
    from transformers import Qwen3ForCausalLM
    model, info = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info            # every HF weight came from the file
    return model.eval()


def _ids(n, vocab, seed):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _full(model, ids):
    h, _ = model.forward_hidden(Batch.build([(model.new_state(), 0, ids)], "cpu"))
    return model.logits(h)


@torch.no_grad()
def test_logits_and_taps_match_transformers(target):
    model = load_qwen3(target)
    ids = _ids(40, model.cfg.vocab_size, 0)
    ref = _hf(target)(torch.tensor([ids]), output_hidden_states=True)
    taps_at = (-1, 0, 2, model.cfg.num_hidden_layers - 1)      # the last one is HF's normed entry
    h, taps = model.forward_hidden(Batch.build([(model.new_state(), 0, ids)], "cpu"), tap_layers=taps_at)
    logits, want = model.logits(h), ref.logits[0]
    assert (logits - want).abs().max() <= 1e-4 * want.abs().max()
    hs = torch.cat([ref.hidden_states[i + 1][0] for i in taps_at], -1)
    assert (taps - hs).abs().max() <= 1e-4 * hs.abs().max()
    assert model.cfg.tie_word_embeddings == (model.head.weight is model.embed.weight)


@torch.no_grad()
def test_mixed_chunked_batches_and_rollback_match_full(target):
    model = load_qwen3(target)
    V = model.cfg.vocab_size
    seqs = [_ids(n, V, 10 + n) for n in (23, 9, 31)]
    full = [_full(model, s) for s in seqs]
    # every step, every request feeds a random-size chunk; requests are shuffled inside the batch
    rng, states, done, got = random.Random(1), [model.new_state() for _ in seqs], [0] * 3, [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        order = [r for r in range(3) if done[r] < len(seqs[r])]
        rng.shuffle(order)
        items, lens = [], []
        for r in order:
            n = min(rng.randint(1, 7), len(seqs[r]) - done[r])
            items.append((states[r], done[r], seqs[r][done[r]:done[r] + n]))
            lens.append(n)
        logits = model.logits(model.forward_hidden(Batch.build(items, "cpu"))[0])
        off = 0
        for r, n in zip(order, lens):
            got[r].append(logits[off:off + n])
            done[r] += n
            off += n
    for r in range(3):
        torch.testing.assert_close(torch.cat(got[r]), full[r], atol=1e-5, rtol=1e-5)
    # rollback = rewrite: a rejected verify block at 12..17 leaves garbage K/V, the next forward
    # restarts at 12 and must not see it
    s, st = seqs[2], model.new_state()
    model.forward_hidden(Batch.build([(st, 0, s[:12])], "cpu"))
    model.forward_hidden(Batch.build([(st, 12, _ids(6, V, 99))], "cpu"))
    rest = model.logits(model.forward_hidden(Batch.build([(st, 12, s[12:])], "cpu"))[0])
    torch.testing.assert_close(rest, full[2][12:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_bf16_checkpoint_loads_and_tracks_fp32(tmp_path):
    out = str(tmp_path / "bf16")
    make_qwen3_checkpoint(out, "tiny", "target", dtype="bf16", seed=3)
    lo, hi = load_qwen3(out, dtype=torch.bfloat16), load_qwen3(out, dtype=torch.float32)
    assert lo.embed.weight.dtype == torch.bfloat16 and lo.head.weight is lo.embed.weight
    ids = _ids(20, lo.cfg.vocab_size, 5)
    a, b = _full(lo, ids), _full(hi, ids)
    assert a.dtype == torch.float32 and (a - b).abs().max() < 0.1 * b.abs().max()


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        fn = os.path.join(dst, "model.safetensors")
        t = load_file(fn)
        edit_tensors(t)
        save_file(t, fn)
    if edit_config:
        fn = os.path.join(dst, "config.json")
        with open(fn) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(fn, "w") as f:
            json.dump(cfg, f)
    return dst


def test_strict_loading_errors(target, tmp_path):
    def drop(t):
        del t["model.layers.1.self_attn.k_norm.weight"]

    def extra(t):
        t["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)

    def reshape(t):
        t["model.norm.weight"] = torch.ones(3)

    for i, (edit, msg) in enumerate([(drop, r"missing \['model.layers.1.self_attn.k_norm.weight'\]"),
                                     (extra, "unexpected"), (reshape, r"model.norm.weight: shape \[3\]")]):
        with pytest.raises(CheckpointError, match=msg):
            load_qwen3(_rewrite(target, str(tmp_path / f"t{i}"), edit_tensors=edit))
    for i, (edit, msg) in enumerate([(lambda c: c.update(model_type="qwen3_moe"), "not 'qwen3'"),
                                     (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4}), "yarn"),
                                     (lambda c: c.update(use_sliding_window=True), "sliding"),
                                     (lambda c: c.pop("hidden_size"), "hidden_size"),
                                     (lambda c: c.update(num_attention_heads="four"),
                                      "num_attention_heads = 'four' is not supported: an integer > 0"),
                                     (lambda c: c.update(hidden_size=-192),
                                      "hidden_size = -192 is not supported: a positive integer")]):
        with pytest.raises(ConfigError, match=msg):
            load_qwen3(_rewrite(target, str(tmp_path / f"c{i}"), edit_config=edit))


def test_config_parsing_variants():
    base = target_config("tiny")
    assert Qwen3Config.from_dict(base).rope_theta == 10000.0
    # transformers-5 style rope_parameters and list-valued eos ids
    raw = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, eos_token_id=[7, 3])
    del raw["rope_theta"]
    cfg = Qwen3Config.from_dict(raw)
    assert cfg.rope_theta == 5e5 and cfg.eos_token_id == 7 and cfg.eos_token_ids == (7, 3)


def test_checkpoint_tool_presets(tmp_path):
    t = target_config("4b")
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
            t["head_dim"], t["intermediate_size"], t["vocab_size"], t["rope_theta"],
            t["tie_word_embeddings"]) == (2560, 36, 32, 8, 128, 9728, 151936, 1e6, True)
    d = draft_config("4b")
    assert (d["num_hidden_layers"], d["num_target_layers"], d["block_size"], d["target_layer_ids"],
            d["mask_token_id"], d["markov_rank"], d["architectures"]) == \
        (5, 36, 7, [1, 9, 17, 25, 33], 151669, 256, ["Qwen3DSparkModel"])
    s = tensor_shapes(d, "dspark")
    assert s["fc.weight"] == (2560, 12800) and s["confidence_head.proj.weight"] == (1, 2816)
    assert s["markov_head.markov_w1.weight"] == s["markov_head.markov_w2.weight"] == (151936, 256)
    assert s["layers.4.self_attn.q_proj.weight"] == (4096, 2560) and "layers.5.norm.weight" not in s
    assert tensor_shapes(draft_config("4b", markov_head="rnn"), "dspark")["markov_head.joint_proj.weight"] \
        == (768, 2 * 256 + 2560)
    assert tensor_shapes(draft_config("4b", markov_head="gated"), "dspark")["markov_head.gate_proj.weight"] \
        == (256, 2560 + 256)
    assert "lm_head.weight" not in tensor_shapes(t, "target")
    assert tap_layers(40, 5) == [1, 10, 19, 28, 37]                 # the 14B drafter's ids
    assert draft_config("4b", layers=4)["target_layer_ids"] == [-1, 0, 1, 2]
    # CLI, sharded output with an index, loads back
    out = str(tmp_path / "sharded")
    main(["--preset", "tiny", "--kind", "target", "--layers", "2", "--untied", "--dtype", "fp32",
          "--shard-mb", "0", "--out", out])
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    m = load_qwen3(out)
    assert m.cfg.num_hidden_layers == 2 and m.head.weight is not m.embed.weight
