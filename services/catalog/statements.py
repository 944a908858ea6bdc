"""Problem statements written like user bug reports: the symptom, never the cause or the fix.

The higher the difficulty, the less the report says: level 1 names the function, what it should do,
the failing call and the expected answer; level 2 drops the description; level 3 only says that the
result of a call looks wrong.
"""

from __future__ import annotations

from random import Random

from services.catalog.evaluate import Outcome

_MAX_SHOWN = 300


def statement(
    *,
    rng: Random,
    difficulty: int,
    package: str,
    module: str,
    function: str,
    summary: str,
    setup: str,
    expr: str,
    expected: Outcome,
    actual: Outcome,
) -> str:
    where = f"{package}.{module}"
    snippet = _snippet(where=where, function=function, setup=setup, expr=expr, actual=actual)
    observed = _observed(actual)
    if difficulty <= 1:
        title = rng.choice(
            [f"`{function}` returns a wrong result", f"Wrong output from `{where}.{function}`"]
        )
        docs = f"{summary[:1].upper()}{summary[1:]}."
        intro = f'The docs of `{where}.{function}` say: "{docs}" But when I run this:'
        return f"{title}\n\n{intro}\n\n{snippet}\n\n{observed}, while I expected {_shown(expected)}.\n"
    if difficulty == 2:
        title = rng.choice([f"`{function}` gives an incorrect answer", f"Bug in `{where}.{function}`"])
        return f"{title}\n\n{snippet}\n\n{observed}; the correct result is {_shown(expected)}.\n"
    title = rng.choice([f"Odd results from `{package}`", f"Something is off in `{where}`"])
    closing = rng.choice(["That does not look right.", "This worked for me before, so I think it is a bug."])
    return f"{title}\n\nWith `{package}` I ran:\n\n{snippet}\n\n{observed}. {closing}\n"


def _snippet(*, where: str, function: str, setup: str, expr: str, actual: Outcome) -> str:
    """The reporter's script: strings are kept in a variable (print would hide their quotes)."""
    body = f"{setup.rstrip()}\n" if setup.strip() else ""
    if actual.error is not None:
        last = expr
    elif isinstance(actual.value, str):
        last = f"result = {expr}"
    else:
        last = f"print({expr})"
    return f"```python\nfrom {where} import {function}\n\n{body}{last}\n```"


def _observed(actual: Outcome) -> str:
    if actual.error is not None:
        detail = f"{actual.error}: {actual.message}" if actual.message else actual.error
        return f"It fails with `{_cap(detail)}`"
    if isinstance(actual.value, str):
        return f"`result` is `{_cap(repr(actual.value))}`"
    return f"It prints `{_cap(repr(actual.value))}`"


def _shown(expected: Outcome) -> str:
    if expected.error is not None:
        return f"a `{expected.error}`"
    return f"`{_cap(repr(expected.value))}`"


def _cap(text: str) -> str:
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
