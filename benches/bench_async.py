"""Does asynchrony buy anything over a synchronous loop? The same run config through the real local stack,
synchronously and asynchronously, with the per-stage costs that benches/simulate_async.py scales up.

  sync:  schedule.max_staleness = 0, publish_every = 1. admission_limit (libs/crucible/rl/staleness.py)
         is then (v + 1) * groups_per_step: rollouts running version v admit exactly the groups of step
         v + 1 and wait for version v + 1 before admitting more, and the trainer waits for those groups.
  async: schedule.max_staleness = --staleness (2), publish_every = 1: the rollouts run up to that many
         versions ahead while the trainer trains.

Per arm, from real measurements: wall-clock per optimizer step (between the first and the last step's
events, start-up excluded), the rollout's busy fraction (crucible_rollout_busy_seconds_total: time with
a group in flight, from version 0's announcement until the replica fell idle after the run), the
trainer's (the steps' `step_seconds`, from version 0's announcement to the last step), reward per
step. Per-stage costs, the simulation's input, from the sync arm (where no two stages share this
machine's two cores, except a grading beside the step's next group): seconds per group
(crucible_rollout_group_seconds), per grading (crucible_grader_seconds), per trainer step
(`step_seconds`), per weight publish (the step's event time less `step_seconds` less the step's start:
its last trajectory's grading or the step before's event, whichever is later; state save and
publication) and load (crucible_rollout_weights_load_seconds).

    python -m benches.bench_async --json > async.json
    python -m benches.bench_async --steps 8 --repeats 2
    # a policy that edits (the random-init one never changes the repository, so grading runs no test
    # and every reward is 0): both arms start from one supervised warm start, as bench_learning's
    python -m benches.bench_async --sft-steps 300 --json > async-warm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benches.bench_learning import AGENT, MAX_CONTEXT
from crucible.cli.demo import DEMO_CONFIG
from crucible.contracts.runconfig import RunConfig
from crucible.localstack import LocalStack
from crucible.localstack.processes import LOOPBACK

RUN = ["schedule.publish_every=1", "eval.at_end=false"]
"""The demo's run (DEMO_CONFIG) with a version every step and without its evaluation; max_steps and
max_staleness are set per arm."""
GRADER_CONCURRENCY = 2
POLL_S = 0.5


def scrape(client: httpx.Client, url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a service's /metrics, by (name, sorted labels)."""
    text = client.get(url).raise_for_status().text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(metrics: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class Bench:
    def __init__(self, stack: LocalStack, timeout: float) -> None:
        self.stack = stack
        self.client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
        self.timeout = timeout

    def metrics(self, service: str) -> dict[tuple[str, tuple], float]:
        return scrape(self.client, f"http://{LOOPBACK}:{self.stack.service(service).http_port}/metrics")

    def pages(self, path: str) -> list[dict[str, Any]]:
        items, cursor = [], None
        while True:
            page = self.client.get(path, params={"limit": 200, **({"cursor": cursor} if cursor else {})})
            body = page.raise_for_status().json()
            items.extend(body["items"])
            cursor = body["next_cursor"]
            if not cursor:
                return items

    def wait(self, condition, what: str) -> None:
        """Poll `condition` until it holds, failing fast when a service died or the deadline passed."""
        deadline = time.monotonic() + self.timeout
        while not condition():
            if dead := self.stack.poll():
                raise RuntimeError(f"service(s) exited: {dead}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {self.timeout} s")
            time.sleep(POLL_S)

    def start(self, name: str, overrides: list[str]) -> str:
        """Create the demo's run with RUN and `overrides`, wait until it has finished; its id."""
        config = RunConfig.from_toml(DEMO_CONFIG, overrides=[*RUN, *overrides]).model_dump(mode="json")
        run_id = (
            self.client.post("/v1/runs", json={"name": name, "config": config})
            .raise_for_status()
            .json()["run_id"]
        )

        def finished() -> bool:
            run = self.client.get(f"/v1/runs/{run_id}").raise_for_status().json()
            if run["status"] == "failed":
                raise RuntimeError(f"run {name} failed: {run['error']}")
            return run["status"] == "finished"

        self.wait(finished, f"run {name}")
        return run_id

    def arm(self, name: str, *, steps: int, max_staleness: int, overrides: list[str]) -> dict[str, Any]:
        grader_before = self.metrics("grader")
        schedule = [f"schedule.max_steps={steps}", f"schedule.max_staleness={max_staleness}"]
        run_id = self.start(name, [*overrides, *schedule])
        self.wait(
            lambda: sample(self.metrics("rollout"), "crucible_rollout_groups_in_flight", run_id=run_id) == 0,
            f"run {name}'s last groups",
        )
        idle_at = time.time()
        self.wait(lambda: len(self.pages(f"/v1/runs/{run_id}/steps")) >= steps, f"run {name}'s step events")
        rollout, grader = self.metrics("rollout"), self.metrics("grader")
        run = self.client.get(f"/v1/runs/{run_id}").raise_for_status().json()
        steps_out = sorted(self.pages(f"/v1/runs/{run_id}/steps"), key=lambda s: s["step"])
        trajectories = self.pages(f"/v1/runs/{run_id}/trajectories")
        checkpoints = self.pages(f"/v1/runs/{run_id}/checkpoints")
        return measure(
            run=run, steps=steps_out, trajectories=trajectories, checkpoints=checkpoints, idle_at=idle_at,
            rollout=rollout, grader_before=grader_before, grader=grader,
        )  # fmt: skip


def measure(
    *, run, steps, trajectories, checkpoints, idle_at, rollout, grader_before, grader
) -> dict[str, Any]:
    """One arm's numbers, from the run's REST history and the services' Prometheus counters."""
    run_id, schedule = run["run_id"], run["config"]["schedule"]
    created = ts(run["created_at"])
    step_at = [ts(s["created_at"]) for s in steps]
    graded_at = {t["trajectory_id"]: ts(t["graded_at"]) for t in trajectories}
    step_seconds = [s["metrics"]["step_seconds"] for s in steps]
    # the trainer starts a step once its last trajectory is graded and the step before has sent its event,
    # then trains (step_seconds), saves its state and publishes the version; the step's event follows
    started = [max(max(graded_at[t] for t in s["trajectory_ids"]), before)
               for s, before in zip(steps, [0.0, *step_at[:-1]], strict=True)]  # fmt: skip
    publish = [
        at - start - s["metrics"]["step_seconds"]
        for s, at, start in zip(steps, step_at, started, strict=True)
    ]
    v0 = min((ts(c["created_at"]) for c in checkpoints if c["version"] == 0), default=created)
    wall = step_at[-1] - v0

    def hist_mean(metrics, name: str, before=None, **labels: str) -> float:
        total = sample(metrics, f"{name}_sum", **labels) - (
            sample(before, f"{name}_sum", **labels) if before else 0
        )
        count = sample(metrics, f"{name}_count", **labels) - (
            sample(before, f"{name}_count", **labels) if before else 0
        )
        return total / count if count else float("nan")

    busy = sample(rollout, "crucible_rollout_busy_seconds_total", run_id=run_id)
    trained_groups = {t["group_id"] for t in trajectories if t["trained_count"] > 0}
    return {
        "run_id": run_id,
        "schedule": {
            k: schedule[k] for k in ("group_size", "groups_per_step", "publish_every", "max_staleness")
        },
        "steps": len(steps),
        "seconds_per_step": round((step_at[-1] - step_at[0]) / max(len(steps) - 1, 1), 3),
        "seconds_per_step_from_v0": round((step_at[-1] - v0) / len(steps), 3),
        "wall_s": round(step_at[-1] - created, 2),
        "rollout_busy": round(busy / max(idle_at - v0, 1e-9), 3),
        "trainer_busy": round(sum(step_seconds) / wall, 3),
        "trainer_busy_with_publish": round((sum(step_seconds) + sum(publish)) / wall, 3),
        "reward_per_step": [round(s["metrics"].get("reward_mean", 0.0), 4) for s in steps],
        "staleness_mean_per_step": [round(s["metrics"].get("staleness_mean", 0.0), 3) for s in steps],
        "groups_generated": int(sample(rollout, "crucible_rollout_group_seconds_count", run_id=run_id)),
        "groups_trained": len(trained_groups),
        "costs": {
            "group_s": round(hist_mean(rollout, "crucible_rollout_group_seconds", run_id=run_id), 3),
            "trajectory_s": round(
                hist_mean(rollout, "crucible_rollout_group_seconds", run_id=run_id) / schedule["group_size"],
                3,
            ),
            "grade_s": round(hist_mean(grader, "crucible_grader_seconds", grader_before), 3),
            "step_s": round(statistics.mean(step_seconds), 3),
            "publish_s": round(statistics.median(publish), 3),
            "load_s": round(hist_mean(rollout, "crucible_rollout_weights_load_seconds", run_id=run_id), 3),
        },
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each number over an arm's repeats (each run's own numbers stay in `runs`)."""
    first = runs[0]
    keys = (
        "seconds_per_step",
        "seconds_per_step_from_v0",
        "rollout_busy",
        "trainer_busy",
        "trainer_busy_with_publish",
    )
    return {
        "schedule": first["schedule"],
        "steps": first["steps"],
        **{k: round(statistics.median(r[k] for r in runs), 3) for k in keys},
        "reward_per_step": [
            round(statistics.mean(x), 4) for x in zip(*(r["reward_per_step"] for r in runs), strict=True)
        ],
        "costs": {k: round(statistics.median(r["costs"][k] for r in runs), 3) for k in first["costs"]},
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps per run.")
    parser.add_argument("--staleness", type=int, default=2, help="schedule.max_staleness of the async arm.")
    parser.add_argument("--repeats", type=int, default=1, help="Pairs of runs, sync and async alternating.")
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="Start both arms from one supervised warm start of this many steps (bench_learning's "
        "agent budgets and difficulty-1 tasks); 0: the random-init tiny preset, as the demo.",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="Override a run config field in both arms, e.g. --set reward.shaping=0.1 (repeatable).",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds per wait.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    arms = {"sync": 0, "async": args.staleness}
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    started = time.monotonic()
    service_env: dict[str, dict[str, str]] = {"grader": {"CRUCIBLE_CONCURRENCY": str(GRADER_CONCURRENCY)}}
    overrides = list(args.overrides)
    if args.sft_steps:
        context = {"CRUCIBLE_MAX_CONTEXT": MAX_CONTEXT}
        service_env |= {
            "catalog": {"CRUCIBLE_DIFFICULTIES": "[1]", "CRUCIBLE_TASKS_PER_DIFFICULTY": "60"},
            "rollout": context,
            "trainer": context,
        }
        overrides = ["tasks.difficulties=[1]", *(f"agent.{k}={v}" for k, v in AGENT.items()), *overrides]
    with LocalStack(api_port=0, service_env=service_env) as stack:
        bench = Bench(stack, args.timeout)
        if args.sft_steps:
            sft = [
                f"sft.steps={args.sft_steps}",
                "sft.tasks=1000",
                "sft.learning_rate=3e-3",
                "schedule.max_steps=0",
            ]
            warm = bench.start("warm-start", [*overrides, *sft])
            overrides.append(f'model.init="{warm}@0"')
        for repeat in range(args.repeats):
            for arm, staleness in arms.items():
                run = bench.arm(
                    f"{arm}-{repeat}", steps=args.steps, max_staleness=staleness, overrides=overrides
                )
                results[arm].append(run)
                print(f"{arm} {repeat}: {run['seconds_per_step']:.2f} s/step", file=sys.stderr)
    report = {
        "schedule": results["sync"][0]["schedule"],
        "grader_concurrency": GRADER_CONCURRENCY,
        "rollout_replicas": 1,
        "trainer_workers": 1,
        "sft_steps": args.sft_steps,
        "overrides": overrides,
        "arms": {arm: pooled(runs) for arm, runs in results.items()},
        "minutes": round((time.monotonic() - started) / 60, 1),
    }
    report["costs"] = report["arms"]["sync"]["costs"]
    report["speedup"] = round(
        report["arms"]["sync"]["seconds_per_step"] / report["arms"]["async"]["seconds_per_step"], 3
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{'arm':>6} {'s/step':>7} {'s/step from v0':>14} {'rollout busy':>12} {'trainer busy':>12}"
        " reward per step"
    )
    for arm, r in report["arms"].items():
        print(
            f"{arm:>6} {r['seconds_per_step']:>7.2f} {r['seconds_per_step_from_v0']:>14.2f} "
            f"{r['rollout_busy']:>12.2f} {r['trainer_busy']:>12.2f} {r['reward_per_step']}"
        )
    print(f"speedup (sync s/step / async s/step): {report['speedup']}")
    print("stage costs (s, sync arm):", ", ".join(f"{k}={v}" for k, v in report["costs"].items()))


if __name__ == "__main__":
    main()
