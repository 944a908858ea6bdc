"""`crucible tasks import|synthesize`: bring real repositories' tasks into the catalog.

Both verify every candidate inside the sandbox service and index the verified ones in the catalog's
database, so they need the stack that serves them (`crucible up`, or the services deployed) and its
settings in the environment (CRUCIBLE_NATS_URL, CRUCIBLE_S3_*, CRUCIBLE_DATABASE_URL). Each prints a
summary; with --json one object: taskset, verified, rejected (counts), reasons (by candidate), splits.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

tasks_app = typer.Typer(help="Import and synthesize task sets from real repositories.", no_args_is_help=True)

TasksetOption = Annotated[
    str, typer.Option("--taskset", help="Name of the task set (replaced if it exists).")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
TimeoutOption = Annotated[float, typer.Option("--timeout", help="Limit of one test run, in seconds.")]
WorkersOption = Annotated[int, typer.Option("--workers", min=1, max=64, help="Candidates verified at once.")]


TASKSET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$")


def _check(taskset: str, split: str | None = None) -> None:
    from crucible.contracts.messages import SPLITS

    if not TASKSET.match(taskset):
        Console(stderr=True).print(f"[red]task set name {taskset!r}: letters, digits, '-' and '_' only[/red]")
        raise typer.Exit(2)
    if split is not None and split not in SPLITS:
        Console(stderr=True).print(f"[red]unknown split {split!r}: one of {', '.join(SPLITS)}[/red]")
        raise typer.Exit(2)


def _run(work: Callable[..., Awaitable[Any]], as_json: bool) -> None:
    from crucible.bus import BusError
    from crucible.telemetry import configure_logging

    # Progress goes to stderr (warnings only with --json), so stdout holds the summary alone.
    configure_logging(service="crucible-tasks", replica="cli", level="WARNING" if as_json else "INFO")

    try:
        report = asyncio.run(_with_stack(work))
    except (OSError, BusError, TimeoutError) as exc:
        Console(stderr=True).print(
            f"[red]cannot reach the stack (NATS, S3, database, sandbox): {exc!r}[/red]"
        )
        raise typer.Exit(2) from None
    out = report.as_json()
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        console = Console()
        console.print(
            f"task set [bold]{out['taskset']}[/bold]: {out['verified']} verified, "
            f"{out['rejected']} rejected, splits {out['splits']}, "
            f"{out['seconds_per_task']:.1f}s per candidate"
        )
        if out["reasons"]:
            table = Table("candidate", "why it is not served")
            for name, reason in out["reasons"].items():
                table.add_row(name, reason)
            console.print(table)
        for note in out["notes"]:
            console.print(f"note: {note}")
    if out["verified"] == 0:
        raise typer.Exit(1)


async def _with_stack(work: Callable[..., Awaitable[Any]]) -> Any:
    from crucible.bus import Bus
    from crucible.clients.sandbox import SandboxClient
    from crucible.db import make_engine, make_sessionmaker
    from crucible.db.migrate import check_schema
    from crucible.objectstore import ObjectStore
    from services.catalog.settings import Settings

    settings = Settings()
    store = ObjectStore.from_settings(settings)
    await store.ensure_bucket()
    engine = make_engine(settings.database_url)
    try:
        await check_schema(engine)
        bus = await Bus.connect(settings, store=store, name="crucible-tasks")
        try:
            sandboxes = SandboxClient(bus, create_timeout_s=60, call_timeout_s=60)
            return await work(store=store, sessionmaker=make_sessionmaker(engine), sandboxes=sandboxes)
        finally:
            await bus.close()
    finally:
        await engine.dispose()


@tasks_app.command("import")
def import_file(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="SWE-bench-format JSONL.")],
    repos: Annotated[
        Path, typer.Option("--repos", exists=True, file_okay=False, help="Folder of repository mirrors.")
    ],
    taskset: TasksetOption = "swebench",
    split: Annotated[
        str | None, typer.Option(help="Put every task in this split instead of splitting by repository.")
    ] = None,
    timeout: TimeoutOption = 300.0,
    workers: WorkersOption = 2,
    hints: Annotated[
        bool, typer.Option("--hints", help="Append each instance's hints_text to its statement.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Import SWE-bench- or SWE-smith-format instances; each is verified in the sandbox before it is
    served."""
    from services.catalog.importing import import_swebench

    _check(taskset, split)

    async def work(**stack: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="crucible-import-") as scratch:
            return await import_swebench(
                text=file.read_text(encoding="utf-8"), repos=repos, taskset=taskset, split=split,
                scratch=Path(scratch), workers=workers, timeout_s=timeout, hints=hints, **stack,
            )  # fmt: skip

    _run(work, as_json)


@tasks_app.command("synthesize")
def synthesize(
    repo_dir: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="A Python repository.")],
    taskset: Annotated[str | None, typer.Option("--taskset", help="Default: the folder's name.")] = None,
    max_tasks: Annotated[
        int, typer.Option(min=1, max=1000, help="Stop after this many verified tasks.")
    ] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the choice and order of mutations.")] = 0,
    timeout: TimeoutOption = 300.0,
    workers: WorkersOption = 2,
    as_json: JsonOption = False,
) -> None:
    """Turn a repository whose own tests pass into verified bug-fix tasks (mutations its tests catch)."""
    from services.catalog.synthesize import synthesize_tasks

    taskset = taskset or re.sub(r"[^A-Za-z0-9_-]+", "-", repo_dir.resolve().name).strip("-_") or "synthesized"
    _check(taskset)

    async def work(**stack: Any) -> Any:
        return await synthesize_tasks(
            repo=repo_dir, taskset=taskset, max_tasks=max_tasks, seed=seed,
            workers=workers, timeout_s=timeout, **stack,
        )  # fmt: skip

    _run(work, as_json)


def register(app: typer.Typer) -> None:
    app.add_typer(tasks_app, name="tasks")
