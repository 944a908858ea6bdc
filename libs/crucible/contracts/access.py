"""Who may do what on the bus and in the object store: each service's publish and subscribe permissions,
from the subjects it uses (`subjects`), and the object keys it may read, write and list (`keys`), as
../shared/DESIGN.md's table of services says. The servers enforce them (`crucible.identities` renders the
bus's into nats-server's authorization and the object store's into MinIO policies, `seaweedfs_identities`
into SeaweedFS's), so
a message a service has no business sending is refused by the server, not trusted by its consumer:

- only the graders publish graded trajectories, only the rollouts trajectories, only the checkpoints
  service announces weights;
- only the api creates runs; a run's end and its status come from the api, the trainer or the rollouts;
- only the grader and the trainer (SFT demonstrations) may ask the catalog for a task's secret: it is
  served on its own subject, `catalog.secret`;
- a service's replies to a request go back through the server's one-reply allowance, and each service
  reads only its own inbox (`inbox_prefix`), so no service can read another's replies (a secret);
- stream configurations are the operator's (`ADMIN`): a service may create a missing stream with the
  configuration of `subjects.STREAMS`, never change one (a changed stream could source forged messages).

Events are permitted by kind (`EVENT_PRODUCERS`): a service publishes only the kinds it reports, so the
subject of every message that changes training or a run names who may have sent it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from crucible.contracts import subjects

ADMIN = "admin"
"""The operator's identity (`crucible up`, `crucible deadletters`, tests): everything, stream setup
included."""

INBOX = "_INBOX"


def inbox_prefix(identity: str) -> str:
    """Where replies to `identity`'s requests (and its JetStream deliveries) arrive; only it reads them."""
    return f"{INBOX}.{identity}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False
    """It serves requests: it may publish one reply to each request it received."""

    def config(self) -> dict[str, object]:
        """The `permissions` block of a nats-server user."""
        block: dict[str, object] = {
            "publish": {"allow": sorted(set(self.publish))},
            "subscribe": {"allow": sorted(set(self.subscribe))},
        }
        if self.responds:
            block["allow_responses"] = True
        return block


@dataclass
class _Grant:
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    responds: bool = False

    def consumes(self, stream: str, durable: str) -> _Grant:
        """A durable pull consumer of `stream` (`durable` may be `*`): create, fetch, ack, dead-letter."""
        api = "$JS.API.CONSUMER"
        self.publish += [
            f"{api}.INFO.{stream}.{durable}",
            f"{api}.CREATE.{stream}.{durable}",
            f"{api}.CREATE.{stream}.{durable}.>",
            f"{api}.DURABLE.CREATE.{stream}.{durable}",
            f"{api}.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>",
            subjects.dead_letter(stream),
        ]
        return self

    def reads(self, stream: str) -> _Grant:
        """The newest message of a subject and the stream's state (`Bus.latest`)."""
        api = "$JS.API"
        self.publish += [
            f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}", f"{api}.DIRECT.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}.>",
        ]  # fmt: skip
        return self

    def follows(self, stream: str) -> _Grant:
        """An ordered consumer of new messages (`Bus.watch`): ephemeral, with flow control."""
        api = "$JS.API"
        self.publish += [
            f"{api}.STREAM.NAMES", f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
            f"{api}.CONSUMER.DELETE.{stream}.*", f"{api}.CONSUMER.INFO.{stream}.*", f"$JS.FC.{stream}.>",
        ]  # fmt: skip
        return self.reads(stream)

    def requests(self, *subjects_: str) -> _Grant:
        self.publish += subjects_
        return self

    def serves(self, *subjects_: str) -> _Grant:
        self.subscribe += subjects_
        self.responds = True
        return self

    def publishes(self, *subjects_: str) -> _Grant:
        self.publish += subjects_
        return self

    def reports(self, *kinds: str) -> _Grant:
        """Events of these kinds about any run."""
        self.publish += [subjects.events("*", kind) for kind in kinds]
        return self


EVENT_PRODUCERS: dict[str, frozenset[str]] = {
    "run.status": frozenset({"api", "trainer", "rollout"}),
    "step": frozenset({"trainer"}),
    "sft": frozenset({"trainer"}),
    "checkpoint": frozenset({"checkpoints"}),
    "rollout": frozenset({"rollout"}),
    "eval": frozenset({"trainer", "rollout"}),
}
"""Which services report each kind of event (`crucible.contracts.events`)."""

SANDBOX_CALLS = subjects.sandbox_call("*", "*")
RUN_ENDED = subjects.run_finished("*")


def _grants() -> dict[str, _Grant]:
    g = {
        name: _Grant()
        for name in ("catalog", "sandbox", "rollout", "grader", "trainer", "checkpoints", "api")
    }
    sandboxes = (subjects.SANDBOX_CREATE, SANDBOX_CALLS)

    g["catalog"].serves(
        subjects.CATALOG_SAMPLE, subjects.CATALOG_GET, subjects.CATALOG_LIST, subjects.CATALOG_DESCRIBE,
        subjects.CATALOG_SECRET,
    )  # fmt: skip
    g["catalog"].requests(*sandboxes)  # imported tasks are verified in a sandbox

    g["sandbox"].serves(subjects.SANDBOX_CREATE, subjects.SANDBOX_LIMITS, subjects.sandbox_call("*", ">"))

    g["rollout"].requests(
        subjects.CATALOG_SAMPLE, subjects.CATALOG_LIST, *sandboxes, subjects.CHECKPOINTS_GET
    )
    g["rollout"].publishes(subjects.rollouts("*"), RUN_ENDED)
    g["rollout"].consumes(subjects.EVALS, subjects.ROLLOUT_EVALS_DURABLE).follows(subjects.WEIGHTS).reads(
        subjects.RUNS
    )

    g["grader"].requests(subjects.CATALOG_SECRET, *sandboxes)
    g["grader"].publishes(subjects.graded("*"))
    g["grader"].consumes(subjects.ROLLOUTS, subjects.GRADER_DURABLE).reads(subjects.RUNS)

    g["trainer"].requests(
        subjects.CATALOG_LIST,
        subjects.CATALOG_SECRET,
        subjects.CHECKPOINTS_COMMIT,
        subjects.CHECKPOINTS_GET,
        *sandboxes,  # a warm start plays its demonstrations in sandboxes
    )
    g["trainer"].publishes(subjects.eval_requested("*"), RUN_ENDED)
    g["trainer"].consumes(subjects.RUNS, subjects.TRAINER_DURABLE).reads(subjects.RUNS)
    # one durable per run (trainer-<run>), deleted when the run ends
    g["trainer"].consumes(subjects.GRADED, "*").publishes(f"$JS.API.CONSUMER.DELETE.{subjects.GRADED}.*")

    g["checkpoints"].serves(subjects.CHECKPOINTS_COMMIT, subjects.CHECKPOINTS_GET)
    g["checkpoints"].publishes(subjects.weights_announced("*")).reads(subjects.WEIGHTS)

    g["api"].requests(subjects.CATALOG_DESCRIBE, subjects.SANDBOX_LIMITS)
    g["api"].publishes(subjects.run_created("*"), RUN_ENDED, subjects.eval_requested("*"))
    g["api"].consumes(subjects.GRADED, subjects.API_GRADED_DURABLE).consumes(
        subjects.EVENTS, subjects.API_EVENTS_DURABLE
    )
    g["api"].reads(subjects.ROLLOUTS).reads(subjects.GRADED).reads(subjects.RUNS)  # run clean-up

    for kind, producers in EVENT_PRODUCERS.items():
        for name in producers:
            g[name].reports(kind)
    return g


def _permissions(identity: str, grant: _Grant) -> Permissions:
    every = [
        "$JS.API.INFO",
        *(f"$JS.API.STREAM.CREATE.{name}" for name in subjects.STREAMS),  # a missing stream, as configured
    ]
    return Permissions(
        publish=tuple(every + grant.publish),
        subscribe=(f"{inbox_prefix(identity)}.>", *grant.subscribe),
        responds=grant.responds,
    )


SERVICE_PERMISSIONS: dict[str, Permissions] = {
    name: _permissions(name, grant) for name, grant in _grants().items()
}
"""Each service's permissions, by its identity (its service name)."""

ADMIN_PERMISSIONS = Permissions(publish=(">",), subscribe=(">",), responds=True)


# --- the object store ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectGrant:
    """Keys of the bucket matching `pattern` (a glob: `*` matches any characters, `/` included)."""

    pattern: str
    write: bool = False
    """Put and delete, beside reading."""
    list: bool = False
    """List keys under the pattern's prefix."""


BUS_CLAIMS = ObjectGrant("bus/*", write=True)
"""Messages too big for the bus (`keys.bus_claim_prefix`); a reference carries the payload's sha256."""
TRAJECTORIES = "runs/*/trajectories/*"
WEIGHTS = "runs/*/weights/*"

OBJECT_GRANTS: dict[str, tuple[ObjectGrant, ...]] = {
    "catalog": (ObjectGrant("tasksets/*", write=True), BUS_CLAIMS),
    # where the agent's code runs: task snapshots and hidden tests to unpack, the big requests sent to it;
    # it writes only the claim checks of its own big replies (a diff, a test report), which nothing but the
    # asker's reply points at, by sha256
    "sandbox": (
        ObjectGrant("tasksets/*"),
        ObjectGrant(f"bus/{SANDBOX_CALLS}"),
        ObjectGrant(f"bus/{INBOX}.*", write=True),
    ),
    "rollout": (ObjectGrant(WEIGHTS), ObjectGrant(TRAJECTORIES, write=True), BUS_CLAIMS),
    "grader": (
        ObjectGrant(TRAJECTORIES),
        ObjectGrant("runs/*/trajectories/*/graded*", write=True),
        BUS_CLAIMS,
    ),
    "trainer": (
        ObjectGrant(TRAJECTORIES),
        ObjectGrant(WEIGHTS, write=True),
        ObjectGrant("runs/*/trainer/*", write=True),
        ObjectGrant("tasksets/*"),
        ObjectGrant("demonstrations/*"),
        BUS_CLAIMS,
    ),
    "checkpoints": (ObjectGrant(WEIGHTS, write=True, list=True), BUS_CLAIMS),
    # a run's objects, released when it ends
    "api": (ObjectGrant(TRAJECTORIES, write=True, list=True), BUS_CLAIMS),
}
"""What each service may do with the objects of the bucket; the operator (`ADMIN`) may do everything."""


def seaweedfs_identities(keys: Mapping[str, Sequence[str]], bucket: str) -> list[dict[str, object]]:
    """SeaweedFS's S3 identities (its `-s3.config`) for each service's (access key, secret key): each
    limited to its grants, as `Read:<bucket>/<glob>`, `Write:...` and `List:...` actions."""
    identities: list[dict[str, object]] = []
    for identity, (access, secret) in keys.items():
        actions = []
        for grant in OBJECT_GRANTS[identity]:
            kinds = ["Read"] + ["Write"] * grant.write + ["List"] * grant.list
            actions += [f"{kind}:{bucket}/{grant.pattern}" for kind in kinds]
        identities.append(
            {
                "name": identity,
                "credentials": [{"accessKey": access, "secretKey": secret}],
                "actions": actions,
            }
        )
    return identities


def aws_policy(identity: str, bucket: str) -> dict[str, object]:
    """`identity`'s grants as an AWS-style IAM policy document (MinIO's `mc admin policy create`)."""
    statements: list[dict[str, object]] = []
    for grant in OBJECT_GRANTS[identity]:
        actions = ["s3:GetObject"] + ["s3:PutObject", "s3:DeleteObject"] * grant.write
        statements.append(
            {"Effect": "Allow", "Action": actions, "Resource": [f"arn:aws:s3:::{bucket}/{grant.pattern}"]}
        )
        if grant.list:
            statements.append({
                "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [grant.pattern]}},
            })  # fmt: skip
    return {"Version": "2012-10-17", "Statement": statements}
