"""Each format against its definition: NVFP4's e2m1 codes, block scales and global scale
computed independently here in plain Python; fp8/int8 scales and the compressed-tensors tensors."""

from __future__ import annotations

import pytest
import torch

from kvmesh.checkpoint.formats import FORMATS, e2m1_decode, e2m1_encode, fake_quantize, get_format

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_e2m1(x: float) -> float:
    """The definition: the nearest e2m1 value, a tie going to the even code (mantissa 0)."""
    mag = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(mag - E2M1[c]), c % 2))
    return -E2M1[best] if x < 0 else E2M1[best]


def test_e2m1_rounds_to_nearest_with_ties_to_even():
    xs = [0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.25, -2.5, -5.0, -6.5]
    got = e2m1_decode(e2m1_encode(torch.tensor(xs))).tolist()
    assert got == [_nearest_e2m1(x) for x in xs]
    # The ties of the e2m1 grid, spelled out: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    assert got[2] == 0.0 and got[4] == 1.0 and got[5] == 1.0 and got[6] == 2.0 and got[7] == 2.0
    assert got[8] == 4.0 and got[9] == 4.0


def test_every_e2m1_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).tolist() == E2M1 + [-v for v in E2M1]
    assert e2m1_encode(e2m1_decode(codes)).tolist() == [0, *range(1, 8), 0, *range(9, 16)]  # -0 encodes as +0


def test_nvfp4_matches_the_definition_value_by_value():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.logspace(-3, 0, 8)[:, None]  # rows of very different magnitude
    t = get_format("nvfp4").quantize(w)
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (8, 32)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (8, 4)
    g = w.abs().max().item() / (6 * 448)
    assert t["weight_global_scale"].item() == pytest.approx(1 / g, rel=1e-6)  # stored as 1/g (compressed-tensors)
    deq = get_format("nvfp4").dequantize(t)
    for r in range(8):
        for b in range(4):
            block = w[r, 16 * b : 16 * (b + 1)].tolist()
            scale = torch.tensor(max(abs(v) for v in block) / (6 * g)).to(torch.float8_e4m3fn).float().item()
            assert t["weight_scale"][r, b].float().item() == scale
            want = [_nearest_e2m1(v / (scale * g)) * scale * g if scale else 0.0 for v in block]
            assert deq[r, 16 * b : 16 * (b + 1)].tolist() == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_nvfp4_packs_element_2i_in_the_low_nibble():
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 6.0, -1.0  # codes 7 and 8|2
    packed = get_format("nvfp4").quantize(w)["weight_packed"]
    assert packed[0, 0].item() == 7 | (10 << 4)


def test_nvfp4_needs_blocks_of_16():
    with pytest.raises(ValueError, match="divisible by 16"):
        get_format("nvfp4").quantize(torch.randn(4, 24))


@pytest.mark.parametrize(("name", "scale_shape", "dtype"), [
    ("fp8-tensor", (1,), torch.float8_e4m3fn), ("fp8-channel", (6, 1), torch.float8_e4m3fn),
    ("int8-channel", (6, 1), torch.int8),
])  # fmt: skip
def test_scaled_formats_map_the_largest_value_to_the_top_of_the_range(name, scale_shape, dtype):
    torch.manual_seed(1)
    w = torch.randn(6, 32) * torch.arange(1, 7)[:, None]
    t = get_format(name).quantize(w)
    assert t["weight"].dtype == dtype and t["weight_scale"].shape == scale_shape
    top = 127.0 if dtype == torch.int8 else 448.0
    amax = w.abs().amax() if name == "fp8-tensor" else w.abs().amax(1, keepdim=True)
    assert torch.allclose(t["weight_scale"], (amax / top).reshape(scale_shape))
    err = (get_format(name).dequantize(t) - w).abs()
    step = t["weight_scale"] * (1.0 if dtype == torch.int8 else 32.0)  # int8: one step; e4m3: top binade's step
    assert (err <= step / 2 + 1e-6).all()


def test_zero_weights_stay_zero_in_every_format():
    for name in FORMATS:
        assert fake_quantize(name, torch.zeros(4, 32)).abs().max().item() == 0.0


def test_stored_bits_per_weight():
    assert get_format("nvfp4").bits == 4.5 and get_format("fp8-channel").bits == 8.0
