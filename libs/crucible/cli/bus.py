"""`crucible bus identities DIR` writes the bus identities a deployment mounts: an NKey seed per service and
one for the operator (mode 0600), and `auth.conf`, the nats-server authorization holding each public key to
its permissions (`crucible.contracts.access`). Seeds already in DIR are kept. `crucible bus setup` creates
or updates the streams as this version configures them, as the operator (CRUCIBLE_NATS_NKEY_FILE naming
the operator's seed): services may only create a missing stream, never change one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

bus_app = typer.Typer(help="Bus identities and stream setup.", no_args_is_help=True)


@bus_app.command("identities")
def identities(
    folder: Annotated[Path, typer.Argument(help="Where the seeds and auth.conf go (made if missing).")],
) -> None:
    """Write every service's NKey seed and nats-server's auth.conf; existing seeds are kept."""
    from crucible.identities import ensure_identities, seed_file, write_server_config

    config = write_server_config(folder)
    console = Console()
    for identity, key in ensure_identities(folder).items():
        console.print(f"{identity:12} {key}  {seed_file(folder, identity)}", markup=False, soft_wrap=True)
    console.print(f"nats-server authorization: {config}", markup=False, soft_wrap=True)


@bus_app.command("setup")
def setup() -> None:
    """Create or update every stream (run as the operator, like the database migrations)."""
    from crucible.bus import Bus
    from crucible.contracts.access import ADMIN
    from crucible.settings import CommonSettings

    async def work() -> None:
        bus = await Bus.connect(CommonSettings(), name=ADMIN)
        try:
            await bus.ensure_streams()
        finally:
            await bus.close()

    try:
        asyncio.run(work())
    except Exception as exc:  # nats raises many unrelated types for a server that is not there
        Console(stderr=True).print(f"stream setup failed: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    Console().print("streams ready", markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(bus_app, name="bus")
