"""The embedded servers: each starts on loopback only, answers its protocol, and is gone (process and
ports) after stop()."""

from __future__ import annotations

import io
import os
import socket
import uuid
from pathlib import Path

import nats
import pytest
import redis
from minio import Minio
from minio.error import S3Error

from crucible.localstack import Server, ServerStartError, start_nats, start_redis, start_seaweedfs
from crucible.localstack.processes import LOOPBACK, port_open

pytestmark = pytest.mark.integration


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket the process listens on, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                packed = bytes.fromhex(address)
                if family == socket.AF_INET:
                    packed = packed[::-1]
                else:
                    packed = b"".join(packed[i : i + 4][::-1] for i in range(0, 16, 4))
                found.add((socket.inet_ntop(family, packed), int(port, 16)))
    return found


def assert_loopback_only(server: Server) -> None:
    addresses = listening_addresses(server.pid)
    assert (LOOPBACK, server.port) in addresses
    assert {ip for ip, _ in addresses} == {LOOPBACK}, f"{server.name} listens beyond loopback: {addresses}"


def assert_stopped(server: Server) -> None:
    server.stop()
    assert server.process.returncode is not None
    assert not Path(f"/proc/{server.pid}").exists()
    assert not port_open(host=LOOPBACK, port=server.port)


async def test_nats_with_jetstream(tmp_path: Path) -> None:
    server = start_nats(state_dir=tmp_path)
    try:
        assert server.url.startswith(f"nats://{LOOPBACK}:")
        assert_loopback_only(server)
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="PROBE", subjects=["probe.>"])
        ack = await js.publish("probe.one", b"hello")
        assert ack.stream == "PROBE" and ack.seq == 1
        msg = await js.get_msg("PROBE", 1)
        assert msg.data == b"hello"
        await nc.close()
        assert any((tmp_path / "nats" / "jetstream").rglob("*")), "JetStream stores under the state dir"
    finally:
        assert_stopped(server)


def test_seaweedfs_serves_s3_with_the_given_keys(tmp_path: Path) -> None:
    secret = uuid.uuid4().hex
    server = start_seaweedfs(state_dir=tmp_path, access_key="crucible-probe", secret_key=secret)
    leftovers = list(server.leftovers)
    try:
        assert_loopback_only(server)
        client = Minio(server.endpoint, access_key="crucible-probe", secret_key=secret, secure=False)
        client.make_bucket("probe-bucket")
        data = os.urandom(300_000)
        client.put_object("probe-bucket", "a/b.bin", io.BytesIO(data), len(data))
        assert client.get_object("probe-bucket", "a/b.bin").read() == data
        intruder = Minio(
            server.endpoint, access_key="crucible-probe", secret_key="wrong-secret", secure=False
        )
        with pytest.raises(S3Error) as excinfo:
            intruder.list_buckets()
        assert excinfo.value.code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied")
    finally:
        assert_stopped(server)
    assert not any(path.exists() for path in leftovers)


def test_redis_answers_and_keeps_nothing_on_disk(tmp_path: Path) -> None:
    server = start_redis(state_dir=tmp_path)
    try:
        assert_loopback_only(server)
        client = redis.Redis.from_url(server.url)
        assert client.ping() is True
        client.set("probe", "1", ex=10)
        assert client.get("probe") == b"1"
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.close()
    finally:
        assert_stopped(server)
    assert not list((tmp_path / "redis").glob("*.rdb"))


def test_two_servers_of_a_kind_get_different_ports(tmp_path: Path) -> None:
    first, second = start_redis(state_dir=tmp_path / "a"), start_redis(state_dir=tmp_path / "b")
    try:
        assert first.port != second.port
    finally:
        first.stop()
        second.stop()


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    (tmp_path / "nats").mkdir()
    (tmp_path / "nats" / "jetstream").write_text("a file where JetStream wants its store directory")
    with pytest.raises(ServerStartError, match=r"nats exited with code \d+ while starting; last log lines"):
        start_nats(state_dir=tmp_path, timeout_s=10)


def test_seaweedfs_refuses_empty_credentials(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="non-empty S3 access key"):
        start_seaweedfs(state_dir=tmp_path, access_key="", secret_key="x")
