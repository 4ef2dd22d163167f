"""Compressors round-trip within their stated error; bit packing is lossless; outliers matter."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanml.memory.compressors import FLOAT_COMPRESSORS, bitpack, bitunpack, make_compressor, relative_error


def _reference_quant(x: np.ndarray, bits: int, axis: str, n_out: int) -> np.ndarray:
    """Independent numpy reference: symmetric rounding, outlier channels copied exactly."""
    qmax = 127 if bits == 8 else 7
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out_idx = np.argsort(-np.abs(x2).max(axis=0), kind="stable")[:n_out]
    body = x2.copy()
    body[:, out_idx] = 0.0
    ax = 0 if axis == "channel" else 1
    scale = np.maximum(np.abs(body).max(axis=ax, keepdims=True), 1e-12) / qmax
    y = np.clip(np.round(body / scale), -qmax, qmax) * scale
    y[:, out_idx] = x2[:, out_idx]
    return y.reshape(x.shape)


@pytest.mark.parametrize("name", ["int8-channel", "int8-token", "int4-channel", "int4-token"])
def test_quantizers_match_numpy_reference(name: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 50, 64)
    x[..., 5] *= 40.0  # an outlier channel
    comp = make_compressor(name, outlier_frac=0.02)  # ceil(0.02 * 64) = 2 channels
    y = comp.unpack(comp.pack(x))
    bits, axis = int(name[3]), name.split("-")[1]
    ref = _reference_quant(x.numpy(), bits, axis, n_out=2)
    assert y.shape == x.shape and y.dtype == x.dtype
    # float32 rounding at exact .5 ties may differ by one step; bound the max by one quantization step
    x2 = x.reshape(-1, 64).double().numpy()
    step = np.abs(x2).max() / (127 if bits == 8 else 7)
    assert np.abs(y.double().numpy() - ref).max() <= step
    assert np.mean(np.abs(y.double().numpy() - ref) > 1e-5) < 0.01
    # the outlier channel is stored exactly
    assert torch.equal(y[..., 5], x[..., 5])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(2, 40), bits=st.sampled_from([8, 4]),
       axis=st.sampled_from(["channel", "token"]), seed=st.integers(0, 1000))
def test_quantization_error_bound(rows: int, cols: int, bits: int, axis: str, seed: int) -> None:
    """Every element is within half a quantization step of its scale (per channel or per token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(cols, generator=g) * 10
    comp = make_compressor(f"int{bits}-{axis}", outlier_frac=0.0)
    y = comp.unpack(comp.pack(x))
    qmax = 127 if bits == 8 else 7
    dim = 0 if axis == "channel" else 1
    half_step = x.abs().amax(dim=dim, keepdim=True) / qmax / 2
    assert torch.all((x - y).abs() <= half_step * (1 + 1e-5) + 1e-7)


def test_bf16_relative_error() -> None:
    x = torch.randn(100, 100) * 1e3
    c = make_compressor("bf16")
    y = c.unpack(c.pack(x))
    assert torch.all((x - y).abs() <= x.abs() * 2**-8)


@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (3, 5, 11), (64, 65)])
def test_bitpack_lossless(shape: tuple[int, ...]) -> None:
    mask = torch.rand(shape) > 0.3
    p = bitpack(mask)
    assert p.nbytes == (mask.numel() + 7) // 8
    assert torch.equal(bitunpack(p), mask)


def test_outlier_channels_rescue_int4_per_token() -> None:
    """With a few huge channels, naive per-token INT4 loses the rest; keeping outliers fixes it."""
    torch.manual_seed(1)
    x = torch.randn(512, 256)
    x[:, [3, 100]] *= 100.0
    naive = make_compressor("int4-token", outlier_frac=0.0)
    kept = make_compressor("int4-token", outlier_frac=0.01)
    err_naive = relative_error(x[:, 4:100], naive.unpack(naive.pack(x))[:, 4:100])
    err_kept = relative_error(x[:, 4:100], kept.unpack(kept.pack(x))[:, 4:100])
    assert err_naive > 0.5 and err_kept < 0.2


def test_payload_sizes() -> None:
    x = torch.randn(128, 256)
    sizes = {n: make_compressor(n, outlier_frac=0.0).pack(x).nbytes for n in FLOAT_COMPRESSORS}
    full = x.numel() * 4
    assert sizes["bf16"] == full // 2
    assert sizes["int8-channel"] == x.numel() + 256 * 4  # one byte per value + a float scale per channel
    assert sizes["int4-token"] == x.numel() // 2 + 128 * 4  # half a byte per value + a scale per token


def test_unknown_compressor() -> None:
    with pytest.raises(ValueError, match="unknown compressor"):
        make_compressor("int3-channel")


def test_scaled_float_mask_bitpack_lossless() -> None:
    """Dropout keep-masks on CPU are floats in {0, 1/(1-p)}: detected and packed without loss."""
    from leanml.memory.compressors import mask_scale

    torch.manual_seed(0)
    mask = (torch.rand(64, 100) > 0.1).float() / 0.9
    scale = mask_scale(mask)
    assert scale == pytest.approx(1 / 0.9)
    p = bitpack(mask, scale)
    assert torch.equal(bitunpack(p), mask) and p.nbytes == 64 * 100 // 8 + 4
    assert mask_scale(torch.randn(64, 100)) is None


def _fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8-bit float format, from its 256 bit patterns (independent of casting)."""
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return torch.unique(vals[torch.isfinite(vals)])


@pytest.mark.parametrize("name,dtype", [("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_fp8_matches_nearest_grid_point(name: str, dtype: torch.dtype, src: torch.dtype) -> None:
    """Reference: scale each row so its absmax is the format's largest value, take the nearest of the
    256 representable values (brute force), scale back."""
    torch.manual_seed(0)
    x = (torch.randn(40, 130) * torch.logspace(-3, 2, 130)).to(src)
    comp = make_compressor(name)
    y = comp.unpack(comp.pack(x))
    assert y.dtype == src and y.shape == x.shape
    grid = _fp8_grid(dtype)
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / grid.max()).clamp_min(1e-30)
    z = xf / scale
    nearest = grid[(z.unsqueeze(-1) - grid).abs().argmin(-1)]
    ref = (nearest * scale).to(src).float()
    # ties between two grid points may round either way: allow one grid step at the few tie points
    assert torch.mean((y.float() != ref).float()) < 0.01
    step = (grid[1:] - grid[:-1]).max() * scale
    assert torch.all((y.float() - ref).abs() <= step)
    # payload: one byte per value plus one float scale per row
    assert comp.pack(x).nbytes == x.numel() + 40 * 4


def test_compressors_for_16_bit_activations() -> None:
    """bf16/fp16 activations are compressed by fp8 and int8 (with outlier channels), not by bf16."""
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, 7] *= 50.0
    for dt in (torch.bfloat16, torch.float16):
        xh = x.to(dt)
        assert not make_compressor("bf16").applies(xh)
        for name in ("fp8-e4m3", "int8-token", "int8-channel"):
            comp = make_compressor(name, outlier_frac=0.01)
            assert comp.applies(xh)
            p = comp.pack(xh)
            y = comp.unpack(p)
            assert y.dtype == dt and p.nbytes < 0.6 * xh.numel() * 2
            assert relative_error(xh, y) < 0.05
        kept = make_compressor("int8-token", outlier_frac=0.01).unpack(make_compressor("int8-token", 0.01).pack(xh))
        assert torch.equal(kept[:, 7], xh[:, 7])  # the outlier channel is kept exactly
    assert make_compressor("bf16").applies(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [n for n in FLOAT_COMPRESSORS if n != "bf16"])
def test_row_blocks_give_the_whole_tensor_result(name: str, dtype: torch.dtype, monkeypatch) -> None:
    """Pack and unpack walk the rows in blocks; a block size that leaves a short last block gives the same
    payload and the same reconstruction as one block over the whole tensor, and matches the reference."""
    from leanml.memory import compressors

    torch.manual_seed(1)
    x = torch.randn(3, 67, 96)
    x[..., 11] *= 60.0
    x = x.to(dtype)
    comp = make_compressor(name, outlier_frac=0.02)
    whole_p = comp.pack(x)
    whole = comp.unpack(whole_p)
    monkeypatch.setattr(compressors, "_BLOCK_ELEMS", 96 * 8)  # 8 rows a block: 201 rows = 25 blocks + 1 row
    assert [r.stop - r.start for r, _ in compressors._row_blocks(201, 96, x.device)] == [8] * 25 + [1]
    blocked_p = comp.pack(x)
    blocked = comp.unpack(blocked_p)
    assert blocked.dtype == dtype and blocked.shape == x.shape
    assert torch.equal(blocked, whole)
    assert blocked_p.nbytes == whole_p.nbytes
    for k, t in whole_p.tensors.items():
        assert torch.equal(blocked_p.tensors[k].float(), t.float()), k
    if name.startswith("int"):
        bits, axis = int(name[3]), name.split("-")[1]
        ref = _reference_quant(x.float().numpy(), bits, axis, n_out=2)
        step = np.abs(x.float().numpy()).max() / (127 if bits == 8 else 7)
        tol = step * (1.0 if dtype == torch.float32 else 1.5)  # bfloat16 output rounds once more
        assert np.abs(blocked.double().numpy() - ref).max() <= tol
