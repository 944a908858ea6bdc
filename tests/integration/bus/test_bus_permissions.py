"""Bus identities against a real nats-server run with the generated authorization (`crucible.identities`):
each forgery an attacker on the bus would try is refused by the server, a caller learns it as
`BusRefused` (not an outage to wait out), and the same traffic from the service whose row allows it
flows. No credential at all, or an NKey the server does not know, gets no connection."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import nkeys
import pytest
from grading_task import trajectory

from crucible.bus import Bus, BusError, BusRefused
from crucible.contracts import endpoints, subjects
from crucible.contracts.access import ADMIN, SERVICE_PERMISSIONS
from crucible.contracts.events import Event, RunStatus
from crucible.contracts.messages import (
    GradedTrajectory,
    ObjectRef,
    Reward,
    RunFinished,
    TaskReply,
    TaskRequest,
    TaskSecret,
    TaskSpec,
    WeightsAnnounced,
)
from crucible.identities import SERVER_CONFIG, seed_file
from crucible.localstack.servers import start_nats
from crucible.settings import CommonSettings

pytestmark = pytest.mark.integration

RUN = "run-perm"
REF = ObjectRef(uri="s3://crucible/forged", sha256="0" * 64, size=1)
SPEC = TaskSpec(task_id="t", taskset="s", difficulty=1, statement="", snapshot=REF)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("nats-auth")
    server = start_nats(state_dir=state, identities=state / "bus")
    yield server, state / "bus"
    server.stop()


@pytest.fixture
async def buses(server):
    """A bus per identity, the streams set up by the operator."""
    srv, folder = server
    connected: dict[str, Bus] = {}
    for identity in (*SERVICE_PERMISSIONS, ADMIN):
        settings = CommonSettings(nats_url=srv.url, nats_nkey_file=seed_file(folder, identity))
        connected[identity] = await Bus.connect(settings, name=identity)
    await connected[ADMIN].ensure_streams()
    yield connected
    for bus in connected.values():
        await bus.close()


def graded() -> GradedTrajectory:
    forged = trajectory(run_id=RUN, task=TaskReply(task=SPEC), diff="")
    reward = Reward(total=1.0, tests_passed=1, tests_total=1, resolved=True)
    return GradedTrajectory(trajectory=forged, reward=reward, graded_at=0.0)


async def refused(call) -> str:
    with pytest.raises(BusRefused) as error:
        await call
    return str(error.value)


async def test_no_credential_and_an_unknown_key_get_no_connection(server, tmp_path):
    srv, _ = server
    with pytest.raises(BusError, match="Authorization Violation"):
        await Bus.connect(CommonSettings(nats_url=srv.url), name="anyone")
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    with pytest.raises(BusError, match="Authorization Violation"):
        await Bus.connect(CommonSettings(nats_url=srv.url, nats_nkey_file=stranger), name="grader")


async def test_forgeries_are_refused_and_the_allowed_traffic_flows(buses):
    finished = RunFinished(run_id=RUN, status="finished", step=0, version=0, finished_at=0.0)
    status = Event.now(RUN, RunStatus(status="finished"), source="forger")
    announced = WeightsAnnounced(run_id=RUN, version=7, step=7, manifest=REF)
    forgeries = {
        # a graded trajectory paid 1.0, from anyone but a grader
        **{
            f"graded by {who}": buses[who].publish(subjects.graded(RUN), graded())
            for who in ("trainer", "rollout", "api", "sandbox", "catalog", "checkpoints")
        },
        # a live run marked finished, by a service that does not end runs
        **{
            f"run ended by {who}": buses[who].publish(subjects.run_finished(RUN), finished)
            for who in ("grader", "sandbox", "catalog", "checkpoints")
        },
        **{
            f"status by {who}": buses[who].publish(status.subject, status)
            for who in ("grader", "sandbox", "catalog", "checkpoints")
        },
        # a weight version nobody trained, announced to every rollout
        **{
            f"weights by {who}": buses[who].publish(subjects.weights_announced(RUN), announced)
            for who in ("trainer", "rollout", "grader", "api")
        },
        # the hidden tests and reference patch, asked by a service that has no use for them
        **{
            f"secret by {who}": buses[who].request(endpoints.CATALOG_SECRET, TaskRequest(task_id="t"))
            for who in ("rollout", "api", "sandbox", "checkpoints")
        },
        "run created by the rollouts": buses["rollout"].publish(subjects.run_created(RUN), finished),
        "graded read by the rollouts": buses["rollout"].latest(
            subjects.GRADED, subjects.graded(RUN), GradedTrajectory
        ),
    }
    outcomes = await asyncio.gather(*(refused(call) for call in forgeries.values()), return_exceptions=True)
    for name, outcome in zip(forgeries, outcomes, strict=True):
        assert isinstance(outcome, str) and "refused" in outcome, (name, outcome)

    # The same kinds of message from the services whose rows allow them.
    async def secret(request: TaskRequest) -> TaskReply:
        hidden = TaskSecret(
            task_id=request.task_id, hidden_tests=REF, test_command=["pytest"], reference_patch=""
        )
        return TaskReply(task=SPEC, secret=hidden)

    await buses["catalog"].serve(endpoints.CATALOG_SECRET, secret)
    reply = await buses["grader"].request(endpoints.CATALOG_SECRET, TaskRequest(task_id="t"))
    assert reply.secret is not None and reply.secret.test_command == ["pytest"]
    assert await buses["grader"].publish(subjects.graded(RUN), graded())
    assert await buses["checkpoints"].publish(subjects.weights_announced(RUN), announced)
    assert await buses["api"].publish(subjects.run_finished(RUN), finished)
    assert await buses["trainer"].publish(status.subject, status)
    seen = await buses["rollout"].latest(subjects.WEIGHTS, subjects.weights_announced(RUN), WeightsAnnounced)
    assert seen is not None and seen.version == 7


async def test_a_service_reads_no_other_inbox_and_changes_no_stream(buses):
    """Replies (a secret to the grader) go to the asker's own inbox; a stream's configuration is the
    operator's: a service changing GRADED could make it source forged messages."""
    trainer, grader = buses["trainer"], buses["grader"]
    snooped: list[object] = []

    async def keep(msg) -> None:
        snooped.append(msg)

    await trainer.nc.subscribe("_INBOX.grader.>", cb=keep)
    await trainer.nc.subscribe(subjects.CATALOG_SECRET, queue=endpoints.CATALOG_SECRET.queue, cb=keep)
    await until(lambda: {"_inbox.grader.>", subjects.CATALOG_SECRET} <= trainer.refused.keys())

    async def secret(request: TaskRequest) -> TaskReply:
        hidden = TaskSecret(
            task_id=request.task_id, hidden_tests=REF, test_command=["pytest"], reference_patch=""
        )
        return TaskReply(task=SPEC, secret=hidden)

    await buses["catalog"].serve(endpoints.CATALOG_SECRET, secret)
    for _ in range(5):
        assert (await grader.request(endpoints.CATALOG_SECRET, TaskRequest(task_id="t"))).secret
    assert snooped == []

    await grader.ensure_streams()  # the same configuration: nothing to change, nothing refused
    with pytest.raises(Exception):  # noqa: B017 - nats-py times out a refused API request
        await grader.js.update_stream(name=subjects.GRADED, subjects=["graded.>", "forged.>"])
    assert "$js.api.stream.update.graded" in grader.refused
    info = await buses[ADMIN].js.stream_info(subjects.GRADED)
    assert info.config.subjects == ["graded.>"]


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the server's refusal never arrived"
        await asyncio.sleep(0.05)


def test_every_identity_has_a_seed_and_only_public_keys_reach_the_server_config(server):
    _, folder = server
    config = (folder / SERVER_CONFIG).read_text()
    for identity in (*SERVICE_PERMISSIONS, ADMIN):
        path: Path = seed_file(folder, identity)
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.read_text().strip() not in config
