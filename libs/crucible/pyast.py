"""Python ASTs built one at a time. CPython 3.11 keeps the AST constructor's recursion depth per
interpreter, not per thread, so two threads parsing at once can fail with "SystemError: AST constructor
recursion depth mismatch" (python/cpython#106905). The catalog generates and synthesizes tasks on
worker threads, and the probes of its generated tasks are read back while it verifies them: every AST
they build goes through here."""

from __future__ import annotations

import ast
import threading
from typing import Any

_LOCK = threading.Lock()


def parse(source: str) -> ast.Module:
    with _LOCK:
        return ast.parse(source)


def literal_eval(text: str) -> Any:
    with _LOCK:
        return ast.literal_eval(text)
