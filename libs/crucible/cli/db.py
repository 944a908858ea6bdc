"""`crucible db upgrade|downgrade|current`: the explicit migration step before catalog and api start."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from crucible.db.cli import cli

    app.add_typer(cli, name="db")
