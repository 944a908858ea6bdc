"""`crucible db upgrade|downgrade|current` (also `python -m crucible.db ...`): the explicit migration step
before catalog and api start. Alembic and SQLAlchemy load only when a command runs, so `--help` stays quick.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

UrlOption = Annotated[str | None, typer.Option(help="Database URL; default: CRUCIBLE_DATABASE_URL.")]
cli = typer.Typer(help="Database schema migrations.", no_args_is_help=True, add_completion=False)


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    return f"{scheme}{sep}{credentials.split(':')[0]}@{host}"


def _url(url: str | None) -> str:
    if url:
        return url
    from crucible.settings import CommonSettings

    return CommonSettings().database_url


@cli.command("upgrade")
def upgrade(revision: str = "head", url: UrlOption = None) -> None:
    """Migrate the schema up to REVISION (default: the newest)."""
    from sqlalchemy.exc import SQLAlchemyError

    from crucible.db import migrate

    url = _url(url)
    try:
        migrate.upgrade(url, revision)
    except (OSError, SQLAlchemyError, ValueError) as exc:
        typer.echo(
            f"crucible db upgrade: cannot migrate {_redact(url)}: {type(exc).__name__}: {exc}", err=True
        )
        raise typer.Exit(1) from None
    typer.echo(f"database at {revision}")


@cli.command("downgrade")
def downgrade(revision: str, url: UrlOption = None) -> None:
    """Migrate the schema down to REVISION (`base` drops every table)."""
    from crucible.db import migrate

    migrate.downgrade(_url(url), revision)
    typer.echo(f"database at {revision}")


@cli.command("current")
def current(url: UrlOption = None) -> None:
    """Print the database's schema revision and the newest one."""
    from crucible.db import migrate
    from crucible.db.session import make_engine

    async def show() -> str | None:
        engine = make_engine(_url(url))
        try:
            return await migrate.current_revision(engine)
        finally:
            await engine.dispose()

    typer.echo(f"current: {asyncio.run(show()) or 'none'}  head: {migrate.head_revision()}")


def register(app: typer.Typer) -> None:
    app.add_typer(cli, name="db")
