"""The whole DSpark loop on the Triton attention backend (interpreter on CPU) produces the same
tokens as on the torch reference backend, with the real fp8_ds_mla cache."""
from dspark import Engine, SamplingParams


def test_triton_backend_engine_matches_reference(small_vocab_ckpt):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [3] * 20]
    outs = {}
    for backend in ("triton", "reference"):
        eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp8",
                     attention_backend=backend)
        outs[backend] = [o.token_ids for o in eng.generate(prompts, sp)]
        assert eng.cache.num_free_pages == eng.cache.num_blocks
    assert outs["triton"] == outs["reference"]
