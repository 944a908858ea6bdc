"""`crucible up`: the whole stack in the foreground, with a live status table; Ctrl-C, SIGTERM or a
closed terminal stops every service (they drain first), then the embedded servers. A service that
exits on its own is started again after a backoff (1 s, doubling to 60 s; back to 1 s once it has run
for 5 minutes), and the table and a line say so."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

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
    from crucible.cli.stopping import ignore_stop_signals, interruptible
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
            s3_access_key=settings.s3_access_key or None,
            s3_secret_key=settings.s3_secret_key or None,
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

    with interruptible():
        try:
            with console.status("starting the stack…"):
                stack.start()
            console.print(f"API: {stack.api_url}    logs: {stack.state_dir}/logs    Ctrl-C stops everything")
            if stack.api_key_file is not None:
                console.print(
                    f"admin API key: {stack.api_key_file} "
                    f"(export CRUCIBLE_API_KEY_FILE={stack.api_key_file})",
                    markup=False,
                    highlight=False,
                )
                console.print(f"dashboard: {stack.login_url()}", markup=False, highlight=False)
            if seed := stack.settings_env.get("CRUCIBLE_NATS_NKEY_FILE"):
                console.print(f"operator's bus identity: {seed} (export CRUCIBLE_NATS_NKEY_FILE={seed})",
                              markup=False, highlight=False)  # fmt: skip
            _supervise(stack, console)
        except KeyboardInterrupt:
            pass
        except (ServerStartError, ServiceError, MigrationError) as exc:
            _error(console, f"crucible up: {exc}")
            raise typer.Exit(1) from None
        finally:
            ignore_stop_signals()
            _say(console, "stopping…")
            stack.stop()
    _say(console, "stopped")


def _error(console: Console, message: str) -> None:
    console.print(message, style="red", markup=False, highlight=False)


def _say(console: Console, message: str) -> None:
    """Print unless the terminal is gone (a closed terminal must not keep the stack from stopping)."""
    try:
        console.print(message)
    except OSError:
        pass


RESTART_FIRST_S, RESTART_MAX_S, RESTART_RESET_S = 1.0, 60.0, 300.0


def _supervise(stack: LocalStack, console: Console) -> None:
    backoff: dict[str, float] = {}  # a service's next restart delay
    due: dict[str, float] = {}  # when an exited service starts again
    started: dict[str, float] = {name: time.monotonic() for name in stack.services}
    with Live(_table(stack), console=console, refresh_per_second=2) as live:
        while True:
            now = time.monotonic()
            for name, code in stack.poll():
                line = f"{name} exited with code {code} (log: {_log_of(stack, name)})"
                if name in stack.services:
                    if now - started[name] >= RESTART_RESET_S:
                        backoff[name] = RESTART_FIRST_S
                    delay = backoff.get(name, RESTART_FIRST_S)
                    backoff[name] = min(2 * delay, RESTART_MAX_S)
                    due[name] = now + delay
                    line += f"; restarting it in {delay:.0f} s"
                live.console.print(line, style="red", markup=False)
            for name, when in list(due.items()):
                if when <= now:
                    del due[name]
                    started[name] = now
                    stack.services[name].start()
                    live.console.print(
                        f"{name} restarted (start {stack.services[name].starts})", markup=False
                    )
            live.update(_table(stack))
            time.sleep(0.5)


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
