"""Checkpoint weight formats of DeepSeek-V4 (spec §5.2) and their exact de-quantization.

* FP8: e4m3fn values, one UE8M0 scale per 128x128 tile.
* FP4 (routed experts): two e2m1 codes per int8 byte (low nibble = even column), one UE8M0 scale
  per row per 32 columns.
* UE8M0 (`torch.float8_e8m0fnu`): one byte b meaning 2^(b-127); b = 255 is NaN.

Scales are decoded from their raw bytes with integer ops (no e8m0 arithmetic kernels exist on CPU)
and every result is exact: a product of a code value and a power of two is representable in fp32.
Last tiles / groups may be partial when a dim is not a multiple of the block size; the scale grid
then has ceil(dim / block) entries along that dim.
"""
from __future__ import annotations

import math

import torch

FP8_BLOCK = 128          # FP8 scale tile: 128 x 128
FP4_GROUP = 32           # FP4 scale group: 1 row x 32 columns
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_TINY = torch.finfo(torch.float32).tiny   # amax floor: all-zero blocks get exponent -126


def _raw_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """The tensor's bytes as uint8 (accepts the typed 1-byte dtype or its uint8/int8 view)."""
    if t.element_size() != 1:
        raise ValueError(f"{what}: expected a 1-byte dtype, got {t.dtype}")
    return t.view(torch.uint8)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 2^(b-127), built bit-exactly (b = 0 is the fp32 subnormal 2^-127)."""
    b = _raw_bytes(scale, "e8m0 scale").to(torch.int32)
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 1 << 22))   # 2^-127 = mantissa-only bit 22
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)  # 0xFF encodes NaN
    return bits.view(torch.float32)


def float_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents e (clamped to [-127, 127]) -> `float8_e8m0fnu` scales 2^e."""
    return (exponent.clamp(-127, 127) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite float32 x (frexp: x = m * 2^k with m in [0.5, 1))."""
    m, k = torch.frexp(x)
    return torch.where(m == 0.5, k - 1, k).to(torch.int32)


def _tiles(x: torch.Tensor, grid: tuple, block_r: int, block_c: int) -> torch.Tensor:
    """View x [rows, cols] as tiles [gr, block_r, gc, block_c], zero-padding partial last tiles.
    Scale grids then broadcast as grid[:, None, :, None], never materialised at full size."""
    rows, cols = x.shape
    pad_r, pad_c = grid[0] * block_r - rows, grid[1] * block_c - cols
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(grid[0], block_r, grid[1], block_c)


def _untile(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])[:rows, :cols].contiguous()


def _check_grid(what: str, scale: torch.Tensor, want: tuple) -> None:
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} does not match the weight; "
                         f"expected {want}")


# ---- FP8 e4m3 with 128x128 UE8M0 tiles -----------------------------------------------------------

def fp8_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    return (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))


def dequant_fp8_blocks(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """W[o, k] = e4m3(w[o, k]) * 2^(scale[o // 128, k // 128] - 127), returned as `dtype`."""
    if w.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    _check_grid("FP8 weight", scale, fp8_scale_shape(rows, cols))
    values = _raw_bytes(w, "FP8 weight").view(torch.float8_e4m3fn).to(torch.float32)
    t = _tiles(values, scale.shape, FP8_BLOCK, FP8_BLOCK) * e8m0_to_float(scale)[:, None, :, None]
    return _untile(t, rows, cols).to(dtype)


def quant_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [O, I] -> (e4m3 codes [O, I], e8m0 scales [ceil(O/128), ceil(I/128)]).

    Scale per tile = 2^ceil(log2(amax / 448)) (the REF/DeepGEMM UE8M0 rule), so every scaled value
    fits e4m3's range; codes are rounded to nearest even by the fp8 cast. All-zero tiles get 2^-126.
    """
    if w.dim() != 2:
        raise ValueError(f"FP8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    t = _tiles(w.to(torch.float32), fp8_scale_shape(rows, cols), FP8_BLOCK, FP8_BLOCK)
    amax = t.abs().amax(dim=(1, 3))
    scale = float_to_e8m0(_ceil_log2((amax / E4M3_MAX).clamp(min=_TINY)))
    inv = 1.0 / e8m0_to_float(scale)          # exact: the reciprocal of a power of two
    codes = (t * inv[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return _untile(codes, rows, cols), scale


# ---- FP4 e2m1 experts with per-row 32-column UE8M0 groups ----------------------------------------

def fp4_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Scale grid of an FP4 weight with logical shape [rows, cols] (packed shape [rows, cols/2])."""
    return (rows, math.ceil(cols / FP4_GROUP))


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [O, I/2] -> float32 e2m1 values [O, I] (low nibble = even column)."""
    u8 = _raw_bytes(packed, "FP4 weight")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=u8.device)
    byte = torch.arange(256, device=u8.device)
    pairs = torch.stack([lut[byte & 0xF], lut[byte >> 4]], dim=1)    # [256, 2]: one row per byte
    return torch.nn.functional.embedding(u8.to(torch.int32), pairs).reshape(u8.shape[0], -1)


def dequant_fp4_experts(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """W[o, k] = LUT[nibble(o, k)] * 2^(scale[o, k // 32] - 127), returned as `dtype` [O, I]."""
    if packed.dim() != 2:
        raise ValueError(f"FP4 weight must be 2-D (packed [out, in/2]), got shape {tuple(packed.shape)}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    _check_grid("FP4 weight", scale, fp4_scale_shape(rows, cols))
    t = _tiles(unpack_fp4(packed), scale.shape, 1, FP4_GROUP) * e8m0_to_float(scale)[:, None, :, None]
    return _untile(t, rows, cols).to(dtype)


# e2m1 magnitudes are 0,.5,1,1.5,2,3,4,6; these are the midpoints between neighbours. A value
# exactly on a midpoint goes to the neighbour with the even code (round half to even), i.e. up at
# 0.75, 1.75 and 3.5 and down at the others.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (0.75, 1.75, 3.5)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (uint8 0..15) for values already scaled into [-6, 6]."""
    mag = x.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, mids)          # ties land on the lower neighbour ...
    for t in _E2M1_TIE_UP:                     # ... except where the upper one has the even code
        code = code + (mag == t).to(code.dtype)
    return (code + 8 * torch.signbit(x).to(code.dtype)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes [O, I] (I even) -> int8 [O, I/2], even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [O, I] -> (packed int8 [O, I/2], e8m0 scales [O, ceil(I/32)]).

    Scale per group = 2^ceil(log2(amax / 6)) so the scaled group fits e2m1's range; codes are the
    nearest e2m1 value (ties to even). All-zero groups get 2^-126.
    """
    if w.dim() != 2:
        raise ValueError(f"FP4 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    t = _tiles(w.to(torch.float32), fp4_scale_shape(rows, cols), 1, FP4_GROUP)
    amax = t.abs().amax(dim=(1, 3))
    scale = float_to_e8m0(_ceil_log2((amax / E2M1_MAX).clamp(min=_TINY)))
    inv = 1.0 / e8m0_to_float(scale)          # exact: the reciprocal of a power of two
    codes = _e2m1_codes((t * inv[:, None, :, None]).clamp_(-E2M1_MAX, E2M1_MAX))
    return pack_fp4(_untile(codes, rows, cols)), scale
