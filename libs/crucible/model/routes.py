"""Recorded expert choices on the wire: u8 [T, moe_layers, top_k], 255 where a token was not recorded.

A rollout records the routes of every token it ran through the model; the trainer replays them so
training routes tokens exactly as inference did. Tokens the rollout never fed back (the last sampled
token) travel as 255 and decode to -1, which the model routes afresh.
"""

from __future__ import annotations

import torch

NOT_RECORDED = 255


def pack_routes(routes_TLK: torch.Tensor) -> tuple[bytes, list[int]]:
    """(bytes, shape) of one sequence's routes; -1 entries become 255."""
    if routes_TLK.dim() != 3:
        raise ValueError(f"routes must be [T, layers, top_k], got shape {tuple(routes_TLK.shape)}")
    if routes_TLK.numel() and (routes_TLK.max() >= NOT_RECORDED or routes_TLK.min() < -1):
        raise ValueError("expert ids must be in [0, 255) or -1")
    data = torch.where(routes_TLK < 0, NOT_RECORDED, routes_TLK).to(torch.uint8).cpu().contiguous()
    return data.numpy().tobytes(), list(routes_TLK.shape)


def unpack_routes(data: bytes, shape: list[int]) -> torch.Tensor:
    """int64 [T, layers, top_k] routes with -1 where none was recorded."""
    if len(shape) != 3 or len(data) != shape[0] * shape[1] * shape[2]:
        raise ValueError(f"{len(data)} bytes do not hold routes of shape {shape}")
    flat = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        if data
        else torch.zeros(0, dtype=torch.int64)
    )
    routes = flat.view(*shape)
    return torch.where(routes == NOT_RECORDED, -1, routes)


def pad_routes(routes_TLK: torch.Tensor, length: int) -> torch.Tensor:
    """Extend routes to `length` tokens with -1 (routed afresh), e.g. for the final sampled token."""
    missing = length - routes_TLK.shape[0]
    if missing < 0:
        raise ValueError(f"routes cover {routes_TLK.shape[0]} tokens, more than {length}")
    filler = routes_TLK.new_full((missing, *routes_TLK.shape[1:]), -1)
    return torch.cat([routes_TLK, filler])
