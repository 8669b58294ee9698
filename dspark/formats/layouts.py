"""Byte-exact KV-cache record formats for DeepSeek-V4 (spec deepseek_v4.md §6, §3.5, §3.6).

Everything here is plain torch (works on CPU and CUDA, no Python loop over entries) and is
the reference that fused kernels must match byte for byte.

Records
-------
* ``fp8_ds_mla`` (584 B per 512-d vector; SWA ring and CSA/HCA compressed entries):
  data row  = 448 B  dims 0..447 as FP8 e4m3, quantized in 7 tiles of 64
            + 128 B  dims 448..511 (the RoPE part) as bf16, little-endian
  scale row = 7 B    UE8M0 tile scales (byte = exponent + 127) + 1 zero pad byte.
  Tile scale s = 2^ceil(log2(max(amax, 1e-4) / 448)).
* Indexer key (132 B per 128-d row): 128 B FP8 e4m3 + one fp32 scale (power of two, same
  rule, block = whole row).

Pages (N entries per page; ``slot = page * N + row``)
-----------------------------------------------------
* fp8_ds_mla: bytes [0, N*576) data rows (row r at r*576), [N*576, N*576 + N*8) scale rows
  (row r at N*576 + r*8), then zero padding up to a multiple of 576 B (FlashMLA addresses pages
  with a 576-B row stride).
* indexer: bytes [0, N*128) values, [N*128, N*128 + N*4) fp32 scales, padded to 576 B.

Quantizers read a bf16-rounded copy of the input, as the reference and vLLM do (the model's
activations are bf16 there). Inputs must be finite: NaN/inf produce garbage scales.

Also here: the FP4 (e2m1) fake-quant and the 128-point orthonormal Hadamard transform that the
reference applies to indexer queries and keys (§3.5, §3.6).
"""

from __future__ import annotations

import torch

# ---- fp8_ds_mla record constants -------------------------------------------------------------
HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64
NUM_TILES = NOPE_DIM // TILE  # 7
DATA_ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: fp8 nope + bf16 rope
SCALE_ROW_BYTES = NUM_TILES + 1  # 8: 7 UE8M0 bytes + 1 pad byte
RECORD_BYTES = DATA_ROW_BYTES + SCALE_ROW_BYTES  # 584
PAGE_ALIGN = 576  # FlashMLA's page row stride

# ---- indexer record constants ----------------------------------------------------------------
INDEXER_DIM = 128
INDEXER_SCALE_BYTES = 4  # one fp32
INDEXER_ROW_BYTES = INDEXER_DIM + INDEXER_SCALE_BYTES  # 132

FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_AMAX_FLOOR = 1e-4  # keeps all-zero tiles from producing a zero / denormal scale
FP4_MAX = 6.0  # largest e2m1 value
FP4_BLOCK = 32
FP4_AMAX_FLOOR = 6.0 * 2.0**-126  # => smallest scale is 2^-126, still a normal fp32

# Finite inputs keep the exponent well inside this range (bf16 max / 448 < 2^120, floors above
# give >= 2^-126); clamping only guards the bit tricks below.
_MIN_EXP, _MAX_EXP = -126, 127


# ---- power-of-two helpers (exact, no transcendental functions) ---------------------------------
def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(v)) for positive normal float32 ``v`` -> int32 (same shape).

    Read from the bits instead of calling log2: a float log2 can land on an integer for a value
    just above a power of two and give a scale one step too small.
    """
    bits = v.to(torch.float32).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    has_fraction = (bits & 0x7FFFFF) != 0
    return (exponent + has_fraction.to(torch.int32)).clamp(_MIN_EXP, _MAX_EXP)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2.0**exponent as float32 for int exponents in [-126, 127], built from the bits (exact)."""
    biased = (exponent.to(torch.int32).clamp(_MIN_EXP, _MAX_EXP) + 127) << 23
    return biased.view(torch.float32)


def ue8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """Decode UE8M0 bytes (uint8, any shape) to float32: 2^(b-127); 0 -> 2^-127, 255 -> NaN."""
    b = b.to(torch.int32)
    value = _pow2(b - 127)
    value = torch.where(b == 0, torch.full_like(value, 2.0**-127), value)
    return torch.where(b == 255, torch.full_like(value, float("nan")), value)


def _fp8_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dim of float32 ``x`` [..., k*tile] in tiles of ``tile``.

    Returns (fp8 bytes uint8 [..., k*tile], exponents int32 [..., k]); scale = 2^exponent.
    """
    tiles = x.unflatten(-1, (-1, tile))
    amax = tiles.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    exponent = _ceil_log2(amax / FP8_MAX)
    # Division by a power of two is exact, so the only rounding is the RNE cast to e4m3.
    # |q| <= 448 by construction; the clamp only protects against the guarded exponent range.
    q = (tiles / _pow2(exponent).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    q8 = q.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
    return q8, exponent


def _fp8_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def _check_rows(x: torch.Tensor, dim: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"{name}: expected a [n, {dim}] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")


def _check_bytes(t: torch.Tensor, shape_tail: tuple[int, ...], name: str) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 + len(shape_tail) or tuple(t.shape[1:]) != shape_tail:
        raise ValueError(
            f"{name}: expected uint8 [n, {', '.join(map(str, shape_tail))}], "
            f"got {t.dtype} {tuple(t.shape)}"
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- fp8_ds_mla: records -----------------------------------------------------------------------
def quantize_fp8_ds_mla(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` [n, 512] (any float dtype) into fp8_ds_mla records.

    Returns ``data`` uint8 [n, 576] (448 fp8 e4m3 bytes, then 64 bf16 values = 128 bytes) and
    ``scales`` uint8 [n, 8] (7 UE8M0 tile scales, then a zero pad byte).
    """
    _check_rows(x, HEAD_DIM, "quantize_fp8_ds_mla")
    xb = x.to(torch.bfloat16)  # the reference quantizes bf16 activations
    nope_bytes, exponent = _fp8_tiles(xb[:, :NOPE_DIM].to(torch.float32), TILE)
    n = x.shape[0]
    data = torch.empty(n, DATA_ROW_BYTES, dtype=torch.uint8, device=x.device)
    data[:, :NOPE_DIM] = nope_bytes
    data[:, NOPE_DIM:] = xb[:, NOPE_DIM:].contiguous().view(torch.uint8)  # little-endian bf16
    scales = torch.zeros(n, SCALE_ROW_BYTES, dtype=torch.uint8, device=x.device)
    scales[:, :NUM_TILES] = (exponent + 127).to(torch.uint8)
    return data, scales


def dequantize_fp8_ds_mla(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decode records: ``data`` uint8 [n, 576], ``scales`` uint8 [n, 8] -> float32 [n, 512]."""
    _check_bytes(data, (DATA_ROW_BYTES,), "dequantize_fp8_ds_mla data")
    _check_bytes(scales, (SCALE_ROW_BYTES,), "dequantize_fp8_ds_mla scales")
    nope = _fp8_bytes_to_float(data[:, :NOPE_DIM]).unflatten(-1, (NUM_TILES, TILE))
    nope = nope * ue8m0_to_float(scales[:, :NUM_TILES]).unsqueeze(-1)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope.flatten(-2), rope], dim=-1)


def fp8_ds_mla_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Fake-quant ``x`` [..., 512] through the 584-B record; returns x's dtype and shape."""
    flat = x.reshape(-1, HEAD_DIM)
    return dequantize_fp8_ds_mla(*quantize_fp8_ds_mla(flat)).to(x.dtype).reshape(x.shape)


# ---- indexer keys: records ---------------------------------------------------------------------
def quantize_indexer_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode indexer keys ``x`` [n, 128] -> (values uint8 [n, 128] fp8 e4m3,
    scales uint8 [n, 4] = the bytes of one little-endian fp32 power-of-two scale per row)."""
    _check_rows(x, INDEXER_DIM, "quantize_indexer_fp8")
    xf = x.to(torch.bfloat16).to(torch.float32)
    values, exponent = _fp8_tiles(xf, INDEXER_DIM)
    scales = _pow2(exponent).contiguous().view(torch.uint8)  # [n, 1] fp32 -> [n, 4] bytes
    return values, scales


def dequantize_indexer_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decode indexer rows: values uint8 [n, 128], scales uint8 [n, 4] -> float32 [n, 128]."""
    _check_bytes(values, (INDEXER_DIM,), "dequantize_indexer_fp8 values")
    _check_bytes(scales, (INDEXER_SCALE_BYTES,), "dequantize_indexer_fp8 scales")
    return _fp8_bytes_to_float(values) * scales.contiguous().view(torch.float32)


def indexer_fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Fake-quant ``x`` [..., 128] through the 132-B indexer row; returns x's dtype and shape."""
    flat = x.reshape(-1, INDEXER_DIM)
    return dequantize_indexer_fp8(*quantize_indexer_fp8(flat)).to(x.dtype).reshape(x.shape)


# ---- pages (same scheme for both record kinds: all value rows, then all scale rows) --------------
def fp8_ds_mla_page_bytes(entries_per_page: int) -> int:
    """Bytes of one page holding N records: N*584 rounded up to a multiple of 576."""
    return _page_bytes(entries_per_page, RECORD_BYTES)


def indexer_page_bytes(entries_per_page: int) -> int:
    """Bytes of one indexer page holding N rows: N*132 rounded up to a multiple of 576."""
    return _page_bytes(entries_per_page, INDEXER_ROW_BYTES)


def _page_bytes(entries_per_page: int, record_bytes: int) -> int:
    if entries_per_page < 1:
        raise ValueError(f"entries_per_page must be >= 1, got {entries_per_page}")
    return _round_up(entries_per_page * record_bytes, PAGE_ALIGN)


def _paged_rows(
    cache: torch.Tensor, n: int, slots: torch.Tensor, row_bytes: int, scale_bytes: int, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and locate ``slots`` [k] in ``cache`` uint8 [num_pages, page_bytes].

    Returns (values view [num_pages, N, row_bytes], scales view [num_pages, N, scale_bytes],
    page [k], row [k]); the views alias ``cache``, so ``values[page, row] = ...`` writes it.
    """
    page_bytes = _page_bytes(n, row_bytes + scale_bytes)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != page_bytes:
        raise ValueError(
            f"{name}: cache must be uint8 [num_pages, {page_bytes}] for {n} entries per page, "
            f"got {cache.dtype} {tuple(cache.shape)}"
        )
    if cache.stride(1) != 1:
        raise ValueError(f"{name}: cache rows must be contiguous (stride(1) == 1)")
    if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name}: slots must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}"
        )
    slots = slots.to(device=cache.device, dtype=torch.int64)
    # Negative slots would silently wrap around to the last page, so reject them. Checking needs
    # the values on the host: done on CPU only (on CUDA it would force a sync per call; there a
    # slot >= capacity still fails in indexing, a negative one does not).
    if slots.device.type == "cpu" and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= cache.shape[0] * n:
            raise IndexError(
                f"{name}: slots must lie in [0, {cache.shape[0] * n}) "
                f"({cache.shape[0]} pages x {n} entries), got min {lo}, max {hi}"
            )
    pages = cache.shape[0]
    values = cache[:, : n * row_bytes].view(pages, n, row_bytes)
    scales = cache[:, n * row_bytes : n * (row_bytes + scale_bytes)].view(pages, n, scale_bytes)
    return values, scales, slots // n, slots % n


def write_fp8_ds_mla(
    cache: torch.Tensor, entries_per_page: int, slots: torch.Tensor, x: torch.Tensor
) -> None:
    """Quantize ``x`` [n, 512] and store record i at ``slots[i]`` (= page*N + row).

    ``cache`` is uint8 [num_pages, fp8_ds_mla_page_bytes(N)], written in place. Duplicate slots
    in one call: which write wins is unspecified (as with any scatter).
    """
    _write_paged(cache, entries_per_page, slots, x, HEAD_DIM, DATA_ROW_BYTES, SCALE_ROW_BYTES,
                 quantize_fp8_ds_mla, "write_fp8_ds_mla", "vectors")


def read_fp8_ds_mla(cache: torch.Tensor, entries_per_page: int, slots: torch.Tensor) -> torch.Tensor:
    """Gather and decode the records at ``slots`` [n] -> float32 [n, 512]."""
    return _read_paged(cache, entries_per_page, slots, DATA_ROW_BYTES, SCALE_ROW_BYTES,
                       dequantize_fp8_ds_mla, "read_fp8_ds_mla")


def write_indexer_fp8(
    cache: torch.Tensor, entries_per_page: int, slots: torch.Tensor, x: torch.Tensor
) -> None:
    """Quantize keys ``x`` [n, 128] and store row i at ``slots[i]`` in ``cache``
    (uint8 [num_pages, indexer_page_bytes(N)], written in place)."""
    _write_paged(cache, entries_per_page, slots, x, INDEXER_DIM, INDEXER_DIM, INDEXER_SCALE_BYTES,
                 quantize_indexer_fp8, "write_indexer_fp8", "keys")


def read_indexer_fp8(cache: torch.Tensor, entries_per_page: int, slots: torch.Tensor) -> torch.Tensor:
    """Gather and decode the indexer rows at ``slots`` [n] -> float32 [n, 128]."""
    return _read_paged(cache, entries_per_page, slots, INDEXER_DIM, INDEXER_SCALE_BYTES,
                       dequantize_indexer_fp8, "read_indexer_fp8")


def _write_paged(cache, entries_per_page, slots, x, dim, value_bytes, scale_bytes, quantize,
                 name, what):
    """Quantize rows x [n, dim] with `quantize` and store row i at slots[i] of a paged cache
    whose pages hold value rows then scale rows (layout: _paged_rows)."""
    _check_rows(x, dim, f"{name} x")
    if slots.shape != x.shape[:1]:
        raise ValueError(f"{name}: {tuple(slots.shape)} slots for {x.shape[0]} {what}")
    values, scale_rows, page, row = _paged_rows(
        cache, entries_per_page, slots, value_bytes, scale_bytes, name)
    data, scales = quantize(x.to(cache.device))
    values[page, row] = data
    scale_rows[page, row] = scales


def _read_paged(cache, entries_per_page, slots, value_bytes, scale_bytes, dequantize, name):
    """Gather the rows at slots [n] of a paged cache and decode them with `dequantize`."""
    values, scale_rows, page, row = _paged_rows(
        cache, entries_per_page, slots, value_bytes, scale_bytes, name)
    return dequantize(values[page, row], scale_rows[page, row])


# ---- FP4 fake-quant and Hadamard (indexer q / keys in the reference) ----------------------------
def _round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Round float32 ``q`` (|q| <= 6 expected) to the e2m1 grid {0,.5,1,1.5,2,3,4,6}, ties to even.

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; rounding |q|/spacing with
    torch.round (half-to-even) is RNE because an even multiple of the spacing is exactly a grid
    point with an even mantissa. Saturates at 6 (satfinite).
    """
    a = q.abs()
    spacing = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(q.dtype)
    r = (torch.round(a / spacing) * spacing).clamp_max(FP4_MAX)
    return torch.copysign(r, q)


def fp4_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """FP4 (e2m1) fake-quant of ``x`` [..., D] (D % 32 == 0) in 32-blocks along the last dim.

    Block scale = 2^ceil(log2(amax / 6)), amax floored at 6*2^-126 (UE8M0-representable).
    Computed in float32 on the values as given; returns x's dtype (exact in bf16 too).
    """
    if x.shape[-1] % FP4_BLOCK:
        raise ValueError(f"fp4_roundtrip: last dim must be a multiple of {FP4_BLOCK}, got {x.shape[-1]}")
    blocks = x.to(torch.float32).unflatten(-1, (-1, FP4_BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    scale = _pow2(_ceil_log2(amax / FP4_MAX))
    return (_round_e2m1(blocks / scale) * scale).flatten(-2).to(x.dtype)


_HADAMARD: dict = {}      # device -> Sylvester ±1 matrix [128, 128] fp32


def _hadamard_matrix(device) -> torch.Tensor:
    device = torch.device(device)
    h = _HADAMARD.get(device)
    if h is None:
        # built outside inference mode (training multiplies by it under autograd too)
        with torch.inference_mode(False), torch.no_grad():
            i = torch.arange(INDEXER_DIM)
            bits = i[:, None] & i[None, :]
            parity = torch.zeros_like(bits)
            for k in range(7):
                parity ^= (bits >> k) & 1
            h = _HADAMARD[device] = (1 - 2 * parity).to(torch.float32).to(device)
    return h


def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (must be 128), Sylvester order:
    y = H x / sqrt(128) with H[i, j] = (-1)^popcount(i & j). Computed in float32, returns x's
    dtype. H is symmetric and orthonormal, so applying it twice is the identity.

    One fp32 GEMM with the ±1 matrix (cached per device) rather than 7 butterfly stages (21
    launches per call on the decode path): the products are exact, only the order of the 128-term
    sums differs; the 1/sqrt(128) factor is applied afterwards as before."""
    if x.shape[-1] != INDEXER_DIM:
        raise ValueError(f"hadamard128: last dim must be {INDEXER_DIM}, got {x.shape[-1]}")
    y = x.to(torch.float32).reshape(-1, INDEXER_DIM)
    if y.is_cuda and (torch.backends.cuda.matmul.allow_tf32
                      or torch.get_float32_matmul_precision() != "highest"):
        y = _butterflies(y)            # TF32 GEMMs (training turns them on) would round inputs
    else:
        y = y @ _hadamard_matrix(x.device)
    return (y * INDEXER_DIM**-0.5).reshape(x.shape).to(x.dtype)


def _butterflies(y: torch.Tensor) -> torch.Tensor:
    """H y for fp32 rows y [N, 128] by 7 butterfly stages: pair element j with j + h inside
    blocks of 2h."""
    h = 1
    while h < INDEXER_DIM:
        pairs = y.view(-1, INDEXER_DIM // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, INDEXER_DIM)
        h *= 2
    return y
