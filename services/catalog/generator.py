"""Deterministic generator of small Python repositories with one injected bug each.

A task is drawn from a family (see `families`): the generator picks the buggy unit and the public
function where the bug shows, lays the units out over modules (more modules and a longer call path
as difficulty rises), evaluates every probe on the fixed and the buggy package, and keeps the
probes that fail on the bug as hidden tests, together with probes that pass on both (partial credit
and the visible tests). The hidden tests hold the probes' calls, not their expected values, which stay
in the task's secret (`crucible.probes`). Everything is drawn from `random.Random` seeded by strings,
so the same (taskset, seed, difficulty, index) always gives byte-identical files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from random import Random

from crucible.contracts.messages import Expected
from services.catalog.evaluate import Outcome, is_testable, run_probes
from services.catalog.families import FAMILIES, Family
from services.catalog.layout import Placed, Placement, place
from services.catalog.render import Case, pyproject, readme, signature, test_name, test_source, unified_patch
from services.catalog.splits import index_split
from services.catalog.statements import statement

HIDDEN_TESTS = "tests/test_hidden.py"
TEST_COMMAND = ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider")
"""Followed by the task's test files: the hidden acceptance tests and the repository's visible ones."""
_ATTEMPTS = 40


class GenerationError(RuntimeError):
    """No valid task could be drawn for these inputs (a bug in a family definition)."""


@dataclass(frozen=True, kw_only=True)
class BugInfo:
    kind: str
    function: str
    """Name of the function or class that carries the bug."""
    path: str
    symptom: str
    """Name of the public function the statement talks about."""
    buggy_snippet: str
    fixed_snippet: str


@dataclass(frozen=True, kw_only=True)
class GeneratedTask:
    task_id: str
    taskset: str
    difficulty: int
    family: str
    statement: str
    files: dict[str, str]
    """The buggy repository: relative path -> text."""
    hidden_files: dict[str, str]
    """Laid over the repository root before grading."""
    reference_patch: str
    test_command: tuple[str, ...]
    fail_to_pass: tuple[str, ...]
    """The hidden tests that fail on the bug (node ids)."""
    pass_to_pass: tuple[str, ...]
    """The hidden and visible tests that pass with and without it."""
    probes: dict[str, Expected]
    """What each hidden test (a probe) must give, by node id; kept out of the sandbox."""
    split: str
    bug: BugInfo


def generate_taskset(
    *, seed: int, per_difficulty: int, difficulties: tuple[int, ...] = (1, 2, 3), taskset: str = "pybugs"
) -> list[GeneratedTask]:
    if per_difficulty < 0:
        raise ValueError("per_difficulty must not be negative")
    bad = [d for d in difficulties if d not in (1, 2, 3)]
    if bad:
        raise ValueError(f"difficulties must be 1, 2 or 3, got {bad}")
    return [
        generate_task(seed=seed, difficulty=d, index=i, taskset=taskset)
        for d in dict.fromkeys(difficulties)
        for i in range(per_difficulty)
    ]


def generate_task(*, seed: int, difficulty: int, index: int, taskset: str = "pybugs") -> GeneratedTask:
    order = list(FAMILIES)
    Random(f"{taskset}:{seed}:families").shuffle(order)
    family = order[(index + difficulty) % len(order)]
    rng = Random(f"{taskset}:{seed}:{difficulty}:{index}")
    for _ in range(_ATTEMPTS):
        task_id = f"{taskset}-d{difficulty}-{index:04d}"
        task = _attempt(
            rng=rng,
            family=family,
            difficulty=difficulty,
            taskset=taskset,
            task_id=task_id,
            task_split=index_split(index),
        )
        if task is not None:
            return task
    raise GenerationError(
        f"no valid {family.key} task at difficulty {difficulty} (seed {seed}, index {index})"
    )


def _attempt(
    *, rng: Random, family: Family, difficulty: int, taskset: str, task_id: str, task_split: str
) -> GeneratedTask | None:
    others = [f for f in FAMILIES if f.key != family.key]
    p = place(rng=rng, family=family, difficulty=difficulty, filler=rng.choice(others or [family]))
    if p is None:
        return None
    probes = p.probes(rng)
    calls = [(setup, expr) for _, setup, expr in probes]
    fixed = run_probes(modules=p.modules(buggy=False), exports=p.exports, probes=calls)
    buggy = run_probes(modules=p.modules(buggy=True), exports=p.exports, probes=calls)
    rows = [_Row(*probe, f, b) for probe, f, b in zip(probes, fixed, buggy, strict=True) if is_testable(f)]
    failing = [r for r in rows if r.owner is p.symptom and not r.fixed.same_as(r.buggy)]
    if difficulty > 1:
        failing = [r for r in failing if not re.search(rf"\b{p.bug.name}\b", r.setup + r.expr)]
    passing = [r for r in rows if r.fixed.same_as(r.buggy)]
    rng.shuffle(passing)
    if not failing or len(passing) < 2:
        return None
    hidden_fail = rng.sample(failing, k=min(2, len(failing)))
    split = max(1, len(passing) // 2)
    hidden_pass, visible = passing[:split][:4], passing[split:][:4]
    shown = min(hidden_fail, key=lambda r: (bool(r.setup), len(r.setup) + len(r.expr)))
    text = statement(
        rng=rng,
        difficulty=difficulty,
        package=p.package,
        module=p.symptom.module,
        function=p.symptom.name,
        summary=p.symptom.unit.summary,
        setup=shown.setup,
        expr=shown.expr,
        expected=shown.fixed,
        actual=shown.buggy,
    )
    if p.leaks(text):
        return None
    visible_path = f"tests/test_{p.symptom.module}.py"
    visible_source, visible_names = _tests(p=p, rows=visible, doc=f"Tests for {p.package}.")
    files = _repository(p=p, visible=(visible_path, visible_source), rng=rng)
    fixed_files = files | p.sources(buggy=False)
    hidden = hidden_fail + hidden_pass
    hidden_source, hidden_names = _tests(p=p, rows=hidden, doc="Acceptance tests.", probes=True)
    failing_names = hidden_names[: len(hidden_fail)]
    return GeneratedTask(
        task_id=task_id,
        taskset=taskset,
        difficulty=difficulty,
        family=family.key,
        statement=text,
        files=files,
        hidden_files={HIDDEN_TESTS: hidden_source},
        reference_patch=unified_patch(before=files, after=fixed_files),
        test_command=(*TEST_COMMAND, HIDDEN_TESTS, visible_path),
        fail_to_pass=tuple(f"{HIDDEN_TESTS}::{name}" for name in failing_names),
        pass_to_pass=tuple(
            [f"{HIDDEN_TESTS}::{name}" for name in hidden_names[len(hidden_fail) :]]
            + [f"{visible_path}::{name}" for name in visible_names]
        ),
        probes={
            f"{HIDDEN_TESTS}::{name}": row.fixed.expected()
            for name, row in zip(hidden_names, hidden, strict=True)
        },
        split=task_split,
        bug=BugInfo(
            kind=p.mutation.kind,
            function=p.bug.name,
            path=p.path_of(p.bug),
            symptom=p.symptom.name,
            buggy_snippet=p.render(p.mutation.replace).strip(),
            fixed_snippet=p.render(p.mutation.find).strip(),
        ),
    )


@dataclass(frozen=True)
class _Row:
    owner: Placed
    setup: str
    expr: str
    fixed: Outcome
    buggy: Outcome


def _tests(*, p: Placement, rows: list[_Row], doc: str, probes: bool = False) -> tuple[str, list[str]]:
    """A test module for `rows` and its test names, in the rows' order (probes: see `test_source`)."""
    taken: set[str] = set()
    cases = [
        Case(name=test_name(function=r.owner.name, taken=taken), setup=r.setup, expr=r.expr, expected=r.fixed)
        for r in rows
    ]
    source = test_source(doc=doc, package=p.package, exports=p.exports, cases=cases, probes=probes)
    return source, [c.name for c in cases]


def _repository(*, p: Placement, visible: tuple[str, str], rng: Random) -> dict[str, str]:
    sources = p.sources(buggy=True)
    listing = {
        module: [
            (q.name, signature(sources[p.path_of(q)], q.name), q.unit.summary)
            for q in p.placed
            if q.module == module
        ]
        for module in p.module_docs
    }
    return {
        "README.md": readme(package=p.package, description=p.description, modules=listing),
        "pyproject.toml": pyproject(package=p.package, version=f"0.{rng.randint(1, 9)}.{rng.randint(0, 9)}"),
        **sources,
        visible[0]: visible[1],
    }
