"""Deterministic 64-bit hashing of feature values into feature signs.

Everything here is a pure function of arrays and is identical across runs, processes and machines
(Python's salted ``hash()`` is never used). The scheme, with all arithmetic modulo 2**64:

* ``mix64(z)`` is the SplitMix64 finaliser (Steele, Lea & Flood, 2014)::

      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
      z = (z ^ (z >> 27)) * 0x94D049BB133111EB
      z =  z ^ (z >> 31)

* a string is first reduced with 64-bit FNV-1a over its UTF-8 bytes (offset basis
  0xCBF29CE484222325, prime 0x100000001B3);
* ``hash_value(v, seed) = mix64(key(v) ^ seed_key(seed))`` where ``key`` is the integer itself
  (two's complement, so -1 -> 2**64-1) or the FNV-1a of the string, and
  ``seed_key(seed) = mix64(seed + 0x9E3779B97F4A7C15)``;
* crosses fold hashes left to right: ``acc = seed_key(seed)``, then for each field hash ``h``:
  ``acc = mix64(acc ^ (h + 0x9E3779B97F4A7C15 + (acc << 6) + (acc >> 2)))``;
* a feature sign is ``h & (2**63 - 1)`` (mask first, so the value is a non-negative int64) and the
  bucket is ``sign % buckets``.

``numpy`` versions work on ``uint64`` arrays; ``torch`` versions work on ``int64`` tensors (two's
complement wrap-around, logical shifts emulated with masks) so they run on CUDA too. The pure-Python
``ref_*`` functions are the independent references used by the tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

MASK64 = (1 << 64) - 1
MASK63 = (1 << 63) - 1
GOLDEN = 0x9E3779B97F4A7C15
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3

_U = np.uint64


# --------------------------------------------------------------------------------------------- reference
def ref_mix64(z: int) -> int:
    """SplitMix64 finaliser on a Python int (reference)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * C1) & MASK64
    z = ((z ^ (z >> 27)) * C2) & MASK64
    return z ^ (z >> 31)


def ref_fnv1a(data: bytes) -> int:
    """64-bit FNV-1a of bytes (reference)."""
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK64
    return h


def ref_seed_key(seed: int) -> int:
    return ref_mix64((seed + GOLDEN) & MASK64)


def ref_hash_value(v: int | str, seed: int = 0) -> int:
    """Unmasked 64-bit hash of one int or str (reference)."""
    key = ref_fnv1a(v.encode("utf-8")) if isinstance(v, str) else int(v) & MASK64
    return ref_mix64(key ^ ref_seed_key(seed))


def ref_combine(acc: int, h: int) -> int:
    return ref_mix64(acc ^ ((h + GOLDEN + (acc << 6) + (acc >> 2)) & MASK64))


def ref_cross(values: list[int | str], seed: int = 0) -> int:
    """Unmasked cross hash of several field values (reference)."""
    acc = ref_seed_key(seed)
    for v in values:
        acc = ref_combine(acc, ref_hash_value(v, 0))
    return acc


def ref_bucket(h: int, buckets: int | None) -> int:
    s = h & MASK63
    return s % buckets if buckets else s


# --------------------------------------------------------------------------------------------- numpy
def mix64(z: np.ndarray, out: np.ndarray | None = None, tmp: np.ndarray | None = None) -> np.ndarray:
    """SplitMix64 finaliser on a ``uint64`` array. With ``out``/``tmp`` buffers it allocates nothing."""
    if out is None:
        out = np.empty_like(z, dtype=_U)
    if tmp is None:
        tmp = np.empty_like(out)
    if out is not z:
        np.copyto(out, z, casting="unsafe")
    with np.errstate(over="ignore"):
        np.right_shift(out, _U(30), out=tmp)
        np.bitwise_xor(out, tmp, out=out)
        np.multiply(out, _U(C1), out=out)
        np.right_shift(out, _U(27), out=tmp)
        np.bitwise_xor(out, tmp, out=out)
        np.multiply(out, _U(C2), out=out)
        np.right_shift(out, _U(31), out=tmp)
        np.bitwise_xor(out, tmp, out=out)
    return out


def seed_key(seed: int) -> np.uint64:
    return _U(ref_seed_key(seed))


def factorize_exact(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes and uniques of an object array by Python equality (slower than pandas, exact for every string)."""
    index: dict[Any, int] = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.int64, count=len(values))
    uniques = np.empty(len(index), dtype=object)
    uniques[:] = list(index)
    return codes, uniques


def fnv1a_strings(values: np.ndarray) -> np.ndarray:
    """FNV-1a of each string of an object array, vectorised over byte positions of the distinct values."""
    values = np.asarray(values, dtype=object)
    if len(values) == 0:
        return np.empty(0, dtype=_U)
    codes, uniques = pd.factorize(values, use_na_sentinel=False)
    if not bool((uniques[codes] == values).all()):  # pandas < 3 merges strings that differ by NUL bytes
        codes, uniques = factorize_exact(values)
    encoded = [str(u).encode("utf-8") for u in uniques]
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    width = max(int(lengths.max()), 1)
    raw = np.frombuffer(b"".join(e.ljust(width, b"\0") for e in encoded), dtype=np.uint8)
    raw = raw.reshape(len(encoded), width)
    h = np.full(len(encoded), FNV_OFFSET, dtype=_U)
    with np.errstate(over="ignore"):
        for j in range(width):
            live = lengths > j
            if not live.all():
                nh = (h ^ raw[:, j].astype(_U)) * _U(FNV_PRIME)
                h = np.where(live, nh, h)
            else:
                h = (h ^ raw[:, j].astype(_U)) * _U(FNV_PRIME)
    return h[codes]


def fnv1a_arrow(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """FNV-1a of each string of an arrow string array (nulls hash as ""), computed on the distinct values.

    Native throughout: arrow's hash-table dictionary encoding finds the distinct values, and the FNV
    loop runs over byte positions of their UTF-8 buffer (longest first, so each step is a prefix slice).
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if len(values) == 0:
        return np.empty(0, dtype=_U)
    enc = pc.dictionary_encode(values.fill_null(""))
    return _fnv1a_distinct(enc.dictionary)[np.asarray(enc.indices)]


def _fnv1a_distinct(arr: pa.Array) -> np.ndarray:
    """FNV-1a of every value of an arrow string array without nulls."""
    n = len(arr)
    large = pa.types.is_large_string(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(1, np.uint8)
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")
    starts = offsets[:-1][order]
    live_counts = np.searchsorted(-lengths[order], -np.arange(int(lengths.max(initial=0))), side="left")
    h = np.full(n, FNV_OFFSET, dtype=_U)
    with np.errstate(over="ignore"):
        for j, c in enumerate(live_counts.tolist()):
            hv = h[:c]
            np.bitwise_xor(hv, data[starts[:c] + j], out=hv, casting="unsafe")
            np.multiply(hv, _U(FNV_PRIME), out=hv)
    out = np.empty(n, dtype=_U)
    out[order] = h
    return out


def value_keys(values: np.ndarray | pa.Array) -> np.ndarray:
    """64-bit keys of a column before mixing: integers as two's complement, strings via FNV-1a."""
    if isinstance(values, pa.Array | pa.ChunkedArray):
        if pa.types.is_integer(values.type) or pa.types.is_boolean(values.type):
            return np.asarray(values.cast(pa.int64()).fill_null(0)).view(_U)
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            return fnv1a_arrow(values)
        raise TypeError(f"cannot hash an arrow column of type {values.type}")
    values = np.asarray(values)
    if values.dtype.kind in "iub":
        return values.astype(np.int64, copy=False).view(_U)
    if values.dtype.kind == "f":
        raise TypeError("hashing floats is ambiguous; bucketize them first or cast to int")
    return fnv1a_strings(values)


def hash_values(values: np.ndarray | pa.Array, seed: int = 0, out: np.ndarray | None = None,
                tmp: np.ndarray | None = None) -> np.ndarray:
    """Unmasked 64-bit hashes (``uint64``) of a column of ints or strings."""
    keys = value_keys(values)
    if out is None:
        out = np.empty(len(keys), dtype=_U)
    np.bitwise_xor(keys, seed_key(seed), out=out)
    return mix64(out, out=out, tmp=tmp)


def combine(acc: np.ndarray, h: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """``acc = mix64(acc ^ (h + GOLDEN + (acc << 6) + (acc >> 2)))`` in place on ``acc``."""
    with np.errstate(over="ignore"):
        t = h + _U(GOLDEN) + (acc << _U(6)) + (acc >> _U(2))
        np.bitwise_xor(acc, t, out=acc)
    return mix64(acc, out=acc, tmp=tmp)


def cross_values(columns: list[np.ndarray], seed: int = 0) -> np.ndarray:
    """Unmasked cross hashes of several equally long columns."""
    n = len(columns[0])
    acc = np.full(n, seed_key(seed), dtype=_U)
    for col in columns:
        combine(acc, hash_values(col, 0))
    return acc


def to_sign(h: np.ndarray, buckets: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Mask to 63 bits, then reduce modulo ``buckets``; returns ``int64``."""
    if out is None:
        out = np.empty(len(h), dtype=np.int64)
    np.bitwise_and(h, _U(MASK63), out=out.view(_U))
    if buckets:
        np.remainder(out, np.int64(buckets), out=out)
    return out


# --------------------------------------------------------------------------------------------- torch
def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64_torch(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on an int64 tensor (bits as two's complement)."""
    z = (z ^ _lsr(z, 30)) * _s64(C1)
    z = (z ^ _lsr(z, 27)) * _s64(C2)
    return z ^ _lsr(z, 31)


def hash_ints_torch(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Unmasked hashes of an integer tensor, bit-identical to :func:`hash_values` (as int64)."""
    return mix64_torch(x.to(torch.int64) ^ _s64(ref_seed_key(seed)))


def combine_torch(acc: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    t = h + _s64(GOLDEN) + (acc << 6) + _lsr(acc, 2)
    return mix64_torch(acc ^ t)


def cross_ints_torch(columns: list[torch.Tensor], seed: int = 0) -> torch.Tensor:
    acc = torch.full_like(columns[0], _s64(ref_seed_key(seed)), dtype=torch.int64)
    for col in columns:
        acc = combine_torch(acc, hash_ints_torch(col, 0))
    return acc


def to_sign_torch(h: torch.Tensor, buckets: int | None = None) -> torch.Tensor:
    s = h & MASK63
    return torch.remainder(s, buckets) if buckets else s
