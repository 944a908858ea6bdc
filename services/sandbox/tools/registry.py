"""The tool registry: each tool has a name, aliases, an argument struct (its schema) and an impl:
a coroutine function, or a plain function (file work on the host), which runs in a worker thread.

`call_tool` is the one entry point: it finds the tool, validates the arguments against the struct and
turns every failure into a `ToolResult` with ok=False, so a bad call never raises through the service.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from crucible.bus import RequestError
from crucible.contracts.sandbox import ToolResult
from services.sandbox.isolation.beneath import PathRefused

if TYPE_CHECKING:
    from services.sandbox.session import Session


class ToolFailure(Exception):
    """Raised by a tool impl to answer a clear error to the agent."""


class Args(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every tool's arguments."""


Impl = Callable[["Session", Any], Awaitable[ToolResult] | ToolResult]
ImplT = TypeVar("ImplT", bound=Impl)


@dataclass(frozen=True, kw_only=True)
class Tool:
    name: str
    description: str
    args: type[Args]
    impl: Impl
    aliases: tuple[str, ...] = field(default=())
    arg_aliases: dict[str, str] = field(default_factory=dict)
    """Other agents' names for arguments (Cursor's target_file, SWE-agent's old_str...) -> ours."""

    def normalise(self, arguments: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in arguments.items() if k not in IGNORED_ARGUMENTS}
        for theirs, ours in self.arg_aliases.items():
            if theirs in out and ours not in out:
                out[ours] = out.pop(theirs)
        return out

    def schema(self) -> dict[str, Any]:
        """A function-calling description: name, description and JSON schema of the arguments."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": msgspec.json.schema(self.args),
        }


IGNORED_ARGUMENTS = frozenset({"explanation"})
"""Arguments some agents send with every call, for their own reasoning; accepted and ignored."""
TOOLS: dict[str, Tool] = {}
_NAMES: dict[str, Tool] = {}


def tool(
    *,
    name: str,
    args: type[Args],
    description: str,
    aliases: tuple[str, ...] = (),
    arg_aliases: dict[str, str] | None = None,
) -> Callable[[ImplT], ImplT]:
    def register(impl: ImplT) -> ImplT:
        entry = Tool(
            name=name,
            description=description,
            args=args,
            impl=impl,
            aliases=aliases,
            arg_aliases=arg_aliases or {},
        )
        for key in (name, *aliases):
            if key in _NAMES:
                raise ValueError(f"tool name {key!r} registered twice")
            _NAMES[key] = entry
        TOOLS[name] = entry
        return impl

    return register


def lookup(name: str) -> Tool | None:
    return _NAMES.get(name)


def failure(error: str, *, started: float | None = None) -> ToolResult:
    duration = round(time.monotonic() - started, 4) if started is not None else 0.0
    return ToolResult(ok=False, error=error, duration_s=duration)


async def call_tool(session: Session, name: str, arguments: dict[str, Any]) -> ToolResult:
    started = time.monotonic()
    entry = lookup(name)
    if entry is None:
        return failure(f"unknown tool {name!r}; tools: {', '.join(sorted(TOOLS))}", started=started)
    if not isinstance(arguments, dict):
        return failure(f"arguments of {entry.name} must be an object", started=started)
    try:
        args = msgspec.convert(entry.normalise(arguments), entry.args)
    except msgspec.ValidationError as exc:
        return failure(f"bad arguments for {entry.name}: {exc}", started=started)
    try:
        if inspect.iscoroutinefunction(entry.impl):
            result = await entry.impl(session, args)
        else:
            result = await asyncio.to_thread(entry.impl, session, args)
        if not isinstance(result, ToolResult):
            raise TypeError(f"returned a {type(result).__name__}, not a ToolResult")
    except (ToolFailure, PathRefused) as exc:
        return failure(str(exc), started=started)
    except FileNotFoundError as exc:
        return failure(f"{exc.filename or 'path'}: no such file or directory", started=started)
    except IsADirectoryError as exc:
        return failure(f"{exc.filename or 'path'}: is a directory", started=started)
    except NotADirectoryError as exc:
        return failure(f"{exc.filename or 'path'}: a part of the path is not a directory", started=started)
    except RequestError:
        raise
    except Exception as exc:  # a tool bug answers an error result; the service keeps serving
        return failure(f"{entry.name} failed: {type(exc).__name__}: {exc}", started=started)
    if not result.duration_s:
        result.duration_s = round(time.monotonic() - started, 4)
    return result
