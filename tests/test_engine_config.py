"""EngineConfig and Engine's settings: unknown or inapplicable settings fail with the valid ones,
and what the device, the checkpoint or the cache cannot do fails at construction with the real
cause and the fix. Runs on the shipped default model (4 layers, 512 tokens: ~0.5 s per Engine)."""
import dataclasses
import json
import warnings

import pytest
import torch

from dspark import Engine, EngineConfig, EngineConfigError, SamplingParams
from dspark.engine import default_model_path


def test_keywords_and_config_are_the_same_settings():
    eng = Engine(config=EngineConfig(max_num_seqs=3, kv_cache_dtype="bf16"), seed=5)
    assert eng.config == EngineConfig(max_num_seqs=3, kv_cache_dtype="bf16", seed=5)
    assert eng.scheduler.max_num_seqs == 3 and eng.kv_cache_dtype == "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        eng.config.max_num_seqs = 4
    # the verify policy's own options are keywords too
    eng = Engine(verify_policy="threshold", threshold=0.25)
    assert eng.config.policy_options == {"threshold": 0.25} and eng.policy.threshold == 0.25


def test_defaults_are_the_keyword_defaults():
    """Engine(path, **kw) keeps every keyword's meaning and default."""
    want = dict(device=None, dtype=None, speculative=None, num_speculative_tokens=None,
                verify_policy="fixed", kv_cache_dtype="fp8", max_num_seqs=64,
                max_num_batched_tokens=2048, max_model_len=None, seed=0, progress=False,
                sps_table=None, draft=None, cpu_threads=None, kv_layout="paged",
                attention_backend="auto", num_kv_blocks=None, kv_cache_memory=None,
                tensor_parallel_size=1, tensor_parallel_drafter="replicated",
                weight_format="auto", cuda_graphs=None,
                target_cuda_graphs=None, overlap_decode=None, deterministic=False)
    got = dataclasses.asdict(EngineConfig())
    assert {k: got[k] for k in want} == want
    assert set(got) - set(want) == {"policy_options", "allow_long_max_model_len"}


@pytest.mark.parametrize("extra", [{}, {"speculative": "none"}])
def test_unknown_setting_lists_the_valid_ones(extra):
    with pytest.raises(EngineConfigError) as e:
        Engine(tpyo=1, **extra)
    msg = str(e.value)
    assert msg.startswith("unknown Engine setting(s) tpyo; valid settings: ")
    for name in ("max_num_seqs", "kv_cache_dtype", "attention_backend", "num_verify"):
        assert name in msg
    assert "FixedPolicy" not in msg


def test_unknown_field_of_engine_config_lists_the_valid_ones():
    with pytest.raises(EngineConfigError, match=r"unknown Engine setting\(s\) tpyo; valid settings: "
                                                r"allow_long_max_model_len, attention_backend"):
        EngineConfig(tpyo=1)
    with pytest.raises(EngineConfigError, match="threshold: pass in policy_options"):
        EngineConfig(threshold=0.3)
    cfg = EngineConfig(verify_policy="threshold", policy_options={"threshold": 0.3})
    assert cfg == EngineConfig.from_kwargs(verify_policy="threshold", threshold=0.3)


def test_policy_option_of_another_policy_names_its_policy():
    with pytest.raises(EngineConfigError) as e:
        EngineConfig.from_kwargs(threshold=0.3)
    msg = str(e.value)
    assert "threshold: not an option of verify_policy='fixed'" in msg
    assert "threshold: mode, temperatures, threshold" in msg


@pytest.mark.parametrize("kw,needle", [
    (dict(max_num_seqs=0), "max_num_seqs=0 is not supported: an integer >= 1"),
    (dict(max_num_seqs="8"), "max_num_seqs='8' is not supported: an integer >= 1"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is not supported: one of 'fp8'"),
    (dict(attention_backend="flash"), "attention_backend='flash' is not supported: one of 'auto'"),
    (dict(device="tpu"), "device='tpu' is not supported: 'cpu', 'cuda' or 'cuda:<index>'"),
    (dict(dtype="fp16"), "dtype='fp16' is not supported: one of None, 'fp32'"),
    (dict(verify_policy="best"), "verify_policy='best' is not supported: one of 'fixed'"),
    (dict(cuda_graphs="yes"), "cuda_graphs='yes' is not supported: True or False"),
    (dict(num_kv_blocks=4, kv_cache_memory=1 << 20), "give one of them"),
    (dict(max_model_len=1), "max_model_len=1 is not supported: an integer >= 2"),
])
def test_bad_values_name_setting_value_and_accepted(kw, needle):
    with pytest.raises(EngineConfigError) as e:
        EngineConfig(**kw)
    assert needle in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU build's message")
def test_cuda_device_without_cuda_says_so():
    with pytest.raises(EngineConfigError) as e:
        Engine(device="cuda")
    msg = str(e.value)
    assert "device='cuda' needs CUDA" in msg and "use device='cpu'" in msg
    assert "re-download" not in msg and "checkpoint" not in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: no Triton driver")
def test_triton_backend_on_cpu_fails_at_construction(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name in ("triton", "flashmla"):
        with pytest.raises(EngineConfigError) as e:
            Engine(device="cpu", attention_backend=name)
        assert f"attention_backend={name!r} needs a CUDA device" in str(e.value)
        assert "use attention_backend='auto' or 'reference'" in str(e.value)


def test_cache_too_small_for_one_request_says_pages_had_and_needed():
    with pytest.raises(EngineConfigError) as e:
        Engine(device="cpu", num_kv_blocks=1, max_model_len=1024)
    assert str(e.value) == ("the KV cache has 1 page(s) of 256 tokens (num_kv_blocks=1) but one "
                            "request of max_model_len=1024 tokens needs 4: raise num_kv_blocks "
                            "(to >= 4 pages) or lower max_model_len to <= 256")
    # unset max_model_len: what the cache holds, and a long prompt names the cache, not max_model_len
    eng = Engine(device="cpu", num_kv_blocks=1)
    assert eng.max_model_len == 256
    with pytest.raises(ValueError) as e:
        eng.add_request(list(range(2, 300)), SamplingParams(max_tokens=4))
    assert "what the KV cache holds: 1 page(s) of 256 tokens; raise num_kv_blocks" in str(e.value)
    assert not eng.requests and eng.cache.num_free_pages == 1


def test_max_model_len_past_the_model_positions():
    with pytest.raises(EngineConfigError) as e:
        Engine(device="cpu", max_model_len=100000)
    msg = str(e.value)
    assert "max_model_len=100000 is past the model's max_position_embeddings=4096" in msg
    assert "allow_long_max_model_len=True" in msg
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = Engine(device="cpu", max_model_len=5000, allow_long_max_model_len=True,
                     num_kv_blocks=20)
    assert eng.max_model_len == 5000
    assert any("past the model's max_position_embeddings=4096" in str(x.message) for x in w)


def test_verify_settings_without_a_drafter_fail():
    for kw in (dict(num_verify=2), dict(verify_policy="threshold"), dict(num_speculative_tokens=5)):
        with pytest.raises(EngineConfigError) as e:
            Engine(device="cpu", speculative="none", **kw)
        assert "verify settings apply to speculative decoding" in str(e.value)
        assert next(iter(kw)) in str(e.value)


def test_dense_layout_rejects_paged_settings():
    with pytest.raises(EngineConfigError, match="num_kv_blocks: paged-cache settings, but "
                                                "kv_layout='dense'"):
        Engine(device="cpu", kv_layout="dense", num_kv_blocks=4)


def test_settings_the_model_type_does_not_use_fail(tmp_path):
    """Qwen3 checkpoints have no use for the DeepSeek-V4 cache / backend / weight settings (checked
    from config.json's model_type, before anything is loaded); a V4 checkpoint has its own
    drafter, so draft= is an error there."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    for kw in (dict(kv_cache_dtype="bf16"), dict(attention_backend="reference"),
               dict(kv_cache_memory=1 << 20), dict(target_cuda_graphs=False),
               dict(weight_format="quantized"), dict(tensor_parallel_size=2),
               dict(overlap_decode=True)):
        with pytest.raises(EngineConfigError) as e:
            Engine(str(tmp_path), device="cpu", **kw)
        assert "DeepSeek-V4 setting(s) that a Qwen3 checkpoint does not use" in str(e.value)
        assert next(iter(kw)) in str(e.value)
    with pytest.raises(EngineConfigError, match="draft=.*applies to Qwen3 targets only"):
        Engine(default_model_path(), device="cpu", draft=str(tmp_path))
