"""The whole system on one machine: embedded servers where no URL was given, migrations, then every
service as a supervised child process. Used by `crucible up`, `crucible demo` and the end-to-end tests.

    with LocalStack(api_port=0) as stack:
        httpx.get(f"{stack.api_url}/v1/runs", headers=stack.api_headers)
        stack.kill("grader", signal.SIGKILL)
        stack.restart("grader")
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from crucible.aio import run_sync
from crucible.apikeys import KEY_FILE, ensure_key_file
from crucible.contracts.access import ADMIN
from crucible.identities import read_s3_key, s3_key_file, s3_keys, seed_file
from crucible.localstack.migrations import check_database_url, run_migrations
from crucible.localstack.processes import LOOPBACK, free_ports, stop_processes
from crucible.localstack.servers import Server, start_nats, start_redis, start_seaweedfs
from crucible.localstack.services import SERVICES, ServiceProcess, wait_all_ready
from crucible.settings import CommonSettings

USES_DATABASE = frozenset({"catalog", "api"})
IDENTITIES_DIR = "identities"
"""Under the state dir: the service identities (`crucible.identities`)."""
_DEFAULTS = CommonSettings.model_fields


class LocalStack:
    def __init__(
        self,
        *,
        services: Sequence[str] = SERVICES,
        state_dir: str | os.PathLike[str] | None = None,
        keep: bool = False,
        nats_url: str | None = None,
        s3_endpoint: str | None = None,
        s3_secure: bool = False,
        s3_access_key: str | None = None,
        s3_secret_key: str | None = None,
        s3_bucket: str = _DEFAULTS["s3_bucket"].default,
        database_url: str | None = None,
        redis_url: str | None = None,
        api_port: int = 0,
        env: Mapping[str, str] | None = None,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
        ready_timeout_s: float = 180.0,
        stop_grace_s: float = 30.0,
    ) -> None:
        """Given URLs are used as they are; for each one missing an embedded server starts (SQLite in the
        state dir stands in for PostgreSQL). `env` goes to every service, `service_env[name]` to one.
        `api_port=0` picks a free port. A state dir made here is removed on stop unless `keep`."""
        unknown = sorted(set(services) - set(SERVICES)) + sorted(set(service_env or {}) - set(SERVICES))
        if unknown:
            raise ValueError(f"unknown service(s) {', '.join(unknown)}; known: {', '.join(SERVICES)}")
        if database_url is not None:
            database_url = check_database_url(database_url)
        if not 0 <= api_port <= 65535:
            raise ValueError(f"api_port must be 0..65535, got {api_port}")
        self.service_names = tuple(dict.fromkeys(services))
        self.keep = keep
        self._state_dir_given = state_dir is not None
        self.state_dir = Path(state_dir).resolve() if state_dir is not None else None
        self._urls = {"nats": nats_url, "s3": s3_endpoint, "database": database_url, "redis": redis_url}
        self._s3 = {
            "secure": s3_secure,
            "access_key": s3_access_key,
            "secret_key": s3_secret_key,
            "bucket": s3_bucket,
        }
        self._api_port = api_port
        self._env = dict(env or {})
        self._service_env = {name: dict(extra) for name, extra in (service_env or {}).items()}
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.servers: dict[str, Server] = {}
        self.services: dict[str, ServiceProcess] = {}
        self.settings_env: dict[str, str] = {}
        """The CRUCIBLE_* settings of this stack (servers, keys, bucket, the operator's bus identity), for
        CommonSettings; each service gets them with its own bus identity instead of the operator's."""
        self.api_url = ""
        self.api_key = ""
        """An admin key for the api (also in `api_key_file`); the same across restarts on one state dir."""
        self.api_key_file: Path | None = None
        self.identities: Path | None = None
        """The service identities, when the stack runs its own NATS or S3 (else None: the given servers'
        rules)."""
        self._s3_keys: dict[str, tuple[str, str]] = {}
        """Each service's own S3 key, when the stack runs its own S3."""
        self._started = False
        self._dead_servers: set[str] = set()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    def start(self) -> Self:
        if self._started:
            raise RuntimeError("this LocalStack is already started")
        self._started = True
        try:
            if self.state_dir is None:
                self.state_dir = Path(tempfile.mkdtemp(prefix="crucible-stack-"))
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._start_servers()
            self._setup_as_operator()
            database_url = self.settings_env["CRUCIBLE_DATABASE_URL"]
            if USES_DATABASE & set(self.service_names):
                run_migrations(database_url=database_url, env=self._env)
            if "api" in self.service_names:
                self.api_key_file = self.state_dir / KEY_FILE
                self.api_key = ensure_key_file(database_url, self.api_key_file)
            self._start_services()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_servers(self) -> None:
        assert self.state_dir is not None
        urls = dict(self._urls)
        operator: dict[str, str] = {}
        identities = self.state_dir / IDENTITIES_DIR
        if urls["nats"] is None or urls["s3"] is None:
            self.identities = identities
        if urls["nats"] is None:
            urls["nats"] = self._add_server(self._start_nats()).url
            operator["CRUCIBLE_NATS_NKEY_FILE"] = str(seed_file(identities, ADMIN))
        if urls["redis"] is None:
            urls["redis"] = self._add_server(start_redis(state_dir=self.state_dir)).url
        if urls["s3"] is None:
            self._s3_keys = s3_keys(identities)
            if not self._s3["access_key"]:  # the operator's, made with the identities like every other key
                self._s3["access_key"], self._s3["secret_key"] = read_s3_key(s3_key_file(identities, ADMIN))
            urls["s3"] = self._add_server(self._start_seaweedfs()).endpoint
        if urls["database"] is None:
            urls["database"] = f"sqlite+aiosqlite:///{self.state_dir / 'crucible.db'}"
        self.settings_env = {
            "CRUCIBLE_NATS_URL": urls["nats"],
            "CRUCIBLE_S3_ENDPOINT": urls["s3"],
            "CRUCIBLE_S3_SECURE": str(self._s3["secure"]).lower(),
            "CRUCIBLE_S3_ACCESS_KEY": self._s3["access_key"] or "",
            "CRUCIBLE_S3_SECRET_KEY": self._s3["secret_key"] or "",
            "CRUCIBLE_S3_BUCKET": self._s3["bucket"],
            "CRUCIBLE_DATABASE_URL": urls["database"],
            "CRUCIBLE_REDIS_URL": urls["redis"],
            **operator,
            **{k: v for k, v in self._env.items() if k.startswith("CRUCIBLE_")},
        }

    def _start_nats(self, *, port: int | None = None) -> Server:
        assert self.state_dir is not None
        return start_nats(state_dir=self.state_dir, port=port, identities=self.identities)

    def _start_seaweedfs(self, *, port: int | None = None) -> Server:
        """SeaweedFS with the operator's key (every right) and each service's, limited to its grants."""
        from crucible.contracts.access import seaweedfs_identities

        assert self.state_dir is not None
        return start_seaweedfs(
            state_dir=self.state_dir, access_key=self._s3["access_key"], secret_key=self._s3["secret_key"],
            s3_port=port, identities=seaweedfs_identities(self._s3_keys, self._s3["bucket"]),
        )  # fmt: skip

    def _setup_as_operator(self) -> None:
        """What services may not do themselves (`crucible.contracts.access`), done as the operator: the
        bucket made, the streams as this version configures them."""
        from crucible.bus import Bus
        from crucible.objectstore import ObjectStore

        fields: dict[str, Any] = {
            k.removeprefix("CRUCIBLE_").lower(): v for k, v in self.settings_env.items()
        }
        settings = CommonSettings(**fields)  # strings, parsed as the environment's would be

        async def work() -> None:
            await ObjectStore.from_settings(settings).ensure_bucket()
            if "nats" in self.servers:  # embedded, so it admits the stack's identities only
                bus = await Bus.connect(settings, name=ADMIN)
                try:
                    await bus.ensure_streams()
                finally:
                    await bus.close()

        run_sync(work)

    def _add_server(self, server: Server) -> Server:
        self.servers[server.name] = server
        return server

    def _start_services(self) -> None:
        assert self.state_dir is not None
        ports = free_ports(count=len(self.service_names) + 1)
        api_port = self._api_port or ports.pop()
        self.api_url = f"http://{LOOPBACK}:{api_port}"
        base_env = {
            **os.environ,
            **self._env,
            **self.settings_env,
            "CRUCIBLE_HTTP_HOST": LOOPBACK,
            "PYTHONUNBUFFERED": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        for name, http_port in zip(self.service_names, ports, strict=False):
            env = {**base_env, "CRUCIBLE_HTTP_PORT": str(http_port)}
            if self.identities is not None:  # the stack's own NATS or S3, which admit its identities only
                if "nats" in self.servers:
                    env["CRUCIBLE_NATS_NKEY_FILE"] = str(seed_file(self.identities, name))
                if self._s3_keys:
                    env["CRUCIBLE_S3_KEY_FILE"] = str(s3_key_file(self.identities, name))
            if name == "api":
                env["CRUCIBLE_API_PORT"] = str(api_port)
                env.setdefault("CRUCIBLE_TRACKING_DIR", str(self.state_dir / "tracking"))
            env.update(self._service_env.get(name, {}))
            workdir = self.state_dir / "services" / name
            workdir.mkdir(parents=True, exist_ok=True)
            service = ServiceProcess(
                name=name,
                env=env,
                http_port=http_port,
                log_path=self.state_dir / "logs" / f"{name}.log",
                cwd=workdir,
            )
            self.services[name] = service
            service.start()
        wait_all_ready(list(self.services.values()), deadline=time.monotonic() + self.ready_timeout_s)

    @property
    def api_headers(self) -> dict[str, str]:
        """Headers that carry the stack's admin key."""
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def nats_options(self) -> dict[str, str]:
        """`nats.connect(**stack.nats_options)`: the stack's NATS, as the operator where it has identities."""
        seed = self.settings_env.get("CRUCIBLE_NATS_NKEY_FILE")
        return {"servers": self.settings_env["CRUCIBLE_NATS_URL"], **({"nkeys_seed": seed} if seed else {})}

    def login_url(self, path: str = "/") -> str:
        """A dashboard URL that logs a browser in with the stack's key and goes on to `path`."""
        from urllib.parse import urlencode

        return f"{self.api_url}/login?{urlencode({'key': self.api_key, 'next': path})}"

    def service(self, name: str) -> ServiceProcess:
        try:
            return self.services[name]
        except KeyError:
            raise ValueError(
                f"service {name!r} is not part of this stack ({', '.join(self.services)})"
            ) from None

    def restart(self, name: str, *, timeout_s: float | None = None) -> None:
        """Stop the service if it still runs, start it again with the same settings, wait until ready."""
        service = self.service(name)
        service.stop(grace_s=self.stop_grace_s)
        service.start()
        service.wait_ready(deadline=time.monotonic() + (timeout_s or self.ready_timeout_s))

    async def arestart(self, name: str, *, timeout_s: float | None = None) -> None:
        await asyncio.to_thread(self.restart, name, timeout_s=timeout_s)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> int | None:
        """Send a signal to one service; for SIGKILL/SIGTERM/SIGINT returns its exit code once it exited."""
        return self.service(name).signal(sig)

    def stop_server(self, name: str) -> None:
        """Stop an embedded server ("nats", "redis" or "seaweedfs"): an outage, until `start_server`."""
        self._server(name).stop()
        self._dead_servers.add(name)

    def start_server(self, name: str) -> None:
        """Start a stopped embedded server again, on its port and with its state: the outage ends."""
        old = self._server(name)
        assert self.state_dir is not None
        if name == "nats":
            new = self._start_nats(port=old.port)
        elif name == "redis":
            new = start_redis(state_dir=self.state_dir, port=old.port)
        else:
            new = self._start_seaweedfs(port=old.port)
        self.servers[name] = new
        self._dead_servers.discard(name)

    def _server(self, name: str) -> Server:
        if name not in ("nats", "redis", "seaweedfs") or name not in self.servers:
            raise ValueError(
                f"no embedded {name!r} server to stop or start (embedded: {', '.join(self.servers)})"
            )
        return self.servers[name]

    def log_tail(self, name: str, *, lines: int = 30) -> str:
        """The last lines of a service's or an embedded server's log."""
        process = self.servers[name] if name in self.servers else self.service(name)
        return process.log_tail(lines=lines)

    def poll(self) -> list[tuple[str, int]]:
        """Services and embedded servers that exited on their own since the last poll, with exit codes."""
        exited = []
        for service in self.services.values():
            code = service.returncode
            if code is not None and not service.exit_seen:
                service.exit_seen = True
                exited.append((service.name, code))
        for server in self.servers.values():
            code = server.process.poll()
            if code is not None and server.name not in self._dead_servers:
                self._dead_servers.add(server.name)
                exited.append((server.name, code))
        return exited

    def backends(self) -> list[tuple[str, str, str]]:
        """(kind, address, "embedded" or "external") for NATS, S3, Redis and the database."""
        env = self.settings_env
        rows = [
            ("nats", env.get("CRUCIBLE_NATS_URL", ""), "nats"),
            ("s3", env.get("CRUCIBLE_S3_ENDPOINT", ""), "seaweedfs"),
            ("redis", env.get("CRUCIBLE_REDIS_URL", ""), "redis"),
        ]
        result = [
            (kind, url, "embedded" if server in self.servers else "external") for kind, url, server in rows
        ]
        database = env.get("CRUCIBLE_DATABASE_URL", "")
        result.append(("database", database, "external" if self._urls["database"] else "embedded (SQLite)"))
        return result

    def stop(self) -> None:
        """SIGTERM every service (they drain), SIGKILL stragglers after the grace, then stop the servers.
        Safe to call twice."""
        stop_processes([s.process for s in self.services.values() if s.process], grace_s=self.stop_grace_s)
        for service in self.services.values():
            service.exit_seen = True
        for server in reversed(list(self.servers.values())):
            server.stop()
        if self.state_dir is not None and not self._state_dir_given and not self.keep:
            shutil.rmtree(self.state_dir, ignore_errors=True)
