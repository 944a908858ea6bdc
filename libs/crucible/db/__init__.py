"""Database layer: SQLAlchemy 2 async models, engines and sessions, Alembic migrations."""

from crucible.db.session import make_engine, make_sessionmaker

__all__ = ["make_engine", "make_sessionmaker"]
