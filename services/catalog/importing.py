"""What importing and synthesizing share: candidates verified in the sandbox, then served all at once.

A candidate's archives go to the object store first (the sandbox starts from them), each candidate is
verified (`sandboxed.verify_in_sandbox`), and only then are the verified ones indexed, in one
transaction that also removes the set's older rows: a half-finished import serves nothing new, and a
rejected candidate is never served. When nothing verifies, the set is left as it was. The report names
every rejected candidate with its reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.clients.sandbox import SandboxClient
from crucible.contracts.keys import taskset_object
from crucible.objectstore import ObjectStore
from services.catalog.publish import HIDDEN, SNAPSHOT, TaskRecord, store_tasks
from services.catalog.sandboxed import verify_in_sandbox
from services.catalog.splits import check_split
from services.catalog.swebench import candidates


@dataclass(kw_only=True)
class ImportReport:
    taskset: str
    verified: int = 0
    rejected: dict[str, str] = field(default_factory=dict)
    """Candidate (instance id, line, mutation) -> why it is not served."""
    splits: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    seconds_per_task: float = 0.0
    """Wall time per verified task, everything included."""
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "taskset": self.taskset,
            "verified": self.verified,
            "rejected": len(self.rejected),
            "reasons": dict(sorted(self.rejected.items())),
            "splits": self.splits,
            "seconds": round(self.seconds, 2),
            "seconds_per_task": round(self.seconds_per_task, 2),
            "notes": self.notes,
        }


async def verify_and_store(
    candidates: Sequence[TaskRecord],
    *,
    report: ImportReport,
    store: ObjectStore,
    sessionmaker: async_sessionmaker[AsyncSession],
    sandboxes: SandboxClient,
    workers: int,
    timeout_s: float,
    labels: dict[str, str] | None = None,
) -> ImportReport:
    """`labels` names candidates in the report (task id -> e.g. the instance id); default the task id."""
    started = time.monotonic()
    slots = asyncio.Semaphore(workers)

    async def verify(record: TaskRecord) -> str:
        async with slots:
            refs = [
                await store.put_bytes(taskset_object(record.taskset, record.task_id, name), data,
                                      content_type="application/gzip")
                for name, data in ((SNAPSHOT, record.snapshot), (HIDDEN, record.hidden))
            ]  # fmt: skip
            try:
                return await verify_in_sandbox(
                    sandboxes,
                    task_id=record.task_id,
                    snapshot=refs[0],
                    hidden=refs[1],
                    reference_patch=record.reference_patch,
                    test_command=list(record.test_command),
                    fail_to_pass=list(record.fail_to_pass),
                    pass_to_pass=list(record.pass_to_pass),
                    timeout_s=timeout_s,
                )
            except Exception as exc:  # the sandbox refused or the bus failed: this candidate only
                return f"could not verify in the sandbox: {exc!r}"[:500]

    reasons = await asyncio.gather(*(verify(record) for record in candidates))
    verified = [record for record, reason in zip(candidates, reasons, strict=True) if not reason]
    for record, reason in zip(candidates, reasons, strict=True):
        if reason:
            report.rejected[(labels or {}).get(record.task_id, record.task_id)] = reason
    if verified:
        await store_tasks(
            verified, store=store, sessionmaker=sessionmaker, replace=report.taskset, upload=False
        )
    else:
        report.notes.append(f"nothing verified: task set {report.taskset!r} is left as it was")
    report.verified = len(verified)
    for record in verified:
        report.splits[record.split] = report.splits.get(record.split, 0) + 1
    report.seconds += time.monotonic() - started
    report.seconds_per_task = report.seconds / max(1, report.verified)
    return report


async def import_swebench(
    *,
    text: str,
    repos: Path,
    taskset: str,
    split: str | None,
    scratch: Path,
    store: ObjectStore,
    sessionmaker: async_sessionmaker[AsyncSession],
    sandboxes: SandboxClient,
    workers: int = 2,
    timeout_s: float = 300.0,
    hints: bool = False,
) -> ImportReport:
    """Import a SWE-bench- or SWE-smith-format JSONL text (see `services.catalog.swebench`); `hints`
    shows each instance's hints_text in its statement."""
    if split is not None:
        check_split(split)
    started = time.monotonic()
    records, rejected, labels = await asyncio.to_thread(
        candidates, text, repos=repos, taskset=taskset, split=split, scratch=scratch, hints=hints
    )
    report = ImportReport(taskset=taskset, rejected=rejected)
    report.notes.append("install commands are not run: tests use the sandbox's Python environment")
    report.seconds = time.monotonic() - started
    return await verify_and_store(
        records, report=report, store=store, sessionmaker=sessionmaker, sandboxes=sandboxes,
        workers=workers, timeout_s=timeout_s, labels=labels,
    )  # fmt: skip
