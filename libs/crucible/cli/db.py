"""`crucible db upgrade`: apply the Alembic migrations, the explicit step before catalog and api start."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)


@db_app.command()
def upgrade(
    database_url: Annotated[
        str | None,
        typer.Option(
            envvar="CRUCIBLE_DATABASE_URL",
            help="postgresql+asyncpg://user@host:port/db or sqlite+aiosqlite:///file.db "
            "(default: the settings' database_url).",
        ),
    ] = None,
) -> None:
    """Upgrade the database schema to the newest migration."""
    from crucible.localstack.migrations import MigrationError, run_migrations
    from crucible.settings import CommonSettings

    console = Console(stderr=True)
    url = database_url or CommonSettings().database_url
    try:
        output = run_migrations(database_url=url)
    except (ValueError, MigrationError) as exc:
        console.print(f"[red]crucible db upgrade: {exc}[/red]", highlight=False)
        raise typer.Exit(1) from None
    if output:
        console.print(output, highlight=False, markup=False)
    console.print("[green]database schema is up to date[/green]")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
