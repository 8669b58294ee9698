"""FP8 / FP4 / UE8M0 formats (spec §5.2) against independent oracles: NumPy bit formulas
(tests/hf_oracle.py), torch's own e4m3 decoder, and brute-force nearest-code search."""
import numpy as np
import pytest
import torch

from dspark.formats.quant import (dequant_fp4_experts, dequant_fp8_blocks, e8m0_to_float,
                                 quant_fp4, quant_fp8_blocks)
from hf_oracle import np_dequant_fp4, np_dequant_fp8, np_e2m1, np_e4m3, np_e8m0

ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def e8m0(b) -> torch.Tensor:
    return torch.as_tensor(b, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def assert_same(ours: torch.Tensor, ref: np.ndarray):
    """Bit-level equality after rounding the float64 reference to float32 (NaN == NaN; products
    beyond the fp32 range become inf on both sides)."""
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(ours.numpy(), ref.astype(np.float32))


# ---- the oracles themselves ---------------------------------------------------------------------

def test_numpy_e4m3_formula_agrees_with_torch_decoder():
    torch_vals = ALL_BYTES.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(np_e4m3(ALL_BYTES.numpy()).astype(np.float32), torch_vals)


def test_numpy_formulas_known_values():
    assert np_e4m3(np.array([0x38, 0x7E, 0x01, 0x08, 0xB8]) ).tolist() == [1.0, 448.0, 2.0**-9, 2.0**-6, -1.0]
    assert np.isnan(np_e4m3(np.array([0x7F, 0xFF]))).all()
    lut = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]   # spec §5.2
    assert np_e2m1(np.arange(16)).tolist() == lut
    assert np_e8m0(np.array([0, 127, 128, 254])).tolist() == [2.0**-127, 1.0, 2.0, 2.0**127]


# ---- decoding -----------------------------------------------------------------------------------

def test_e8m0_all_bytes_exact():
    assert_same(e8m0_to_float(ALL_BYTES.view(torch.float8_e8m0fnu)), np_e8m0(ALL_BYTES.numpy()))
    assert torch.isnan(e8m0_to_float(e8m0([255]))).all()


def test_fp8_all_codes_under_extreme_scales():
    # 2 rows x 256 codes each, tile grid [1, 2]; scales include 2^-127 (fp32 subnormal products)
    # and 2^127 (products overflow fp32 to inf, as in the reference float32 computation)
    codes = ALL_BYTES.repeat(2, 1)
    for scale_bytes in ([[127, 127]], [[0, 1]], [[254, 200]], [[60, 255]]):
        ours = dequant_fp8_blocks(codes.view(torch.float8_e4m3fn), e8m0(scale_bytes))
        assert_same(ours, np_dequant_fp8(codes.numpy(), np.array(scale_bytes, dtype=np.uint8)))


def test_fp8_random_bits_partial_tiles():
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (300, 200), generator=g, dtype=torch.uint8)    # 3 x 2 tiles, partial
    s = torch.randint(100, 150, (3, 2), generator=g, dtype=torch.uint8)
    ours = dequant_fp8_blocks(w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu))
    assert_same(ours, np_dequant_fp8(w.numpy(), s.numpy()))
    # raw uint8 views of both are accepted and give the same result
    assert_same(dequant_fp8_blocks(w, s), np_dequant_fp8(w.numpy(), s.numpy()))
    assert dequant_fp8_blocks(w, s, torch.bfloat16).dtype == torch.bfloat16


def test_fp4_all_codes_and_nibble_order():
    # every byte once per row: low nibble must be the even column
    packed = ALL_BYTES.repeat(3, 1).view(torch.int8)                  # [3, 256] -> 512 columns
    scale_bytes = np.array([[127] * 16, [0] * 8 + [254] * 8, list(range(100, 116))], dtype=np.uint8)
    ours = dequant_fp4_experts(packed, torch.from_numpy(scale_bytes).view(torch.float8_e8m0fnu))
    assert_same(ours, np_dequant_fp4(packed.view(torch.uint8).numpy(), scale_bytes))
    assert ours[0, :4].tolist() == [0.0, 0.0, 0.5, 0.0]                # byte 0 -> (0, 0), byte 1 -> (.5, 0)
    assert ours[0, 2 * 0x71: 2 * 0x71 + 2].tolist() == [0.5, 6.0]      # byte 0x71: low 1, high 7


def test_fp4_random_bits_partial_group():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (70, 50), generator=g, dtype=torch.uint8)  # 100 cols: 4 groups
    s = torch.randint(90, 160, (70, 4), generator=g, dtype=torch.uint8)
    ours = dequant_fp4_experts(packed.view(torch.int8), s.view(torch.float8_e8m0fnu))
    assert_same(ours, np_dequant_fp4(packed.numpy(), s.numpy()))


def test_scale_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequant_fp8_blocks(torch.zeros(200, 100, dtype=torch.uint8), e8m0(np.zeros((1, 1), np.uint8)))
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        dequant_fp4_experts(torch.zeros(4, 20, dtype=torch.int8), e8m0(np.zeros((4, 1), np.uint8)))
    with pytest.raises(ValueError, match="1-byte dtype"):
        dequant_fp8_blocks(torch.zeros(4, 4), e8m0(np.zeros((1, 1), np.uint8)))


# ---- quantization -------------------------------------------------------------------------------

def _tile_amax(w: np.ndarray, br: int, bc: int) -> np.ndarray:
    gr, gc = -(-w.shape[0] // br), -(-w.shape[1] // bc)
    return np.array([[np.abs(w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]).max() for j in range(gc)]
                     for i in range(gr)])


def _nearest_error(w: np.ndarray, scale: np.ndarray, code_values: np.ndarray) -> np.ndarray:
    """Brute force: distance from each w to the nearest representable code * scale."""
    cand = scale[..., None] * code_values[None, None, :]
    return np.abs(w[..., None] - cand).min(axis=-1)


def test_quant_fp8_scale_rule_and_nearest_codes():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 2, 300)   # wide range per column
    codes, scale = quant_fp8_blocks(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (2, 3)
    want_exp = np.ceil(np.log2(_tile_amax(w.double().numpy(), 128, 128) / 448.0))
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy().astype(np.int64), want_exp + 127)
    deq = dequant_fp8_blocks(codes, scale).double().numpy()
    s_full = np.repeat(np.repeat(np_e8m0(scale.view(torch.uint8).numpy()), 128, 0), 128, 1)[:200, :300]
    finite_codes = np_e4m3(np.arange(256))
    finite_codes = finite_codes[np.isfinite(finite_codes)]
    err = np.abs(deq - w.double().numpy())
    np.testing.assert_allclose(err, _nearest_error(w.double().numpy(), s_full, finite_codes), rtol=0, atol=0)


def test_quant_fp8_exact_power_of_two_boundaries():
    w = torch.zeros(128, 384)
    w[0, 0], w[0, 128], w[0, 256] = 448.0, 449.0, 448.0 * 8
    _, scale = quant_fp8_blocks(w)
    assert scale.view(torch.uint8).tolist() == [[127, 128, 130]]
    codes, scale = quant_fp8_blocks(torch.zeros(5, 7))           # all-zero tile: finite tiny scale
    assert (dequant_fp8_blocks(codes, scale) == 0).all()


def test_quant_fp8_is_value_idempotent():
    g = torch.Generator().manual_seed(3)
    w = dequant_fp8_blocks(*quant_fp8_blocks(torch.randn(130, 260, generator=g)))
    assert torch.equal(dequant_fp8_blocks(*quant_fp8_blocks(w)), w)


def test_quant_fp4_scale_rule_nearest_codes_and_ties():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-2, 1, 96)
    packed, scale = quant_fp4(w)
    assert packed.shape == (64, 48) and packed.dtype == torch.int8 and scale.shape == (64, 3)
    want_exp = np.ceil(np.log2(_tile_amax(w.double().numpy(), 1, 32) / 6.0))
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy().astype(np.int64), want_exp + 127)
    deq = dequant_fp4_experts(packed, scale).double().numpy()
    s_full = np.repeat(np_e8m0(scale.view(torch.uint8).numpy()), 32, 1)
    err = np.abs(deq - w.double().numpy())
    np.testing.assert_allclose(err, _nearest_error(w.double().numpy(), s_full, np_e2m1(np.arange(16))),
                               rtol=0, atol=0)
    # exact midpoints round to the neighbour with the even code; amax 6 keeps the scale at 1
    mids = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, -5.0]])
    deq = dequant_fp4_experts(*quant_fp4(mids))
    assert deq.tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0]]


def test_quant_fp4_partial_group_round_trip():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 70, generator=g)                 # 70 cols: last group has 6 columns
    packed, scale = quant_fp4(w)
    assert scale.shape == (3, 3)
    w2 = dequant_fp4_experts(packed, scale)
    assert torch.equal(dequant_fp4_experts(*quant_fp4(w2)), w2)
    assert ((w2 - w).abs() <= w.abs().amax() / 6 * 2 * 1.0).all()  # within one code step of the max
    with pytest.raises(ValueError, match="even number of columns"):
        quant_fp4(torch.randn(2, 5))
