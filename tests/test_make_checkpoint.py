"""Random checkpoints: official layout (spec §5.1, dspark.md §3.2), determinism, config.json that
both ModelConfig and transformers read, and transformers loading every tensor."""
import hashlib
import json
import math
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark.config import ModelConfig
from dspark.models.deepseek_v4.weights import TensorSpec, stored_inventory, tensor_inventory
from dspark.tools.make_checkpoint import hf_config, main, make_checkpoint, preset_config
from hf_oracle import dequantized_state_dict, hf_logits, hf_model

INDEX = "model.safetensors.index.json"


def _digests(path):
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(path))}


def _all_tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


# ---- determinism --------------------------------------------------------------------------------

def test_same_seed_same_bytes_other_seed_other_values(tmp_path):
    kw = dict(preset="tiny", layers=1, dtype="fp8", fp4_experts=True, dspark=True, progress=False)
    a, b, c = (str(tmp_path / x) for x in "abc")
    make_checkpoint(a, seed=7, **kw)
    make_checkpoint(b, seed=7, **kw)
    make_checkpoint(c, seed=8, **kw)
    assert _digests(a) == _digests(b)
    ta, tc = _all_tensors(a), _all_tensors(c)
    assert ta.keys() == tc.keys()
    same = [n for n in ta if not n.endswith(".scale") and torch.equal(ta[n], tc[n])]
    assert same == []


def test_tensor_values_depend_only_on_seed_and_name(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_checkpoint(a, preset="tiny", layers=1, seed=5, progress=False)
    make_checkpoint(b, preset="tiny", layers=2, seed=5, progress=False)
    ta, tb = _all_tensors(a), _all_tensors(b)
    assert set(ta) < set(tb)
    for n in ta:
        assert torch.equal(ta[n], tb[n]), n


# ---- layout -------------------------------------------------------------------------------------

def test_files_hold_exactly_the_inventory(tiny_quant_ckpt):
    cfg = ModelConfig.from_path(tiny_quant_ckpt)
    want = stored_inventory(cfg)
    with open(os.path.join(tiny_quant_ckpt, INDEX)) as f:
        index = json.load(f)
    wm = index["weight_map"]
    assert list(wm) == list(want)
    assert index["metadata"]["total_size"] == sum(st.nbytes for st in want.values())
    shards = sorted(set(wm.values()))
    assert len(shards) >= 3
    for shard in shards:
        with safe_open(os.path.join(tiny_quant_ckpt, shard), "pt") as f:
            assert sorted(f.keys()) == sorted(n for n, s in wm.items() if s == shard)
            for n in f.keys():
                t = f.get_tensor(n)
                assert tuple(t.shape) == want[n].shape and t.dtype == want[n].dtypes[0], n
    for n in wm:                                        # a weight and its scale share a shard
        if n.endswith(".scale"):
            assert wm[n] == wm[n[: -len(".scale")] + ".weight"]


def test_tiny_inventory_structure():
    cfg = preset_config("tiny", dspark=True)
    inv = tensor_inventory(cfg)
    assert cfg.compress_ratios == (0, 4, 16, 4, 16, 0)
    for i, r in enumerate(cfg.compress_ratios):
        p = f"layers.{i}.attn."
        assert (p + "compressor.ape" in inv) == (r > 0)
        assert (p + "indexer.wq_b.weight" in inv) == (r == 4)
        assert (f"layers.{i}.ffn.gate.tid2eid" in inv) == (i < 2)
        assert (f"layers.{i}.ffn.gate.bias" in inv) == (i >= 2)
    assert inv["layers.1.attn.compressor.wkv.weight"].shape == (1024, 256)      # c = 2 at ratio 4
    assert inv["layers.1.attn.compressor.ape"].shape == (4, 1024)
    assert inv["layers.2.attn.compressor.wkv.weight"].shape == (512, 256)       # c = 1 at ratio 16
    assert inv["layers.2.attn.compressor.ape"].shape == (16, 512)
    assert inv["layers.1.attn.indexer.compressor.wkv.weight"].shape == (256, 256)
    assert inv["layers.1.attn.indexer.compressor.norm.weight"].shape == (128,)
    assert inv["layers.0.ffn.gate.tid2eid"].shape == (1024, 2)
    assert inv["layers.0.attn.wo_a.weight"].shape == (128, 1024)               # [G*R, H*512/G]
    stage_only = {s: sorted(n.split(".", 2)[2] for n in inv if n.startswith(f"mtp.{s}."))
                  for s in range(3)}
    assert set(stage_only[0]) - set(stage_only[1]) == {"main_proj.weight", "main_norm.weight"}
    assert set(stage_only[2]) - set(stage_only[1]) == {
        "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight", "confidence_head.proj.weight"}
    assert not any("compressor" in n or "indexer" in n or "tid2eid" in n for n in inv if n.startswith("mtp."))
    assert inv["mtp.0.main_proj.weight"].shape == (256, 768)
    assert inv["mtp.2.confidence_head.proj.weight"] == TensorSpec((1, 256 + 32), "bf16")   # no bias


def test_real_width_inventories_match_the_spec():
    flash = preset_config("flash", layers=43, dtype="fp8", fp4_experts=True)
    pro = preset_config("pro", layers=61, dtype="fp8", fp4_experts=True)
    # spec §1.1 "sanity": 284.3 B (Flash) and 1.573 T (Pro) parameters
    n = lambda cfg: sum(math.prod(s.shape) for s in tensor_inventory(cfg).values())  # noqa: E731
    assert round(n(flash) / 1e9, 1) == 284.3
    assert round(n(pro) / 1e12, 3) == 1.573
    # spec §5.1 concrete examples: (stored shape, stored dtype, scale shape)
    fs, ps = stored_inventory(flash), stored_inventory(pro)
    assert fs["layers.2.attn.wq_b.weight"].shape == (32768, 1024)
    assert fs["layers.2.attn.wq_b.scale"].shape == (256, 8)
    assert fs["layers.2.attn.wo_a.weight"].shape == (8192, 4096)
    assert fs["layers.2.attn.wo_a.scale"].shape == (64, 32)
    assert fs["layers.5.ffn.experts.7.w1.weight"].shape == (2048, 2048)
    assert fs["layers.5.ffn.experts.7.w1.weight"].dtypes[0] == torch.int8
    assert fs["layers.5.ffn.experts.7.w1.scale"].shape == (2048, 128)
    assert fs["layers.5.ffn.experts.7.w1.scale"].dtypes[0] == torch.float8_e8m0fnu
    assert fs["layers.0.ffn.gate.tid2eid"].shape == (129280, 6)
    assert ps["layers.2.attn.wq_b.scale"].shape == (512, 12)
    assert ps["layers.2.attn.wo_a.weight"].shape == (16384, 4096)
    assert ps["layers.9.ffn.experts.0.w1.weight"].shape == (3072, 3584)
    assert ps["layers.9.ffn.experts.0.w1.scale"].shape == (3072, 224)
    # dspark.md §3.2 (V4-Flash DSpark stages)
    ds = tensor_inventory(preset_config("flash", layers=4, dtype="fp8", fp4_experts=True, dspark=True))
    assert ds["mtp.0.main_proj.weight"].shape == (4096, 12288) and ds["mtp.0.main_proj.weight"].kind == "fp8"
    assert ds["mtp.1.hc_attn_fn"].shape == (24, 16384)
    assert ds["mtp.1.attn.wo_a.weight"].shape == (8192, 4096)
    assert ds["mtp.2.markov_head.markov_w1.weight"].shape == (129280, 256)
    assert ds["mtp.2.confidence_head.proj.weight"].shape == (1, 4352)
    assert ds["mtp.2.hc_head_fn"].shape == (4, 16384)
    assert ds["mtp.1.ffn.experts.255.w2.weight"].kind == "fp4"
    assert ds["mtp.1.ffn.gate.bias"].shape == (256,)


# ---- config.json --------------------------------------------------------------------------------

def test_presets():
    t = preset_config("tiny", dspark=True)
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.sliding_window, t.num_hash_layers) == \
        (1024, 256, 6, 8, 2)
    assert (t.index_topk, t.index_n_heads, t.original_seq_len, t.rope_factor) == (4, 16, 32, 4.0)
    assert (t.dspark_block_size, t.dspark_target_layer_ids, t.dspark_markov_rank,
            t.dspark_noise_token_id) == (5, (3, 4, 5), 32, 1023)
    f = preset_config("flash", dspark=True)
    assert f.compress_ratios == (0, 0, 4, 128) and f.dspark_target_layer_ids == (1, 2, 3)
    assert (f.dspark_noise_token_id, f.dspark_markov_rank, f.num_hash_layers) == (128799, 256, 3)
    p = preset_config("pro", layers=3, dspark=True)
    assert p.compress_ratios == (128, 128, 4) and p.dspark_markov_rank == 512
    assert preset_config("flash", dspark=True, vocab=1000).dspark_noise_token_id == 999
    with pytest.raises(ValueError, match="choose 1..6"):
        preset_config("tiny", layers=7)
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['window'\]"):
        preset_config("tiny", overrides={"window": 3})


@pytest.mark.parametrize("kw", [dict(preset="tiny"), dict(preset="tiny", dtype="fp8", dspark=True),
                                dict(preset="tiny", fp4_experts=True, vocab=8),
                                dict(preset="flash", dtype="fp8", fp4_experts=True, dspark=True),
                                dict(preset="pro", layers=6, dspark=True)])
def test_config_json_round_trips_through_model_config(kw):
    cfg = preset_config(**kw)
    raw = json.loads(json.dumps(hf_config(cfg)))
    assert ModelConfig.from_dict(raw) == cfg
    assert len(raw["compress_ratios"]) == cfg.num_hidden_layers + cfg.num_dspark_stages


def test_transformers_reads_the_config(tiny_ckpt):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_ckpt)
    assert hf.model_type == "deepseek_v4" and hf.num_hidden_layers == 6
    assert hf.layer_types == ["sliding_attention", "compressed_sparse_attention",
                              "heavily_compressed_attention", "compressed_sparse_attention",
                              "heavily_compressed_attention", "sliding_attention"]
    assert hf.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert hf.mlp_layer_types == ["hash_moe"] * 2 + ["moe"] * 4
    assert hf.qk_rope_head_dim == 64 and hf.sliding_window == 8 and hf.index_topk == 4
    main_rope, comp = hf.rope_parameters["main"], hf.rope_parameters["compress"]
    assert (main_rope["rope_type"], main_rope["rope_theta"]) == ("default", 10000.0)
    assert (comp["rope_type"], comp["rope_theta"], comp["factor"], comp["original_max_position_embeddings"],
            comp["attention_factor"]) == ("yarn", 160000.0, 4.0, 32, 1.0)
    with open(os.path.join(tiny_ckpt, "config.json")) as f:
        raw = json.load(f)
    assert raw["compress_ratios"] == [0, 4, 16, 4, 16, 0, 0, 0, 0]
    assert (raw["dspark_block_size"], raw["dspark_target_layer_ids"], raw["dspark_markov_rank"],
            raw["dspark_noise_token_id"]) == (5, [3, 4, 5], 32, 1023)


def test_cli_and_overrides(tmp_path):
    out = str(tmp_path / "cli")
    main(["--preset", "tiny", "--layers", "1", "--dtype", "fp8", "--seed", "3",
          "--set", "swiglu_limit=0.5", "--set", "sliding_window=128", "--out", out])
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    assert raw["swiglu_limit"] == 0.5 and raw["sliding_window"] == 128
    assert raw["quantization_config"]["weight_block_size"] == [128, 128] and raw["expert_dtype"] == "fp8"
    cfg = ModelConfig.from_path(out)
    assert (cfg.swiglu_limit, cfg.sliding_window, cfg.weight_dtype, cfg.expert_format) == (0.5, 128, "fp8", "fp8")


# ---- weights ------------------------------------------------------------------------------------

def test_init_follows_spec_recommendation(tiny_quant_ckpt):
    cfg = ModelConfig.from_path(tiny_quant_ckpt)
    w = dequantized_state_dict(tiny_quant_ckpt, include_mtp=True)     # independent NumPy decode
    inv = tensor_inventory(cfg)
    for name, spec in inv.items():
        t = w[name]
        if name.endswith("norm.weight"):
            assert 0.89 <= t.min() and t.max() <= 1.11, name      # 1 +- 0.1, bf16-rounded
        elif spec.kind in ("fp8", "fp4") or name.endswith("wkv.weight") or name.endswith("head.weight"):
            ratio = t.std().item() * math.sqrt(spec.shape[1])       # N(0, 1/in): ratio ~ 1
            assert 0.5 < ratio < 2.0, (name, ratio)
    assert abs(w["layers.3.hc_attn_fn"].std().item() - 0.05) < 0.01
    tid = w["layers.0.ffn.gate.tid2eid"]
    assert tid.dtype == torch.int64 and tid.min() >= 0 and tid.max() < cfg.n_routed_experts
    assert (tid[:, 0] != tid[:, 1]).all()                           # distinct experts per token
    assert len({tuple(r) for r in tid.tolist()}) > 20


# ---- transformers loads it ----------------------------------------------------------------------

@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_quant_ckpt"])
def test_transformers_runs_the_checkpoint(ckpt, request):
    path = request.getfixturevalue(ckpt)
    ids = list(range(3, 27))              # crosses the CSA (4) and HCA (16) boundaries and window 8
    logits = hf_logits(path, ids)            # raises unless HF filled every parameter from the file
    assert logits.shape == (len(ids), 1024) and torch.isfinite(logits).all()
    assert logits.std() > 0.1


def test_oracle_refuses_a_checkpoint_with_a_missing_tensor(tiny_ckpt, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(tiny_ckpt, path)
    with open(os.path.join(path, INDEX)) as f:
        wm = json.load(f)["weight_map"]
    name = "layers.2.attn.compressor.wgate.weight"
    shard = os.path.join(path, wm.pop(name))
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"weight_map": wm}, f)
    with pytest.raises(AssertionError, match=r"model\.layers\.2\.self_attn\.compressor\.gate_proj\.weight"):
        hf_model(path)
