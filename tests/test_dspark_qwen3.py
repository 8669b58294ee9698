"""Qwen3 DSpark drafter (DeepSpec format): forward vs an independent re-implementation of the
dspark.md §2 formulas, strict loading, and the engine loop (greedy identity, exact sampling law).

The oracle below reads the safetensors and config.json directly and computes in float64; it uses
nothing from dspark. Target taps come from transformers' Qwen3ForCausalLM (`hidden_states[l+1]`).
"""
import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark.spec.accept as accept_mod
from dspark import Engine, SamplingParams
from dspark.models.dspark_qwen3 import load_qwen3_pair
from dspark.models.qwen3 import CheckpointError, ConfigError
from dspark.tools.make_qwen3_checkpoint import make_qwen3_checkpoint

from test_engine import _broken_verify, _chi2_pvalue, _sample_counts, _target_law


def _make_pair(root, name, seed=0, draft_seed=None, vocab=None, tie=None, **draft_kw):
    t, d = os.path.join(root, name, "target"), os.path.join(root, name, "draft")
    make_qwen3_checkpoint(t, "tiny", "target", dtype="fp32", seed=seed, vocab=vocab, tie=tie)
    make_qwen3_checkpoint(d, "tiny", "dspark", dtype="fp32", seed=seed if draft_seed is None else draft_seed,
                          vocab=vocab, tie=tie, **draft_kw)
    return t, d


# ---- independent oracle (float64, spec §2.3-2.6) ------------------------------------------------

def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """NeoX: dims i and i + d/2 rotate together by pos * theta^(-2i/d). x [T, H, d]."""
    d = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


class Oracle:
    def __init__(self, target_dir, draft_dir):
        self.c = json.load(open(os.path.join(draft_dir, "config.json")))
        self.w = {k: v.double() for k, v in load_file(os.path.join(draft_dir, "model.safetensors")).items()}
        tw = load_file(os.path.join(target_dir, "model.safetensors"))
        # embed / lm_head: the drafter's copies when stored, else the target's (tied or not)
        self.embed = self.w.get("embed_tokens.weight", tw["model.embed_tokens.weight"].double())
        self.head = self.w.get("lm_head.weight", tw.get("lm_head.weight", tw["model.embed_tokens.weight"]).double())

    def _heads(self, x, n):
        return x.view(x.shape[0], n, self.c["head_dim"])

    def context(self, taps, pos):
        """Per draft layer (K, V) of committed rows: k_norm + RoPE on W_K c, W_V c (no layer norm)."""
        c, w, L = self.c, self.w, self.c["num_hidden_layers"]
        ctx = _rms(taps.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
        out = []
        for j in range(L):
            p = f"layers.{j}.self_attn."
            k = _rms(self._heads(ctx @ w[p + "k_proj.weight"].T, c["num_key_value_heads"]), w[p + "k_norm.weight"])
            out.append((_rope(k, pos, c["rope_theta"]),
                        self._heads(ctx @ w[p + "v_proj.weight"].T, c["num_key_value_heads"])))
        return out

    def block(self, ctx_kv, anchor, P):
        """Post-norm hidden [γ, H] and base logits [γ, V] of the block at P (bidirectional)."""
        c, w, g = self.c, self.w, self.c["block_size"]
        x = self.embed[torch.tensor([anchor] + [c["mask_token_id"]] * (g - 1))]
        pos = torch.arange(P, P + g)
        nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        for j in range(c["num_hidden_layers"]):
            p = f"layers.{j}."
            u = _rms(x, w[p + "input_layernorm.weight"])
            q = _rope(_rms(self._heads(u @ w[p + "self_attn.q_proj.weight"].T, nq), w[p + "self_attn.q_norm.weight"]),
                      pos, c["rope_theta"])
            k = _rope(_rms(self._heads(u @ w[p + "self_attn.k_proj.weight"].T, nkv), w[p + "self_attn.k_norm.weight"]),
                      pos, c["rope_theta"])
            v = self._heads(u @ w[p + "self_attn.v_proj.weight"].T, nkv)
            K, V = torch.cat([ctx_kv[j][0][:P], k]), torch.cat([ctx_kv[j][1][:P], v])
            o = torch.empty_like(q)
            for h in range(nq):                       # GQA: query head h reads kv head h // (nq/nkv)
                kh = h // (nq // nkv)
                a = torch.softmax(q[:, h] @ K[:, kh].T / c["head_dim"] ** 0.5, -1)   # no mask
                o[:, h] = a @ V[:, kh]
            x = x + o.reshape(g, -1) @ w[p + "self_attn.o_proj.weight"].T
            m = _rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        h = _rms(x, w["norm.weight"])
        return h, h @ self.head.T

    def sequential(self, h, prevs):
        """Markov biases [γ, V] and confidence logits [γ] along a given prev-token path."""
        c, w = self.c, self.w
        W1, W2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
        r = c["markov_rank"]
        s, biases, confs = torch.zeros(r, dtype=torch.float64), [], []
        for k, prev in enumerate(prevs):
            e = W1[prev]
            if c["markov_head_type"] == "vanilla":
                b = W2 @ e
            elif c["markov_head_type"] == "gated":
                gt = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat([h[k], e]) +
                                   w["markov_head.gate_proj.bias"])
                b = W2 @ (gt * e)
            else:
                z = w["markov_head.joint_proj.weight"] @ torch.cat([s, e, h[k]]) + w["markov_head.joint_proj.bias"]
                gt, cand, o = torch.sigmoid(z[:r]), torch.tanh(z[r:2 * r]), z[2 * r:]
                s = gt * s + (1 - gt) * cand
                b = W2 @ torch.tanh(o)
            feat = torch.cat([h[k], e]) if c["confidence_head_with_markov"] else h[k]
            confs.append(w["confidence_head.proj.weight"][0] @ feat + w["confidence_head.proj.bias"][0])
            biases.append(b)
        return torch.stack(biases), torch.stack(confs)


def _hf_taps(target_dir, ids, layer_ids):
    from transformers import Qwen3ForCausalLM
    m = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[0 if i == -1 else i + 1][0] for i in layer_ids], -1)


def _close(a, b, tol=2e-5):
    a, b = a.double(), b.double()
    assert (a - b).abs().max() <= tol * max(1.0, b.abs().max()), (a - b).abs().max()


CASES = {  # name: (make_pair kwargs, drafter keeps its own embed/lm_head copies?)
    "vanilla": (dict(markov_head="vanilla"), False),
    "gated-no-copies-untied": (dict(markov_head="gated", embed_copies=False, tie=False), False),
    "rnn-own-copies": (dict(markov_head="rnn", draft_seed=7), True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_drafter_matches_independent_oracle(case, tmp_path):
    kw, own = CASES[case]
    tdir, ddir = _make_pair(str(tmp_path), case, **kw)
    target, drafter, cfg = load_qwen3_pair(tdir, ddir)
    assert (drafter.embed_tokens is not None) == own and (drafter.lm_head is not None) == own
    oracle, g = Oracle(tdir, ddir), drafter.gamma
    seqs = [[random.Random(s).randrange(cfg.vocab_size) for _ in range(n)] for s, n in ((1, 19), (2, 11))]
    states, Ps, anchors, ctxs = [], [], [], []
    for ids in seqs:
        taps = _hf_taps(tdir, ids, cfg.dspark_target_layer_ids)
        P = len(ids) - 1                            # the last token is the anchor
        st = drafter.new_state()
        # context committed in uneven chunks (prefill chunks, then accepted rows of rounds)
        for a, b in ((0, 5), (5, 6), (6, P)):
            drafter.commit_context(st, taps[a:b], torch.arange(a, b))
        ctx = oracle.context(taps[:P], torch.arange(P))
        for j in range(len(ctx)):
            _close(st.kv.k[j][:P], ctx[j][0]), _close(st.kv.v[j][:P], ctx[j][1])
        states.append(st), Ps.append(P), anchors.append(ids[-1]), ctxs.append(ctx)
    # one batched block for both requests at different positions
    hidden = drafter.block_hidden(target.embed, torch.tensor(anchors), Ps, states)
    base = drafter.base_logits(target.head, hidden)
    prevs = [[anchors[r]] + [(7 * r + 5 * k) % cfg.vocab_size for k in range(1, g)] for r in range(2)]
    steps = [drafter.markov_step(hidden[:, k], torch.tensor([prevs[0][k], prevs[1][k]])) for k in range(g)]
    for r in range(2):
        h_ref, u_ref = oracle.block(ctxs[r], anchors[r], Ps[r])
        _close(hidden[r], h_ref), _close(base[r], u_ref)
        b_ref, c_ref = oracle.sequential(h_ref, prevs[r])
        _close(torch.stack([s[0][r] for s in steps]), b_ref)
        _close(torch.stack([s[1][r] for s in steps]), c_ref)
    if drafter.markov_head.kind == "rnn":            # γ steps per block, then a new block is needed
        with pytest.raises(RuntimeError, match="block_hidden"):
            drafter.markov_step(hidden[:, 0], torch.tensor(anchors))


# ---- loading errors ---------------------------------------------------------------------------------

def _edit(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors:
        t = load_file(os.path.join(dst, "model.safetensors"))
        tensors(t)
        save_file(t, os.path.join(dst, "model.safetensors"))
    if config:
        c = json.load(open(os.path.join(dst, "config.json")))
        config(c)
        json.dump(c, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_pair_loading_errors(tmp_path):
    tdir, ddir = _make_pair(str(tmp_path), "base", markov_head="rnn")
    bad = [(dict(tensors=lambda t: t.pop("markov_head.joint_proj.bias")), CheckpointError,
            r"missing \['markov_head.joint_proj.bias'\]"),
           (dict(tensors=lambda t: t.update({"fc.weight": torch.zeros(64, 64)})), CheckpointError,
            r"fc.weight: shape \[64, 64\]"),
           (dict(config=lambda c: c.update(markov_head_type="vanilla")), CheckpointError, "unexpected"),
           (dict(config=lambda c: c.update(markov_head_type="lstm")), ConfigError, "markov_head_type"),
           (dict(config=lambda c: c.update(target_layer_ids=[2, 1, 3])), ConfigError, "strictly increasing"),
           (dict(config=lambda c: c.update(target_layer_ids=[-1, 1, 4])), ConfigError, r"\[0, 4\)"),
           (dict(config=lambda c: c.update(num_target_layers=36)), ConfigError, "num_target_layers=36"),
           (dict(config=lambda c: c.update(hidden_size=128)), ConfigError, "hidden_size"),
           (dict(config=lambda c: c.update(mask_token_id=10 ** 6)), ConfigError, "mask_token_id"),
           (dict(config=lambda c: c.update(dflash_config={})), ConfigError, "speculators"),
           (dict(config=lambda c: c.pop("block_size")), ConfigError, "block_size")]
    for i, (edit, err, msg) in enumerate(bad):
        with pytest.raises(err, match=msg):
            load_qwen3_pair(tdir, _edit(ddir, str(tmp_path / f"e{i}"), **edit))
    # no confidence tensors: loads, confidence disabled (+inf logits = verify everything)
    nc = _edit(ddir, str(tmp_path / "noconf"), tensors=lambda t: [t.pop(k) for k in list(t)
                                                                  if k.startswith("confidence_head")])
    target, drafter, _ = load_qwen3_pair(tdir, nc)
    h = drafter.block_hidden(target.embed, torch.tensor([3]), [0], [drafter.new_state()])
    assert torch.isinf(drafter.markov_step(h[:, 0], torch.tensor([3]))[1]).all()
    with pytest.raises(ValueError, match="block_size=4"):
        Engine(tdir, draft=ddir, device="cpu", num_speculative_tokens=7)


# ---- engine loop ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab8_pairs(tmp_path_factory):
    """8-token vocabulary: random drafts are accepted often enough to exercise partial acceptance,
    and output laws can be enumerated exactly."""
    root = str(tmp_path_factory.mktemp("q3_vocab8"))
    return {h: _make_pair(root, h, seed=2, vocab=8, markov_head=h) for h in ("vanilla", "gated", "rnn")}


def _engines(tdir, ddir, **kw):
    return (Engine(tdir, draft=ddir, device="cpu", dtype="fp32", **kw),
            Engine(tdir, device="cpu", dtype="fp32"))


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_greedy_identity(vocab8_pairs, head):
    spec, off = _engines(*vocab8_pairs[head])
    assert spec.speculative == "dspark" and off.speculative == "none"
    rng = random.Random(1)
    prompts = [[rng.randrange(8) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in off.generate(prompts, sp)]
    together = spec.generate(prompts, sp)
    assert [o.token_ids for o in together] == ref
    assert sum(o.metrics.accepted for o in together) > 0
    assert [spec.generate(p, sp).token_ids for p in prompts[:2]] == ref[:2]
    # a small token budget forces chunked prefill interleaved with verify blocks
    chunked, _ = _engines(*vocab8_pairs[head], max_num_batched_tokens=7, max_num_seqs=3)
    assert [o.token_ids for o in chunked.generate(prompts, sp)] == ref


def test_sampling_distribution_is_exact(vocab8_pairs, monkeypatch):
    spec, off = _engines(*vocab8_pairs["rnn"], max_num_seqs=512, max_num_batched_tokens=4096)
    prompt, steps, T, n = [3, 1, 4, 1, 5], 2, 1.0, 800
    law = _target_law(off, prompt, steps, T)
    counts = _sample_counts(spec, prompt, steps, T, n)
    assert _chi2_pvalue(counts, law, n) > 1e-3
    monkeypatch.setattr(accept_mod, "verify", _broken_verify)   # the test must catch a biased verifier
    assert _chi2_pvalue(_sample_counts(spec, prompt, steps, T, n), law, n) < 1e-3


@torch.no_grad()
def test_engine_drafts_match_fresh_recomputation(vocab8_pairs):
    """After every round (chunked prefill, partial acceptance), each request's draft equals one
    computed from scratch: one full target pass over its committed tokens -> context -> block."""
    from dspark.models.deepseek_v4.model import Batch
    spec, _ = _engines(*vocab8_pairs["rnn"], max_num_batched_tokens=9, max_num_seqs=3)
    t, d = spec.model, spec.drafter
    rng = random.Random(4)
    for _ in range(4):
        spec.add_request([rng.randrange(8) for _ in range(rng.randrange(2, 20))],
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    checked = 0
    while spec.has_unfinished():
        spec.step()
        for req in spec.scheduler.running:
            toks, P = req.prompt_ids + req.output_ids, req.num_committed
            assert P == len(toks) - 1
            _, taps = t.forward_hidden(Batch.build([(t.new_state(), 0, toks[:P])], "cpu"),
                                       tap_layers=t.cfg.dspark_target_layer_ids)
            st = d.new_state()
            d.commit_context(st, taps, torch.arange(P))
            h = d.block_hidden(t.embed, torch.tensor([req.anchor]), [P], [st])
            base, prev, draft, conf = d.base_logits(t.head, h), torch.tensor([req.anchor]), [], []
            for k in range(d.gamma):
                bias, c = d.markov_step(h[:, k], prev)
                prev = (base[:, k] + bias).argmax(-1)
                draft.append(int(prev)), conf.append(float(c))
            assert req.draft.tokens.tolist() == draft
            torch.testing.assert_close(req.draft.conf_logits, torch.tensor(conf), atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10
