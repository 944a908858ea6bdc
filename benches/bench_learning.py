"""The coding experiment: does RL after a supervised warm start beat spending the same compute on more
supervised training, on held-out tasks? Everything runs through the real services of a local stack.

Per seed:
  1. warm start: an SFT-only run on the train split's reference solutions, evaluated on the test split
     (the common starting point of both arms, step 0; with --shared-warm-start one for every seed, so
     the seeds' spread leaves out the warm start's own);
  2. RL arm: a run from the warm start's weights (`model.init`), `--rl-steps` optimizer steps on the
     train split, evaluated on the test split every `--eval-every` versions and at the end;
  3. control arm: SFT continued from the same weights for as many trained sequences as the RL arm
     trained trajectories (steps x groups x group size), evaluated at the end.
Held-out resolved rate counts every evaluated episode (greedy and sampled); the lift's 95% interval is
Newcombe's for a difference of two proportions, over the episodes of all seeds. Nothing is tuned on the
test split: the defaults below were chosen from pilots evaluated on the validation split
(docs/benchmarks.md), before any run on the test split.

    python -m benches.bench_learning --json            # SmolLM2-135M-Instruct, 3 seeds, docs/learning.png
    python -m benches.bench_learning --seeds 1 --eval-split validation --rl-steps 6   # a pilot
    # the byte-level tiny preset (its budgets and rates; it learns the shape of an episode, not the edit):
    python -m benches.bench_learning --model tiny --observation-bytes 1000 --sft-steps 300 --sft-lr 3e-3 \\
        --rl-lr 1e-3 --control-lr 3e-3 --lora 0 --group-size 4 --temperature 1.0 --samples 2 --eval-every 2 \\
        --trainer-threads 1 --no-shared-warm-start --plot learning-tiny.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx

from crucible.localstack import LocalStack
from services.api.queries.evals import wilson  # the interval the evaluation API reports

AGENT = {"max_turns": 5, "max_action_tokens": 256, "max_observation_bytes": 1000}
"""Budgets that fit every one-line reference fix of a difficulty-1 task (the byte-level agent), and show
the policy most of the file it edits (bench_learning raises the observation budget: --observation-bytes)."""
MAX_CONTEXT = "4096"
"""Tokens per episode on the rollouts and in the trainer's demonstrations (the tiny preset's limit):
prompt, file, edit, test output and submit fit."""


def newcombe(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """95% interval of p1 - p2 (Newcombe's hybrid score method)."""
    p1, p2 = k1 / max(n1, 1), k2 / max(n2, 1)
    (l1, u1), (l2, u2) = ((r.ci_low or 0.0, r.ci_high or 1.0) for r in (wilson(k1, n1), wilson(k2, n2)))
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


class Stack:
    def __init__(self, stack: LocalStack, timeout: float) -> None:
        self.stack = stack
        self.client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
        self.timeout = timeout

    def run(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """Create a run, wait until it and its evaluations finish; the run with its evaluations."""
        run = self.client.post("/v1/runs", json={"name": name, "config": config}).raise_for_status().json()
        started = time.monotonic()
        deadline = started + self.timeout
        while time.monotonic() < deadline:
            dead = self.stack.poll()
            if dead:
                raise RuntimeError(f"service(s) exited: {dead}")
            run = self.client.get(f"/v1/runs/{run['run_id']}").raise_for_status().json()
            if run["status"] == "failed":
                raise RuntimeError(f"run {name} failed: {run['error']}")
            if run["status"] == "finished":
                evals = self.client.get(f"/v1/runs/{run['run_id']}/evals", params={"limit": 100}).json()[
                    "items"
                ]
                if evals and all(e["status"] in ("finished", "failed") for e in evals):
                    return {**run, "evals": evals, "seconds": round(time.monotonic() - started, 1)}
            time.sleep(2.0)
        raise TimeoutError(f"run {name} did not finish in {self.timeout} s")

    def train_resolved(self, run: dict[str, Any]) -> list[dict[str, float]]:
        """The run's resolved rate on its own training episodes, per step."""
        items = self.client.get(f"/v1/runs/{run['run_id']}/steps", params={"limit": 500}).json()["items"]
        return [{"step": s["step"], "resolved": s["metrics"].get("resolved_rate", 0.0),
                 "reward": s["metrics"].get("reward_mean", 0.0),
                 **{k: v for k, v in s["metrics"].items() if k.startswith("tokens_")}}
                for s in items]  # fmt: skip

    def tasks_of(self, run: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
        """Per task, [resolved, episodes] of the run's training episodes and of its last evaluation."""
        last = {"eval_id": run["evals"][-1]["eval_id"]} if run["evals"] else None
        return {"train": self._tally(run, {}), "eval": self._tally(run, last) if last else {}}

    def _tally(self, run: dict[str, Any], params: dict[str, str]) -> dict[str, list[int]]:
        counts: dict[str, list[int]] = {}
        cursor = None
        while True:
            query = {**params, "limit": 200, **({"cursor": cursor} if cursor else {})}
            page = self.client.get(f"/v1/runs/{run['run_id']}/trajectories", params=query)
            for t in page.raise_for_status().json()["items"]:
                tally = counts.setdefault(t["task_id"], [0, 0])
                tally[0] += int(t["resolved"])
                tally[1] += 1
            cursor = page.json()["next_cursor"]
            if cursor is None:
                return counts

    def steps_of(self, run: dict[str, Any]) -> dict[int, int]:
        """version -> optimizer step it was published at."""
        items = self.client.get(f"/v1/runs/{run['run_id']}/checkpoints", params={"limit": 500}).json()[
            "items"
        ]
        return {c["version"]: c["step"] for c in items}


def point(e: dict[str, Any]) -> dict[str, Any]:
    r = e["resolved_rate"]
    n = r["n"]
    return {"resolved": r["value"] or 0.0, "k": round((r["value"] or 0.0) * n), "n": n,
            "pass_at_1": e["pass_at_1"]["value"]}  # fmt: skip


def one_seed(
    stack: Stack, seed: int, args: argparse.Namespace, warm: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One seed's warm start (or the shared one, `warm`), RL arm and control arm."""
    base, sft = base_config(args, seed), sft_config(args)
    # Both arms start from the warm start's weights; with --lora both train adapters on them.
    arm_model = {"source": args.model, "init": None}
    if args.lora:
        arm_model["lora"] = {"rank": args.lora, "alpha": 2.0 * args.lora}
    if warm is None:
        warm = warm_start(stack, args, seed)
    start = point(warm["evals"][-1])
    arm_model["init"] = f"{warm['run_id']}@0"
    schedule = {"group_size": args.group_size, "groups_per_step": args.groups, "max_steps": args.rl_steps,
                "publish_every": 2, "max_staleness": 1}  # fmt: skip
    rl = stack.run(f"rl-{seed}", {
        **base, "model": arm_model, "schedule": schedule,
        "reward": {"shaping": args.shaping}, "optim": {"learning_rate": args.rl_lr},
        "eval": {**base["eval"], "every_versions": args.eval_every},
    })  # fmt: skip
    steps = stack.steps_of(rl)
    rl_curve = [
        {"step": 0, **start},
        *sorted(
            (
                {"step": steps.get(e["version"], e["version"]), **point(e)}
                for e in rl["evals"]
                if e["status"] == "finished"
            ),
            key=lambda p: p["step"],
        ),
    ]
    sequences = args.rl_steps * args.groups * args.group_size
    control = stack.run(f"control-{seed}", {
        **base, "model": arm_model, "schedule": {"max_steps": 0},
        "sft": {**sft, "steps": max(1, sequences // args.batch),
                "learning_rate": args.control_lr or args.sft_lr},
    })  # fmt: skip
    control_curve = [{"step": 0, **start}, {"step": args.rl_steps, **point(control["evals"][-1])}]
    return {
        "seed": seed,
        "model": args.model,
        "warm_start": warm["warm_start"],
        "rl": rl_curve,
        "control": control_curve,
        "rl_train": stack.train_resolved(rl),
        "tasks": {"warm": stack.tasks_of(warm), "rl": stack.tasks_of(rl), "control": stack.tasks_of(control)},
        "runs": {"warm": warm["run_id"], "rl": rl["run_id"], "control": control["run_id"]},
        "seconds": {"warm": warm["seconds"], "rl": rl["seconds"], "control": control["seconds"]},
    }


def base_config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """What every run of a seed shares."""
    return {
        "seed": seed,
        "model": {"source": args.model},
        "tasks": {"taskset": "pybugs", "difficulties": [1], "sampling": args.sampling},
        "agent": {**AGENT, "max_observation_bytes": args.observation_bytes, "temperature": args.temperature},
        "eval": {"split": args.eval_split, "samples": args.samples, "max_tasks": 1000, "at_end": True},
    }


def sft_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"tasks": 1000, "batch_size": args.batch, "learning_rate": args.sft_lr}


def warm_start(stack: Stack, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """An SFT-only run on the train split's demonstrations, evaluated: the arms' common start."""
    config = {**base_config(args, seed), "sft": {**sft_config(args), "steps": args.sft_steps},
              "schedule": {"max_steps": 0}}  # fmt: skip
    return stack.run(f"warm-{seed}", config)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, train) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for i, r in enumerate(results):
        train.plot(
            [p["step"] for p in r["rl_train"]],
            [p["resolved"] for p in r["rl_train"]],
            color="tab:blue",
            alpha=0.8,
            label="RL arm" if i == 0 else None,
        )
    train.set_xlabel("RL optimizer step")
    train.set_ylabel("resolved rate of the step's training episodes")
    train.set_ylim(-0.02, 1.02)
    train.set_title("train split (what RL sees)")
    train.legend()
    for arm, colour in (("rl", "tab:blue"), ("control", "tab:orange")):
        for i, r in enumerate(results):
            xs, ys = [p["step"] for p in r[arm]], [p["resolved"] for p in r[arm]]
            label = ("RL after warm start" if arm == "rl" else "SFT continued (control)") if i == 0 else None
            ax.plot(xs, ys, marker="o", color=colour, alpha=0.8, label=label)
    ax.set_xlabel("optimizer steps after the warm start (control: same trained sequences)")
    ax.set_ylabel("held-out resolved rate (test split)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"held-out test split: {results[0]['model']}, pybugs difficulty 1, {len(results)} seeds")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--model", default="package:smollm2-135m-instruct", help="model.source, or tiny.")
    parser.add_argument("--torch-threads", type=int, default=1, help="Per rollout and trainer process.")
    parser.add_argument(
        "--trainer-threads",
        type=int,
        default=2,
        help="The trainer's (its warm start runs alone; RL shares the cores with the rollout).",
    )
    parser.add_argument(
        "--tasks-per-difficulty", type=int, default=60, help="Generated difficulty-1 tasks (1/5 test)."
    )
    parser.add_argument("--sft-steps", type=int, default=16)
    parser.add_argument("--sft-lr", type=float, default=3e-5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rl-steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument(
        "--eval-every", type=int, default=0, help="RL evaluations every this many versions (0: at the end)."
    )
    parser.add_argument(
        "--shaping",
        type=float,
        default=0.0,
        help="reward.shaping of the RL arm: pays successful tool calls of an episode that changed the "
        "repository.",
    )
    parser.add_argument("--rl-lr", type=float, default=2e-4, help="optim.learning_rate of the RL arm.")
    parser.add_argument(
        "--lora", type=int, default=8, help="model.lora rank of both arms (alpha 2 x rank); 0: every weight."
    )
    parser.add_argument(
        "--sampling", choices=("uniform", "learnable"), default="uniform", help="tasks.sampling of every run."
    )
    parser.add_argument("--temperature", type=float, default=0.3, help="agent.temperature of every run.")
    parser.add_argument(
        "--observation-bytes",
        type=int,
        default=2000,
        help="agent.max_observation_bytes: at 1000 the buggy line of 5 of the 46 train and validation tasks "
        "falls in the cut middle of the file the policy reads, at 2000 none.",
    )
    parser.add_argument(
        "--control-lr", type=float, default=2e-4, help="sft.learning_rate of the control arm."
    )
    parser.add_argument("--samples", type=int, default=1, help="Sampled evaluation episodes per task.")
    parser.add_argument(
        "--eval-split",
        choices=("validation", "test"),
        default="test",
        help="Held-out split the arms are evaluated on: validation to choose settings, test to report.",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="Seconds per run.")
    parser.add_argument("--plot", type=Path, default=Path("docs/learning.png"))
    parser.add_argument(
        "--shared-warm-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="One warm start for every seed (the seeds vary the arms): a third of the warm-start time.",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    catalog = {
        "CRUCIBLE_TASKS_PER_DIFFICULTY": str(args.tasks_per_difficulty),
        "CRUCIBLE_DIFFICULTIES": "[1]",
    }
    context = {"CRUCIBLE_MAX_CONTEXT": MAX_CONTEXT, "CRUCIBLE_TORCH_THREADS": str(args.torch_threads)}
    # A wave of a step's SmolLM2 episodes runs past the trainer's default 180 s before anything is graded
    # on 2 cores; a shorter wait would take the groups in flight for lost and admit more.
    trainer = {**context, "CRUCIBLE_TORCH_THREADS": str(args.trainer_threads),
               "CRUCIBLE_GROUP_TIMEOUT_S": "900"}  # fmt: skip
    with LocalStack(
        api_port=0, service_env={"catalog": catalog, "rollout": context, "trainer": trainer}
    ) as local:
        stack = Stack(local, args.timeout)
        # --shared-warm-start: one warm start (seed 0) that both arms of every seed start from
        shared = warm_start(stack, args, 0) if args.shared_warm_start else None
        results = [one_seed(stack, seed, args, shared) for seed in range(args.seeds)]
    final = {arm: [r[arm][-1] for r in results] for arm in ("rl", "control")}
    k1, n1 = sum(p["k"] for p in final["rl"]), sum(p["n"] for p in final["rl"])
    k2, n2 = sum(p["k"] for p in final["control"]), sum(p["n"] for p in final["control"])
    low, high = newcombe(k1, n1, k2, n2)
    plot(results, args.plot)
    summary = {
        "rl_resolved": round(k1 / max(n1, 1), 4),
        "control_resolved": round(k2 / max(n2, 1), 4),
        "rl_train_resolved_first_last": [
            [r["rl_train"][0]["resolved"], r["rl_train"][-1]["resolved"]] for r in results if r["rl_train"]
        ],
        "rl_train_reward_first_last": [
            [r["rl_train"][0]["reward"], r["rl_train"][-1]["reward"]] for r in results if r["rl_train"]
        ],
        "start_resolved": round(
            sum(r["rl"][0]["k"] for r in results) / max(sum(r["rl"][0]["n"] for r in results), 1), 4
        ),
        "lift_points": round(100 * (k1 / max(n1, 1) - k2 / max(n2, 1)), 2),
        "lift_ci_low": round(100 * low, 2),
        "lift_ci_high": round(100 * high, 2),
        "episodes_per_arm": [n1, n2],
        "seeds": args.seeds,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "plot": str(args.plot),
        "per_seed": results,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key in ("rl_resolved", "control_resolved", "start_resolved", "rl_train_resolved_first_last",
                    "rl_train_reward_first_last", "lift_points", "lift_ci_low", "lift_ci_high",
                    "episodes_per_arm", "minutes", "plot"):  # fmt: skip
            print(f"{key:>18}: {summary[key]}")


if __name__ == "__main__":
    main()
