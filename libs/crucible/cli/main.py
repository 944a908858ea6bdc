"""The `crucible` command. Each command (group) lives in its own module under crucible.cli and exposes
`register(app)`; modules import nothing heavy (torch, ray, the stack) until a command runs, so
`crucible --help` answers fast."""

from __future__ import annotations

import importlib
import importlib.util

import typer

app = typer.Typer(
    name="crucible",
    help="Crucible: asynchronous reinforcement learning for coding agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

COMMAND_MODULES = ("up", "db", "demo", "runs", "sandbox")
"""Registered in this order; a module not written yet is left out."""

for _name in COMMAND_MODULES:
    _module = f"crucible.cli.{_name}"
    if importlib.util.find_spec(_module) is not None:
        importlib.import_module(_module).register(app)
