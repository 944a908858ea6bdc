"""The base of every model validated from what a client sends (the run config, REST bodies).

pydantic's lax mode reads `true` or `"5"` as a number, `0` or `"yes"` as a flag, and `nan` as a float; JSON
Schema, which the OpenAPI document promises, allows none of them. An `Input` takes each JSON kind only
where the schema does (an integral float such as 3.0 is still an integer, as JSON Schema reads it).
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
"""Text without control characters: what a name, id or path is, and what PostgreSQL stores (it refuses
NUL)."""
NONBLANK = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"
"""PRINTABLE text with more than whitespace: what a field whose whitespace is stripped must be for its
stripped text to be PRINTABLE and not empty (the schema sees the text before it is stripped)."""


def _kinds(annotation: Any) -> set[type]:
    """The scalar types an annotation admits (int | None -> {int, NoneType}; list[int] -> {int})."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation)))
    return {annotation} if isinstance(annotation, type) else set()


def _check(value: Any, kinds: set[type]) -> None:
    if isinstance(value, list):
        for item in value:
            _check(item, kinds)
    elif isinstance(value, bool | str) and kinds & {int, float} and not kinds & {bool, str}:
        raise ValueError(f"a number, not {'true or false' if isinstance(value, bool) else 'a string'}")
    elif kinds == {bool} and not isinstance(value, bool):
        raise ValueError("true or false")


class Input(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _json_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is not None:
            _check(value, _kinds(cls.model_fields[info.field_name].annotation))
        return value
