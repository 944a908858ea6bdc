"""Packed little-endian arrays for per-token data (token ids, logprobs, versions, masks, routes).

`pack` writes them; `view` reads them as numpy arrays over the message's own bytes (no copy, read-only);
`unpack` gives Python lists. A trajectory's arrays are read together through
`crucible.contracts.trajectories.arrays`, which checks that they agree.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import numpy as np

_CODES = {"u8": "B", "u32": "I", "f32": "f"}
DTYPES = {"u8": np.dtype("u1"), "u32": np.dtype("<u4"), "f32": np.dtype("<f4")}
"""Each kind's numpy dtype: little-endian whatever the host's byte order."""


def pack(kind: str, values: Iterable[float] | Iterable[int]) -> bytes:
    arr = array(_CODES[kind], values)
    if sys.byteorder == "big" and arr.itemsize > 1:
        arr.byteswap()
    return arr.tobytes()


def view(kind: str, data: bytes) -> np.ndarray:
    """The values packed in `data`, as a read-only numpy array sharing its memory."""
    dtype = DTYPES[kind]
    if len(data) % dtype.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {kind} values")
    return np.frombuffer(data, dtype=dtype)


def unpack(kind: str, data: bytes) -> list:
    return view(kind, data).tolist()
