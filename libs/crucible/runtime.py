"""The service runtime every Crucible service runs in.

It loads settings (a bad config exits with a clear message), connects the bus, the object store and
Redis, serves /healthz, /readyz and /metrics, runs the service's `setup`, and on SIGTERM or SIGINT
stops taking new work, lets in-flight work finish (or hands it back to JetStream), and exits 0.
`Runtime[Settings]` is generic over the service's settings class, so `rt.settings` has its type.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
import structlog
import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import ValidationError

from crucible.bus import Bus
from crucible.objectstore import ObjectStore
from crucible.settings import CommonSettings
from crucible.telemetry import configure_logging

S = TypeVar("S", bound=CommonSettings)
SHUTDOWN_GRACE_S = 20.0


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside the service runtime, which owns the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


READY_CHECK_S = 2.0


class Runtime(Generic[S]):
    bus: Bus
    store: ObjectStore
    redis: aioredis.Redis
    """Connected by start(), before the service's setup runs."""

    def __init__(self, *, name: str, settings: S) -> None:
        self.name = name
        self.settings = settings
        self.log = structlog.get_logger(f"crucible.{name}")
        self.stopping = asyncio.Event()
        self.metrics: CollectorRegistry = REGISTRY
        self.http_port: int | None = None
        self._ready = False
        self._tasks: set[asyncio.Task] = set()
        self.failure: str | None = None
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._checks: dict[str, Callable[[], Awaitable[object]]] = {}

    def readiness_check(self, name: str, check: Callable[[], Awaitable[object]]) -> None:
        """`/readyz` is 503 while `check` raises or takes over READY_CHECK_S (a dependency of this
        service's own, beside the bus, Redis and the object store every service has)."""
        self._checks[name] = check

    def ready(self) -> None:
        self._ready = True
        self.log.info("ready", http_port=self.http_port)

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task:
        """Run a background loop; it should return soon after `stopping` is set."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._on_task_done)
        self._tasks.add(task)
        return task

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run `closer` at shutdown, after the background tasks; closers run in reverse order."""
        self._closers.append(closer)

    def _on_task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        self.failure = f"background task {task.get_name()} failed: {task.exception()!r}"
        self.log.error("background task failed; stopping", task=task.get_name(), error=repr(task.exception()))
        self.stopping.set()

    async def start(self) -> None:
        s = self.settings
        self.store = ObjectStore.from_settings(s)
        await self.store.ensure_bucket()
        self.bus = await Bus.connect(s, store=self.store, name=self.name)
        await self.bus.ensure_streams()
        self.redis = aioredis.from_url(s.redis_url, socket_connect_timeout=5)
        await self.redis.ping()
        self.readiness_check("redis", self.redis.ping)
        self.readiness_check("s3", self.store.check)
        await self._serve_health()

    async def _serve_health(self) -> None:
        app = FastAPI(title=f"crucible-{self.name} health", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok", "service": self.name, "replica": self.settings.replica}

        @app.get("/readyz")
        async def readyz(response: Response) -> dict[str, Any]:
            connected = hasattr(self, "bus") and self.bus.nc.is_connected
            names = list(self._checks)
            results = await asyncio.gather(*(self._passes(self._checks[n]) for n in names))
            checks = dict(zip(names, results, strict=True))
            ok = self._ready and connected and all(results) and not self.stopping.is_set()
            response.status_code = 200 if ok else 503
            return {"ready": ok, "bus": connected, **checks}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics), media_type=CONTENT_TYPE_LATEST)

        self.http_port = await self.serve_http(
            app, host=self.settings.http_host, port=self.settings.http_port, name="health"
        )

    @staticmethod
    async def _passes(check: Callable[[], Awaitable[object]]) -> bool:
        try:
            await asyncio.wait_for(check(), timeout=READY_CHECK_S)
            return True
        except Exception:  # any failure to reach the dependency means not ready
            return False

    async def serve_http(self, app: FastAPI, *, host: str, port: int, name: str) -> int:
        """Serve an ASGI app until the service has stopped; returns its port (0 picks a free one)."""
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", access_log=False
        )
        server = EmbeddedServer(config)
        task = asyncio.create_task(server.serve(), name=f"http-{name}")
        while not server.started:
            if task.done():  # uvicorn exits (SystemExit) when it cannot bind
                error = None if task.cancelled() else task.exception()
                raise RuntimeError(f"{name} HTTP server could not start on {host}:{port}: {error!r}")
            await asyncio.sleep(0.01)

        async def stop_server() -> None:
            server.should_exit = True
            await task

        self.on_close(stop_server)  # closers run last-registered first: health, registered at start, last
        return server.servers[0].sockets[0].getsockname()[1]

    async def shutdown(self) -> None:
        self._ready = False
        self.stopping.set()
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=SHUTDOWN_GRACE_S)
            for task in still:
                task.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception as exc:
                self.log.warning("error while closing", error=repr(exc))
        if hasattr(self, "bus"):
            await self.bus.close()
        if hasattr(self, "redis"):
            await self.redis.aclose()
        self.log.info("stopped")


def load_settings(settings_cls: type[S]) -> S:
    try:
        return settings_cls()
    except ValidationError as exc:
        lines = [f"  CRUCIBLE_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in exc.errors()]
        print("crucible: invalid configuration\n" + "\n".join(lines), file=sys.stderr)
        raise SystemExit(2) from None


async def run(name: str, settings: S, setup: Callable[[Runtime[S]], Awaitable[None]]) -> None:
    rt = Runtime(name=name, settings=settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.stopping.set)
    try:
        await rt.start()
        await setup(rt)
        rt.ready()
        await rt.stopping.wait()
        rt.log.info("stopping")
    finally:
        await rt.shutdown()
    if rt.failure:
        raise RuntimeError(rt.failure)  # exit non-zero, so a supervisor restarts the service


@contextlib.asynccontextmanager
async def running(
    name: str, settings: S, setup: Callable[[Runtime[S]], Awaitable[None]], *, timeout_s: float = 60.0
) -> AsyncIterator[Runtime[S]]:
    """A service inside this event loop, from setup to a clean stop (tests, embedding)."""
    started: asyncio.Future[Runtime[S]] = asyncio.get_running_loop().create_future()

    async def setup_and_report(rt: Runtime[S]) -> None:
        await setup(rt)
        started.set_result(rt)

    task = asyncio.create_task(run(name, settings, setup_and_report))
    done, _ = await asyncio.wait([started, task], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    if not started.done():
        task.cancel()
        raise TimeoutError(f"{name} did not finish its setup within {timeout_s:.0f}s")
    rt = started.result()
    try:
        yield rt
    finally:
        rt.stopping.set()
        await asyncio.wait_for(task, timeout=timeout_s)


def run_service(name: str, settings_cls: type[S], setup: Callable[[Runtime[S]], Awaitable[None]]) -> None:
    """Entry point of `python -m services.<name>`."""
    settings = load_settings(settings_cls)
    configure_logging(
        service=name, replica=settings.replica, level=settings.log_level, json=settings.log_json
    )
    try:
        asyncio.run(run(name, settings, setup))
    except Exception as exc:
        structlog.get_logger(f"crucible.{name}").error("service failed", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
