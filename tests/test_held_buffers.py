"""Buffers kernels keep across launches are baked into every CUDA graph captured while they were
current: growing one must never free the buffer it replaces (an older graph would write into
memory the allocator has given to another tensor, or read an unmapped address)."""
import gc
import weakref

import torch

from dspark.cuda.graph_capture import held_buffer


def test_a_grown_buffer_keeps_the_one_it_replaces_alive():
    store = {}
    small = held_buffer(store, "k", 10, lambda n: torch.zeros(n, dtype=torch.int32))
    assert held_buffer(store, "k", 4, lambda n: torch.ones(n)) is small     # large enough: kept
    ref = weakref.ref(small)
    big = held_buffer(store, "k", 100, lambda n: torch.zeros(n, dtype=torch.int32))
    assert big.numel() == 100 and store["k"] is big
    assert held_buffer(store, "k", 101, lambda n: torch.zeros(n)).numel() == 200   # doubling
    del small
    gc.collect()
    assert ref() is not None, "the replaced buffer was freed"


def test_arrival_counters_and_rope_tables_keep_outgrown_buffers():
    """The split-K kernels' arrival counters (fp8_gemm, shared with the FP4 MoE kernels; the
    router's) and the shared RoPE tables: a request for more replaces the buffer, the old one
    stays alive."""
    from dspark.kernels import fp8_gemm, gate_route
    from dspark.models.deepseek_v4.rope import Rope
    for get in (fp8_gemm._arrival_counters, gate_route._counters):
        first = get("cpu", 8)
        ref = weakref.ref(first)
        grown = get("cpu", first.numel() + 1)
        assert grown.numel() > first.numel() and not grown.any()
        del first
        gc.collect()
        assert ref() is not None, get.__module__
    rope = Rope(64, 10000.0)
    t = rope.table(10, "cpu")
    ref = weakref.ref(t)
    assert rope.table(t.shape[0] + 1, "cpu").shape[0] > t.shape[0]
    del t
    gc.collect()
    assert ref() is not None
