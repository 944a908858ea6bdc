"""The `crucible` command. Each command (group) lives in a module of its own that exposes `register(app)`:
under crucible.cli, or with its service (services.sandbox.cli, services.catalog.cli), named here by
module path so that the library never imports a service. The modules import nothing heavy (torch, ray,
the stack) until a command runs, so `crucible --help` answers fast."""

from __future__ import annotations

import importlib
import importlib.util

import typer

COMMAND_MODULES = (
    "crucible.cli.up",
    "crucible.cli.db",
    "crucible.cli.demo",
    "crucible.cli.keys",
    "crucible.cli.runs",
    "crucible.cli.evals",
    "crucible.cli.sft",
    "crucible.cli.model",
    "crucible.cli.serve",
    "crucible.cli.deadletters",
    "crucible.cli.identities",
    "services.sandbox.cli",
    "services.catalog.cli",
)
"""Registered in this order; a module not written yet (or whose package is not installed) is left out."""


app = typer.Typer(
    name="crucible",
    help="Crucible: asynchronous reinforcement learning for coding agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a package above it is not installed
        return False


for _module in COMMAND_MODULES:
    if _exists(_module):
        importlib.import_module(_module).register(app)
