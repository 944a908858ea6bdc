"""The `crucible` command line (typer + rich)."""
