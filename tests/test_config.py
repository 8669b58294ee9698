"""config.json parsing: both key spellings, HF layer_types, and clear errors for foreign or
inconsistent configs."""
import pytest

from dspark.config import ConfigError, ModelConfig

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
