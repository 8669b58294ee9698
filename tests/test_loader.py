"""load_checkpoint: exact de-quantization and strict, explanatory rejection of broken checkpoints."""
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.config import ModelConfig
from dspark.models.deepseek_v4.weights import tensor_inventory
from dspark.models.loader import CheckpointError, load_checkpoint
from dspark.tools.make_checkpoint import make_checkpoint
from hf_oracle import dequantized_state_dict

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """Two tiny layers (SWA + CSA with indexer, both hash-routed), bf16, no DSpark stages."""
    out = str(tmp_path_factory.mktemp("small"))
    make_checkpoint(out, preset="tiny", layers=2, seed=3, progress=False)
    return out


def _copy(src, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(src, dst)
    return dst


def _weight_map(path) -> dict:
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)["weight_map"]


def _rewrite(path, edit):
    """Apply edit({name: tensor}) to the whole checkpoint (edit mutates the dict in place or
    returns a new one), keeping each surviving tensor in its shard (new names go to the first
    shard) and rewriting the index to match."""
    wm = _weight_map(path)
    shards = sorted(set(wm.values()))
    tensors = {}
    for s in shards:
        tensors.update(load_file(os.path.join(path, s)))
    new = edit(tensors)
    new = tensors if new is None else new
    placement = {n: wm.get(n, shards[0]) for n in new}
    for s in shards:
        save_file({n: t for n, t in new.items() if placement[n] == s}, os.path.join(path, s))
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": placement}, f)


def _set_config(path, **kw):
    fn = os.path.join(path, "config.json")
    with open(fn) as f:
        raw = json.load(f)
    raw.update(kw)
    with open(fn, "w") as f:
        json.dump(raw, f)


def _assert_same(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---- what a good checkpoint loads to ------------------------------------------------------------

def test_loads_every_logical_tensor(tiny_quant_ckpt):
    cfg = ModelConfig.from_path(tiny_quant_ckpt)
    inv = tensor_inventory(cfg)
    for dtype in (torch.float32, torch.bfloat16):
        w = load_checkpoint(tiny_quant_ckpt, cfg, dtype=dtype, progress=False)
        assert list(w) == list(inv)                   # no `.scale` entries, inventory order
        for name, spec in inv.items():
            want = {"fp32": torch.float32, "int64": torch.int64}.get(spec.kind, dtype)
            assert tuple(w[name].shape) == spec.shape and w[name].dtype == want, name
    assert {s.kind for s in inv.values()} == {"bf16", "fp32", "int64", "fp8", "fp4"}


def test_dequantized_values_equal_numpy_oracle(tiny_quant_ckpt):
    ours = load_checkpoint(tiny_quant_ckpt, progress=False)      # cfg from config.json
    ref = dequantized_state_dict(tiny_quant_ckpt, include_mtp=True)
    assert set(ours) == set(ref)
    for name, t in ours.items():
        assert torch.equal(t, ref[name]), name


def test_weight_and_scale_in_different_shards(tiny_quant_ckpt, tmp_path):
    path = _copy(tiny_quant_ckpt, tmp_path)
    wm = _weight_map(path)
    shards = sorted(set(wm.values()))
    moved = {n: shards[-1] if n.endswith(".scale") and wm[n] != shards[-1] else s for n, s in wm.items()}
    assert moved != wm
    tensors = {}
    for s in shards:
        tensors.update(load_file(os.path.join(path, s)))
    for s in shards:
        save_file({n: t for n, t in tensors.items() if moved[n] == s}, os.path.join(path, s))
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"weight_map": moved}, f)
    _assert_same(load_checkpoint(path, progress=False), load_checkpoint(tiny_quant_ckpt, progress=False))


def test_model_prefix_is_stripped(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    _rewrite(path, lambda t: {"model." + n: v for n, v in t.items()})
    _assert_same(load_checkpoint(path, progress=False), load_checkpoint(small_ckpt, progress=False))


def test_single_file_without_index(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    shards = sorted(set(_weight_map(path).values()))
    merged = {}
    for s in shards:
        merged.update(load_file(os.path.join(path, s)))
        os.remove(os.path.join(path, s))
    os.remove(os.path.join(path, INDEX))
    save_file(merged, os.path.join(path, "model.safetensors"))
    _assert_same(load_checkpoint(path, progress=False), load_checkpoint(small_ckpt, progress=False))


def test_classic_mtp_tensors_are_ignored_without_dspark_config(small_ckpt, tmp_path, caplog):
    path = _copy(small_ckpt, tmp_path)

    def add_mtp(t):
        d = 256
        t.update({"mtp.0.e_proj.weight": torch.zeros(d, d, dtype=torch.bfloat16),
                  "mtp.0.h_proj.weight": torch.zeros(d, d, dtype=torch.bfloat16),
                  "mtp.0.enorm.weight": torch.ones(d, dtype=torch.bfloat16),
                  "mtp.0.hnorm.weight": torch.ones(d, dtype=torch.bfloat16),
                  "mtp.0.attn.attn_sink": torch.zeros(4)})
    _rewrite(path, add_mtp)
    with caplog.at_level(logging.INFO, logger="dspark.models.loader"):
        w = load_checkpoint(path, progress=False)
    assert not any(n.startswith("mtp.") for n in w)
    assert "ignoring 5 classic MTP tensor(s)" in caplog.text


# ---- what a broken checkpoint is rejected with ---------------------------------------------------

def _shard(path, k):
    return sorted(set(_weight_map(path).values()))[k]


def test_truncated_shard(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    fn = os.path.join(path, _shard(path, 1))
    os.truncate(fn, os.path.getsize(fn) - 100)
    with pytest.raises(CheckpointError, match=rf"{_shard(path, 1)}.*truncated or corrupt.*Fix"):
        load_checkpoint(path, progress=False)


def test_corrupt_header(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    with open(os.path.join(path, _shard(path, 0)), "r+b") as f:
        f.seek(8)
        f.write(b"not json at all!")
    with pytest.raises(CheckpointError, match=rf"{_shard(path, 0)}.*truncated or corrupt"):
        load_checkpoint(path, progress=False)


def test_missing_shard_file(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    os.remove(os.path.join(path, _shard(path, 2)))
    with pytest.raises(CheckpointError, match=rf"1 shard file\(s\).*missing: {_shard(path, 2)}"):
        load_checkpoint(path, progress=False)


def test_no_weights_at_all(small_ckpt, tmp_path):
    path = str(tmp_path)
    shutil.copy(os.path.join(small_ckpt, "config.json"), path)
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        load_checkpoint(path, progress=False)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(os.path.join(path, "config.json"), progress=False)


def test_index_points_at_wrong_shard(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    wm = _weight_map(path)
    name = "layers.0.attn.wkv.weight"
    wm[name] = next(s for s in sorted(set(wm.values())) if s != wm[name])
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"weight_map": wm}, f)
    with pytest.raises(CheckpointError, match=rf"not in their shard file: {name} \(in {wm[name]}\)"):
        load_checkpoint(path, progress=False)


def test_missing_tensor(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    _rewrite(path, lambda t: {n: v for n, v in t.items() if n != "layers.1.ffn.experts.3.w2.weight"})
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\): layers.1.ffn.experts.3.w2.weight\n"):
        load_checkpoint(path, progress=False)


def test_many_missing_tensors_are_summarised(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    _rewrite(path, lambda t: {n: v for n, v in t.items() if ".experts." not in n})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, progress=False)
    msg = str(e.value)
    assert "48 missing tensor(s)" in msg and "... (48 in total)" in msg
    assert msg.count("experts.") == 10                    # only the first ten are spelled out


def test_unexpected_tensor(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    _rewrite(path, lambda t: t.update({"layers.0.attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\): layers.0.attn.extra.weight"):
        load_checkpoint(path, progress=False)


def test_wrong_shape(small_ckpt, tmp_path):
    path = _copy(small_ckpt, tmp_path)
    _rewrite(path, lambda t: t.update({"layers.0.attn.wkv.weight": torch.zeros(511, 256, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"wrong shape: layers.0.attn.wkv.weight: \[511, 256\] "
                                              r"\(expected \[512, 256\]\)"):
        load_checkpoint(path, progress=False)


def test_wrong_dtype(small_ckpt, tmp_path):
    # float dtypes other than the format's are cast (test_loader_dtypes.py); an integer is not a norm
    path = _copy(small_ckpt, tmp_path)
    _rewrite(path, lambda t: t.update({"layers.0.attn_norm.weight": t["layers.0.attn_norm.weight"].to(torch.int32)}))
    with pytest.raises(CheckpointError, match=r"wrong dtype: layers.0.attn_norm.weight: torch.int32 "
                                              r"\(expected torch.bfloat16 or torch.float32 or "
                                              r"torch.float16\)\n  unquantized tensors may be stored as"):
        load_checkpoint(path, progress=False)


def test_config_that_does_not_describe_the_weights(small_ckpt):
    cfg = ModelConfig.from_path(small_ckpt).replace(weight_dtype="fp8")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(small_ckpt, cfg, progress=False)
    msg = str(e.value)
    assert "missing tensor(s): layers.0.attn.wq_a.scale" in msg
    assert "wrong dtype: layers.0.attn.wq_a.weight: torch.bfloat16 (expected torch.float8_e4m3fn)" in msg
    assert "Fix: use the config.json that belongs to these weights" in msg


@pytest.mark.parametrize("raw, needle", [
    ({"model_type": "qwen3"}, "'qwen3'"),
    ({"model_type": "deepseek_v41", "text_config": {"model_type": "deepseek_v41_text"}}, "'deepseek_v41'"),
])
def test_foreign_config(small_ckpt, tmp_path, raw, needle):
    path = _copy(small_ckpt, tmp_path)
    _set_config(path, **raw)
    for cfg in (None, ModelConfig.from_path(small_ckpt)):     # even with an explicit cfg
        with pytest.raises(CheckpointError, match=rf"model_type {needle} is not a DeepSeek-V4 .*Fix"):
            load_checkpoint(path, cfg, progress=False)
