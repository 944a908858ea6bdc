"""Sandbox latency and capacity, each against a bare process spawn measured in the same run.

1. create: `SessionManager.create` of a snapshot the replica already holds (a warm create: tmpfs +
   overlay mounts, a cgroup, a Redis lease), and the first, cold create that fetches and unpacks it.
2. round trips over NATS against the real service running in this process: `read_file` and
   `run_terminal_cmd("true")` through `SandboxSession` (in a fresh network namespace, and in the
   session's own once a background job made it), and a create through `SandboxClient`; a bare
   bus request/reply of the same messages is shown too, as the floor.
3. create + destroy per second over NATS at several concurrencies.
4. many live sessions on one replica: create them, one tool call on each, memory, destroy.

The baseline everywhere is `asyncio.create_subprocess_exec("true")` + wait; samples alternate in
blocks between candidate and baseline so drift on a shared machine hits both alike. Starts its own
nats-server and SeaweedFS; uses the Redis on its usual loopback port when it answers (else starts one).
Runs as root to get what production gets (overlay + tmpfs quota, cgroups, the unprivileged uid).

    python benches/bench_sandbox.py [--iterations 200] [--concurrency 1,8,32] [--live 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from crucible.bus import Bus
from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts.endpoints import Endpoint
from crucible.contracts.messages import ObjectRef
from crucible.contracts.sandbox import ToolReply, ToolRequest, ToolResult
from crucible.localstack.processes import LOOPBACK, port_open
from crucible.localstack.servers import start_nats, start_redis, start_seaweedfs
from crucible.objectstore import ObjectStore
from crucible.runtime import running
from crucible.telemetry import configure_logging
from services.sandbox.app import setup
from services.sandbox.isolation import mounts
from services.sandbox.leases import Leases
from services.sandbox.manager import SessionManager
from services.sandbox.settings import Settings

Step = Callable[[], Awaitable[object]]


def make_repo(files: int) -> bytes:
    """A Python project as a task snapshot: `files` distinct modules of ~2 KiB each and a README."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        contents = {"README.md": "bench\n" + "".join(f"line {i}\n" for i in range(200))}
        for i in range(files):
            contents[f"pkg/mod_{i:03d}.py"] = "".join(
                f"def f{j}(x):\n    return x * {i} + {j}\n\n" for j in range(60)
            )
        for name, text in contents.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def spawn_true() -> None:
    proc = await asyncio.create_subprocess_exec("true")
    await proc.wait()


async def alternate(steps: dict[str, Step], *, reps: int, block: int = 10) -> dict[str, list[float]]:
    """Seconds per call of each step, in alternating blocks (after one warm-up call each)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        await step()
    for _ in range(max(1, reps // block)):
        for name, step in steps.items():
            for _ in range(block):
                t0 = time.perf_counter()
                await step()
                times[name].append(time.perf_counter() - t0)
    return times


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(samples) * 1e3,
        "p95_ms": pct(samples, 0.95) * 1e3,
        "n": len(samples),
    }


async def throughput(step: Step, *, concurrency: int, total: int) -> float:
    """Calls of `step` per second with `concurrency` workers sharing `total` calls."""
    left = total

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await step()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - t0)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def tmpfs_used(sessions_dir: Path) -> tuple[int, int]:
    """Bytes used on the sessions' tmpfs mounts together, and how many mounts."""
    used = count = 0
    for point in mounts.mounted_under(sessions_dir):
        if point.parent == sessions_dir:  # the tmpfs, not the overlay inside it
            st = os.statvfs(point)
            used += (st.f_blocks - st.f_bfree) * st.f_frsize
            count += 1
    return used, count


async def bench_create(settings: Settings, store: ObjectStore, redis, snapshot: ObjectRef, reps: int) -> dict:
    """SessionManager.create on a replica of its own (its own folder, so the service's sweep leaves it be)."""
    direct = settings.model_copy(
        update={
            "replica": f"{settings.replica}-direct",
            "workspace_root": settings.workspace_root.parent / "direct",
        }
    )
    manager = SessionManager(
        settings=direct, fetch=store.get_bytes, leases=Leases(redis, replica=direct.replica)
    )
    await manager.start()
    try:
        t0 = time.perf_counter()
        first = await manager.create(run_id="bench", task_id="t", snapshot=snapshot, ttl_s=600)
        cold = time.perf_counter() - t0
        creates: list[float] = []
        destroys: list[float] = []

        async def create_then_destroy() -> None:  # each half timed on its own
            t0 = time.perf_counter()
            session = await manager.create(run_id="bench", task_id="t", snapshot=snapshot, ttl_s=600)
            t1 = time.perf_counter()
            await manager.destroy(session.id)
            creates.append(t1 - t0)
            destroys.append(time.perf_counter() - t1)

        times = await alternate({"create": create_then_destroy, "spawn": spawn_true}, reps=reps)
        await manager.destroy(first.id)
    finally:
        await manager.close()
    return {
        "cold_create_ms": cold * 1e3,
        "create": summary(creates[1:]),  # without the warm-up call
        "destroy": summary(destroys[1:]),
        "spawn": summary(times["spawn"]),
        "privileged": manager.privileged,
        "cgroups": manager.cgroups is not None,
    }


async def bench_tools(bus: Bus, client: SandboxClient, snapshot: ObjectRef, reps: int, run_reps: int) -> dict:
    echo = Endpoint(f"bench.echo.{uuid.uuid4().hex[:8]}", ToolRequest, ToolReply)
    reply = ToolReply(result=ToolResult(ok=True, output="".join(f"line {i}\n" for i in range(40))))

    async def answer(_: ToolRequest) -> ToolReply:
        return reply

    sub = await bus.serve(echo, answer)
    request = ToolRequest(session_id="x", name="read_file", arguments={"path": "README.md", "end_line": 40})
    async with (
        await client.create(run_id="bench", task_id="t", snapshot=snapshot) as box,
        await client.create(run_id="bench", task_id="t", snapshot=snapshot) as networked,
    ):
        read = await box.tool("read_file", path="README.md", end_line=40)
        assert read.ok, read
        ran = await box.tool("run_terminal_cmd", command="true")
        assert ran.ok, ran
        # A background job gives this session its own network, which its later commands join.
        job = await networked.tool("run_terminal_cmd", command="sleep 600", is_background=True)
        assert job.ok, job

        async def read_file() -> None:
            await box.tool("read_file", path="README.md", end_line=40)

        async def bus_echo() -> None:
            await bus.request(echo, request)

        async def run_true() -> None:
            await box.tool("run_terminal_cmd", command="true")

        async def run_true_networked() -> None:
            await networked.tool("run_terminal_cmd", command="true")

        creates: list[float] = []

        async def create_then_destroy() -> None:  # only the create is timed
            t0 = time.perf_counter()
            other = await client.create(run_id="bench", task_id="t", snapshot=snapshot)
            creates.append(time.perf_counter() - t0)
            await other.destroy()

        reads = await alternate(
            {"read_file": read_file, "bus_echo": bus_echo, "spawn": spawn_true}, reps=reps
        )
        runs = await alternate(
            {"run_true": run_true, "run_networked": run_true_networked, "spawn": spawn_true},
            reps=run_reps,
            block=5,
        )
        made = await alternate({"create": create_then_destroy, "spawn": spawn_true}, reps=reps)
    await sub.unsubscribe()
    return {
        "read_file": summary(reads["read_file"]),
        "bus_echo": summary(reads["bus_echo"]),
        "spawn": summary(reads["spawn"]),
        "run_true": summary(runs["run_true"]),
        "run_networked": summary(runs["run_networked"]),
        "run_spawn": summary(runs["spawn"]),
        "create": summary(creates[1:]),
        "create_spawn": summary(made["spawn"]),
    }


async def bench_rate(client: SandboxClient, snapshot: ObjectRef, levels: list[int], total: int) -> list[dict]:
    async def create_destroy() -> None:
        box = await client.create(run_id="bench", task_id="t", snapshot=snapshot)
        await box.destroy()

    rows = []
    for c in levels:
        n = max(total, 2 * c)
        spawn_rate = await throughput(spawn_true, concurrency=c, total=n)
        sandbox_rate = await throughput(create_destroy, concurrency=c, total=n)
        rows.append({"concurrency": c, "sandbox_per_s": sandbox_rate, "spawn_per_s": spawn_rate})
    return rows


async def bench_live(client: SandboxClient, snapshot: ObjectRef, sessions_dir: Path, live: int) -> dict:
    rss0, avail0, shmem0 = rss_bytes(), meminfo("MemAvailable"), meminfo("Shmem")
    gate = asyncio.Semaphore(16)

    async def create() -> SandboxSession:
        async with gate:
            return await client.create(run_id="bench", task_id="t", snapshot=snapshot)

    t0 = time.perf_counter()
    boxes = await asyncio.gather(*(create() for _ in range(live)))
    create_s = time.perf_counter() - t0
    latencies: list[float] = []

    async def call(box: SandboxSession) -> bool:
        t0 = time.perf_counter()
        result = await box.tool("read_file", path="README.md", end_line=40)
        latencies.append(time.perf_counter() - t0)
        return result.ok and "line 1" in result.output

    t0 = time.perf_counter()
    answered = sum(await asyncio.gather(*(call(box) for box in boxes)))
    calls_s = time.perf_counter() - t0
    used, count = tmpfs_used(sessions_dir)
    rss1, avail1, shmem1 = rss_bytes(), meminfo("MemAvailable"), meminfo("Shmem")
    t0 = time.perf_counter()
    destroyed = sum(await asyncio.gather(*(box.destroy() for box in boxes)))
    destroy_s = time.perf_counter() - t0
    return {
        "sessions": live,
        "answered": answered,
        "destroyed": destroyed,
        "tmpfs_mounts": count,
        "create_all_s": create_s,
        "calls_all_s": calls_s,
        "call": summary(latencies),
        "destroy_all_s": destroy_s,
        "rss_before_mib": rss0 / 2**20,
        "rss_after_mib": rss1 / 2**20,
        "tmpfs_used_mib": used / 2**20,
        "shmem_delta_mib": (shmem1 - shmem0) / 2**20,
        "mem_available_drop_mib": (avail0 - avail1) / 2**20,
    }


def report(r: dict) -> None:
    c, t = r["create"], r["tools"]
    print(
        f"machine: {os.cpu_count()} cores; snapshot {r['snapshot_kib']:.0f} KiB tar.gz, {r['files']} files; "
        f"overlay+tmpfs={c['privileged']} cgroups={c['cgroups']}"
    )
    print(f"\n{'':34}{'p50 ms':>9}{'p95 ms':>9}   {'baseline: bare spawn p50/p95':>30}   ratio p50")

    def row(name: str, s: dict, base: dict) -> None:
        print(
            f"{name:34}{s['p50_ms']:9.2f}{s['p95_ms']:9.2f}   {base['p50_ms']:19.2f} / {base['p95_ms']:6.2f}"
            f"   {s['p50_ms'] / base['p50_ms']:7.2f}"
        )

    row("create, warm snapshot (manager)", c["create"], c["spawn"])
    row("destroy (manager)", c["destroy"], c["spawn"])
    row("create over NATS (client)", t["create"], t["create_spawn"])
    row("read_file round trip (NATS)", t["read_file"], t["spawn"])
    row("  bus echo, same messages", t["bus_echo"], t["spawn"])
    row("run_terminal_cmd true (NATS)", t["run_true"], t["run_spawn"])
    row("  in the session's network", t["run_networked"], t["run_spawn"])
    print(f"cold create (fetch + unpack + baseline git): {c['cold_create_ms']:.1f} ms")
    print(f"\n{'concurrency':>11}{'create+destroy/s':>18}{'bare spawns/s':>15}{'ratio':>8}")
    for x in r["rate"]:
        print(
            f"{x['concurrency']:11}{x['sandbox_per_s']:18.1f}{x['spawn_per_s']:15.1f}"
            f"{x['sandbox_per_s'] / x['spawn_per_s']:8.3f}"
        )
    v = r["live"]
    print(
        f"\n{v['sessions']} live sessions: {v['answered']} answered read_file, {v['destroyed']} destroyed; "
        f"{v['tmpfs_mounts']} tmpfs mounts"
    )
    print(
        f"  create all {v['create_all_s']:.2f} s (16 at a time), {v['sessions']} calls at once "
        f"{v['calls_all_s'] * 1e3:.0f} ms (p50 {v['call']['p50_ms']:.1f} ms, "
        f"p95 {v['call']['p95_ms']:.1f} ms), "
        f"destroy all {v['destroy_all_s']:.2f} s"
    )
    print(
        f"  process RSS {v['rss_before_mib']:.0f} -> {v['rss_after_mib']:.0f} MiB; tmpfs used "
        f"{v['tmpfs_used_mib']:.2f} MiB; Shmem {v['shmem_delta_mib']:+.1f} MiB; "
        f"MemAvailable {-v['mem_available_drop_mib']:+.0f} MiB"
    )


async def main(args: argparse.Namespace) -> dict:
    configure_logging(service="bench", replica="bench", level="WARNING")
    state = Path(tempfile.mkdtemp(prefix="crucible-bench-"))
    root = Path(tempfile.mkdtemp(prefix="crucible-bench-sandbox-"))
    root.chmod(0o711)  # the unprivileged sandbox uid must traverse it
    servers = []
    try:
        # A NATS of its own: every sandbox replica on a server shares the `sandbox.create` queue group,
        # so on a shared server another replica (with another object store) could take our creates.
        servers.append(start_nats(state_dir=state))
        nats_url = servers[-1].url
        if port_open(host=LOOPBACK, port=6379):
            redis_url = f"redis://{LOOPBACK}:6379/0"
        else:
            servers.append(start_redis(state_dir=state))
            redis_url = servers[-1].url
        secret = uuid.uuid4().hex
        servers.append(start_seaweedfs(state_dir=state, access_key="crucible-bench", secret_key=secret))
        settings = Settings(
            nats_url=nats_url,
            redis_url=redis_url,
            s3_endpoint=servers[-1].endpoint,
            s3_access_key="crucible-bench",
            s3_secret_key=secret,
            s3_bucket=f"crucible-bench-{uuid.uuid4().hex[:8]}",
            workspace_root=root / "service",
            replica=f"bench-{uuid.uuid4().hex[:8]}",
            max_sessions=256,
            log_level="WARNING",
        )
        archive = make_repo(args.files)
        results: dict = {"snapshot_kib": len(archive) / 1024, "files": args.files + 1}
        async with running("sandbox", settings, setup) as rt:
            snapshot = await rt.store.put_bytes(
                "bench/snapshot.tar.gz", archive, content_type="application/gzip"
            )
            results["create"] = await bench_create(settings, rt.store, rt.redis, snapshot, args.iterations)
            bus = await Bus.connect(settings, store=rt.store, name="bench-client")
            client = SandboxClient(bus)
            try:
                results["tools"] = await bench_tools(
                    bus, client, snapshot, args.iterations, args.run_iterations
                )
                results["rate"] = await bench_rate(client, snapshot, args.concurrency, args.cycles)
                sessions_dir = settings.workspace_root / settings.replica / "sessions"
                results["live"] = await bench_live(client, snapshot, sessions_dir, args.live)
            finally:
                await bus.close()
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--iterations", type=int, default=200, help="samples per latency (and as many baseline)"
    )
    parser.add_argument("--run-iterations", type=int, default=100, help="samples of run_terminal_cmd")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--cycles", type=int, default=200, help="create+destroy cycles per concurrency level")
    parser.add_argument("--live", type=int, default=200, help="sessions held at once (max_sessions is 256)")
    parser.add_argument("--files", type=int, default=300, help="modules in the snapshot")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("note: not root, so no overlay/tmpfs quota, cgroups or uid drop (copy mode)", file=sys.stderr)
    out = asyncio.run(main(args))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        report(out)
