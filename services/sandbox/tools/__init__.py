"""The agent's tools. Importing this package registers them all."""

from services.sandbox.tools import files, search, shell
from services.sandbox.tools.registry import TOOLS, Tool, ToolFailure, call_tool, lookup

__all__ = ["TOOLS", "Tool", "ToolFailure", "call_tool", "files", "lookup", "search", "shell"]
