"""`crucible up`: the whole stack in the foreground, with a live status table; Ctrl-C or SIGTERM stops
every service (they drain first), then the embedded servers."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

# A closed terminal (SIGHUP) stops the stack like Ctrl-C; SIGINT is handled even when a shell started
# us in the background with it ignored.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

if TYPE_CHECKING:
    from crucible.localstack import LocalStack


def up(
    nats_url: Annotated[
        str | None, typer.Option(help="Use this NATS server instead of starting one.")
    ] = None,
    s3_endpoint: Annotated[
        str | None, typer.Option(help="host:port of an S3 server to use instead of starting SeaweedFS.")
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(help="postgresql+asyncpg://user@host:port/db; default: SQLite in the state dir."),
    ] = None,
    redis_url: Annotated[str | None, typer.Option(help="Use this Redis instead of starting Valkey.")] = None,
    service: Annotated[
        list[str] | None, typer.Option("--service", "-s", help="Start only this service (repeatable).")
    ] = None,
    api_port: Annotated[int, typer.Option(help="Port of the REST API; 0 picks a free one.")] = 8000,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Keep servers' data and logs here (kept on exit); default: a temp dir."),
    ] = None,
    keep: Annotated[bool, typer.Option(help="Keep the temp state dir on exit.")] = False,
    ready_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for every service to be ready.")
    ] = 180.0,
) -> None:
    """Start NATS, S3, Redis and every service on this machine and run until interrupted."""
    from crucible.localstack import SERVICES, LocalStack, MigrationError, ServerStartError, ServiceError
    from crucible.settings import CommonSettings

    console = Console()
    settings = CommonSettings()
    try:
        stack = LocalStack(
            services=service or SERVICES,
            state_dir=state_dir,
            keep=keep,
            nats_url=nats_url,
            s3_endpoint=s3_endpoint,
            s3_access_key=settings.s3_access_key,
            s3_secret_key=settings.s3_secret_key,
            s3_bucket=settings.s3_bucket,
            s3_secure=settings.s3_secure,
            database_url=database_url,
            redis_url=redis_url,
            api_port=api_port,
            ready_timeout_s=ready_timeout,
        )
    except ValueError as exc:
        _error(console, f"crucible up: {exc}")
        raise typer.Exit(2) from None

    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        with console.status("starting the stack…"):
            stack.start()
        console.print(f"API: {stack.api_url}    logs: {stack.state_dir}/logs    Ctrl-C stops everything")
        _supervise(stack, console)
    except KeyboardInterrupt:
        pass
    except (ServerStartError, ServiceError, MigrationError) as exc:
        _error(console, f"crucible up: {exc}")
        raise typer.Exit(1) from None
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _say(console, "stopping…")
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say(console, "stopped")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _error(console: Console, message: str) -> None:
    console.print(message, style="red", markup=False, highlight=False)


def _say(console: Console, message: str) -> None:
    """Print unless the terminal is gone (a closed terminal must not keep the stack from stopping)."""
    try:
        console.print(message)
    except OSError:
        pass


def _supervise(stack: LocalStack, console: Console) -> None:
    with Live(_table(stack), console=console, refresh_per_second=2) as live:
        while True:
            for name, code in stack.poll():
                live.console.print(
                    f"{name} exited with code {code} (log: {_log_of(stack, name)})", style="red", markup=False
                )
            live.update(_table(stack))
            time.sleep(1.0)


def _log_of(stack: LocalStack, name: str) -> Path:
    if name in stack.services:
        return stack.services[name].log_path
    return stack.servers[name].log_path


def _table(stack: LocalStack) -> Table:
    table = Table(title="crucible local stack", title_justify="left")
    for column in ("name", "state", "pid", "address"):
        table.add_column(column)
    for kind, address, origin in stack.backends():
        server = stack.servers.get({"s3": "seaweedfs"}.get(kind, kind))
        state = origin if server is None or server.alive() else f"exited ({server.process.returncode})"
        table.add_row(kind, _styled(state), str(server.pid) if server else "", _redact(address))
    for svc in stack.services.values():
        address = stack.api_url if svc.name == "api" else f"http://127.0.0.1:{svc.http_port}"
        table.add_row(svc.name, _styled(svc.state()), str(svc.pid or ""), address)
    return table


def _styled(state: str) -> str:
    return f"[red]{state}[/red]" if state.startswith("exited") else f"[green]{state}[/green]"


def _redact(url: str) -> str:
    """Hide a password in a database URL."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}"
    return url


def register(app: typer.Typer) -> None:
    app.command()(up)
