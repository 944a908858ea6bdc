"""Building blocks of a task family: units of code, the bugs they can carry, and the calls that probe them.

A unit is one function or class as a `string.Template`: `$<key>` stands for the name chosen for unit
`key` (its own or one it calls), `$p_<param>` for a constant drawn per task. A mutation replaces one
exact snippet of the template with its buggy version; a probe is a call (plus optional setup code)
whose outcome becomes a test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random

BUG_KINDS = frozenset(
    {
        "off_by_one",
        "comparison",
        "boolean",
        "swapped_args",
        "missing_edge_case",
        "wrong_constant",
        "wrong_return",
        "wrong_operator",
        "wrong_call",
    }
)


@dataclass(frozen=True, kw_only=True)
class Probe:
    """`expr` evaluated after `setup` (both templates); its value or exception is the expected outcome."""

    expr: str
    setup: str = ""


@dataclass(frozen=True, kw_only=True)
class Mutation:
    kind: str
    find: str
    replace: str

    def __post_init__(self) -> None:
        if self.kind not in BUG_KINDS:
            raise ValueError(f"unknown bug kind {self.kind!r}")
        if self.find == self.replace:
            raise ValueError("a mutation must change the code")


@dataclass(frozen=True, kw_only=True)
class Unit:
    key: str
    layer: int
    """0: base helpers, 1: built on helpers, 2: the package's top-level API."""
    names: tuple[str, ...]
    summary: str
    """What the unit does, in the words a README or a user would use."""
    source: str
    probes: Callable[[Random], list[Probe]]
    calls: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()
    params: dict[str, Callable[[Random], object]] = field(default_factory=dict)
    mutations: tuple[Mutation, ...] = ()

    def __post_init__(self) -> None:
        for mutation in self.mutations:
            if self.source.count(mutation.find) != 1:
                raise ValueError(f"{self.key}: mutation snippet must occur exactly once: {mutation.find!r}")


@dataclass(frozen=True, kw_only=True)
class Family:
    key: str
    description: str
    packages: tuple[str, ...]
    topics: tuple[str, ...]
    """Names for the module holding the family's top-level API."""
    units: tuple[Unit, ...]

    def __post_init__(self) -> None:
        keys = {unit.key for unit in self.units}
        for unit in self.units:
            missing = set(unit.calls) - keys
            if missing:
                raise ValueError(f"{self.key}.{unit.key} calls unknown units {sorted(missing)}")
            if any(keys_layer > unit.layer for keys_layer in (self.unit(c).layer for c in unit.calls)):
                raise ValueError(f"{self.key}.{unit.key} calls a unit of a higher layer")

    def unit(self, key: str) -> Unit:
        for unit in self.units:
            if unit.key == key:
                return unit
        raise KeyError(key)

    def closure(self, keys: set[str]) -> set[str]:
        """The units named plus everything they call, transitively."""
        seen: set[str] = set()
        todo = list(keys)
        while todo:
            key = todo.pop()
            if key not in seen:
                seen.add(key)
                todo.extend(self.unit(key).calls)
        return seen


def call(key: str, *args: object, **kwargs: object) -> Probe:
    """A probe calling unit `key` with literal arguments."""
    parts = [repr(arg) for arg in args] + [f"{name}={value!r}" for name, value in kwargs.items()]
    arguments = ", ".join(parts).replace("$", "$$")
    return Probe(expr=f"${key}({arguments})")
