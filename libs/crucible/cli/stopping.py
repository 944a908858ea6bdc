"""How the commands that run the local stack in the foreground (`crucible up`, `crucible demo`) are
stopped: Ctrl-C, SIGTERM or a closed terminal (SIGHUP) all raise KeyboardInterrupt, SIGINT even where a
shell started the command in the background with it ignored, so the stack is always taken down."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: a stop signal raises KeyboardInterrupt. After: the handlers from before."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals() -> None:
    """While the stack stops: a second signal must not cut its clean-up short."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
