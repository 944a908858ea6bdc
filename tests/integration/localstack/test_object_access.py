"""Each service's own S3 key, against a real SeaweedFS configured from `crucible.contracts.access` as the
local stack configures it: what a service needs works, and what it has no business doing is refused
(`AccessRefused`, not an outage to wait out). Above all the sandbox, where the agent's code runs, reads
task snapshots and the big requests sent to it, and writes only the claim checks of its own replies."""

from __future__ import annotations

import pytest

from crucible.contracts.access import OBJECT_GRANTS, seaweedfs_identities
from crucible.localstack.servers import start_seaweedfs
from crucible.objectstore import AccessRefused, ObjectStore
from crucible.settings import CommonSettings

pytestmark = pytest.mark.integration

BUCKET = "crucible"
SNAPSHOT = "tasksets/pybugs/t1/snapshot.tar.gz"
WEIGHTS = "runs/r1/weights/000001/manifest.msgpack"
TRAJECTORY = "runs/r1/trajectories/abc"
STATE = "runs/r1/trainer/state-0.pt"
CLAIM = "bus/catalog.sample/0123.msgpack"
KEYS = {name: (f"crucible-{name}", f"{name}-secret-key-0123") for name in OBJECT_GRANTS}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    state = tmp_path_factory.mktemp("s3-access")
    server = start_seaweedfs(
        state_dir=state, access_key="operator", secret_key="operator-secret-key",
        identities=seaweedfs_identities(KEYS, BUCKET),
    )  # fmt: skip
    common = {"s3_endpoint": server.endpoint, "s3_bucket": BUCKET}
    made = {
        name: ObjectStore.from_settings(CommonSettings(**common, s3_access_key=access, s3_secret_key=secret))
        for name, (access, secret) in KEYS.items()
    }
    made["operator"] = ObjectStore.from_settings(
        CommonSettings(**common, s3_access_key="operator", s3_secret_key="operator-secret-key")
    )
    yield made
    server.stop()


async def refused(call) -> None:
    with pytest.raises(AccessRefused):
        await call


async def test_each_service_does_its_work_and_nothing_else(stores):
    operator = stores["operator"]
    await operator.ensure_bucket()
    for key in (SNAPSHOT, WEIGHTS, TRAJECTORY, STATE, CLAIM):
        await operator.put_bytes(key, b"x")
    for store in stores.values():  # readiness and start-up pass with a key limited to some prefixes
        await store.check()
        await store.ensure_bucket()

    sandbox = stores["sandbox"]
    assert await sandbox.get_bytes(sandbox.uri(SNAPSHOT), verify=False) == b"x"
    await operator.put_bytes("bus/sandbox.r1.write_file/0123.msgpack", b"big request")
    assert await sandbox.get_bytes(sandbox.uri("bus/sandbox.r1.write_file/0123.msgpack"), verify=False)
    await sandbox.put_bytes("bus/_INBOX.rollout.abc.def/0123.msgpack", b"a big reply")  # a 4 MiB diff, say
    for key in (WEIGHTS, TRAJECTORY, STATE, CLAIM):
        await refused(sandbox.get_bytes(sandbox.uri(key), verify=False))
    for key in (SNAPSHOT, CLAIM, TRAJECTORY, "bus/sandbox.r1.write_file/forged.msgpack"):
        await refused(sandbox.put_bytes(key, b"forged"))

    grader = stores["grader"]
    assert await grader.get_bytes(grader.uri(TRAJECTORY), verify=False) == b"x"
    await grader.put_bytes(f"{TRAJECTORY}/graded/0123.msgpack", b"g")
    for key in (TRAJECTORY, WEIGHTS, SNAPSHOT):
        await refused(grader.put_bytes(key, b"forged"))

    rollout = stores["rollout"]
    assert await rollout.get_bytes(rollout.uri(WEIGHTS), verify=False) == b"x"
    await rollout.put_bytes("runs/r1/trajectories/def/0123.msgpack", b"t")
    await refused(rollout.put_bytes(WEIGHTS, b"forged"))
    await refused(rollout.get_bytes(rollout.uri(STATE), verify=False))

    trainer = stores["trainer"]
    await trainer.put_bytes("runs/r1/weights/000002/shard-0.safetensors", b"w")
    await trainer.put_bytes(STATE, b"s")
    await refused(trainer.put_bytes(SNAPSHOT, b"forged"))

    checkpoints, api = stores["checkpoints"], stores["api"]
    assert await checkpoints.list("runs/r1/weights/") == [
        WEIGHTS,
        "runs/r1/weights/000002/shard-0.safetensors",
    ]
    await refused(checkpoints.list("runs/r1/"))
    await refused(checkpoints.put_bytes(TRAJECTORY, b"forged"))
    listed = await api.list("runs/r1/trajectories/")
    assert TRAJECTORY in listed
    await api.delete(TRAJECTORY)
    await refused(api.list("runs/r1/weights/"))
    await refused(api.delete(WEIGHTS))

    catalog = stores["catalog"]
    await catalog.put_bytes("tasksets/pybugs/t2/snapshot.tar.gz", b"t")
    await refused(catalog.get_bytes(catalog.uri(WEIGHTS), verify=False))
    assert await operator.get_bytes(operator.uri(WEIGHTS), verify=False) == b"x"  # nothing forged landed
