"""Activation compressors: pure ``pack``/``unpack`` pairs in plain torch.

Every compressor maps a tensor to a :class:`Packed` payload (a few tensors plus metadata) and back.
Lossy float compressors:

* ``bf16`` - round float32 to bfloat16 (2x; not offered for 16-bit activations).
* ``fp8-e4m3`` / ``fp8-e5m2`` - scale each token (row) so its largest magnitude fits the format, then
  round to 8-bit floating point (4x from float32, 2x from bf16/fp16). e4m3 keeps 3 mantissa bits
  (relative rounding error up to 1/16), e5m2 keeps 2 bits and a wider exponent range.
* ``int8-channel`` / ``int8-token`` - symmetric 8-bit quantization with one scale per channel (last
  dimension) or per token (row), about 4x from float32, 2x from 16-bit.
* ``int4-channel`` / ``int4-token`` - the same with 15 levels, two values per byte, about 8x (4x).

The integer compressors keep the ``outlier_frac`` channels with the largest magnitude in full precision.
LLM activations carry a few channels that are orders of magnitude larger than the rest; a per-token
scale that has to cover them leaves almost no resolution for everything else, which is why naive INT4
breaks. Removing them first makes per-token scales usable and tightens per-channel ones.

``bitpack`` is lossless: boolean masks stored one bit per element (8x), and so are float tensors that
hold only zero and one other value (the scaled keep-masks dropout saves on CPU, 32x).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

MIN_COMPRESS_NUMEL = 4096  # smaller float tensors are kept as they are (scales would dominate)


@dataclass
class Packed:
    """A compressed tensor: payload tensors plus what is needed to rebuild the original."""

    method: str
    tensors: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the payload tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y|| / ||x||`` in float64 (0 for an all-zero ``x`` reconstructed exactly)."""
    x64, y64 = x.detach().double(), y.detach().double()
    num = torch.linalg.vector_norm(x64 - y64).item()
    den = torch.linalg.vector_norm(x64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ---------------------------------------------------------------- bit packing helpers


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Pack int values in [-7, 7] two per byte (flattened, padded to even length)."""
    flat = (q.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    lo = (packed & 0x0F).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)[:numel]


_BIT_WEIGHTS = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = (2 ** torch.arange(8, device=device)).to(torch.uint8)
    return _BIT_WEIGHTS[device]


def mask_scale(t: torch.Tensor) -> float | None:
    """``c`` when float tensor ``t`` holds only 0 and one positive value ``c`` (a dropout keep-mask scaled
    by 1/(1-p)); None otherwise or for small tensors."""
    if not t.is_floating_point() or t.numel() < MIN_COMPRESS_NUMEL:
        return None
    c = t.detach().max()
    if not c.item() > 0:
        return None
    ok = bool(((t == 0) | (t == c)).all().item())
    return float(c.item()) if ok else None


def bitpack(mask: torch.Tensor, scale: float | None = None) -> Packed:
    """Lossless: a boolean tensor stored as one bit per element. With ``scale``, a float tensor whose
    values are 0 or ``scale`` (see :func:`mask_scale`) is stored the same way plus the scale."""
    if scale is not None:
        p = bitpack(mask != 0)
        p.tensors["scale"] = torch.tensor([scale], dtype=mask.dtype, device=mask.device)
        p.dtype = mask.dtype
        return p
    if mask.dtype != torch.bool:
        raise TypeError(f"bitpack needs a bool tensor (or a scale for a 0/c float mask), got {mask.dtype}")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = flat.view(-1, 8).to(torch.uint8) * _bit_weights(mask.device)
    return Packed("bitpack", {"bits": bits.sum(1, dtype=torch.uint8)}, tuple(mask.shape), mask.dtype)


def bitunpack(p: Packed) -> torch.Tensor:
    """Inverse of :func:`bitpack`."""
    bits = p.tensors["bits"]
    numel = math.prod(p.shape)
    out = (bits.unsqueeze(1) & _bit_weights(bits.device)).ne(0).reshape(-1)[:numel].reshape(p.shape)
    if "scale" in p.tensors:
        return out.to(p.dtype) * p.tensors["scale"]
    return out


# ---------------------------------------------------------------- float compressors


def _bf16_pack(x: torch.Tensor, outlier_frac: float = 0.0) -> Packed:
    return Packed("bf16", {"x": x.detach().to(torch.bfloat16)}, tuple(x.shape), x.dtype)


def _bf16_unpack(p: Packed) -> torch.Tensor:
    return p.tensors["x"].to(p.dtype)


_FP8 = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}

# Pack and unpack walk a [rows, C] view in blocks of about this many elements through one reused float32
# buffer. On CPU every fresh tensor of a few MB is new memory from the OS, and its first touch (page faults)
# costs more than the arithmetic; a block-sized buffer stays in cache. The result is the same as one
# whole-tensor pass. On other devices (a caching allocator, kernel launches per block) one block is the whole.
_BLOCK_ELEMS = 1 << 16


def _row_blocks(rows: int, cols: int, device: torch.device) -> Iterator[tuple[slice, torch.Tensor]]:
    """The row slices of a [rows, cols] view, block by block, each with a float32 work buffer of its size
    (views of one buffer)."""
    n = max(1, rows if device.type != "cpu" else min(rows, _BLOCK_ELEMS // max(cols, 1)))
    buf = torch.empty((n, cols), dtype=torch.float32, device=device)
    for i in range(0, rows, n):
        m = min(n, rows - i)
        yield slice(i, i + m), buf[:m]


def _abs_amax_rows(x2: torch.Tensor, buf: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
    """Per-row largest magnitude of block ``x2`` (float32, [rows, 1]), ignoring the channels in ``skip``."""
    if x2.dtype == buf.dtype:
        torch.abs(x2, out=buf)
    else:
        buf.copy_(x2).abs_()
    if skip is not None:
        buf.index_fill_(1, skip, 0.0)
    return buf.amax(dim=1, keepdim=True)


def _fp8_pack(x: torch.Tensor, name: str) -> Packed:
    """Per-row scale so the row's absmax maps to the format's largest finite value, then an fp8 cast."""
    fmt = _FP8[name]
    shape = tuple(x.shape)
    x2 = x.detach().reshape(-1, shape[-1])
    rows, cols = x2.shape
    fmax = torch.finfo(fmt).max
    q = torch.empty((rows, cols), dtype=fmt, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    for r, b in _row_blocks(rows, cols, x.device):
        s = scale[r]
        torch.div(_abs_amax_rows(x2[r], b, None), fmax, out=s)
        s.clamp_min_(1e-30)
        torch.div(x2[r], s, out=b)
        q[r].copy_(b)
    return Packed(name, {"q": q, "scale": scale}, shape, x.dtype)


def _fp8_unpack(p: Packed) -> torch.Tensor:
    q, scale = p.tensors["q"], p.tensors["scale"]
    rows, cols = q.shape
    out = torch.empty((rows, cols), dtype=p.dtype, device=q.device)
    for r, b in _row_blocks(rows, cols, q.device):
        b.copy_(q[r])
        torch.mul(b, scale[r], out=out[r])
    return out.reshape(p.shape)


def _outlier_channels(x2: torch.Tensor, outlier_frac: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-channel largest magnitude of a [rows, C] matrix (float32) and the indices of the outlier channels
    (the ``outlier_frac`` largest, sorted), or None."""
    channels = x2.shape[1]
    absmax = torch.maximum(x2.amax(dim=0), x2.amin(dim=0).neg()).float()
    k = min(channels - 1, math.ceil(outlier_frac * channels)) if outlier_frac > 0 else 0
    if k <= 0:
        return absmax, None
    return absmax, torch.topk(absmax, k).indices.sort().values


def _quant_pack(x: torch.Tensor, bits: int, axis: str, outlier_frac: float) -> Packed:
    """Symmetric quantization of ``x`` viewed as [rows, C] (C = last dim) with outlier channels kept.

    The outlier channels' own codes are quantized like the rest (per channel, or against a row scale that
    ignores them) and overwritten by their full-precision values on unpack."""
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
    qmax = 127 if bits == 8 else 7
    shape = tuple(x.shape)
    x2 = x.detach().reshape(-1, shape[-1])
    rows, cols = x2.shape
    absmax, idx = _outlier_channels(x2, outlier_frac)
    tensors: dict[str, torch.Tensor] = {}
    if idx is not None:
        tensors["out_idx"] = idx.to(torch.int32)
        tensors["out_val"] = x2.index_select(1, idx)
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    if axis == "channel":
        scale = absmax.clamp_min(1e-12).div_(qmax).unsqueeze(0)
    else:
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    for r, b in _row_blocks(rows, cols, x.device):
        s = scale if axis == "channel" else scale[r]
        if axis == "token":
            torch.div(_abs_amax_rows(x2[r], b, idx).clamp_min_(1e-12), qmax, out=s)
        torch.div(x2[r], s, out=b)
        b.round_().clamp_(-qmax, qmax)
        q[r].copy_(b)
    tensors["q"] = q if bits == 8 else _pack_nibbles(q)
    tensors["scale"] = scale
    method = f"int{bits}-{axis}"
    return Packed(method, tensors, shape, x.dtype, {"rows": rows, "cols": cols})


def _quant_unpack(p: Packed) -> torch.Tensor:
    rows, cols = p.meta["rows"], p.meta["cols"]
    q = p.tensors["q"]
    if q.dtype != torch.int8:
        q = _unpack_nibbles(q, rows * cols)
    q = q.reshape(rows, cols)
    scale = p.tensors["scale"]
    out = torch.empty((rows, cols), dtype=p.dtype, device=q.device)
    for r, b in _row_blocks(rows, cols, q.device):
        s = scale if scale.shape[0] == 1 else scale[r]
        if out.dtype == torch.float32:
            torch.mul(q[r], s, out=out[r])
        else:
            torch.mul(q[r], s, out=b)
            out[r].copy_(b)
    if "out_idx" in p.tensors:
        out.index_copy_(1, p.tensors["out_idx"].long(), p.tensors["out_val"].to(p.dtype))
    return out.reshape(p.shape)


@dataclass(frozen=True)
class Compressor:
    """A named lossy or lossless pack/unpack pair."""

    name: str
    pack_fn: Callable[[torch.Tensor], Packed]
    unpack_fn: Callable[[Packed], torch.Tensor]
    lossless: bool = False
    min_element_size: int = 2  # compress only tensors whose elements are at least this many bytes

    def applies(self, t: torch.Tensor) -> bool:
        """Whether this compressor makes ``t`` smaller (see :func:`compressible`)."""
        return compressible(t) and t.element_size() >= self.min_element_size

    def pack(self, x: torch.Tensor) -> Packed:
        """Compress ``x`` (no autograd history is kept)."""
        with torch.no_grad():
            return self.pack_fn(x)

    def unpack(self, p: Packed) -> torch.Tensor:
        """Rebuild a tensor with the original shape and dtype."""
        with torch.no_grad():
            return self.unpack_fn(p)


def make_compressor(name: str, outlier_frac: float = 0.01) -> Compressor:
    """Build a compressor by name: ``bf16``, ``fp8-e4m3``, ``fp8-e5m2``, ``int8-channel``, ``int8-token``,
    ``int4-channel``, ``int4-token`` or ``bitpack``. ``outlier_frac`` is the fraction of channels kept in full
    precision."""
    if name == "bf16":
        return Compressor(name, _bf16_pack, _bf16_unpack, min_element_size=4)
    if name in _FP8:
        return Compressor(name, lambda x: _fp8_pack(x, name), _fp8_unpack)
    if name == "bitpack":
        return Compressor(name, bitpack, bitunpack, lossless=True)
    parts = name.split("-")
    if len(parts) == 2 and parts[0] in ("int8", "int4") and parts[1] in ("channel", "token"):
        bits = int(parts[0][3:])
        axis = parts[1]
        return Compressor(
            name, lambda x: _quant_pack(x, bits, axis, outlier_frac), _quant_unpack
        )
    raise ValueError(
        f"unknown compressor {name!r}; choose from {', '.join(FLOAT_COMPRESSORS + ('bitpack',))}"
    )


FLOAT_COMPRESSORS: tuple[str, ...] = ("bf16", "fp8-e4m3", "fp8-e5m2", "int8-channel", "int8-token", "int4-channel",
                                      "int4-token")


def compressible(t: torch.Tensor) -> bool:
    """Whether a float compressor may apply to ``t``: a float tensor of at least 16 bits with at least 2
    dims and enough elements (each compressor also checks its own element size, :meth:`Compressor.applies`)."""
    return (t.is_floating_point() and t.dim() >= 2 and t.numel() >= MIN_COMPRESS_NUMEL and t.element_size() >= 2
            and t.dtype not in _FP8.values())


def outlier_ratio(t: torch.Tensor) -> float:
    """Largest channel absmax over the median channel absmax (last dim = channel): how spiky ``t`` is."""
    absmax = t.detach().reshape(-1, t.shape[-1]).abs().amax(dim=0).float()
    med = absmax.median().item()
    return float(absmax.max().item() / med) if med > 0 else math.inf
