"""Attacks on the sandbox service, made the way an agent would: tool calls and commands over the bus to
the real service. Each one must be contained and answered with a clear result (ok=False and an error,
or the limit that stopped it), and each is checked on the host afterwards. After every test, once the
service has stopped, no process, mount, folder or cgroup of it is left (`host_left_clean`)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from pathlib import Path

import msgspec
import pytest
from sandbox_archives_integration import tar_gz
from sandbox_attacks import (
    REPO,
    SWAP_FOREVER,
    cgroup_dirs,
    eventually,
    fingerprint,
    host_snapshot,
    lasting_processes,
    named,
    pids,
    refused,
    sandbox_uid,
    section,
    service_ports,
    service_processes,
    session_traces,
    uids,
    with_marker,
)

from crucible.bus import RemoteError
from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts.messages import ObjectRef
from services.sandbox.isolation.bwrap import python_paths

pytestmark = pytest.mark.integration
MiB = 1024 * 1024
SECRET_ENV = "ABUSE_HOST_SECRET"


@pytest.fixture(autouse=True)
def host_secret(monkeypatch) -> str:
    """A secret in the environment of the test process, set before the in-process service starts."""
    secret = f"host-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv(SECRET_ENV, secret)
    return secret


@pytest.fixture(autouse=True)
def host_left_clean(host_secret, sandbox_settings):
    """Set up before the service and torn down after it: once it has stopped, nothing of it is left."""
    before = host_snapshot(sandbox_settings)
    yield
    assert lasting_processes(sandbox_settings) == {}, "sandboxed processes outlived the service"
    after = host_snapshot(sandbox_settings)
    assert after.mounts == [], "mounts left under the workspace root"
    assert after.cgroups == [], "cgroups left"
    assert after.root_entries == [], "files left under the workspace root"
    assert after.children <= before.children, "child processes of the test left behind"


@pytest.fixture
def host_files(tmp_path: Path) -> dict[str, Path]:
    """A host folder with a secret file, outside anything the service owns."""
    folder = tmp_path / "host"
    folder.mkdir()
    secret = folder / "secret.txt"
    secret.write_text(f"host-file-{uuid.uuid4().hex}\n")
    return {"folder": folder, "secret": secret}


@pytest.fixture
async def snapshot(store) -> ObjectRef:
    return await store.put_bytes("tasksets/test/abuse/snapshot.tar.gz", tar_gz(REPO))


@pytest.fixture
def client(bus) -> SandboxClient:
    return SandboxClient(bus)


async def create(client: SandboxClient, snapshot: ObjectRef) -> SandboxSession:
    return await client.create(run_id="abuse", task_id="calc", snapshot=snapshot)


def host_fingerprints(settings, host_files) -> dict[str, tuple[bytes, int]]:
    replica = settings.workspace_root / settings.replica
    files = [Path("/etc/passwd"), Path("/etc/shadow"), host_files["secret"], replica / "etc" / "passwd"]
    files += list((replica / "snapshots").glob("*/tree/calc/ops.py"))
    return {str(f): fingerprint(f) for f in files if f.exists()}


# 1. Paths in tool arguments


ESCAPES = [
    "../../etc/passwd",
    "/etc/passwd",
    "/workspace/../etc/shadow",
    "calc/../../etc/passwd",
    "/workspace/calc/../../../../../../../etc/passwd",
    "calc/ops.py\x00../../etc/passwd",
    "\x00",
    "/proc/self/environ",
]


def path_attacks(path: str) -> list[tuple[str, dict]]:
    return [
        ("read_file", {"path": path}),
        ("create_file", {"path": path, "content": "pwned\n", "overwrite": True}),
        ("replace", {"path": path, "old": "root", "new": "pwned"}),
        ("insert", {"path": path, "line": 0, "text": "pwned"}),
        ("delete_file", {"path": path}),
        ("undo_edit", {"path": path}),
        ("list_dir", {"path": path}),
        ("grep", {"pattern": "root", "path": path}),
        ("codebase_search", {"query": "root", "path": path}),
        ("str_replace_editor", {"command": "create", "path": path, "file_text": "pwned\n"}),
    ]


async def test_paths_out_of_the_workspace_are_refused(client, snapshot, host_files, sandbox_settings):
    secret = str(host_files["secret"])
    escapes = [*ESCAPES, secret, "../" * 16 + secret.lstrip("/"), str(host_files["folder"]), "..", "/"]
    async with await create(client, snapshot) as box:
        before = host_fingerprints(sandbox_settings, host_files)
        for path in escapes:
            for name, args in path_attacks(path):
                result = await box.tool(name, **args)
                assert not result.ok and refused(result.error), (name, args, result)
        assert host_fingerprints(sandbox_settings, host_files) == before
        assert sorted(os.listdir(host_files["folder"])) == ["secret.txt"]
        assert await box.diff() == ""  # nothing landed inside the workspace either
        assert (await box.tool("read_file", path="/workspace/calc/ops.py")).output == REPO["calc/ops.py"]


# 2. Links planted in the workspace


async def test_planted_links_are_never_followed_out(client, snapshot, host_files, sandbox_settings):
    secret, folder = host_files["secret"], host_files["folder"]
    token = secret.read_text().strip()
    plant = f"""set -e
ln -s /etc/passwd passwd_link
ln -s / root_link
ln -s {secret} secret_link
ln -s {folder} dir_link
ln -s ../../../../../../../../etc/passwd climb_link
ln -s /proc/self/root proc_root_link
mkdir sub && ln -s ../.. sub/up_link
ln -s calc/ops.py inward_link
mkfifo fifo
"""
    async with await create(client, snapshot) as box, await create(client, snapshot) as other:
        assert (await box.run(plant, timeout_s=30)).ok
        before = host_fingerprints(sandbox_settings, host_files)
        attacks = [
            ("read_file", {"path": "passwd_link"}),
            ("read_file", {"path": "root_link/etc/passwd"}),
            ("read_file", {"path": "secret_link"}),
            ("read_file", {"path": "dir_link/secret.txt"}),
            ("read_file", {"path": "climb_link"}),
            ("read_file", {"path": "proc_root_link/etc/passwd"}),
            ("read_file", {"path": "sub/up_link/etc/passwd"}),
            ("list_dir", {"path": "root_link"}),
            ("list_dir", {"path": "dir_link"}),
            ("list_dir", {"path": "sub/up_link"}),
            ("create_file", {"path": "secret_link", "content": "pwned\n", "overwrite": True}),
            ("create_file", {"path": "passwd_link", "content": "pwned\n", "overwrite": True}),
            ("create_file", {"path": "dir_link/planted.txt", "content": "pwned\n"}),
            ("create_file", {"path": "root_link/tmp/planted.txt", "content": "pwned\n"}),
            ("replace", {"path": "secret_link", "old": token, "new": "pwned"}),
            ("insert", {"path": "passwd_link", "line": 0, "text": "pwned"}),
            ("delete_file", {"path": "dir_link/secret.txt"}),
            ("grep", {"pattern": ".", "path": "dir_link"}),
            ("grep", {"pattern": ".", "path": "secret_link"}),
            ("codebase_search", {"query": "secret", "path": "dir_link"}),
            ("str_replace_editor", {"command": "view", "path": "dir_link"}),
            ("str_replace_editor", {"command": "str_replace", "path": "secret_link", "old_str": token}),
            ("read_file", {"path": "fifo"}),
        ]
        for name, args in attacks:
            result = await box.tool(name, **args)
            assert not result.ok and refused(result.error), (name, args, result)
        started = time.monotonic()
        fifo = await box.tool("grep", pattern="x", path="fifo")
        assert not fifo.ok and "not a regular file" in (fifo.error or "") and time.monotonic() - started < 5

        # Whole-workspace tools skip the links; an inward link still works.
        for name, args in [
            ("grep", {"pattern": token}),
            ("grep", {"pattern": "root:"}),
            ("file_search", {"query": "secret"}),
            ("codebase_search", {"query": "secret host file"}),
            ("list_dir", {"path": "."}),
        ]:
            result = await box.tool(name, **args)
            assert result.ok and token not in result.output and "root:" not in result.output, (name, result)
        assert (await box.tool("read_file", path="inward_link")).output == REPO["calc/ops.py"]

        # Inside, the links lead nowhere: the host's files are not in the sandbox.
        inside = await box.run(
            "echo pwned > secret_link; echo pwned > passwd_link; echo pwned > dir_link/planted.txt; "
            "cat secret_link dir_link/secret.txt climb_link",
            timeout_s=30,
        )
        assert not inside.ok and token not in inside.output

        # Hard links: none to a file outside (another mount, or absent inside); one inside is fine,
        # and writing through it changes this workspace only, never the shared snapshot.
        links = await box.run(
            f"for target in /etc/passwd /usr/bin/su {secret}; do ln $target hard_$RANDOM; echo rc=$?; done; "
            "ln calc/ops.py hard_ops && echo inside=$?",
            timeout_s=30,
        )
        assert links.output.count("rc=1") == 3 and "inside=0" in links.output, links.output
        written = await box.tool(
            "create_file", path="hard_ops", content="def add(a, b):\n    return 0\n", overwrite=True
        )
        assert written.ok, written
        assert "return 0" in (await box.tool("read_file", path="calc/ops.py")).output
        assert (await other.tool("read_file", path="calc/ops.py")).output == REPO["calc/ops.py"]

        assert host_fingerprints(sandbox_settings, host_files) == before
        assert sorted(os.listdir(folder)) == ["secret.txt"]


async def test_links_swapped_in_during_a_host_side_walk_lead_nowhere(client, snapshot, host_files):
    """A background job swaps a folder and a symlink to a host folder (or a host fifo) for ever, so a
    walk that looked at the folder meets the link when it opens it."""
    folder = host_files["folder"]
    token = host_files["secret"].read_text().strip()
    os.mkfifo(folder / "fifo")
    plant = f"mkdir d e && echo decoy > d/secret.txt && ln -s {folder} lnk && ln -s {folder}/fifo fifo_lnk"
    try:
        async with await create(client, snapshot) as box:
            assert (await box.run(plant, timeout_s=30)).ok
            assert (await box.tool("create_file", path="swap.py", content=SWAP_FOREVER)).ok
            jobs = []
            for pair in ("d lnk", "e fifo_lnk"):
                job = await box.tool(
                    "run_terminal_cmd", command=f"python3 swap.py {pair}", is_background=True
                )
                assert job.ok, job
                jobs.append(job.output.split()[-1])
            await asyncio.sleep(0.3)
            for _ in range(12):
                for name, args in [
                    ("grep", {"pattern": "host-file"}),
                    ("grep", {"pattern": "host-file", "path": "d"}),
                    ("file_search", {"query": "secret"}),
                ]:
                    result = await asyncio.wait_for(box.tool(name, **args), timeout=15)
                    assert token not in result.output and str(folder) not in result.output, (name, result)
            index = await asyncio.wait_for(box.tool("codebase_search", query="host file secret"), timeout=30)
            assert token not in index.output

            # Forking copies the workspace on the host: not while a job can swap things mid-copy.
            with pytest.raises(RemoteError) as err:
                await box.fork(1)
            assert err.value.code == "busy"
            for job_id in jobs:
                await box.tool("background_job", job_id=job_id, kill=True)
            (child,) = await box.fork(1)
            async with child:
                copied = await child.run("cat d/secret.txt lnk/secret.txt e/* 2>&1", timeout_s=30)
                assert token not in copied.output
    finally:
        # Should a host-side open be stuck on the fifo, let it go so the service can stop.
        try:
            os.close(os.open(folder / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


# 3. /proc and the host's environment


async def test_proc_and_environment_show_nothing_of_the_host(client, snapshot, host_secret, sandbox_settings):
    me = os.getpid()
    script = f"""
echo "== pid1 environ"; tr '\\0' '\\n' < /proc/1/environ
echo "== pid1 cmdline"; tr '\\0' ' ' < /proc/1/cmdline; echo
echo "== all environ"; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'
echo "== env"; env
echo "== pids"; ls /proc | grep -E '^[0-9]+$' | wc -l
echo "== host pid"; if [ -e /proc/{me} ]; then tr '\\0' ' ' < /proc/{me}/cmdline; else echo "no pid {me}"; fi
echo "== roots"; readlink /proc/self/root /proc/1/root
echo "== etc"; ls -A /proc/self/root/etc/
echo "== tmp"; ls -A /proc/self/root/tmp/; ls -A /proc/1/root/tmp/
echo "== shadow"; cat /proc/self/root/etc/shadow /proc/1/root/etc/shadow 2>&1
"""
    async with await create(client, snapshot) as box:
        result = await box.run(script, timeout_s=30)
        out = result.output
        assert host_secret not in out and SECRET_ENV not in out
        assert section(out, "pid1 environ") == ""  # bubblewrap starts with an empty environment
        assert section(out, "pid1 cmdline").startswith(("bwrap", "/usr/bin/bwrap", "/bin/bwrap"))
        env = dict(line.split("=", 1) for line in section(out, "env").splitlines() if "=" in line)
        assert env["HOME"] == "/tmp" and env["USER"] == "sandbox"
        assert int(section(out, "pids")) < 10  # only the sandbox's own processes
        if me > 100:
            assert section(out, "host pid") == f"no pid {me}"
        assert section(out, "roots").split() == ["/", "/"]
        assert "shadow" not in section(out, "etc").split()
        # A private /tmp: none of the host's, but for where this Python is bound read-only (a checkout
        # under /tmp, as in CI, puts its venv there).
        python_under_tmp = {p.parts[2] for p in python_paths() if p.is_relative_to("/tmp")}
        assert set(section(out, "tmp").split()) <= python_under_tmp
        assert "No such file" in section(out, "shadow")
        environ = await box.tool("read_file", path="/proc/self/environ")
        assert not environ.ok and refused(environ.error)


# 4. Mounts


async def test_mounts_and_unmounts_fail(client, snapshot, sandbox_settings):
    script = """
try() { "$@" >/dev/null 2>&1; echo "$* -> $?"; }
try mount -t tmpfs none /tmp
try mount -t proc proc /tmp
try mount -o remount,rw /usr
try mount -o remount,rw,suid /workspace
try mount --bind /workspace /tmp
try umount /workspace
try umount -l /workspace
try umount -l /proc
try umount /etc/passwd
try touch /usr/crucible-abuse
try touch /etc/passwd
try touch /crucible/plugins/planted.py
touch /etc/crucible-abuse  # the sandbox's own root, a tmpfs of this command
"""
    async with await create(client, snapshot) as box:
        before = host_snapshot(sandbox_settings).mounts
        result = await box.run(script, timeout_s=30)
        codes = [line.rpartition(" -> ")[2] for line in result.output.splitlines() if " -> " in line]
        assert len(codes) == 12 and "0" not in codes, result.output
        assert host_snapshot(sandbox_settings).mounts == before
        assert not Path("/usr/crucible-abuse").exists() and not Path("/etc/crucible-abuse").exists()
        assert (await box.run("cat calc/ops.py", timeout_s=30)).output == REPO["calc/ops.py"]


# 5. Capabilities and privileges


async def test_no_capabilities_no_user_namespaces_no_setuid(client, snapshot):
    script = """
echo "== status"; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status
echo "== tries"
try() { "$@" </dev/null >/dev/null 2>&1; echo "$* -> $?"; }
try unshare -U true
try unshare -r true
try unshare -m true
try unshare -n true
try su -c true root
if command -v sudo >/dev/null; then try sudo -n true; fi
try python3 -c 'import os; os.setuid(0)'
try chown 0:0 calc/ops.py
try chroot / true
echo "== id"; id -u; id -g
echo "== usr"; grep ' /usr ' /proc/self/mountinfo
"""
    async with await create(client, snapshot) as box:
        out = (await box.run(script, timeout_s=30)).output
        status = dict(line.split(":\t") for line in section(out, "status").splitlines())
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert status[cap] == "0000000000000000", out
        assert status["NoNewPrivs"] == "1"
        tries = section(out, "tries").splitlines()
        assert len(tries) >= 8 and all(not line.endswith(" -> 0") for line in tries), out
        assert section(out, "id").split() == ["1000", "1000"]
        assert "nosuid" in section(out, "usr")


# 6. Network


PROBE = """
import json, socket, sys
targets = json.loads(sys.argv[1])
def attempt(name, family, kind, address):
    try:
        with socket.socket(family, kind) as s:
            s.settimeout(2)
            if kind == socket.SOCK_DGRAM:
                s.sendto(b"x", address)
            else:
                s.connect(address)
        print(f"{name}: ok")
    except OSError as exc:
        print(f"{name}: {type(exc).__name__} {exc.errno}")
for name, (host, port) in targets["tcp"].items():
    attempt(name, socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, (host, port))
attempt("udp-dns", socket.AF_INET, socket.SOCK_DGRAM, ("8.8.8.8", 53))
attempt("abstract-unix", socket.AF_UNIX, socket.SOCK_STREAM, "\\0" + targets["abstract"])
try:
    socket.getaddrinfo("example.com", 443)
    print("dns: ok")
except OSError as exc:
    print(f"dns: {type(exc).__name__}")
"""


def outward_ip() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return None


async def test_no_network_to_the_host_or_beyond(client, snapshot, sandbox_settings, service):
    accepted: list[str] = []

    async def handler(reader, writer):
        accepted.append("connection")
        writer.close()

    tcp = await asyncio.start_server(handler, host="0.0.0.0", port=0)
    abstract = f"crucible-abuse-{uuid.uuid4().hex}"
    unix = await asyncio.start_unix_server(handler, path="\0" + abstract)
    port = tcp.sockets[0].getsockname()[1]
    targets = {f"loopback-{name}": ("127.0.0.1", p) for name, p in service_ports(sandbox_settings).items()}
    targets |= {"loopback-http": ("127.0.0.1", service.http_port), "loopback-listener": ("127.0.0.1", port)}
    targets |= {
        "ipv6-listener": ("::1", port),
        "internet-dns": ("1.1.1.1", 53),
        "internet-https": ("8.8.8.8", 443),
    }
    if (address := outward_ip()) is not None:
        targets["host-address"] = (address, port)
    try:
        async with await create(client, snapshot) as box:
            assert (await box.tool("create_file", path="probe.py", content=PROBE)).ok
            argument = json.dumps({"tcp": targets, "abstract": abstract})
            # Alone, then in the session's own network (which its first background job makes).
            for background in (None, "sleep 30"):
                if background:
                    assert (await box.tool("run_terminal_cmd", command=background, is_background=True)).ok
                result = await box.run(["python3", "probe.py", argument], timeout_s=60)
                lines = result.output.splitlines()
                assert len(lines) == len(targets) + 3, result.output
                assert not [line for line in lines if line.endswith(": ok")], result.output
    finally:
        tcp.close()
        unix.close()
        await tcp.wait_closed()
        await unix.wait_closed()
    assert accepted == []


# 7. Signals


async def test_signals_do_not_reach_host_processes(client, snapshot):
    sleeper = await asyncio.create_subprocess_exec("sleep", "60")
    marker = f"crucible-abuse-{uuid.uuid4().hex[:12]}"
    try:
        async with await create(client, snapshot) as box, await create(client, snapshot) as other:
            job = await other.tool(
                "run_terminal_cmd", command=f"exec -a {marker} sleep 60", is_background=True
            )
            assert job.ok, job
            assert await eventually(lambda: named(marker))
            script = (
                f"kill -9 {os.getpid()}; echo rc=$?; kill -9 {sleeper.pid}; echo rc=$?; "
                "pkill -9 sleep; echo rc=$?; kill -9 -1; echo rc=$?; kill -9 1; echo done"
            )
            result = await box.run(script, timeout_s=30)
            assert result.output.count("rc=") == 4 and "rc=0" not in result.output, result.output
            assert sleeper.returncode is None
            assert named(marker), "the other session's job was killed"
            status = await other.tool("background_job", job_id=job.output.split()[-1])
            assert status.output.startswith("[running"), status
            assert (await box.run("echo alive", timeout_s=30)).output == "alive\n"
    finally:
        sleeper.kill()
        await sleeper.wait()
    assert sleeper.returncode == -9  # it lived until the test killed it


# 8. Fork bomb


@pytest.mark.slow
@pytest.mark.parametrize("sandbox_settings", [{"max_processes": 64}], indirect=True)
async def test_a_fork_bomb_is_contained(client, snapshot, sandbox_settings):
    hosted = len(pids())
    async with await create(client, snapshot) as box, await create(client, snapshot) as other:
        if not cgroup_dirs(sandbox_settings.replica):
            pytest.skip("a per-session process limit needs cgroups (the service runs as root)")
        bomb = asyncio.ensure_future(box.run(":(){ :|:& };:; while :; do sleep 1; done", timeout_s=6))
        await asyncio.sleep(1.0)
        # The kernel's count of the session's cgroup: a scan of /proc takes long enough for the bomb's
        # processes to exit and be replaced within it, and can count both (65 seen once under a limit of 64).
        (counter,) = [
            Path(d) / "pids.current"
            for d in cgroup_dirs(sandbox_settings.replica)
            if os.path.basename(d) == box.session_id and (Path(d) / "pids.current").exists()
        ]
        peak = 0
        for _ in range(10):
            peak = max(peak, int(counter.read_text()))
            await asyncio.sleep(0.1)
        started = time.monotonic()
        read = await other.tool("read_file", path="calc/ops.py")
        ran = await other.run("echo alive", timeout_s=30)
        served_in = time.monotonic() - started
        result = await bomb
        assert 8 < peak <= 64, f"{peak} processes under a limit of 64"
        assert read.output == REPO["calc/ops.py"] and ran.output == "alive\n"
        assert served_in < 5, f"the other session waited {served_in:.1f}s"
        assert not result.ok and result.limit in ("timeout", "processes"), result
        assert await eventually(lambda: not service_processes(sandbox_settings, box.session_id))
        assert (await box.run("echo recovered", timeout_s=30)).output == "recovered\n"
    assert len(pids()) < hosted + 50


# 9. Memory


EAT = """
import os, sys
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        chunks = [b"\\1" * (32 << 20) for _ in range(12)]  # 384 MiB each, touched
        os._exit(0)
    children.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
print(statuses)
sys.exit(1 if any(statuses) else 0)
"""


@pytest.mark.parametrize("sandbox_settings", [{"memory_bytes": 512 * MiB}], indirect=True)
async def test_a_memory_bomb_is_killed(client, snapshot, sandbox_settings):
    async with await create(client, snapshot) as box, await create(client, snapshot) as other:
        one = await box.run(["python3", "-c", "b = bytearray(4 << 30)"], timeout_s=30)
        assert not one.ok and "MemoryError" in one.output  # one process: its address-space limit
        assert one.limit == "memory"
        if not cgroup_dirs(sandbox_settings.replica):
            pytest.skip("a limit on a session's processes together needs cgroups (the service runs as root)")
        assert (await box.tool("create_file", path="eat.py", content=EAT)).ok
        many = await box.run(["python3", "eat.py"], timeout_s=60)
        assert not many.ok and many.limit == "memory" and "memory limit" in (many.error or ""), many
        # The sandbox's /tmp is memory, and counts against the same limit.
        tmp = await box.run("dd if=/dev/zero of=/tmp/fill bs=1M count=2048", timeout_s=60)
        assert not tmp.ok and tmp.limit == "memory", tmp
        assert (await other.tool("read_file", path="calc/ops.py")).output == REPO["calc/ops.py"]
        assert (await box.run("echo alive", timeout_s=30)).output == "alive\n"


# 10. Disk


REPORT_FILLER = """import os, sys


def test_fills_the_report_folder():
    report = next(arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("--crucible-report="))
    written = 0
    try:
        for i in range(16):
            with open(os.path.join(os.path.dirname(report), f"fill{i}"), "wb") as f:
                f.write(bytes(3 << 20))
            written += 3 << 20
    finally:
        print(f"wrote {written} bytes")
"""


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize(
    "sandbox_settings", [{"disk_quota_bytes": 16 * MiB, "max_write_bytes": 4 * MiB}], indirect=True
)
async def test_disk_quota_and_file_size_limit(client, snapshot, sandbox_settings):
    root = sandbox_settings.workspace_root
    async with await create(client, snapshot) as box, await create(client, snapshot) as other:
        if not host_snapshot(sandbox_settings).mounts:
            pytest.skip("the disk quota needs overlay workspaces (the service runs as root)")
        host_free = free_bytes(Path("/")), free_bytes(root)
        fill = "for i in $(seq 1 10); do dd if=/dev/zero of=fill$i bs=1M count=3 2>&1 || exit 1; done"
        filled = await box.run(fill, timeout_s=60)
        assert not filled.ok and filled.limit == "disk" and "No space left" in filled.output, filled
        for command in ("yes > yes.txt", "fallocate -l 3M huge"):
            result = await box.run(command, timeout_s=30)
            assert not result.ok and "No space left" in result.output, (command, result)
        full = await box.tool("create_file", path="more.txt", content="x" * MiB)
        assert not full.ok and "quota is full" in (full.error or ""), full
        big = await box.run("dd if=/dev/zero of=/tmp/big bs=1M count=8", timeout_s=30)
        assert not big.ok and big.limit == "file_size", big
        now = free_bytes(Path("/")), free_bytes(root)
        assert all(abs(a - b) < 64 * MiB for a, b in zip(host_free, now, strict=True)), (host_free, now)
        # The other session has its own quota; this one recovers once the files are gone.
        assert (await other.tool("create_file", path="notes.txt", content="x" * MiB)).ok
        assert (await box.run("rm -f fill* yes.txt huge", timeout_s=30)).ok
        assert (await box.tool("create_file", path="more.txt", content="x" * MiB)).ok
        # run_tests binds a folder for pytest's report: it counts against the quota too.
        assert (await box.tool("create_file", path="tests/test_fill.py", content=REPORT_FILLER)).ok
        filled = await box.tool("run_tests", node_ids=["tests/test_fill.py"], pytest_args=["-s"])
        wrote = int(filled.output.rpartition("wrote ")[2].split()[0])
        assert wrote <= 16 * MiB and not filled.ok, filled.output


# 10b. A workspace full of text against the service's own memory


TEXT = """
import random
words = ["".join(random.choice("abcdefghij") for _ in range(6)) for _ in range(5000)]
with open("base.py", "w") as f:
    f.write("\\n".join(" ".join(random.choices(words, k=10)) for _ in range(7000)))
"""


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


@pytest.mark.slow
async def test_indexing_a_workspace_full_of_text_stays_within_bounds(client, snapshot):
    """codebase_search builds its index in the service's own process: 90 MiB of text would take it
    to several GiB; the index stops at a fixed budget of text."""
    async with await create(client, snapshot) as box:
        assert (await box.tool("create_file", path="text.py", content=TEXT)).ok
        made = await box.run(
            "python3 text.py && for i in $(seq 1 200); do cp base.py t$i.py; done", timeout_s=120
        )
        assert made.ok, made
        before = peak = rss_bytes()
        search = asyncio.ensure_future(box.tool("codebase_search", query="abcdef ghijab"))
        while not search.done():
            peak = max(peak, rss_bytes())
            await asyncio.sleep(0.02)
        assert search.result().ok, search.result()
        assert peak - before < 1536 * MiB, f"the service grew by {(peak - before) // MiB} MiB"


# 11. Endless output


async def test_endless_output_is_cut_to_its_head_and_tail(client, snapshot):
    async with await create(client, snapshot) as box:
        endless = await box.run("yes", timeout_s=1.5, output_cap=4096)
        assert endless.timed_out and endless.limit == "timeout" and endless.truncated
        assert endless.output.startswith("y\ny\n") and endless.output.endswith("y\n")
        assert "bytes of output omitted" in endless.output and len(endless.output) < 4096 + 100
        assert len(msgspec.msgpack.encode(endless)) < 8192  # what went over the bus
        finite = await box.run(
            "head -c 20000000 /dev/zero | tr '\\0' a; echo; echo THE-END", timeout_s=60, output_cap=4096
        )
        assert finite.ok and finite.truncated and finite.output.endswith("THE-END\n")
        assert len(finite.output) < 4096 + 100
        binary = await box.run("head -c 10000000 /dev/urandom", timeout_s=60, output_cap=4096)
        assert binary.ok and binary.truncated and len(binary.output) < 3 * 4096  # replacement characters
        stderr = await box.tool("run_terminal_cmd", command="yes crucible >&2", timeout_s=1.5)
        assert stderr.timed_out and stderr.truncated and len(stderr.output) < 16 * 1024 + 100


# 12. Endless loop


async def test_endless_loops_stop_at_the_timeout(client, snapshot):
    async with await create(client, snapshot) as box:
        for command, timeout in [
            ("while true; do :; done", 1.5),
            ("trap '' TERM INT HUP; while true; do :; done", 1.0),
        ]:
            result = await box.run(command, timeout_s=timeout)
            assert not result.ok and result.timed_out and result.limit == "timeout", result
            assert timeout <= result.duration_s < timeout + 2, result
            assert result.error == f"timed out after {timeout:g}s"
        through_tool = await box.tool("run_terminal_cmd", command="while :; do :; done", timeout_s=1)
        assert through_tool.limit == "timeout" and through_tool.timed_out
        assert (await box.run("echo alive", timeout_s=30)).output == "alive\n"


# 13. Processes left behind


def daemons(marker: str) -> str:
    return f"""
setsid bash -c 'exec -a {marker}-setsid sleep 300' </dev/null >/dev/null 2>&1 &
nohup bash -c 'exec -a {marker}-nohup sleep 300' </dev/null >/dev/null 2>&1 &
( ( exec -a {marker}-double sleep 300 ) & )
bash -c 'exec -a {marker}-disowned sleep 300' & disown
exec -a {marker}-main sleep 300
"""


async def test_no_process_outlives_its_command_or_session(client, snapshot, sandbox_settings):
    marker = f"crucible-abuse-{uuid.uuid4().hex[:12]}"
    async with await create(client, snapshot) as box:
        command = asyncio.ensure_future(box.run(daemons(marker), timeout_s=3))
        running = await eventually(lambda: len(named(marker)) >= 5 and named(marker))
        assert running, "the daemons never showed up on the host"
        assert uids(running) == {sandbox_uid(sandbox_settings)}  # an unprivileged host uid, not root
        assert service_processes(sandbox_settings) >= set(running)  # what `host_left_clean` looks for
        result = await command
        assert result.timed_out and result.limit == "timeout"
        assert await eventually(lambda: not with_marker(marker))

        job_marker = f"crucible-abuse-{uuid.uuid4().hex[:12]}"
        job = await box.tool("run_terminal_cmd", command=daemons(job_marker), is_background=True)
        assert job.ok, job
        assert await eventually(lambda: len(named(job_marker)) >= 5)
        status = await box.tool("background_job", job_id=job.output.split()[-1])
        assert status.output.startswith("[running")
        session_id = box.session_id
    # Leaving the block destroyed the session.
    assert await eventually(lambda: not with_marker(job_marker))
    assert session_traces(sandbox_settings, session_id) == []
    assert lasting_processes(sandbox_settings) == {}
    host = host_snapshot(sandbox_settings)
    assert host.sessions == set() and host.leftovers == []


# 14. One session reading another's workspace


async def test_a_session_cannot_reach_another_sessions_files(client, snapshot, sandbox_settings):
    name = f"secret-{uuid.uuid4().hex[:8]}.txt"
    content = f"cross-session-{uuid.uuid4().hex}"
    async with await create(client, snapshot) as a, await create(client, snapshot) as b:
        assert (await a.tool("create_file", path=f"notes/{name}", content=content)).ok
        assert (await a.run("cp notes/secret-* /tmp/", timeout_s=30)).ok
        job = await a.tool("run_terminal_cmd", command="cd notes && exec sleep 60", is_background=True)
        assert job.ok
        sessions = sandbox_settings.workspace_root / sandbox_settings.replica / "sessions"
        host = sessions / a.session_id
        script = f"""
find / -path /proc -prune -o -path /usr -prune -o -name 'secret-*' -print 2>/dev/null
cat {host}/merged/notes/secret-* {host}/upper/notes/secret-* 2>&1
ls {sandbox_settings.workspace_root} {sessions} 2>&1
cat /proc/*/cwd/secret-* /proc/*/root/workspace/notes/secret-* /proc/*/root/tmp/secret-* 2>&1
grep -rl cross-session /workspace /tmp /crucible 2>/dev/null
"""
        seen = [await b.run(script, timeout_s=60)]
        for path in (f"{host}/merged/notes/{name}", f"../../{a.session_id}/merged/notes/{name}"):
            answer = await b.tool("read_file", path=path)
            assert not answer.ok and refused(answer.error), answer
        seen.append(await b.tool("grep", pattern="cross-session"))
        seen.append(await b.tool("file_search", query="secret"))
        for answer in seen:
            assert content not in answer.output and name not in answer.output, answer
        assert (await a.tool("read_file", path=f"notes/{name}")).output == content


# 15. Lying test runs


LIAR = """import sys


def test_prints_a_pass():
    print("tests/test_liar.py::test_prints_a_pass PASSED")
    print("tests/test_liar.py::test_other PASSED")
    print("=" * 30 + " 2 passed in 0.01s " + "=" * 30)
    with open("junit.xml", "w") as f:
        f.write('<testsuite tests="2" failures="0"><testcase name="test_prints_a_pass"/></testsuite>')
    sys.stdout.flush()
    assert 1 == 2, "the real outcome"
"""
QUITTER = """import os


def test_quits_before_the_report():
    print("=" * 30 + " 1 passed in 0.01s " + "=" * 30, flush=True)
    os._exit(0)
"""
REWRITES_THE_REPORT = """import atexit, json, os, sys


def _forge():
    for arg in sys.argv:
        if arg.startswith("--crucible-report="):
            with open(arg.split("=", 1)[1], "w") as f:
                f.write(json.dumps({"nodeid": "tests/test_ops.py::test_add", "outcome": "passed",
                                    "duration_s": 0.0, "message": ""}) + "\\n")
    os._exit(0)


atexit.register(_forge)


def add(a, b):
    return a - b
"""
PATCHES_THE_REPORTER = """import sys

_reporter = sys.modules.get("__main__")
if hasattr(_reporter, "_record"):
    _real = _reporter._record
    _reporter._record = lambda nodeid, outcome, duration, message: _real(nodeid, "passed", duration, "")


def add(a, b):
    return a - b
"""


async def test_a_failing_run_that_claims_to_pass_is_reported_failed(client, snapshot, sandbox_settings):
    async with await create(client, snapshot) as box:
        assert (await box.tool("create_file", path="tests/test_liar.py", content=LIAR)).ok
        lied = await box.tool("run_tests", node_ids=["tests/test_liar.py"], pytest_args=["-s"])
        assert "2 passed in 0.01s" in lied.output  # the console lied...
        assert not lied.ok and lied.tests is not None  # ...the result did not
        assert [(t.nodeid, t.outcome) for t in lied.tests] == [
            ("tests/test_liar.py::test_prints_a_pass", "failed")
        ]

        assert (await box.tool("create_file", path="tests/test_quit.py", content=QUITTER)).ok
        quitter = await box.tool("run_tests", node_ids=["tests/test_quit.py"])
        assert not quitter.ok and quitter.tests is None and "no report" in (quitter.error or ""), quitter

        # The code under test (not a test file) tampers with the report from inside pytest's process.
        for forger in (REWRITES_THE_REPORT, PATCHES_THE_REPORTER):
            assert (await box.tool("create_file", path="calc/ops.py", content=forger, overwrite=True)).ok
            forged = await box.tool("run_tests", node_ids=["tests/test_ops.py"])
            assert not forged.ok, forged
            assert not [t for t in forged.tests or [] if t.outcome == "passed"], forged.tests
        host = host_snapshot(sandbox_settings)
        assert host.sessions == {box.session_id} and host.leftovers == []
        session_folder = (
            sandbox_settings.workspace_root / sandbox_settings.replica / "sessions" / box.session_id
        )
        assert not list(session_folder.glob("report-*"))  # no report folder left
