"""`crucible identities DIR` writes the service identities a deployment mounts (`crucible.identities`): per
service an NKey seed and an S3 key, one seed for the operator, nats-server's authorization of the public
keys and each service's MinIO policy. What DIR already holds is kept. `crucible bus setup` creates or
updates the streams as this version configures them, as the operator (CRUCIBLE_NATS_NKEY_FILE naming the
operator's seed): services may only create a missing stream, never change one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

bus_app = typer.Typer(help="The bus's streams.", no_args_is_help=True)


def identities(
    folder: Annotated[Path, typer.Argument(help="Where the identities go (made if missing).")],
    bucket: Annotated[str, typer.Option(help="The bucket the MinIO policies are for.")] = "crucible",
) -> None:
    """Write every service's NKey seed and S3 key, nats-server's auth.conf and the MinIO policies; what is
    there already is kept."""
    from crucible.identities import ensure_identities, seed_file, write_server_config

    config = write_server_config(folder, bucket=bucket)
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
    app.command("identities")(identities)
    app.add_typer(bus_app, name="bus")
