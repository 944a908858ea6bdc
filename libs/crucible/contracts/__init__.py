"""Wire contracts: messages, events, the run config, subjects and streams, keys, and the msgpack codec."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel

from crucible.contracts import subjects
from crucible.contracts.messages import *  # noqa: F403  (the contracts package re-exports every message)
from crucible.contracts.messages import Message

M = TypeVar("M", bound=Message)


class ContractError(ValueError):
    """A message that does not decode as the type its consumer expects."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, BaseModel):  # the run config travels as its JSON form
        return obj.model_dump(mode="json")
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(type_: type, obj: Any) -> Any:
    if isinstance(type_, type) and issubclass(type_, BaseModel):
        return type_.model_validate(obj)  # a ValidationError becomes msgspec's, naming the field
    raise NotImplementedError(f"cannot decode {type_!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, type_: type[M]) -> M:
    try:
        return msgspec.msgpack.decode(data, type=type_, dec_hook=_dec_hook)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ContractError(f"not a valid {type_.__name__}: {exc}") from exc


__all__ = ["ContractError", "Message", "decode", "encode", "subjects"]
