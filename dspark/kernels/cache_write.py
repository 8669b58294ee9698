"""Fused quantise-and-scatter kernels for the paged KV caches (spec §6.1, §6.2).

Both kernels write exactly the bytes that ``dspark.formats.layouts.write_fp8_ds_mla`` /
``write_indexer_fp8`` write (that torch code is the byte-level reference):

* input rounded to bf16 first (REF/vLLM quantise bf16 activations),
* tile scale 2^e with e = ceil(log2(max(amax, 1e-4) / 448)), stored as UE8M0 byte e + 127
  (fp8_ds_mla, 7 tiles of 64) or as an fp32 power of two (indexer, one tile of 128),
* values x / 2^e rounded to e4m3 (round to nearest even, incl. subnormals).

Every rounding step is integer bit arithmetic instead of float casts: ceil(log2(·)) from the
exponent bits (a float log2 can land on an integer just above a power of two), and fp32→bf16 /
fp32→e4m3 rounding by hand. That makes the output identical on GPU and under TRITON_INTERPRET,
whose float down-casts do not round to nearest even (triton 3.9).

Slots are global entry ids ``page · N + row``; a negative slot skips the row (padding tokens in a
fixed-size batch), unlike the torch writer which rejects it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (int32, low 16 bits), round to nearest even. Finite x only."""
    b = x.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16) & 0xFFFF


@triton.jit
def _bf16_round(x):
    """Round fp32 x to the nearest bf16 value, returned as fp32."""
    return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _tile_exponent(amax):
    """e = ceil(log2(max(amax, 1e-4) / 448)) for amax ≥ 0, exact (int32).

    With amax = M·2^E (M in [1, 2)): amax/448 = (M/1.75)·2^(E-8), so e = E-8 if M ≤ 1.75 else
    E-7. (The correctly rounded fp32 quotient the torch reference takes the log of never rounds
    onto a power of two unless M = 1.75 exactly, so both agree on every input.)"""
    a = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    E = (a >> 23) - 127
    frac = a & 0x7FFFFF
    return E - 8 + (frac > 0x600000).to(tl.int32)


@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(v):
    """fp32 v with |v| ≤ 448 -> e4m3fn byte (int32), round to nearest even, subnormals exact."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    E = a >> 23
    # normal e4m3 (|v| ≥ 2^-6, fp32 biased exponent ≥ 121): drop 20 mantissa bits with RNE; the
    # carry of a rounded-up mantissa moves into the exponent field as it should
    r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = r - (120 << 3)  # exponent bias 127 -> 7
    # subnormal e4m3: code = RNE(|v| · 2^9) = RNE(m · 2^(E - 141)) for the 24-bit significand m
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(141 - E, 31)  # ≥ 21 here; 31 flushes fp32 zeros/denormals to 0
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(E >= 121, normal, q)
    return sign | tl.minimum(code, 0x7E)


@triton.jit
def _write_fp8_ds_mla_kernel(cache_ptr, cache_i16_ptr, page_bytes, N, slot_ptr, x_ptr, stride_x):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot >= 0:
        page = slot // N
        row = slot - page * N
        rec = cache_ptr + page * page_bytes + row * 576
        g = tl.arange(0, 8)[:, None]           # tile id; tile 7 is the RoPE part
        j = tl.arange(0, 64)[None, :]
        x = tl.load(x_ptr + i.to(tl.int64) * stride_x + g * 64 + j).to(tl.float32)
        x = _bf16_round(x)
        e = _tile_exponent(tl.max(tl.abs(x), axis=1))          # [8]
        q = _e4m3_code(x, _pow2(-e)[:, None])
        is_nope = g < 7
        tl.store(rec + g * 64 + j, q.to(tl.uint8), mask=is_nope)
        # RoPE part: the 64 bf16 bit patterns at bytes 448..575 of the data row, stored through
        # an int16 view of the cache (2-aligned: 576 | page_bytes)
        rope_at = (page * page_bytes + row * 576 + 448) // 2
        tl.store(cache_i16_ptr + rope_at + j + g * 0, _bf16_bits(x).to(tl.int16), mask=g == 7)
        # scale row: 7 UE8M0 bytes + one zero pad byte
        gg = tl.arange(0, 8)
        sbyte = tl.where(gg < 7, e + 127, 0)
        tl.store(cache_ptr + page * page_bytes + N * 576 + row * 8 + gg, sbyte.to(tl.uint8))


@triton.jit
def _write_indexer_fp8_kernel(cache_ptr, cache_f32_ptr, page_bytes, N, slot_ptr, x_ptr,
                              stride_x):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot >= 0:
        page = slot // N
        row = slot - page * N
        d = tl.arange(0, 128)
        x = _bf16_round(tl.load(x_ptr + i.to(tl.int64) * stride_x + d).to(tl.float32))
        e = _tile_exponent(tl.max(tl.abs(x), axis=0))
        q = _e4m3_code(x, _pow2(-e))
        tl.store(cache_ptr + page * page_bytes + row * 128 + d, q.to(tl.uint8))
        # fp32 scale at byte page·page_bytes + N·128 + row·4 (4-aligned: page_bytes % 576 == 0)
        tl.store(cache_f32_ptr + (page * page_bytes + N * 128 + row * 4) // 4, _pow2(e))


@triton.jit
def _sign_bit(x):
    """The sign bit of fp32 x as int32 (0 or INT32_MIN), read from the bits: float arithmetic on
    the GPU may drop the sign of a zero (-0.0 * 2^k came out +0.0 on the H200), the torch
    reference keeps it."""
    return x.to(tl.int32, bitcast=True) & (-2147483648)


@triton.jit
def _e4m3_code(x, inv_scale):
    """The e4m3fn byte stored for x at tile scale 1 / inv_scale (a power of two): the magnitude
    from x * inv_scale, the sign from x's own bits (_sign_bit: -0.0 keeps its sign)."""
    return (_e4m3_bits(x * inv_scale) & 0x7F) | ((_sign_bit(x) >> 24) & 0x80)


@triton.jit
def _e4m3_value(code):
    """e4m3fn byte (int32 0..255, no NaN codes) -> its fp32 value, exactly."""
    E = (code >> 3) & 0xF
    M = code & 7
    normal = (((E + 120) << 23) | (M << 20)).to(tl.float32, bitcast=True)   # (1 + M/8)·2^(E-7)
    v = tl.where(E == 0, M.to(tl.float32) * (1.0 / 512.0), normal)         # subnormal: M·2^-9
    return tl.where((code & 0x80) != 0, -v, v)


@triton.jit
def _fp8_ds_mla_roundtrip_kernel(x_ptr, stride_x, out_ptr, stride_o):
    """One 512-d row: what storing it as an fp8_ds_mla record and reading it back gives."""
    i = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, 8)[:, None]               # tile id; tile 7 is the RoPE part
    j = tl.arange(0, 64)[None, :]
    x = _bf16_round(tl.load(x_ptr + i * stride_x + g * 64 + j).to(tl.float32))
    e = _tile_exponent(tl.max(tl.abs(x), axis=1))[:, None]                 # [8, 1]
    # magnitude through the e4m3 code and back, then x's own sign bit (quantisation keeps it)
    mag = _e4m3_value(_e4m3_bits(x * _pow2(-e)) & 0x7F) * _pow2(e)
    nope = (mag.to(tl.int32, bitcast=True) | _sign_bit(x)).to(tl.float32, bitcast=True)
    y = tl.where(g < 7, nope, x)
    tl.store(out_ptr + i * stride_o + g * 64 + j, y.to(out_ptr.dtype.element_ty))


def fp8_ds_mla_roundtrip_triton(x: torch.Tensor) -> torch.Tensor:
    """``dspark.formats.layouts.fp8_ds_mla_roundtrip`` of ``x`` [..., 512] in one launch (the
    dense path's fp8 storage rounding, `QuantSim.kv`): bf16 rounding, 7 FP8 tiles of 64 with
    UE8M0 scales, the 64 RoPE dims kept as bf16; same dtype and shape as x, bit-identical to the
    torch formula."""
    assert x.shape[-1] == 512 and x.is_floating_point(), "fp8_ds_mla rows are 512-d floats"
    rows = x.reshape(-1, 512)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _fp8_ds_mla_roundtrip_kernel[(rows.shape[0],)](rows, rows.stride(0), out, out.stride(0),
                                                      num_warps=4)
    return out.view(x.shape)


def _check(cache: torch.Tensor, N: int, slots: torch.Tensor, x: torch.Tensor, dim: int,
           row_bytes: int, name: str):
    assert cache.dtype == torch.uint8 and cache.dim() == 2 and cache.is_contiguous(), \
        f"{name}: cache must be a contiguous uint8 [num_pages, page_bytes] tensor"
    assert cache.shape[1] >= N * row_bytes, f"{name}: page too small for {N} entries"
    assert x.dim() == 2 and x.shape[1] == dim and x.is_floating_point(), \
        f"{name}: x must be float [n, {dim}]"
    assert slots.dim() == 1 and slots.shape[0] == x.shape[0], f"{name}: slots must be [n]"
    if x.stride(1) != 1:
        x = x.contiguous()
    return slots.to(device=cache.device, dtype=torch.int64).contiguous(), x


def write_fp8_ds_mla_triton(cache: torch.Tensor, entries_per_page: int, slots: torch.Tensor,
                            x: torch.Tensor) -> None:
    """Quantise ``x`` [n, 512] (any float dtype) into fp8_ds_mla records at ``slots`` [n] (int64,
    global entry ids; < 0 = skip) of ``cache`` uint8 [num_pages, page_bytes], in place."""
    slots, x = _check(cache, entries_per_page, slots, x, 512, 584, "write_fp8_ds_mla_triton")
    if x.shape[0] == 0:
        return
    assert cache.shape[1] % 2 == 0, "fp8_ds_mla page size must be even"
    _write_fp8_ds_mla_kernel[(x.shape[0],)](cache, cache.view(torch.int16), cache.shape[1],
                                            entries_per_page, slots, x, x.stride(0), num_warps=4)


def write_indexer_fp8_triton(cache: torch.Tensor, entries_per_page: int, slots: torch.Tensor,
                             x: torch.Tensor) -> None:
    """Quantise indexer keys ``x`` [n, 128] into 132-B FP8 rows at ``slots`` [n] (int64, global
    entry ids; < 0 = skip) of ``cache`` uint8 [num_pages, page_bytes], in place."""
    slots, x = _check(cache, entries_per_page, slots, x, 128, 132, "write_indexer_fp8_triton")
    assert cache.shape[1] % 4 == 0, "indexer page size must be a multiple of 4 bytes"
    if x.shape[0] == 0:
        return
    _write_indexer_fp8_kernel[(x.shape[0],)](cache, cache.view(torch.float32), cache.shape[1],
                                             entries_per_page, slots, x, x.stride(0),
                                             num_warps=1)


__all__ = ["write_fp8_ds_mla_triton", "write_indexer_fp8_triton"]
