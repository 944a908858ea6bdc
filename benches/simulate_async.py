"""What asynchrony buys at sizes one machine cannot hold: a discrete-event simulation of the RL pipeline,
driven by the per-stage costs that benches/bench_async.py measures on the real local stack.

The model, one event queue (heapq), standard library only:
  - N rollout replicas, each running one group at a time (`group_s` from admission to publication). A
    replica running version v admits the next group index only while it is below
    `admission_limit(version=v, ...)` (libs/crucible/rl/staleness.py) and the run's budget
    (`(steps + 1) * groups_per_step`, as services/rollout/admission.py); otherwise it waits for weights.
  - a grader pool of `graders` concurrent gradings (`grade_s` per trajectory, first come first served);
    a group is ready once its `group_size` trajectories are graded.
  - the trainer (M data-parallel workers) takes a step once `groups_per_step` groups are ready, in the
    order they became ready (`step_s / (1 + efficiency * (M - 1))`), and after every `publish_every`-th
    step saves and publishes a version (`publish_s`, trainer busy); each replica swaps it in `load_s`
    later and keeps generating meanwhile.
Synchronous is `max_staleness = 0, publish_every = 1`: a step's groups are all admitted under the
version before it, so rollouts wait for the trainer and the trainer for the rollouts.

    python -m benches.bench_async --json > async.json
    python -m benches.simulate_async --costs async.json                 # check vs measured, then predict
    python -m benches.simulate_async --group-s 20 --grade-s 2 --step-s 5 --publish-s 1 --load-s 0.5
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from crucible.rl.staleness import admission_limit


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Mean seconds of each stage (benches/bench_async.py measures them)."""

    group_s: float
    """One rollout replica generating one group: task, sandboxes, episodes, publication."""
    grade_s: float
    """Grading one trajectory (hidden tests in a fresh sandbox)."""
    step_s: float
    """One optimizer step on one trainer worker."""
    publish_s: float
    """The trainer saving its state and publishing a version (it trains nothing meanwhile)."""
    load_s: float
    """A replica from a version's announcement to the weights swapped in (it keeps generating)."""


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    replicas: int = 1
    trainers: int = 1
    efficiency: float = 0.9
    """Data-parallel trainer scaling: M workers take a step 1 + efficiency * (M - 1) times as fast."""
    graders: int = 2
    """Trajectories graded at once, over all grader replicas (the grader's `concurrency` is 2)."""
    group_size: int = 4
    groups_per_step: int = 2
    publish_every: int = 1
    max_staleness: int = 0
    steps: int = 50


@dataclass
class Result:
    step_done_at: list[float] = field(default_factory=list)
    """When each step's version was published (or the step ended, when it published none)."""
    rollout_busy_s: float = 0.0
    trainer_busy_s: float = 0.0
    groups_generated: int = 0
    max_lag: int = 0
    """Versions by which the stalest trained group lagged the trainer (never over max_staleness)."""

    @property
    def seconds(self) -> float:
        return self.step_done_at[-1] if self.step_done_at else 0.0

    @property
    def seconds_per_step(self) -> float:
        """Between the first and the last step, as bench_async.py measures it (start-up excluded)."""
        done = self.step_done_at
        return (done[-1] - done[0]) / (len(done) - 1) if len(done) > 1 else self.seconds

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.seconds_per_step if self.seconds_per_step > 0 else float("inf")


def simulate(costs: Costs, pipe: Pipeline) -> Result:
    """Run the pipeline until the trainer has taken `pipe.steps` steps."""
    events: list[tuple[float, int, str, tuple]] = []
    seq = 0

    def at(time: float, kind: str, *payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, kind, payload))
        seq += 1

    result = Result()
    budget = (pipe.steps + 1) * pipe.groups_per_step
    replica_version = [0] * pipe.replicas
    replica_busy = [False] * pipe.replicas
    next_index = 0
    grading_queue: list[int] = []  # group ids, one entry per trajectory waiting for a grader
    graders_free = pipe.graders
    graded_left: dict[int, int] = {}
    group_version: dict[int, int] = {}
    ready: list[int] = []
    trainer_busy = False
    trainer_version = 0
    steps = 0
    speedup = 1 + pipe.efficiency * (pipe.trainers - 1)

    def admit(now: float, r: int) -> None:
        nonlocal next_index
        if replica_busy[r] or steps >= pipe.steps:
            return
        limit = admission_limit(
            version=replica_version[r], max_staleness=pipe.max_staleness,
            groups_per_step=pipe.groups_per_step, publish_every=pipe.publish_every,
        )  # fmt: skip
        if next_index >= min(limit, budget):
            return  # waits for a newer version
        replica_busy[r] = True
        group_version[next_index] = replica_version[r]
        at(now + costs.group_s, "generated", r, next_index)
        next_index += 1

    def grade(now: float) -> None:
        nonlocal graders_free
        while graders_free and grading_queue:
            graders_free -= 1
            at(now + costs.grade_s, "graded", grading_queue.pop(0))

    def train(now: float) -> None:
        nonlocal trainer_busy
        if trainer_busy or steps >= pipe.steps or len(ready) < pipe.groups_per_step:
            return
        batch = [ready.pop(0) for _ in range(pipe.groups_per_step)]
        result.max_lag = max(result.max_lag, *(trainer_version - group_version[g] for g in batch))
        trainer_busy = True
        at(now + costs.step_s / speedup, "stepped")

    for r in range(pipe.replicas):
        admit(0.0, r)
    while events and steps < pipe.steps:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "generated":
            r, g = payload
            replica_busy[r] = False
            result.rollout_busy_s += costs.group_s
            result.groups_generated += 1
            graded_left[g] = pipe.group_size
            grading_queue.extend([g] * pipe.group_size)
            grade(now)
            admit(now, r)
        elif kind == "graded":
            (g,) = payload
            graders_free += 1
            graded_left[g] -= 1
            if graded_left[g] == 0:
                ready.append(g)
                train(now)
            grade(now)
        elif kind == "stepped":
            result.trainer_busy_s += costs.step_s / speedup
            if (steps + 1) % pipe.publish_every:
                steps += 1
                result.step_done_at.append(now)
                trainer_busy = False
                train(now)
            else:
                result.trainer_busy_s += costs.publish_s
                at(now + costs.publish_s, "published")
        elif kind == "published":
            steps += 1
            trainer_version += 1
            result.step_done_at.append(now)
            trainer_busy = False
            for r in range(pipe.replicas):
                at(now + costs.load_s, "loaded", r, trainer_version)
            train(now)
        elif kind == "loaded":
            r, version = payload
            replica_version[r] = max(replica_version[r], version)
            admit(now, r)
    return result


def summary(result: Result, pipe: Pipeline) -> dict[str, float]:
    seconds = max(result.seconds, 1e-9)
    return {
        "seconds_per_step": round(result.seconds_per_step, 3),
        "steps_per_hour": round(result.steps_per_hour, 1),
        "rollout_busy": round(result.rollout_busy_s / (pipe.replicas * seconds), 3),
        "trainer_busy": round(result.trainer_busy_s / seconds, 3),
        "max_lag": result.max_lag,
    }


def _costs_from(args: argparse.Namespace) -> tuple[Costs, dict | None]:
    measured = None
    values: dict[str, float] = {}
    if args.costs:
        measured = json.loads(sys.stdin.read() if str(args.costs) == "-" else args.costs.read_text())
        values = dict(measured["costs"])
    for name in Costs.__dataclass_fields__:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    missing = sorted(set(Costs.__dataclass_fields__) - set(values))
    if missing:
        raise SystemExit(f"simulate_async: no cost for {', '.join(missing)} (give --costs or --{missing[0]})")
    return Costs(**{k: float(values[k]) for k in Costs.__dataclass_fields__}), measured


def check(costs: Costs, measured: dict, base: Pipeline) -> dict[str, dict[str, float]]:
    """Predicted vs measured seconds per step of each arm bench_async.py ran (1 replica, 1 trainer)."""
    out = {}
    for arm, run in measured["arms"].items():
        schedule = run["schedule"]
        pipe = replace(base, replicas=1, trainers=1, steps=run["steps"], group_size=schedule["group_size"],
                       groups_per_step=schedule["groups_per_step"], publish_every=schedule["publish_every"],
                       max_staleness=schedule["max_staleness"])  # fmt: skip
        predicted = simulate(costs, pipe).seconds_per_step
        own = Costs(**{k: run["costs"][k] for k in Costs.__dataclass_fields__})
        predicted_own = simulate(own, pipe).seconds_per_step
        actual = run["seconds_per_step"]
        out[arm] = {"measured_s": actual, "predicted_s": round(predicted, 3),
                    "error_pct": round(100 * (predicted - actual) / actual, 1),
                    "predicted_s_own_costs": round(predicted_own, 3),
                    "error_own_costs_pct": round(100 * (predicted_own - actual) / actual, 1)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", type=Path, help="bench_async.py --json output ('-': stdin).")
    for name in Costs.__dataclass_fields__:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float, help=f"Override {name}.")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--trainers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--efficiency", type=float, default=0.9)
    parser.add_argument(
        "--graders", type=int, default=None, help="Concurrent gradings (default: as measured, else 2)."
    )
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--groups-per-step", type=int, default=None)
    parser.add_argument(
        "--async-staleness", type=int, default=2, help="max_staleness of the asynchronous arm."
    )
    parser.add_argument("--steps", type=int, default=200, help="Steps simulated per prediction.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    costs, measured = _costs_from(args)
    schedule = (measured or {}).get("schedule", {})
    base = Pipeline(
        efficiency=args.efficiency,
        graders=args.graders or (measured or {}).get("grader_concurrency", 2),
        group_size=args.group_size or schedule.get("group_size", 4),
        groups_per_step=args.groups_per_step or schedule.get("groups_per_step", 2),
        steps=args.steps,
    )
    report: dict = {"costs": asdict(costs), "pipeline": asdict(base)}
    if measured:
        report["check"] = check(costs, measured, base)
    predictions = []
    for n in args.replicas:
        for m in args.trainers:
            pipe = replace(base, replicas=n, trainers=m)
            sync = summary(simulate(costs, replace(pipe, max_staleness=0, publish_every=1)), pipe)
            asyn = summary(
                simulate(costs, replace(pipe, max_staleness=args.async_staleness, publish_every=1)), pipe
            )
            predictions.append(
                {
                    "replicas": n,
                    "trainers": m,
                    "sync": sync,
                    "async": asyn,
                    "speedup": round(sync["seconds_per_step"] / asyn["seconds_per_step"], 2),
                }
            )
    report["predictions"] = predictions
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print("costs (s):", ", ".join(f"{k}={v:.3f}" for k, v in asdict(costs).items()))
    for arm, c in report.get("check", {}).items():
        print(
            f"check {arm:>5} (1 replica, 1 trainer): measured {c['measured_s']:.2f} s/step, "
            f"predicted {c['predicted_s']:.2f} s/step (error {c['error_pct']:+.1f}%); "
            f"from the arm's own costs {c['predicted_s_own_costs']:.2f} ({c['error_own_costs_pct']:+.1f}%)"
        )
    print(
        f"{'replicas':>8} {'trainers':>8} {'sync s/step':>11} {'async s/step':>12} {'sync step/h':>11} "
        f"{'async step/h':>12} {'speedup':>7} {'rollout busy s/a':>16} {'trainer busy s/a':>16}"
    )
    for p in predictions:
        s, a = p["sync"], p["async"]
        print(
            f"{p['replicas']:>8} {p['trainers']:>8} "
            f"{s['seconds_per_step']:>11.2f} {a['seconds_per_step']:>12.2f} "
            f"{s['steps_per_hour']:>11.0f} {a['steps_per_hour']:>12.0f} {p['speedup']:>7.2f} "
            f"{s['rollout_busy']:>7.2f}/{a['rollout_busy']:<8.2f} "
            f"{s['trainer_busy']:>7.2f}/{a['trainer_busy']:<8.2f}"
        )


if __name__ == "__main__":
    main()
