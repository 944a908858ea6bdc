"""`crucible deadletters list|show|replay`: the messages a consumer parked because it could not process
them (malformed, or failing every delivery), read from the DEADLETTER stream, and put back on their
subject once the cause is fixed. Talks to NATS (CRUCIBLE_NATS_URL) and, for claim checks, S3."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

deadletters_app = typer.Typer(help="Inspect and replay dead-lettered messages.", no_args_is_help=True)


async def _with_bus(work):
    from crucible.bus import Bus
    from crucible.settings import CommonSettings

    settings = CommonSettings()
    try:
        bus = await Bus.connect(settings, name="cli-deadletters")
    except Exception as exc:  # nats raises many unrelated types for a server that is not there
        Console(stderr=True).print(
            f"cannot reach NATS at {settings.nats_url}: {exc}", style="red", markup=False
        )
        raise typer.Exit(2) from None
    try:
        return await work(bus)
    finally:
        await bus.close()


def _payload(data: bytes) -> Any:
    """The parked message as data (msgpack decoded, bytes shown by size), or its size if it is not msgpack."""
    import msgspec

    def plain(value: Any) -> Any:
        if isinstance(value, bytes):
            return f"<{len(value)} bytes>"
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    try:
        return plain(msgspec.msgpack.decode(data))
    except msgspec.DecodeError:
        return f"<{len(data)} bytes, not msgpack>"


@deadletters_app.command("list")
def list_letters(
    stream: Annotated[
        str | None, typer.Option(help="Only letters from this stream's consumers (e.g. GRADED).")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 20,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The newest dead letters, newest first."""
    letters = asyncio.run(_with_bus(lambda bus: bus.dead_letters(stream=stream, limit=limit)))
    if as_json:
        rows = [
            {
                "seq": seq,
                "stream": letter.stream,
                "subject": letter.subject,
                "consumer": letter.consumer,
                "deliveries": letter.deliveries,
                "reason": letter.reason,
            }
            for seq, letter in letters
        ]
        print(json.dumps(rows, indent=2))
        return
    table = Table("seq", "stream", "subject", "consumer", "deliveries", "reason")
    for seq, letter in letters:
        table.add_row(str(seq), letter.stream, letter.subject, letter.consumer, str(letter.deliveries),
                      letter.reason[:120])  # fmt: skip
    Console().print(table)


@deadletters_app.command("show")
def show_letter(seq: int) -> None:
    """One dead letter, with the message it parked."""
    letter = asyncio.run(_with_bus(lambda bus: _at(bus, seq)))
    shown = {
        "seq": seq, "stream": letter.stream, "subject": letter.subject, "consumer": letter.consumer,
        "deliveries": letter.deliveries, "reason": letter.reason, "headers": letter.headers,
        "message": _payload(letter.payload),
    }  # fmt: skip
    print(json.dumps(shown, indent=2, default=str))


@deadletters_app.command("replay")
def replay(
    seqs: Annotated[list[int], typer.Argument(help="Sequence numbers from `crucible deadletters list`.")],
) -> None:
    """Put dead letters' messages back on their subjects (their consumers get them anew) and remove the
    letters. Replaying one twice publishes it once."""

    async def work(bus) -> int:
        failed = 0
        for seq in seqs:
            try:
                letter = await bus.replay_dead_letter(seq)
            except LookupError as exc:
                Console(stderr=True).print(str(exc), style="red", markup=False)
                failed += 1
                continue
            Console().print(f"{seq}: replayed on {letter.subject}", markup=False)
        return failed

    if asyncio.run(_with_bus(work)):
        raise typer.Exit(1)


async def _at(bus, seq: int):
    try:
        return await bus.dead_letter_at(seq)
    except LookupError as exc:
        Console(stderr=True).print(str(exc), style="red", markup=False)
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    app.add_typer(deadletters_app, name="deadletters")
