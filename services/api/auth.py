"""Who may call the REST API: API keys (crucible.apikeys) as bearer tokens, checked per route by scope.

    READ    every GET of /v1 (a `read` key, or the dashboard's cookie, which is good for reads only)
    WRITE   start and cancel runs, request evaluations (a `write` key); writes are rate-limited per key
    ADMIN   create, list and revoke keys (an `admin` key)

No key, a malformed, unknown or revoked one is a 401 with `WWW-Authenticate: Bearer`; a key whose scope
is too small is a 403 naming the scope needed; a key over its write rate is a 429 with `Retry-After`.
The key checked for a request is kept in its ASGI scope, so a route with several guards looks it up once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import SQLAlchemyError

from crucible.apikeys import KeyInfo, Scope, allows, find_key
from services.api.commands import Unavailable

COOKIE = "crucible_key"
SCOPE_KEY = "crucible.api_key"
READS = frozenset({"GET", "HEAD"})

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="apiKey",
    bearerFormat="crk_<id>_<secret>",
    description="An API key from `crucible keys create` (a local stack writes an admin key to "
    "`<state>/api-key`): `Authorization: Bearer crk_...`.",
)
cookie = APIKeyCookie(
    name=COOKIE,
    auto_error=False,
    scheme_name="dashboardCookie",
    description="The dashboard's login cookie (set by `/login`); good for reads only.",
)

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "No API key, or one that is malformed, unknown or revoked."},
    403: {"description": "The API key's scope does not allow this."},
}
WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **AUTH_RESPONSES,
    429: {"description": "The API key is over its write rate; `Retry-After` says when to try again."},
}


@dataclass
class _Bucket:
    tokens: float
    at: float


class WriteLimiter:
    """A token bucket per key: `burst` writes at once, refilled at `rate_per_s`."""

    def __init__(self, *, rate_per_s: float, burst: int) -> None:
        self.rate, self.burst = rate_per_s, burst
        self._buckets: dict[str, _Bucket] = {}

    def wait_s(self, key_id: str) -> float:
        """0 and one write taken when the key may write now, else the seconds until it may."""
        now = time.monotonic()
        bucket = self._buckets.setdefault(key_id, _Bucket(float(self.burst), now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / self.rate


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})


async def lookup(request: Request, token: str) -> KeyInfo | None:
    """The live key of a token, or None; a database that does not answer is `Unavailable` (a 503)."""
    try:
        async with request.app.state.sessionmaker() as session:
            return await find_key(session, token)
    except (SQLAlchemyError, OSError) as exc:
        raise Unavailable(f"database unavailable: {type(exc).__name__}") from exc


async def _key(request: Request, token: str | None) -> KeyInfo:
    cached = request.scope.get(SCOPE_KEY)
    if cached is not None:
        return cached
    if not token:
        raise _unauthorized("an API key is required: send `Authorization: Bearer <key>`")
    key = await lookup(request, token)
    if key is None:
        raise _unauthorized("the API key is malformed, unknown or revoked")
    request.scope[SCOPE_KEY] = key
    return key


def _require(needed: Scope, key: KeyInfo, request: Request) -> KeyInfo:
    if not allows(key.scope, needed):
        raise HTTPException(
            status_code=403, detail=f"this needs a {needed} key; key {key.key_id} is {key.scope}"
        )
    if needed != "read" and request.method not in READS:
        wait = request.app.state.write_limiter.wait_s(key.key_id)
        if wait > 0:
            raise HTTPException(
                status_code=429,
                detail=f"key {key.key_id} is over its write rate",
                headers={"Retry-After": str(math.ceil(wait))},
            )
    return key


Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


Cookie = Annotated[str | None, Depends(cookie)]


async def reader(request: Request, credentials: Bearer, from_cookie: Cookie) -> KeyInfo:
    """The request's key, good for reads: the bearer token, or the dashboard's cookie on a GET."""
    token = credentials.credentials if credentials else None
    if token is None and request.method in READS:
        token = from_cookie
    return _require("read", await _key(request, token), request)


async def _writer(request: Request, credentials: Bearer) -> KeyInfo:
    return _require("write", await _key(request, credentials.credentials if credentials else None), request)


async def _admin(request: Request, credentials: Bearer) -> KeyInfo:
    return _require("admin", await _key(request, credentials.credentials if credentials else None), request)


READ = Depends(reader)
WRITE = Depends(_writer)
ADMIN = Depends(_admin)
KeyDep = Annotated[KeyInfo, ADMIN]
"""The admin key of the request, for routes that need to know who calls."""
