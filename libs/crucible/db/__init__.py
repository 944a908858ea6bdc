"""Database layer: SQLAlchemy 2 async models, engines and sessions, Alembic migrations.

`make_engine` and `make_sessionmaker` load SQLAlchemy on first use, so `crucible db --help` stays quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crucible.db.session import make_engine, make_sessionmaker

__all__ = ["make_engine", "make_sessionmaker"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from crucible.db import session

        return getattr(session, name)
    raise AttributeError(f"module 'crucible.db' has no attribute {name!r}")
