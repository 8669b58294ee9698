"""dspark.train: the batched training forwards reproduce the reference decoder / drafter (fp32,
CPU), checkpoints round-trip through the official layout, and the training / evaluation
entry points run end to end at tiny sizes."""
import json
import os

import pytest
import torch

from dspark.models.deepseek_v4.model import Batch, DeepseekV4Model
from dspark.models.deepseek_v4.weights import tensor_inventory
from dspark.models.drafter import DraftState, DSparkDrafter
from dspark.tools.make_checkpoint import generate_tensor
from dspark.train import forward as tf
from dspark.train.common import (QATQuant, build_drafter, init_drafter, init_target, load_models,
                                 make_config, save_checkpoint)

L = 40          # crosses CSA (4) / HCA (16) boundaries, SWA eviction (8) and top-k (4) selection


def _random_models(cfg, seed=0, markov=True):
    """Reference-style random weights (spec §9 init via make_checkpoint.generate_tensor)."""
    weights = {}
    for name, spec in tensor_inventory(cfg).items():
        weights.update(generate_tensor(name, spec, cfg, seed))
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    model = DeepseekV4Model(cfg)
    model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")})
    drafter = build_drafter(cfg, markov)
    sd = {DSparkDrafter.param_name(k): v for k, v in weights.items() if k.startswith("mtp.")}
    if not markov:
        sd = {k: (v[:, :0] if k.startswith("markov") else v) for k, v in sd.items()}
        sd["confidence.weight"] = sd["confidence.weight"][:, :cfg.hidden_size]
    drafter.load_state_dict(sd)
    return model.eval(), drafter.eval()


def _tokens(cfg, B, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, cfg.vocab_size, (B, n), generator=g)


def _close(ours, ref, rel=1e-4, floor=0.0):
    scale = max(ref.abs().max().item(), floor)
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max |Δ| = {err:.3e} vs scale {scale:.3f}"


def _reference_target(model, toks, quant=None, tap_layers=()):
    state = model.new_state()
    X, taps = model.forward_hidden(Batch.build([(state, 0, toks.tolist())], "cpu"), quant=quant,
                                   tap_layers=tap_layers)
    return model.logits(X), taps


@pytest.mark.parametrize("quant", [None, "qat"])
def test_target_training_forward_equals_reference(quant):
    cfg = make_config("tiny")
    if quant:   # FP4 rounding of the indexer makes score ties common: select every entry here
        cfg = cfg.replace(index_topk=64)
    model, _ = _random_models(cfg, seed=3)
    tokens = _tokens(cfg, 3, L, seed=4)
    q = QATQuant() if quant else None
    with torch.no_grad():
        X, taps, _ = tf.target_forward(model, tokens, quant=q, tap_layers=cfg.dspark_target_layer_ids)
        ours = model.logits(X).view(3, L, -1)
        for b in range(3):
            ref, ref_taps = _reference_target(model, tokens[b], q, cfg.dspark_target_layer_ids)
            _close(ours[b], ref)
            _close(taps.view(3, L, -1)[b], ref_taps)


def test_selection_actually_bites():
    """The tiny config really exercises top-k: some queries see more entries than index_topk."""
    cfg = make_config("tiny")
    assert (L // 4) > cfg.index_topk and L > cfg.sliding_window and L >= 2 * 16


def test_training_forward_has_gradients_everywhere():
    cfg = make_config("tiny")
    model = init_target(DeepseekV4Model(cfg), seed=0)
    tokens = _tokens(cfg, 2, L + 1, seed=5)
    X, _, batch = tf.target_forward(model, tokens[:, :-1], quant=QATQuant(), indexer_aux=True)
    logits = model.logits(X)
    loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
    loss = loss + sum(batch.aux_losses)
    loss.backward()
    assert len(batch.aux_losses) == 2 and all(torch.isfinite(a) for a in batch.aux_losses)
    no_grad = [n for n, p in model.named_parameters()
               if p.grad is None and not n.endswith("gate.bias")]
    assert not no_grad, no_grad
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("markov", [True, False])
def test_drafter_training_forward_equals_reference(markov):
    cfg = make_config("tiny")
    model, drafter = _random_models(cfg, seed=7, markov=markov)
    B, g = 2, cfg.dspark_block_size
    tokens = _tokens(cfg, B, L, seed=8)
    anchors = torch.tensor([[1, 5, 9, 20, L - g - 1], [2, 8, 13, 17, 30]])
    with torch.no_grad():
        _, taps, _ = tf.target_forward(model, tokens, tap_layers=cfg.dspark_target_layer_ids)
        z, conf, h = tf.drafter_forward(drafter, model.embed, model.head, taps, tokens, anchors,
                                        markov=markov)
        for b in range(B):
            _, ref_taps = _reference_target(model, tokens[b], None, cfg.dspark_target_layer_ids)
            for a, P in enumerate(anchors[b].tolist()):
                st = DraftState(cfg.num_dspark_stages, cfg.sliding_window)
                # commit in chunks no larger than the ring (as rounds do): one write of more
                # rows than the ring holds would alias slots inside a single index_put
                for lo in range(0, P, 5):
                    hi = min(P, lo + 5)
                    drafter.commit_context(st, ref_taps[lo:hi], torch.arange(lo, hi))
                hid = drafter.block_hidden(model.embed, tokens[b, P:P + 1], [P], [st])[0]
                base = drafter.base_logits(model.head, hid)
                _close(h[b, a], hid)
                for k in range(g):
                    bias, c = drafter.markov_step(hid[k:k + 1], tokens[b, P + k:P + k + 1])
                    _close(z[b, a, k], (base[k] + bias[0]) if markov else base[k])
                    _close(conf[b, a, k:k + 1], c, floor=1.0)


def test_checkpoint_roundtrip_official_layout(tmp_path):
    cfg = make_config("tiny")
    model = init_target(DeepseekV4Model(cfg), seed=1)
    drafter = init_drafter(build_drafter(cfg), seed=2)
    with torch.no_grad():
        drafter.markov_w2.normal_()
    info = save_checkpoint(str(tmp_path), cfg, model, drafter, shard_bytes=200_000)
    assert info["shards"] > 1
    raw = json.load(open(tmp_path / "config.json"))
    assert raw["compress_ratios"] == list(cfg.compress_ratios) + [0, 0, 0]
    assert raw["dspark_block_size"] == 5 and raw["dspark_noise_token_id"] == 2
    assert raw["dspark_target_layer_ids"] == [1, 2, 3]
    cfg2, m2, d2 = load_models(str(tmp_path))
    assert cfg2 == cfg
    for (n, p), (n2, p2) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert n == n2
        want = p if not p.is_floating_point() or n.endswith(("_fn", "_base", "_scale", "attn_sink",
                                                             ".ape", "gate.bias")) \
            else p.to(torch.bfloat16).float()
        assert torch.equal(want, p2), n
    assert torch.equal(drafter.markov_w2.to(torch.bfloat16).float(), d2.markov_w2)


def test_data_split_and_tokenizer():
    from dspark.train.data import (BOS_ID, EOS_ID, NOISE_ID, PAD_ID, SPECIAL_TOKENS, Corpus,
                                   is_heldout, train_tokenizer)
    assert is_heldout("a/b.py") == is_heldout("a/b.py")
    frac = sum(is_heldout(f"dir/file_{i}.py") for i in range(4000)) / 4000
    assert 0.03 < frac < 0.07
    corpus = Corpus.load(limit_files=60)
    assert corpus.train and all(not is_heldout(r) for r, _ in corpus.train)
    tok = train_tokenizer([t for _, t in corpus.train], vocab_size=400)
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, NOISE_ID, PAD_ID]
    enc = tok.encode("def f(x):\n    return x\n")
    assert enc.ids[0] == BOS_ID
    assert tok.decode(enc.ids) == "def f(x):\n    return x\n"


def _tiny_data_and_target(tmp_path, prompts, steps, batch, eval_tokens):
    """(data dir, target dir) of a few-file corpus and a tiny target trained a few steps."""
    from dspark.train import data as dmod
    from dspark.train import target as ttrain
    d = str(tmp_path / "data")
    dmod.main(["--out", d, "--vocab", "512", "--limit-files", "40", "--prompts", str(prompts)])
    t = str(tmp_path / "target")
    ttrain.main(["--data", d, "--out", t, "--tiny", "--steps", str(steps), "--batch", str(batch),
                 "--seq-len", "48", "--eval-tokens", str(eval_tokens)])
    return d, t


@pytest.mark.slow
def test_pipeline_tiny_end_to_end(tmp_path):
    """data -> target -> drafter (+ablation) -> evaluate, at tiny sizes on CPU."""
    from dspark.train import drafter as dtrain
    from dspark.train import evaluate as ev
    d, t = _tiny_data_and_target(tmp_path, prompts=12, steps=6, batch=4, eval_tokens=2000)
    k = str(tmp_path / "ckpt")
    dtrain.main(["--data", d, "--target", t, "--out", k, "--tiny", "--steps", "4", "--batch", "2",
                 "--seq-len", "48", "--anchors", "6", "--ablation",
                 "--updates-per-batch", "2"])
    res = ev.main(["--ckpt", k, "--data", d, "--max-new", "8", "--max-prompts", "3",
                   "--ablation", os.path.join(k, "ablation.pt"), "--greedy-check", "2",
                   "--no-autocast"])
    for name in ("markov", "no_markov"):
        for mode in ("greedy", "t1"):
            r = res[name][mode]
            assert 1.0 <= r["tau"] <= 6.0
    assert res["markov"]["greedy"]["greedy_check_match"] == 1.0
    assert os.path.exists(os.path.join(k, "config.json"))


def test_sample_anchors_stay_in_range():
    from dspark.train.drafter import sample_anchors
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(3, 64, 100, 5, g, lo=40)
    assert a.shape == (3, 64 - 5 - 1 - 40 + 1)          # capped at the positions that fit
    assert int(a.min()) >= 40 and int(a.max()) <= 64 - 5 - 1
    assert all(len(set(r.tolist())) == a.shape[1] for r in a)
    b = sample_anchors(2, 64, 8, 5, g)
    assert int(b.min()) >= 1 and b.shape == (2, 8)
    with pytest.raises(ValueError, match="no anchor fits"):
        sample_anchors(1, 16, 4, 5, g, lo=12)


@pytest.mark.slow
def test_on_policy_rows_and_ablation_only(tmp_path):
    """sample (DSpark rounds and plain ancestral) -> drafter on sampled rows -> ablation alone."""
    import numpy as np
    from dspark.train import drafter as dtrain
    from dspark.train import sample as smod
    d, t = _tiny_data_and_target(tmp_path, prompts=4, steps=2, batch=2, eval_tokens=500)
    stream = np.load(os.path.join(d, "train.npy"))
    k = str(tmp_path / "ckpt")
    dtrain.main(["--data", d, "--target", t, "--out", k, "--steps", "2", "--batch", "2",
                 "--seq-len", "48", "--anchors", "4"])
    for ckpt, name in ((k, "spec"), (t, "plain")):       # with / without DSpark stages
        out = str(tmp_path / f"rows_{name}.npy")
        smod.main(["--ckpt", ckpt, "--data", d, "--out", out, "--rows", "3", "--prompt-len", "40",
                   "--new", "8", "--batch", "2"])
        rows, meta = smod.load_rows(out)
        assert rows.shape == (3, 48) and meta["prompt_len"] == 40 and meta["rows"] == 3
        assert int(rows.max()) < 512
        for r in rows:       # the prompt is a real window of the train stream
            hits = np.flatnonzero(stream[:len(stream) - 40] == r[0])
            assert any((stream[h:h + 40] == r[:40]).all() for h in hits)
    a = str(tmp_path / "abl")
    log = dtrain.main(["--data", d, "--target", t, "--out", a, "--steps", "2", "--batch", "2",
                       "--seq-len", "48", "--anchors", "4", "--ablation-only",
                       "--sampled", str(tmp_path / "rows_spec.npy"), "--sampled-frac", "1.0"])
    assert list(log["train"]) == ["no_markov"] and log["args"]["sampled_rows"] == 3
    assert os.path.exists(os.path.join(a, "ablation.pt"))
    assert not os.path.exists(os.path.join(a, "config.json"))
    with pytest.raises(ValueError, match="--seq-len"):
        dtrain.main(["--data", d, "--target", t, "--out", a, "--steps", "1", "--batch", "2",
                     "--seq-len", "32", "--sampled", str(tmp_path / "rows_spec.npy")])
    # continuing: --init-from / --init-ablation start from those weights (lr 0: unchanged)
    from dspark.train.common import load_models
    c = str(tmp_path / "cont")
    dtrain.main(["--data", d, "--target", t, "--out", c, "--steps", "1", "--batch", "2",
                 "--seq-len", "48", "--anchors", "4", "--lr", "0", "--ablation", "--init-from", k,
                 "--init-ablation", os.path.join(a, "ablation.pt")])
    before, after = load_models(k)[2].state_dict(), load_models(c)[2].state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    abl_a = torch.load(os.path.join(a, "ablation.pt"))
    abl_c = torch.load(os.path.join(c, "ablation.pt"))
    assert all(torch.equal(abl_a[n], abl_c[n]) for n in abl_a)
    with pytest.raises(RuntimeError, match="markov"):     # shapes differ: named, not silent
        dtrain.main(["--data", d, "--target", t, "--out", c, "--steps", "1", "--batch", "2",
                     "--seq-len", "48", "--anchors", "4", "--markov-rank", "8", "--init-from", k])
