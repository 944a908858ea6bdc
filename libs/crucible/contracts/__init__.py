"""Wire contracts: messages, subjects and streams, and the msgpack codec."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from crucible.contracts import subjects
from crucible.contracts.messages import *  # noqa: F403  (the contracts package re-exports every message)
from crucible.contracts.messages import Message

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()


class ContractError(ValueError):
    """A message that does not decode as the type its consumer expects."""


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, type_: type[M]) -> M:
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ContractError(f"not a valid {type_.__name__}: {exc}") from exc


__all__ = ["ContractError", "Message", "decode", "encode", "subjects"]
