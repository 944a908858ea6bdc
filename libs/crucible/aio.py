"""Running a coroutine to completion from synchronous code (the CLI, the local stack), also when that code
is itself called from inside a running event loop (a test, an async caller)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `work()` to completion, in a thread with its own loop when this thread already runs one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(work())).result()
