"""REST API keys: tokens `crk_<key id>_<secret>`, of which the database keeps the id, a name, a scope
and the sha256 of the secret (never the secret). Scopes are ordered: read < write < admin.

A secret is 32 random bytes, so one sha256 (not a slow password hash) is enough to make the stored
digest useless to whoever reads the table; comparing digests is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.aio import run_sync
from crucible.db.models import ApiKey, utcnow
from crucible.private import write_private

Scope = Literal["read", "write", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "write", "admin")
KEY_FILE = "api-key"
"""The file under a local stack's state directory that holds its admin key."""
_TOKEN = re.compile(r"^crk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    name: str
    scope: Scope
    created_at: datetime
    revoked_at: datetime | None


def allows(held: str, needed: Scope) -> bool:
    """Whether a key of scope `held` may do what needs `needed`."""
    return held in SCOPES and SCOPES.index(held) >= SCOPES.index(needed)  # type: ignore[arg-type]


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.key_id, row.name, row.scope, row.created_at, row.revoked_at)  # type: ignore[arg-type]


async def create_key(session: AsyncSession, *, scope: Scope, name: str) -> tuple[KeyInfo, str]:
    """A new key and its token; the token is shown once and cannot be recovered."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    row = ApiKey(key_id=key_id, name=name, scope=scope, secret_sha256=_digest(secret))
    session.add(row)
    await session.commit()
    return _info(row), f"crk_{key_id}_{secret}"


async def find_key(session: AsyncSession, token: str) -> KeyInfo | None:
    """The live key a token belongs to, or None for a malformed, unknown, wrong or revoked token."""
    match = _TOKEN.match(token)
    if match is None:
        return None
    key_id, secret = match.groups()
    row = await session.get(ApiKey, key_id)
    if row is None or row.revoked_at is not None:
        return None
    if not hmac.compare_digest(row.secret_sha256, _digest(secret)):
        return None
    return _info(row)


async def revoke_key(session: AsyncSession, key_id: str) -> KeyInfo | None:
    """Revoke a key (idempotent); None when there is no such key."""
    row = await session.get(ApiKey, key_id)
    if row is None:
        return None
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        await session.commit()
    return _info(row)


async def list_keys(session: AsyncSession) -> list[KeyInfo]:
    rows = await session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id))
    return [_info(row) for row in rows]


def make_key(
    database_url: str, *, scope: Scope = "admin", name: str = "local", reuse: Path | None = None
) -> str:
    """A token of a new key in the database at `database_url`; with `reuse`, the token in that file
    instead when it is a live key of this scope there."""
    from crucible.db import make_engine, make_sessionmaker

    async def work() -> str:
        engine = make_engine(database_url)
        try:
            async with make_sessionmaker(engine)() as session:
                if reuse is not None and reuse.is_file():
                    token = reuse.read_text().strip()
                    held = await find_key(session, token)
                    if held is not None and held.scope == scope:
                        return token
                return (await create_key(session, scope=scope, name=name))[1]
        finally:
            await engine.dispose()

    return run_sync(work)


def ensure_key_file(database_url: str, path: Path, *, scope: Scope = "admin", name: str = "local") -> str:
    """The token in `path` when it is still a live key of `scope`, else a new key's, written there
    (mode 0600): a local stack started again on the same state keeps its key."""
    token = make_key(database_url, scope=scope, name=name, reuse=path)
    write_private(path, token)
    return token
