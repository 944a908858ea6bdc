"""`crucible keys create|list|revoke`: REST API keys, made in the database directly (an operator's
first key cannot come from the api, which needs one). The database is CRUCIBLE_DATABASE_URL or --url."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from crucible.cli.db import UrlOption, _redact, _url

keys_app = typer.Typer(help="REST API keys (bearer tokens for the api, the CLI and the dashboard).",
                       no_args_is_help=True)  # fmt: skip


def _with_session(url: str | None, work: Any) -> Any:
    from sqlalchemy.exc import SQLAlchemyError

    from crucible.db import make_engine, make_sessionmaker

    url = _url(url)

    async def run() -> Any:
        engine = make_engine(url)
        try:
            async with make_sessionmaker(engine)() as session:
                return await work(session)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(run())
    except (OSError, SQLAlchemyError) as exc:
        typer.echo(
            f"crucible keys: cannot use the database {_redact(url)}: {type(exc).__name__}: {exc}", err=True
        )
        raise typer.Exit(1) from None


@keys_app.command("create")
def create(
    scope: Annotated[
        str,
        typer.Option(
            help="read, write (also start and cancel runs, request evaluations) or admin (also manage keys)."
        ),
    ],
    name: Annotated[str, typer.Option(help="Who or what holds the key.")] = "cli",
    file: Annotated[
        Path | None, typer.Option(help="Write the token to this file (mode 0600) instead of printing it.")
    ] = None,
    url: UrlOption = None,
) -> None:
    """A new key; its token is printed (or written to --file) this once."""
    from crucible.apikeys import SCOPES, create_key
    from crucible.private import write_private

    if scope not in SCOPES:
        raise typer.BadParameter(f"one of {', '.join(SCOPES)}", param_hint="--scope")
    info, token = _with_session(url, lambda s: create_key(s, scope=scope, name=name))  # type: ignore[arg-type]
    if file is None:
        typer.echo(token)
    else:
        write_private(file, token)
        typer.echo(f"key {info.key_id} ({info.scope}) written to {file}")


@keys_app.command("list")
def list_(url: UrlOption = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every key, revoked ones included (never their secrets)."""
    from crucible.apikeys import list_keys

    keys = _with_session(url, list_keys)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        **k.__dict__,
                        "created_at": k.created_at.isoformat(),
                        "revoked_at": k.revoked_at and k.revoked_at.isoformat(),
                    }
                    for k in keys
                ],
                indent=2,
            )
        )
        return
    table = Table("key", "name", "scope", "created", "revoked")
    for k in keys:
        table.add_row(k.key_id, k.name, k.scope, f"{k.created_at:%Y-%m-%d %H:%M:%S}",
                      f"{k.revoked_at:%Y-%m-%d %H:%M:%S}" if k.revoked_at else "")  # fmt: skip
    Console().print(table)


@keys_app.command("revoke")
def revoke(key_id: str, url: UrlOption = None) -> None:
    """Revoke a key: from now on the api answers it with a 401."""
    from crucible.apikeys import revoke_key

    info = _with_session(url, lambda s: revoke_key(s, key_id))
    if info is None:
        typer.echo(f"crucible keys: no key {key_id}", err=True)
        raise typer.Exit(1)
    typer.echo(f"key {key_id} revoked")


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
