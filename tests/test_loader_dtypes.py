"""Unquantized tensors load from bf16 / fp32 / fp16 storage (cast to the held dtype, logged once per
dtype pair); quantized codes and scales in the wrong dtype are still refused, naming the tensor.

The expected result of loading a checkpoint whose small tensors are stored as X is the original
checkpoint with those tensors rounded through X and stored back in the format's dtype (the
reference checkpoint, built here with plain torch casts). Loading both must give bitwise equal
tensors, hence bitwise equal logits and drafts: the only difference the storage dtype may make
is the cast's own rounding. For X = fp32 the reference is the original itself (bf16 -> fp32 -> bf16
and fp32 -> fp32 are exact).
"""
import json
import logging
import os
import random
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark import Engine, SamplingParams
from dspark.config import ModelConfig
from dspark.distributed.loader import load_checkpoint_shard
from dspark.models.deepseek_v4.model import Batch
from dspark.models.deepseek_v4.weights import tensor_inventory
from dspark.models.dspark_qwen3 import load_qwen3_pair
from dspark.models.loader import CheckpointError, load_checkpoint
from dspark.models.qwen3 import CheckpointError as Qwen3CheckpointError
from dspark.tools import make_qwen3_checkpoint as mq3
from dspark.tools.make_checkpoint import SMALL_DTYPES, is_small_tensor, main, make_checkpoint

INDEX = "model.safetensors.index.json"
LOADER_LOG = "dspark.models.loader"


def _shards(path):
    if os.path.exists(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def _resave(src, dst, edit):
    """Copy checkpoint src to dst with every tensor replaced by edit(name, tensor), same shards."""
    os.makedirs(dst)
    for fn in os.listdir(src):
        if not fn.endswith(".safetensors"):
            with open(os.path.join(src, fn)) as f, open(os.path.join(dst, fn), "w") as g:
                g.write(f.read())
    for shard in _shards(src):
        t = load_file(os.path.join(src, shard))
        save_file({n: edit(n, v) for n, v in t.items()}, os.path.join(dst, shard))
    return dst


def _stored(path) -> dict:
    out = {}
    for shard in _shards(path):
        out.update(load_file(os.path.join(path, shard)))
    return out


def _assert_same(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _casts(caplog) -> list:
    return [r.getMessage() for r in caplog.records if " cast " in r.getMessage()]


# ---- DeepSeek-V4 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v4(tiny_ckpt, tmp_path_factory):
    """{X: (checkpoint with small tensors stored as X, reference checkpoint)} for the tiny DSpark
    checkpoint; the variants come from `make_checkpoint(small_dtype=X)` (same seed as tiny_ckpt)."""
    root = tmp_path_factory.mktemp("v4_dtypes")
    inv = tensor_inventory(ModelConfig.from_path(tiny_ckpt))
    out = {}
    for x, dt in SMALL_DTYPES.items():
        path = str(root / x)
        make_checkpoint(path, preset="tiny", seed=0, dspark=True, progress=False, small_dtype=x)
        ref = tiny_ckpt if x == "fp32" else _resave(
            tiny_ckpt, str(root / f"ref_{x}"),
            lambda n, t, dt=dt: t.to(dt).to(t.dtype) if n in inv and is_small_tensor(n, inv[n]) else t)
        out[x] = (path, ref)
    return out


@pytest.mark.parametrize("x", sorted(SMALL_DTYPES))
def test_small_dtype_checkpoint_is_the_default_one_recast(tiny_ckpt, v4, x):
    inv = tensor_inventory(ModelConfig.from_path(tiny_ckpt))
    orig, new = _stored(tiny_ckpt), _stored(v4[x][0])
    assert orig.keys() == new.keys()
    small = [n for n in orig if n in inv and is_small_tensor(n, inv[n])]
    assert len(small) > 100 and "mtp.2.confidence_head.proj.weight" in small
    assert "layers.0.hc_attn_fn" in small and "embed.weight" not in small
    for n in orig:
        want = orig[n].to(SMALL_DTYPES[x]) if n in small else orig[n]
        assert new[n].dtype == want.dtype and torch.equal(new[n], want), n
    with open(os.path.join(v4[x][0], INDEX)) as f:
        total = json.load(f)["metadata"]["total_size"]
    assert total == sum(t.numel() * t.element_size() for t in new.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x", sorted(SMALL_DTYPES))
def test_loads_as_the_recast_reference(v4, x, dtype, caplog):
    path, ref = v4[x]
    cfg = ModelConfig.from_path(path)
    inv = tensor_inventory(cfg)
    caplog.set_level(logging.INFO, logger=LOADER_LOG)
    got = load_checkpoint(path, cfg, dtype=dtype, progress=False)
    lines = _casts(caplog)
    want = load_checkpoint(ref, cfg, dtype=dtype, progress=False)
    _assert_same(got, want)
    for n, spec in inv.items():     # held dtypes do not depend on the storage
        assert got[n].dtype == {"fp32": torch.float32, "int64": torch.int64}.get(spec.kind, dtype), n
    # one line per (stored -> held) pair, counted here from the file itself
    on_disk = _stored(path)
    pairs = {}
    for n, spec in inv.items():
        if spec.kind in ("bf16", "fp32") and on_disk[n].dtype != got[n].dtype:
            pairs.setdefault((on_disk[n].dtype, got[n].dtype), []).append(n)
    assert len(lines) == len(pairs), lines
    for (s, h), names in pairs.items():
        mine = [ln for ln in lines if f"cast {len(names)} tensor(s) stored as {_NAME[s]} to {_NAME[h]} "
                f"(e.g. " in ln]
        assert len(mine) == 1, (lines, s, h, len(names))
        assert re.search(r"\(e\.g\. (\S+)\)", mine[0]).group(1) in names


@pytest.fixture(scope="module")
def v4_engines(tiny_ckpt, v4):
    kw = dict(device="cpu", dtype="fp32", kv_cache_dtype="fp32", max_num_seqs=2)
    return {x: (Engine(v4[x][0], **kw), Engine(v4[x][1], **kw)) for x in v4}


# The engines compared hold bitwise equal weights (test_loads_as_the_recast_reference), so their
# outputs differ only by fp32 evaluation order: CPU GEMM kernels may round differently with the
# tensors' memory alignment (seen: 5e-7 on |conf logits| ~ 4). 1e-5 of the output's scale bounds
# that; the storage roundings themselves (test_rounding_is_visible) are over ten times larger.
REL = 1e-5


def _assert_close(ours, ref, rel=REL):
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max |diff| = {err:.3e} vs scale {scale:.3f}"


def _draft(eng, seed):
    runner, cfg = eng.runner, eng.cfg
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i, P in enumerate([6, 19]):
        _, ds = runner.new_states()
        taps = torch.randn(P, len(cfg.dspark_target_layer_ids) * cfg.hidden_size, generator=gen)
        runner.commit_context(ds, taps, 0)
        reqs.append(SimpleNamespace(anchor=3 + i, num_committed=P, draft_state=ds, seed=11 + i,
                                    params=SamplingParams(temperature=1.0)))
    return runner.draft(reqs)


@pytest.mark.parametrize("x", sorted(SMALL_DTYPES))
def test_logits_and_drafts_equal_the_original_up_to_the_cast(tiny_ckpt, v4, v4_engines, x):
    eng, ref = v4_engines[x]
    ids = [random.Random(5).randrange(eng.cfg.vocab_size) for _ in range(40)]
    _assert_close(eng.score(ids), ref.score(ids))
    for a, b in zip(_draft(eng, 1), _draft(ref, 1)):
        assert torch.equal(a.tokens, b.tokens)
        _assert_close(a.probs, b.probs)
        _assert_close(a.conf_logits, b.conf_logits)
    if x == "fp32":     # the reference is the original checkpoint: no rounding at all
        assert v4[x][1] == tiny_ckpt


def test_rounding_is_visible(v4_engines):
    """The bf16 / fp16 storage does change the model (the fp32 hc_* / attn_sink / ape / gate bias
    tensors are rounded) by over ten times REL (fp16: ~2.5e-4 of the logit scale), so the
    comparisons above would see a loader that cast those tensors differently from the reference."""
    ids = list(range(1, 30))
    orig = v4_engines["fp32"][1].score(ids)
    for x in ("bf16", "fp16"):
        got = v4_engines[x][0].score(ids)
        assert (got - orig).abs().max().item() > 10 * REL * orig.abs().max().item(), x
        confs = [(a.conf_logits, b.conf_logits) for a, b in
                 zip(_draft(v4_engines[x][0], 1), _draft(v4_engines["fp32"][1], 1))]
        assert max((a - b).abs().max().item() for a, b in confs) > 10 * REL, x


@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize("x", ["bf16", "fp16"])
def test_sharded_loader_casts_the_same(v4, x, world, caplog):
    path, ref = v4[x]
    cfg = ModelConfig.from_path(path)
    for rank in range(world):
        caplog.clear()
        caplog.set_level(logging.INFO, logger=LOADER_LOG)
        got = load_checkpoint_shard(path, cfg, rank, world)
        lines = _casts(caplog)
        _assert_same(got, load_checkpoint_shard(ref, cfg, rank, world))
        assert bool(lines) == (rank == 0), lines      # rank 0 reports for everyone


def test_tp2_engine_on_fp16_small_tensors(v4):
    """Tensor parallel over gloo (2 CPU processes, each loading its slices): the fp16-stored
    checkpoint gives the single-process reference's logits, taps and draft (tolerance of
    test_distributed: fp32 partial sums reduced in another order; the fp16 rounding itself moves
    the logits by ~1e-3, test_rounding_is_visible)."""
    from dspark.distributed.engine import DistributedRunner
    from test_distributed import _passes, _reference
    path, ref = v4["fp16"]
    want = _passes(*_reference(ref))
    cfg = ModelConfig.from_path(path)
    runner = DistributedRunner.launch(path, cfg, 2, dtype=torch.float32)
    try:
        got = _passes(runner, cfg)
    finally:
        runner.shutdown()
    for a, b in zip(want[:3], got[:3]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[3].tokens, want[3].tokens)
    torch.testing.assert_close(got[3].conf_logits, want[3].conf_logits, rtol=1e-4, atol=1e-4)


def test_quantized_checkpoint_small_tensors_recast(tiny_quant_ckpt, tmp_path):
    """FP8 + FP4 storage: the small tensors in fp16 load as their recast reference, dequantized and
    kept quantized, whole and rank-sharded; codes and scales untouched."""
    inv = tensor_inventory(ModelConfig.from_path(tiny_quant_ckpt))
    small = lambda n: n in inv and is_small_tensor(n, inv[n])            # noqa: E731
    path = _resave(tiny_quant_ckpt, str(tmp_path / "fp16"),
                   lambda n, t: t.to(torch.float16) if small(n) else t)
    ref = _resave(tiny_quant_ckpt, str(tmp_path / "ref"),
                  lambda n, t: t.to(torch.float16).to(t.dtype) if small(n) else t)
    cfg = ModelConfig.from_path(path)
    for kq in (False, True):
        _assert_same(load_checkpoint(path, cfg, progress=False, keep_quantized=kq),
                     load_checkpoint(ref, cfg, progress=False, keep_quantized=kq))
        _assert_same(load_checkpoint_shard(path, cfg, 1, 2, keep_quantized=kq),
                     load_checkpoint_shard(ref, cfg, 1, 2, keep_quantized=kq))


# the quantized tensors of tiny_quant_ckpt stored in a wrong dtype: (name, edit, dtype shown,
# expected dtypes shown, the fix line)
_QUANT_WRONG = [
    ("layers.0.attn.wq_a.weight", lambda t: t.to(torch.bfloat16), "torch.bfloat16",
     "torch.float8_e4m3fn", "FP8 weights are float8_e4m3fn codes"),
    ("mtp.0.attn.wkv.weight", lambda t: t.to(torch.float8_e5m2), "torch.float8_e5m2",
     "torch.float8_e4m3fn", "FP8 weights are float8_e4m3fn codes"),
    ("layers.1.ffn.experts.3.w2.weight", lambda t: t.view(torch.float8_e4m3fn), "torch.float8_e4m3fn",
     "torch.int8 or torch.uint8", "FP4 expert weights are packed e2m1 pairs"),
    ("layers.0.attn.wq_b.scale", lambda t: t.to(torch.float32), "torch.float32",
     "torch.float8_e8m0fnu or torch.uint8", "scales are UE8M0 exponents"),
    ("layers.2.ffn.experts.0.w1.scale", lambda t: t.to(torch.bfloat16), "torch.bfloat16",
     "torch.float8_e8m0fnu or torch.uint8", "scales are UE8M0 exponents"),
]


@pytest.mark.parametrize("name, edit, shown, expected, fix", _QUANT_WRONG, ids=[c[0] for c in _QUANT_WRONG])
def test_quantized_tensor_in_wrong_dtype_is_refused(tiny_quant_ckpt, tmp_path, name, edit, shown,
                                                    expected, fix):
    path = _resave(tiny_quant_ckpt, str(tmp_path / "bad"), lambda n, t: edit(t) if n == name else t)
    cfg = ModelConfig.from_path(path)
    for load in (lambda: load_checkpoint(path, cfg, progress=False),
                 lambda: load_checkpoint_shard(path, cfg, 1, 2)):
        with pytest.raises(CheckpointError) as e:
            load()
        msg = str(e.value)
        assert f"1 tensor(s) with the wrong dtype: {name}: {shown} (expected {expected})" in msg, msg
        assert fix in msg and "Fix:" in msg, msg


def test_values_that_overflow_the_held_dtype_are_refused(tiny_ckpt, tmp_path):
    path = _resave(tiny_ckpt, str(tmp_path / "big"),
                   lambda n, t: t.float().mul(1e5) if n == "layers.1.ffn_norm.weight" else t)
    cfg = ModelConfig.from_path(path)
    assert load_checkpoint(path, cfg, dtype=torch.bfloat16, progress=False)
    with pytest.raises(CheckpointError, match=r"layers.1.ffn_norm.weight: stored as torch.float32 "
                                              r"with values up to .* beyond torch.float16's range"):
        load_checkpoint(path, cfg, dtype=torch.float16, progress=False)


def test_cli_small_dtype(tmp_path):
    out = str(tmp_path / "cli")
    main(["--preset", "tiny", "--layers", "1", "--small-dtype", "fp16", "--out", out])
    inv = tensor_inventory(ModelConfig.from_path(out))
    for shard in _shards(out):
        with safe_open(os.path.join(out, shard), framework="pt") as f:
            for n in f.keys():
                tag = f.get_slice(n).get_dtype()
                if is_small_tensor(n, inv[n]):
                    assert tag == "F16", n
                else:
                    assert tag != "F16", n
    with pytest.raises(SystemExit):
        main(["--small-dtype", "fp64", "--out", out])


# ---- Qwen3 target + DeepSpec drafter ---------------------------------------------------------------

def _pair(root, name, dtype="bf16", small=None):
    t, d = os.path.join(root, name, "target"), os.path.join(root, name, "draft")
    mq3.make_qwen3_checkpoint(t, "tiny", "target", dtype=dtype, seed=4, small_dtype=small)
    mq3.make_qwen3_checkpoint(d, "tiny", "dspark", dtype=dtype, seed=4, markov_head="gated",
                              small_dtype=small)
    return t, d


def _recast(src, dst, dt):
    return _resave(src, dst, lambda n, t: t.to(dt).to(t.dtype) if mq3.is_small_tensor(n, t.shape) else t)


def _pair_state(pair):
    target, drafter, _ = pair
    return ({k: v for k, v in target.state_dict().items()},
            {k: v for k, v in drafter.state_dict().items()})


@torch.no_grad()
def _pair_outputs(pair):
    target, drafter, cfg = pair
    gen = torch.Generator().manual_seed(0)
    st = drafter.new_state()
    taps = torch.randn(9, len(cfg.dspark_target_layer_ids) * cfg.hidden_size, generator=gen)
    drafter.commit_context(st, taps, torch.arange(9))
    hidden = drafter.block_hidden(target.embed, torch.tensor([5]), [9], [st])
    base = drafter.base_logits(target.head, hidden)
    bias, conf = drafter.markov_step(hidden[:, 0], torch.tensor([5]))
    ids = torch.arange(1, 20) * 7 % cfg.vocab_size
    logits = target.logits(target.forward_hidden(Batch.build([(target.new_state(), 0, ids.tolist())],
                                                             "cpu"))[0])
    return base, bias, conf, logits


@pytest.mark.parametrize("dtype, x", [("bf16", "fp32"), ("bf16", "fp16"), ("fp32", "bf16")])
def test_qwen3_pair_small_tensors_in_another_dtype(tmp_path, caplog, dtype, x):
    base = _pair(str(tmp_path), "base", dtype)
    other = _pair(str(tmp_path), "other", dtype, small=x)
    dt = mq3.SMALL_DTYPES[x]
    ref = [_recast(p, str(tmp_path / "ref" / k), dt) for p, k in zip(base, ("t", "d"))]
    stored = load_file(os.path.join(other[1], "model.safetensors"))
    assert stored["confidence_head.proj.weight"].dtype == dt and stored["norm.weight"].dtype == dt
    assert stored["fc.weight"].dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    caplog.set_level(logging.INFO, logger=LOADER_LOG)
    got = load_qwen3_pair(*other)
    lines = _casts(caplog)
    want = load_qwen3_pair(*ref)
    for a, b in zip(_pair_state(got), _pair_state(want)):
        _assert_same(a, b)
        assert all(v.dtype == torch.float32 for v in a.values())
    for a, b in zip(_pair_outputs(got), _pair_outputs(want)):
        _assert_close(a, b)     # equal weights: evaluation-order rounding only (see REL)
    # the drafter's file: one line for its small tensors (unless stored as the held fp32)
    draft_lines = [ln for ln in lines if ln.startswith(other[1])]
    n_small = sum(mq3.is_small_tensor(n, t.shape) for n, t in stored.items())
    small_line = [ln for ln in draft_lines if f"stored as {_NAME[dt]} " in ln]
    if dt != torch.float32:
        assert len(small_line) == 1 and f"cast {n_small} tensor(s)" in small_line[0], draft_lines
    else:
        assert not small_line, draft_lines
    assert len(draft_lines) == len(set(draft_lines)) <= 2


def test_qwen3_non_float_tensor_is_refused(tmp_path):
    tdir, ddir = _pair(str(tmp_path), "base")
    bad = _resave(ddir, str(tmp_path / "bad"),
                  lambda n, t: t.to(torch.float8_e4m3fn) if n == "confidence_head.proj.weight" else t)
    with pytest.raises(Qwen3CheckpointError, match=r"confidence_head.proj.weight: dtype F8_E4M3 "
                                                   r"\(expected BF16, F32, F16\).*bf16 release"):
        load_qwen3_pair(tdir, bad)
    big = _resave(tdir, str(tmp_path / "big"),
                  lambda n, t: t.float().mul(1e6) if n == "model.norm.weight" else t)
    with pytest.raises(Qwen3CheckpointError, match=r"model.norm.weight: stored as torch.float32 .* "
                                                   r"beyond torch.float16's range"):
        load_qwen3_pair(big, ddir, dtype=torch.float16)

