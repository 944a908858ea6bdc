"""Grading one trajectory: rebuild its final workspace in a fresh sandbox and run the hidden tests.

The per-test outcomes come from the sandbox's `run_tests` tool, which reads them from pytest itself,
never from the console the code under test can print into. A generated task's hidden tests are probes:
what each call gave is judged here against the expected outcome, which never entered the sandbox
(`crucible.probes`).

A resolved change of an evaluation, or of a run with `reward.quality`, also gets quality measures
(`quality`); such a run weighs them into its reward.

A trajectory that cheats or whose code fails scores 0 (see `reward`), with the reason in the note: one
whose diff touches the tests or pytest's configuration (`anticheat`); one that adds to the code under
test what reaches past the behaviour graded, seen in its source (`tamper`: pytest's internals, frames,
the garbage collector, exit hooks, patched modules, run-time names) or, however it is spelled, when
it runs (the runtime guard of `crucible.pytest_report`, told which lines the change added: frames,
code objects, the garbage collector, ctypes, signals, the report and the hidden tests' files, and a
true `==` of the hidden tests decided by an `__eq__` the change wrote between values that differ).
`crucible_grader_tampered_total` counts the last two by run and rule (the guard's as `guard:<rule>`).

A failure of Crucible's own infrastructure (catalog or sandbox unreachable or refusing, a bus timeout,
a task whose hidden tests do not unpack) raises instead, so the message is held or redelivered and
graded later rather than scored 0.
"""

from __future__ import annotations

import structlog

from crucible import probes, pytest_report
from crucible.bus import Bus, BusError
from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts import endpoints
from crucible.contracts.messages import Reward, TaskRequest, TaskSecret, Trajectory
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.sandbox import GuardSpec
from crucible.contracts.trajectories import arrays
from crucible.runs import run_config
from services.grader.anticheat import BadDiff, added_lines, protected_paths, touched_paths
from services.grader.metrics import TAMPERED
from services.grader.quality import change_measures, lint_findings, lint_paths, repetition
from services.grader.reward import compute_reward, zero_reward
from services.grader.settings import Settings
from services.grader.tamper import Finding, added_findings

log = structlog.get_logger("crucible.grader")
NOTE_CHARS = 500
SOURCE_CAP_BYTES = 1024 * 1024
TOO_LARGE = "\0too large"  # read_source's answer for a file it could not read whole


class GradingInfraError(RuntimeError):
    """Crucible, not the trajectory, failed; grade it again later."""


class RunConfigs:
    """Each run's config, read once from its `created` message on RUNS (the reward options live there).
    A run with no such message (a trajectory forged or from a test) is graded with the defaults."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.known: dict[str, RunConfig] = {}

    async def get(self, run_id: str) -> RunConfig:
        if run_id not in self.known:
            config = await run_config(self.bus, run_id)
            if config is None:
                log.warning("no run config on the bus; default reward options", run_id=run_id)
                return RunConfig()
            self.known[run_id] = config
        return self.known[run_id]


async def grade(*, bus: Bus, trajectory: Trajectory, config: RunConfig, settings: Settings) -> Reward:
    request = TaskRequest(task_id=trajectory.task_id)
    task = await bus.request(endpoints.CATALOG_SECRET, request, timeout=settings.catalog_timeout_s)
    if task.secret is None or not task.secret.test_command:
        raise GradingInfraError(f"catalog sent task {trajectory.task_id} without its secret or test command")
    if not trajectory.final_diff.strip():
        # Nothing changed: the snapshot fails every FAIL_TO_PASS test by construction (verified).
        return compute_reward(
            tests=[],
            fail_to_pass=task.secret.fail_to_pass,
            pass_to_pass=task.secret.pass_to_pass,
            changed=False,
        )
    try:
        protected = protected_paths(trajectory.final_diff)
    except BadDiff as exc:
        return zero_reward(note=f"diff does not parse: {exc}"[:NOTE_CHARS])
    if protected:
        return zero_reward(
            note=f"diff touches test files or pytest configuration, or shadows the standard library: "
            f"{', '.join(protected)}"[:NOTE_CHARS]
        )
    client = SandboxClient(
        bus, create_timeout_s=settings.sandbox_timeout_s, call_timeout_s=settings.sandbox_timeout_s
    )
    session = await client.create(
        run_id=trajectory.run_id,
        task_id=trajectory.task_id,
        snapshot=task.task.snapshot,
        ttl_s=settings.sandbox_ttl_s,
    )
    try:
        return await run_hidden_tests(
            session=session, trajectory=trajectory, secret=task.secret, config=config, settings=settings
        )
    finally:
        try:
            await session.destroy()
        except BusError as exc:  # the session's TTL reclaims it
            log.warning("could not destroy grading sandbox", session=session.session_id, error=str(exc))


def scanned_paths(diff: str) -> list[str]:
    """The Python files a diff changes that the tests import (test modules it adds are never run)."""
    return [
        path for path in touched_paths(diff) if path.endswith(".py") and not pytest_report.is_test_path(path)
    ]


async def read_source(session: SandboxSession, path: str) -> str | None:
    """A workspace file's text (None if there is none), read by `cat`: no Python of the workspace runs.
    A file over SOURCE_CAP_BYTES reads as TOO_LARGE."""
    result = await session.run(["cat", "--", path], timeout_s=30, output_cap=SOURCE_CAP_BYTES)
    if not result.ok or result.exit_code != 0:
        return None
    return TOO_LARGE if result.truncated else result.output


async def tamper_findings(
    session: SandboxSession, before: dict[str, str | None]
) -> list[tuple[str, Finding]]:
    """What the applied change added to each scanned file, by `services.grader.tamper`'s rules."""
    found = []
    for path, source in before.items():
        after = await read_source(session, path)
        if after is TOO_LARGE:
            found.append(
                (path, Finding("unparsable", 0, f"over {SOURCE_CAP_BYTES} bytes, too large to scan"))
            )
        elif after is not None:
            found += [
                (path, finding) for finding in added_findings(None if source is TOO_LARGE else source, after)
            ]
    return found


def guard_spec(diff: str, secret: TaskSecret) -> GuardSpec:
    """What the runtime guard watches for: the change's added lines, and the hidden tests' files."""
    tests = {nodeid.split("::")[0] for nodeid in [*secret.fail_to_pass, *secret.pass_to_pass, *secret.probes]}
    return GuardSpec(added=added_lines(diff), protected=sorted(t for t in tests if t.endswith(".py")))


async def run_hidden_tests(
    *,
    session: SandboxSession,
    trajectory: Trajectory,
    secret: TaskSecret,
    config: RunConfig,
    settings: Settings,
) -> Reward:
    measure = bool(trajectory.eval_id) or config.reward.quality is not None  # quality measures
    lint_before, lint_after = lint_paths(trajectory.final_diff) if measure else ([], [])
    findings_before = await lint_findings(session, lint_before) if measure else None
    scanned = scanned_paths(trajectory.final_diff) if settings.tamper_scan else []
    sources_before = {path: await read_source(session, path) for path in scanned}
    applied = await session.apply_patch(trajectory.final_diff)
    if not applied.ok:
        return zero_reward(
            note=f"diff does not apply: {applied.error or ''} {applied.output}".strip()[:NOTE_CHARS]
        )
    tampered = await tamper_findings(session, sources_before)
    if tampered:
        path, finding = tampered[0]
        TAMPERED.labels(run_id=trajectory.run_id, rule=finding.rule).inc()
        more = f" and {len(tampered) - 1} more" if len(tampered) > 1 else ""
        return zero_reward(
            note=f"tamper scan: {finding.rule} at {path}:{finding.line} ({finding.detail}){more}"[:NOTE_CHARS]
        )
    findings_after = await lint_findings(session, lint_after) if measure else None
    repeated = await repetition(session, trajectory.final_diff) if measure else None
    overlay = await session.overlay(secret.hidden_tests)
    if not overlay.ok:
        raise GradingInfraError(f"hidden tests of {secret.task_id} do not unpack: {overlay.error}")
    try:
        args = pytest_report.split_command(secret.test_command)
    except ValueError as exc:
        raise GradingInfraError(f"task {secret.task_id}: {exc}") from None
    guard = guard_spec(trajectory.final_diff, secret) if settings.guard else None
    run = await session.tool("run_tests", pytest_args=args, timeout_s=settings.test_timeout_s, guard=guard)
    if guard is not None:
        if run.guard is None:
            raise GradingInfraError(f"the sandbox ran {secret.task_id}'s tests without the guard's log")
        if run.guard:
            first = run.guard[0]
            TAMPERED.labels(run_id=trajectory.run_id, rule=f"guard:{first.rule}").inc()
            more = f" and {len(run.guard) - 1} more" if len(run.guard) > 1 else ""
            where = f"{first.path}:{first.line}"
            return zero_reward(
                note=f"guard refused: {first.rule} at {where} ({first.detail}){more}"[:NOTE_CHARS]
            )
    if run.timed_out:
        return zero_reward(note=f"hidden tests ran past {settings.test_timeout_s:.0f}s")
    if not run.tests:
        return zero_reward(
            note=f"no test results ({run.error or 'no tests ran'}): {run.output[-300:]}"[:NOTE_CHARS]
        )
    quality = None
    if measure:
        quality = change_measures(trajectory=trajectory, reference_patch=secret.reference_patch)
        if findings_before is not None and findings_after is not None:
            quality["lint_introduced"] = float(findings_after - findings_before)
        if repeated is not None:
            quality["repetition"] = repeated
    return compute_reward(
        tests=probes.judge(run.tests, secret.probes),
        fail_to_pass=secret.fail_to_pass,
        pass_to_pass=secret.pass_to_pass,
        changed=True,
        tool_calls=trajectory.tool_calls,
        sampled_tokens=arrays(trajectory).num_sampled,
        token_budget=config.agent.max_turns * config.agent.max_action_tokens,
        options=config.reward,
        quality=quality,
    )
