"""Run generated code in-process to learn what each probe returns, on the buggy and the fixed package.

The code comes from Crucible's own templates, so executing it here is safe; it is loaded under a
throw-away package name and removed from `sys.modules` afterwards. Verification proper (real files,
real pytest, in a subprocess) happens later in `verify`.
"""

from __future__ import annotations

import builtins
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

from crucible import pyast
from crucible.contracts.messages import Expected
from crucible.probes import same_value


@dataclass(frozen=True, kw_only=True)
class Outcome:
    value: object = None
    error: str | None = None
    """Name of the builtin exception raised, if any."""
    message: str = ""

    def same_as(self, other: Outcome) -> bool:
        """Whether a test expecting `self` passes when the code produces `other`."""
        if self.error is not None or other.error is not None:
            return self.error == other.error
        return same_value(self.value, other.value)

    def expected(self) -> Expected:
        """What a probe test of this outcome must give (kept in the task's secret)."""
        return Expected(error=self.error) if self.error is not None else Expected(value=repr(self.value))


def is_literal(value: object) -> bool:
    """Whether `repr(value)` reads back as an equal value of the same type (so a test can spell it)."""
    try:
        back = pyast.literal_eval(repr(value))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
    return type(back) is type(value) and back == value


def is_testable(outcome: Outcome) -> bool:
    if outcome.error is not None:
        return isinstance(getattr(builtins, outcome.error, None), type)
    return is_literal(outcome.value)


def run_probes(
    *, modules: Sequence[tuple[str, str]], exports: Mapping[str, str], probes: Sequence[tuple[str, str]]
) -> list[Outcome]:
    """Load `modules` ((name, source), dependencies first) as one package and evaluate each probe.

    `exports` maps every name a probe may use to the module defining it; a probe is (setup, expr).
    """
    alias = f"_crucible_eval_{uuid.uuid4().hex}"
    package = ModuleType(alias)
    package.__path__ = []
    loaded: dict[str, ModuleType] = {}
    sys.modules[alias] = package
    try:
        for name, source in modules:
            module = ModuleType(f"{alias}.{name}")
            module.__package__ = alias
            sys.modules[module.__name__] = module
            exec(compile(source, f"<{name}.py>", "exec"), module.__dict__)  # our own templates
            setattr(package, name, module)
            loaded[name] = module
        namespace = {name: getattr(loaded[module], name) for name, module in exports.items()}
        return [_evaluate(setup, expr, dict(namespace)) for setup, expr in probes]
    finally:
        # list(): another thread may be generating (and importing) at the same time
        for key in [k for k in list(sys.modules) if k == alias or k.startswith(alias + ".")]:
            del sys.modules[key]


def _evaluate(setup: str, expr: str, namespace: dict[str, object]) -> Outcome:
    try:
        if setup:
            exec(setup, namespace)  # our own templates
        return Outcome(value=eval(expr, namespace))
    except Exception as exc:  # any failure of generated code is an outcome to record
        return Outcome(error=type(exc).__name__, message=str(exc))
