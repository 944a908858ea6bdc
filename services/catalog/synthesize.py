"""Bug-fix tasks synthesized from a real Python repository (SWE-smith-like).

The repository's real functions are mutated by AST (`mutations`); a mutation is kept only when the
repository's own tests catch it. Screening runs, in the sandbox, the tests that name the function
(pytest -k NAME) on the mutated code: the ones that fail become FAIL_TO_PASS, the ones that still pass
PASS_TO_PASS. The statement is written from that failing behaviour alone (the failing tests and their
assertion lines, never the changed code), the reference patch is the mutation undone, and every kept
task is verified like an imported one before it is served (the tests must pass on the original code).
At most one task per function; mutations are tried in a seeded order, kinds interleaved. Splits are
by index (`splits.index_split`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from pathlib import Path

import structlog
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts.keys import taskset_object
from crucible.objectstore import ObjectStore
from crucible.pytest_report import is_test_path, split_command
from services.catalog.generator import TEST_COMMAND
from services.catalog.importing import ImportReport, verify_and_store
from services.catalog.mutations import Mutation, mutations
from services.catalog.publish import SNAPSHOT, TaskRecord
from services.catalog.render import unified_patch
from services.catalog.snapshots import read_tree, tarball
from services.catalog.splits import index_split

SCREEN_PER_TASK = 8
"""Mutations screened at most per task asked for (most are not caught, or are caught by nothing)."""
SCREEN_TIMEOUT_S = 10.0
"""A screening run past this (a mutation that loops forever) rejects the mutation."""
KEYWORDS = {"and", "or", "not"}
log = structlog.get_logger("crucible.catalog")


def source_modules(files: dict[str, bytes]) -> dict[str, str]:
    """The repository's own Python code: not tests, not build scripts, not docs."""
    out = {}
    for path, data in files.items():
        name = path.rsplit("/", 1)[-1]
        if (
            not path.endswith(".py")
            or is_test_path(path)
            or name in {"setup.py", "conftest.py", "noxfile.py"}
        ):
            continue
        if path.split("/", 1)[0] in {"docs", "doc", "examples", "benchmarks", "scripts"}:
            continue
        try:
            out[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def test_paths(files: dict[str, bytes]) -> list[str]:
    return sorted(
        {
            p.split("/", 1)[0] if p.split("/", 1)[0] in {"tests", "test"} else p
            for p in files
            if p.endswith(".py") and is_test_path(p) and p.rsplit("/", 1)[-1] != "conftest.py"
        }
    )


def ordered(candidates: list[Mutation], seed: int) -> list[Mutation]:
    """Seeded shuffle, then kinds interleaved, so a few tasks already cover several bug kinds."""
    rng = random.Random(seed)
    by_kind: dict[str, list[Mutation]] = defaultdict(list)
    for m in sorted(candidates, key=lambda m: m.label):
        by_kind[m.kind].append(m)
    kinds = sorted(by_kind)
    for kind in kinds:
        rng.shuffle(by_kind[kind])
    rng.shuffle(kinds)
    out = []
    while any(by_kind.values()):
        for kind in kinds:
            if by_kind[kind]:
                out.append(by_kind[kind].pop())
    return out


def name_filter(function: str) -> str:
    """pytest -k for the tests that name a function: test_sliding_window and SlidingWindowTests alike
    (-k is case-insensitive)."""
    joined = function.replace("_", "")
    return function if joined == function else f"{function} or {joined}"


def statement(*, package: str, failing: list[tuple[str, str]], mutation: Mutation) -> str:
    """The failing behaviour as a user would report it: the tests that fail and what they say."""
    lines = [f"Some of `{package}`'s own tests fail after a recent change:", ""]
    lines += [f"- `{nodeid}`" for nodeid, _ in failing[:5]]
    if len(failing) > 5:
        lines.append(f"- and {len(failing) - 5} more")
    messages = [m for _, m in failing if m][:2]
    shown = [m for m in messages if not _leaks(m, mutation)]
    if shown:
        lines += ["", "What they report:", "", "```", *shown, "```"]
    lines += ["", "Find the cause in the library code and fix it, without changing the tests."]
    return "\n".join(lines)


def _leaks(text: str, mutation: Mutation) -> bool:
    snippets = [s.strip() for s in (mutation.before, mutation.after)]
    return any(len(s) >= 6 and s in text for s in snippets)


async def _screen(
    prepared: SandboxSession, mutation: Mutation, *, tests: list[str], timeout_s: float
) -> tuple[list[tuple[str, str]], list[str]] | str:
    """(failing tests with their messages, passing tests) on the mutated code, or why it is not kept."""
    started = time.monotonic()
    if not mutation.parses():
        return "the mutated file does not parse"
    patch = unified_patch(before={mutation.path: mutation.text}, after={mutation.path: mutation.source})
    [session] = await prepared.fork(1)
    async with session:
        if not (await session.apply_patch(patch)).ok:
            return "the mutation does not apply"
        args = split_command([*TEST_COMMAND, "-k", name_filter(mutation.function), *tests])
        run = await session.tool("run_tests", pytest_args=args, timeout_s=timeout_s)
    log.info("screened", mutation=mutation.label, seconds=round(time.monotonic() - started, 2),
             tests=len(run.tests or []), timed_out=run.timed_out)  # fmt: skip
    if run.timed_out:
        return f"tests ran past {timeout_s:.0f}s on the mutation"
    if not run.tests:
        return f"no test names `{mutation.function}`"
    failing = [
        (t.nodeid, t.message) for t in run.tests if t.outcome in ("failed", "error") and "::" in t.nodeid
    ]
    passing = [t.nodeid for t in run.tests if t.outcome == "passed"]
    if not failing:
        return "no test catches it"
    return failing, passing


async def synthesize_tasks(
    *,
    repo: Path,
    taskset: str,
    max_tasks: int,
    seed: int,
    store: ObjectStore,
    sessionmaker: async_sessionmaker[AsyncSession],
    sandboxes: SandboxClient,
    workers: int = 2,
    timeout_s: float = 300.0,
) -> ImportReport:
    started = time.monotonic()
    files = await asyncio.to_thread(read_tree, repo)
    sources = source_modules(files)
    tests = test_paths(files)
    package = repo.resolve().name
    report = ImportReport(taskset=taskset)
    if not sources or not tests:
        report.notes.append(f"no Python code or no tests under {repo}")
        return report
    pool = ordered([m for path, text in sources.items() for m in mutations(path, text)], seed)
    pool = [m for m in pool if m.function not in KEYWORDS and not m.function.startswith("_")] or pool
    original = tarball(files)
    ref = await store.put_bytes(
        taskset_object(taskset, "original", SNAPSHOT), original, content_type="application/gzip"
    )
    kept: list[tuple[Mutation, list[tuple[str, str]], list[str]]] = []
    functions: set[tuple[str, str]] = set()
    screened = 0
    prepared = await sandboxes.create(
        run_id="catalog-synthesize", task_id=f"{taskset}-original", snapshot=ref
    )
    async with prepared:
        for start in range(0, len(pool), workers):
            if len(kept) >= max_tasks or screened >= max_tasks * SCREEN_PER_TASK:
                break
            batch = [m for m in pool[start : start + workers] if (m.path, m.function) not in functions]
            screened += len(batch)
            results = await asyncio.gather(*(
                _screen(prepared, m, tests=tests, timeout_s=min(timeout_s, SCREEN_TIMEOUT_S))
                for m in batch
            ))  # fmt: skip
            for mutation, result in zip(batch, results, strict=True):
                if isinstance(result, str):
                    report.rejected[mutation.label] = result
                elif (mutation.path, mutation.function) not in functions and len(kept) < max_tasks:
                    functions.add((mutation.path, mutation.function))
                    kept.append((mutation, *result))
    report.notes.append(f"screened {screened} of {len(pool)} mutations")
    records = [
        _record(taskset, package, index, mutation, failing, passing, files)
        for index, (mutation, failing, passing) in enumerate(kept)
    ]
    report.seconds = time.monotonic() - started
    labels = {r.task_id: m.label for r, (m, _, _) in zip(records, kept, strict=True)}
    return await verify_and_store(
        records, report=report, store=store, sessionmaker=sessionmaker, sandboxes=sandboxes,
        workers=workers, timeout_s=timeout_s, labels=labels,
    )  # fmt: skip


def _record(taskset, package, index, mutation, failing, passing, files) -> TaskRecord:
    original = mutation.text
    mutated = {**files, mutation.path: mutation.source.encode("utf-8")}
    f2p = sorted({nodeid for nodeid, _ in failing})
    p2p = sorted(set(passing) - set(f2p))
    hidden_paths = {nodeid.split("::", 1)[0] for nodeid in f2p + p2p}
    return TaskRecord(
        task_id=f"{taskset}-{index:04d}",
        taskset=taskset,
        split=index_split(index),
        source="synthesized",
        repo=package,
        difficulty=1 if len(f2p) > 1 else 2,
        family=mutation.kind,
        statement=statement(package=package, failing=failing, mutation=mutation),
        snapshot=tarball(mutated),
        hidden=tarball({path: files[path] for path in hidden_paths if path in files}),
        test_command=(*TEST_COMMAND, *f2p, *p2p),
        reference_patch=unified_patch(
            before={mutation.path: mutation.source}, after={mutation.path: original}
        ),
        fail_to_pass=tuple(f2p),
        pass_to_pass=tuple(p2p),
    )
