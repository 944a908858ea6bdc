"""TLS to NATS and to S3, as a deployment turns it on: real nats-server and SeaweedFS serving a certificate
signed by a CA of the test's own. A service given the CA (nats_tls_ca_file, s3_ca_file) connects and
works; one that does not trust the CA gets no connection."""

from __future__ import annotations

import pytest
from tls_certs import make_certificates

from crucible.bus import Bus, BusError
from crucible.contracts import subjects
from crucible.contracts.events import Event, RunStatus
from crucible.identities import seed_file
from crucible.localstack.servers import start_nats, start_seaweedfs
from crucible.objectstore import ObjectStore
from crucible.outage import Unavailable
from crucible.settings import CommonSettings

pytestmark = pytest.mark.integration


async def test_the_bus_over_tls_with_identities(tmp_path):
    ca, cert, key = make_certificates(tmp_path / "certs")
    folder = tmp_path / "bus"
    server = start_nats(state_dir=tmp_path, identities=folder, tls=(cert, key))
    try:
        assert server.url.startswith("tls://")
        operator = CommonSettings(
            nats_url=server.url, nats_nkey_file=seed_file(folder, "admin"), nats_tls_ca_file=ca
        )
        bus = await Bus.connect(operator, name="admin")
        try:
            await bus.ensure_streams()
            status = Event.now("run-tls", RunStatus(status="running"), source="test")
            assert await bus.publish(status.subject, status)
            assert (await bus.js.stream_info(subjects.EVENTS)).state.messages == 1
        finally:
            await bus.close()
        with pytest.raises(BusError):  # the system's CAs do not know the test's
            await Bus.connect(operator.model_copy(update={"nats_tls_ca_file": None}), name="admin")
    finally:
        server.stop()


async def test_the_object_store_over_https(tmp_path):
    ca, cert, key = make_certificates(tmp_path / "certs")
    server = start_seaweedfs(
        state_dir=tmp_path, access_key="operator", secret_key="operator-secret", tls=(cert, key)
    )
    try:
        secure = CommonSettings(
            s3_endpoint=server.tls_endpoint, s3_secure=True, s3_ca_file=ca, s3_access_key="operator",
            s3_secret_key="operator-secret", s3_bucket="crucible-tls",
        )  # fmt: skip
        store = ObjectStore.from_settings(secure)
        await store.ensure_bucket()
        ref = await store.put_bytes("tasksets/s/t/snapshot.tar.gz", b"over tls")
        assert await store.get_bytes(ref) == b"over tls"
        untrusting = ObjectStore.from_settings(secure.model_copy(update={"s3_ca_file": None}))
        with pytest.raises(Unavailable):
            await untrusting.check()
    finally:
        server.stop()
