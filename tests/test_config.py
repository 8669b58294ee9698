"""config.json parsing: both key spellings, HF layer_types, and clear errors for foreign or
inconsistent configs."""
import pytest

from dspark.config import _REF_ALIASES, REQUIRED_KEYS, ConfigError, ModelConfig

TINY_REF = dict(model_type="deepseek_v4", vocab_size=1024, dim=256, n_layers=6, n_heads=4,
                head_dim=512, rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64,
                n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64, window_size=8,
                compress_ratios=[0, 4, 16, 4, 16, 0, 0], n_hash_layers=2, original_seq_len=32,
                rope_factor=4, index_n_heads=16, index_topk=4)


def test_reference_and_hf_spellings_agree():
    ref = ModelConfig.from_dict(TINY_REF)
    hf = ModelConfig.from_dict(dict(
        model_type="deepseek_v4", vocab_size=1024, hidden_size=256, num_hidden_layers=6,
        num_attention_heads=4, head_dim=512, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2,
        o_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        sliding_window=8, num_hash_layers=2, index_n_heads=16, index_topk=4,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "sliding_attention"],
        compress_rates={"csa": 4, "hca": 16},
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                      "beta_fast": 32, "beta_slow": 1}))
    assert ref == hf
    assert ref.compress_ratios == (0, 4, 16, 4, 16, 0)     # MTP/draft tail stripped
    assert ref.rope_factor == 4 and ref.original_seq_len == 32


@pytest.mark.parametrize("patch,needle", [
    ({"model_type": "deepseek_v41"}, "deepseek_v41"),
    ({"model_type": "qwen3"}, "Qwen3"),
    ({"compress_ratios": [0, 4, 16]}, "compress_ratios has 3 entries"),
    ({"compress_ratios": [0, 3, 16, 4, 16, 0]}, "compress_ratios[1]"),
    ({"o_groups": 3}, "o_groups"),
    ({"n_activated_experts": 9}, "num_experts_per_tok"),
    ({"score_func": "softmax"}, "scoring_func"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}},
     "weight_block_size"),
    ({"dspark_block_size": 5, "dspark_target_layer_ids": [3, 9]}, "dspark_target_layer_ids"),
])
def test_bad_configs_name_the_field(patch, needle):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**TINY_REF, **patch})
    assert needle in str(e.value)


def test_missing_config_file_is_explained(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_path(str(tmp_path))


# ---- every architecture field: required, typed, in range --------------------------------------

def test_missing_shape_is_named_not_defaulted():
    """A missing hidden_size is an error naming it (both spellings), not V4-Flash's 4096."""
    raw = {k: v for k, v in TINY_REF.items() if k != "dim"}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    msg = str(e.value)
    assert "missing required key(s) hidden_size (or dim)" in msg and "add them to config.json" in msg
    assert len(msg) < 300


def test_every_required_key_is_required():
    hf = ModelConfig.from_dict(TINY_REF)
    for key in REQUIRED_KEYS:
        raw = {k: v for k, v in TINY_REF.items() if k not in (key, _REF_ALIASES.get(key))}
        with pytest.raises(ConfigError, match=f"missing required key.*{key}"):
            ModelConfig.from_dict(raw)
    assert hf.hidden_size == 256


@pytest.mark.parametrize("patch,needle", [
    ({"n_heads": "four"}, "num_attention_heads = 'four' is not supported: an integer > 0"),
    ({"dim": -192}, "hidden_size = -192 is not supported: a positive integer"),
    ({"dim": 25.5}, "hidden_size = 25.5 is not supported: an integer"),
    ({"dim": True}, "hidden_size = True is not supported: an integer"),
    ({"n_layers": "6"}, "num_hidden_layers = '6' is not supported: an integer"),
    ({"head_dim": 0}, "head_dim = 0 is not supported: a positive integer"),
    ({"norm_eps": 0}, "rms_norm_eps = 0 is not supported: a number > 0"),
    ({"rope_theta": "big"}, "rope_theta = 'big' is not supported: a number > 0"),
    ({"swiglu_limit": -1.0}, "swiglu_limit = -1.0 is not supported: a number >= 0"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings = 'no' is not supported: true or false"),
    ({"eos_token_id": 1024}, "eos_token_id = 1024 is not supported: a token id below vocab_size=1024"),
    ({"n_shared_experts": -1}, "n_shared_experts = -1 is not supported: an integer >= 0"),
    ({"expert_dtype": "int4"}, "expert_dtype = 'int4' is not supported: one of"),
    ({"compress_ratios": "0,4"}, "compress_ratios = '0,4' is not supported: a list"),
    ({"compress_ratios": [0, 4, "x", 4, 16, 0]}, "compress_ratios[2] = 'x' is not supported"),
    ({"num_key_value_heads": "1"}, "num_key_value_heads = '1' is not supported: an integer > 0"),
    ({"rope_scaling": {"factor": "x"}}, "rope_scaling.factor = 'x' is not supported: a number > 0"),
    ({"rope_scaling": [4]}, "rope_scaling = [4] is not supported"),
    ({"quantization_config": "fp8"}, "quantization_config = 'fp8' is not supported"),
    ({"dspark_block_size": 5, "dspark_target_layer_ids": "4"}, "dspark_target_layer_ids = '4'"),
])
def test_bad_field_types_and_ranges_name_field_value_and_accepted(patch, needle):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**TINY_REF, **patch})
    assert needle in str(e.value)


def test_whole_floats_are_ints():
    """JSON writers may spell 4096 as 4096.0: taken as the int."""
    cfg = ModelConfig.from_dict({**TINY_REF, "dim": 256.0})
    assert cfg.hidden_size == 256 and type(cfg.hidden_size) is int
    assert cfg == ModelConfig.from_dict(TINY_REF)


def test_directly_built_config_is_checked_too():
    cfg = ModelConfig.from_dict(TINY_REF)
    with pytest.raises(ConfigError, match="hidden_size = -1 is not supported"):
        cfg.replace(hidden_size=-1).validate()


def test_checkpoint_without_hidden_size_names_it(tmp_path):
    """The shipped model's config.json minus hidden_size: the loader names the key, not the 300
    tensor shapes it would have mismatched."""
    import json
    import os
    from dspark.models.loader import CheckpointError, load_checkpoint
    import dspark
    src = os.path.join(os.path.dirname(dspark.__file__), "assets", "default")
    for name in os.listdir(src):
        if name.endswith((".safetensors", ".index.json")):
            os.symlink(os.path.join(src, name), tmp_path / name)
    raw = json.load(open(os.path.join(src, "config.json")))
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path))
    assert "missing required key(s) hidden_size" in str(e.value) and "mismatch" not in str(e.value)


def test_checkpoint_with_a_wrong_hidden_size_names_it(tmp_path):
    """hidden_size present but not the weights' width: the shape error says which field."""
    import json
    import os
    import dspark
    from dspark.models.loader import CheckpointError, load_checkpoint
    src = os.path.join(os.path.dirname(dspark.__file__), "assets", "default")
    for name in os.listdir(src):
        if name.endswith((".safetensors", ".index.json")):
            os.symlink(os.path.join(src, name), tmp_path / name)
    raw = json.load(open(os.path.join(src, "config.json")))
    raw["hidden_size"] = 256
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path))
    assert "(config.json's hidden_size = 256, but the tensors have 192 there)" in str(e.value)
