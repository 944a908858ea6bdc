"""Packed little-endian arrays for per-token data (token ids, logprobs, versions, masks, routes)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_CODES = {"u8": "B", "u32": "I", "f32": "f"}


def pack(kind: str, values: Iterable[float] | Iterable[int]) -> bytes:
    arr = array(_CODES[kind], values)
    if sys.byteorder == "big" and arr.itemsize > 1:
        arr.byteswap()
    return arr.tobytes()


def unpack(kind: str, data: bytes) -> list:
    arr = array(_CODES[kind])
    if len(data) % arr.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {kind} values")
    arr.frombytes(data)
    if sys.byteorder == "big" and arr.itemsize > 1:
        arr.byteswap()
    return arr.tolist()
