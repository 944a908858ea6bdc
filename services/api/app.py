"""The api service: the REST app (`create_app`) and its wiring into the service runtime (`setup`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

import crucible
from crucible.bus import Bus
from crucible.db import make_engine, make_sessionmaker
from crucible.db.migrate import check_schema
from crucible.runtime import Runtime
from services.api import dashboard
from services.api.auth import AUTH_RESPONSES, READ, WriteLimiter
from services.api.cleanup import run_cleanup
from services.api.commands import ConfigCheck, Conflict, Unavailable, Unservable
from services.api.ingest import run_ingest
from services.api.metrics import HTTP_REQUESTS, HTTP_SECONDS
from services.api.pagination import InvalidCursor
from services.api.queries import NotFound
from services.api.routes import evals, health, keys, runs, trajectories
from services.api.settings import Settings
from services.api.trackers import Trackers

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


MAX_ERRORS, MAX_ERROR_CHARS = 20, 300


async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
    """A 422 naming what is wrong where, never echoing the input back (it may be megabytes)."""
    assert isinstance(exc, RequestValidationError)
    detail = [
        {
            "type": str(error.get("type", ""))[:MAX_ERROR_CHARS],
            "loc": [str(part)[:MAX_ERROR_CHARS] for part in error.get("loc", ())][:16],
            "msg": str(error.get("msg", ""))[:MAX_ERROR_CHARS],
        }
        for error in exc.errors()[:MAX_ERRORS]
    ]
    return JSONResponse(status_code=422, content={"detail": detail})


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's errors, except that a 405's `Allow` names every method of the path, not only those of
    the first route that matched it."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        path = request.url.path
        methods = {
            m
            for r in request.app.routes
            if isinstance(r, APIRoute) and r.path_regex.match(path)
            for m in r.methods or ()
        }
        exc.headers = {**(exc.headers or {}), "Allow": ", ".join(sorted(methods))}
    return await http_exception_handler(request, exc)


async def _unservable(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Unservable)
    detail = [{"type": "unservable", "loc": list(exc.loc), "msg": exc.msg}]
    return JSONResponse(status_code=422, content={"detail": detail})


def _error(status: int) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    async def handler(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=status, content={"detail": str(exc)})

    return handler


def create_app(
    *, settings: Settings, sessionmaker: async_sessionmaker[AsyncSession], bus: Bus | None = None
) -> FastAPI:
    app = FastAPI(
        title="Crucible API",
        version=crucible.__version__,
        description=(
            "Run history of Crucible: runs, steps, metrics, trajectories, checkpoints and evaluations."
        ),
        responses={
            400: {"description": "A body that does not parse."},
            413: {"description": "A request body over the api's `max_body_bytes`."},
        },
    )
    app.state.settings = settings
    app.state.sessionmaker = sessionmaker
    app.state.bus = bus
    app.state.config_check = ConfigCheck()
    app.state.write_limiter = WriteLimiter(rate_per_s=settings.write_rate_per_s, burst=settings.write_burst)
    app.add_exception_handler(NotFound, _error(404))
    app.add_exception_handler(InvalidCursor, _error(400))
    app.add_exception_handler(Unavailable, _error(503))
    app.add_exception_handler(Conflict, _error(409))
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Unservable, _unservable)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(dashboard.LoginNeeded, dashboard.login_needed)
    app.include_router(health.router)
    for module in (runs, trajectories, evals):
        app.include_router(module.router, dependencies=[READ], responses=AUTH_RESPONSES)
    app.include_router(keys.router)
    app.include_router(dashboard.router)
    app.mount("/static", dashboard.static, name="static")

    @app.middleware("http")
    async def bounded_bodies(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        length = request.headers.get("content-length", "")
        if length and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return JSONResponse(
                status_code=413, content={"detail": f"request body over {settings.max_body_bytes} bytes"}
            )
        return await call_next(request)

    @app.middleware("http")
    async def count_requests(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        method = request.method if request.method in METHODS else "other"
        HTTP_REQUESTS.labels(method, route, str(response.status_code)).inc()
        HTTP_SECONDS.labels(route).observe(time.perf_counter() - started)
        return response

    return app


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings
    engine = make_engine(settings.database_url)
    rt.on_close(engine.dispose)
    await check_schema(engine)
    sessionmaker = make_sessionmaker(engine)
    rt.readiness_check("database", lambda: health.database_answers(sessionmaker))
    rt.spawn(
        run_ingest(
            bus=rt.bus,
            sessionmaker=sessionmaker,
            stop=rt.stopping,
            batch=settings.ingest_batch,
            max_deliver=settings.ingest_max_deliver,
            graded_durable=settings.graded_durable,
            events_durable=settings.events_durable,
            trackers=Trackers(
                root=settings.tracking_dir,
                mlflow_tracking_uri=settings.mlflow_tracking_uri,
                wandb_mode=settings.wandb_mode,
            ),
        ),
        name="ingest",
    )
    rt.spawn(
        run_cleanup(
            bus=rt.bus,
            store=rt.store,
            sessionmaker=sessionmaker,
            stop=rt.stopping,
            after_s=settings.release_objects_after_s,
            every_s=settings.cleanup_every_s,
            graded_durable=settings.graded_durable,
        ),
        name="cleanup",
    )
    app = create_app(settings=settings, sessionmaker=sessionmaker, bus=rt.bus)
    port = await rt.serve_http(app, host=settings.api_host, port=settings.api_port, name="rest")
    base = f"http://{settings.api_host}:{port}"
    rt.log.info("REST API listening", url=f"{base}/v1", docs=f"{base}/docs")
