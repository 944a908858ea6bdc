"""RL sanity: a tiny policy from random initialisation learns a choice that chance sometimes gets right.

The prompt names one of the agent's tools ("use grep #417"); the reward is 1 when the policy's action
calls that tool. Sampling runs through the rollout's engine (constrained decoding, per-token versions
and behaviour logprobs, router replay), training through the trainer service's worker group (one rank)
with the run config's loss and advantages, and the sampler's weights lag the trainer's (a new version every
`publish_every` steps), so the importance ratios and staleness are exercised as in a real run.

Held-out accuracy is the greedy choice on 60 prompts whose numbers never occur in training (10 per
tool, so any policy that ignores the prompt scores 1/6). The control arm shuffles the rewards within
each group: the same compute, no signal.

    python -m benches.bench_rl_sanity --json                      # ppo, 3 seeds, RL vs control
    python -m benches.bench_rl_sanity --loss ppo cispo decoupled  # steps to a fixed accuracy per loss
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass

import torch

from crucible.agent import grammar, tokenizer
from crucible.agent.episode import packed_arrays
from crucible.contracts.messages import GradedTrajectory, Reward, Trajectory
from crucible.contracts.runconfig import RunConfig
from crucible.model import Transformer
from crucible.model.sources import initial_model
from crucible.rl.advantages import group_advantages
from services.rollout.engine import PolicyEngine
from services.trainer.group import PolicyGroup

TOOLS = tokenizer.TOOLS
TRAIN_NUMBERS = range(0, 500)
HELD_OUT_NUMBERS = range(500, 1000)


def prompt(tool: str, number: int) -> list[int]:
    return [tokenizer.BOS, *tokenizer.encode(f"use {tool} #{number}"), tokenizer.ACT]


def held_out_prompts(seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(10_000 + seed)
    return [(tool, prompt(tool, rng.choice(HELD_OUT_NUMBERS))) for tool in TOOLS for _ in range(10)]


async def act(engine: PolicyEngine, state, generator: torch.Generator) -> str | None:
    """One action of a one-action episode."""
    name, _, _ = await engine.sample_action(state, generator=generator)
    state.append_env([tokenizer.EOS], engine.version)
    await engine.finish(state)
    engine.release(state)
    return name


@torch.no_grad()
def greedy_accuracy(model: Transformer, prompts: list[tuple[str, list[int]]], *, temperature: float) -> float:
    """Fraction of prompts whose most likely tool (under the tool-token constraint) is the one named."""
    model.eval()
    hits = 0
    for tool, tokens in prompts:
        logits = model(torch.tensor([tokens])).logits[0, -1]
        logp = grammar.constrained_logprobs(logits, torch.tensor(grammar.TOOL), temperature=temperature)
        hits += tokenizer.tool_name(int(logp.argmax())) == tool
    return hits / len(prompts)


@dataclass(frozen=True, kw_only=True)
class ArmResult:
    loss: str
    seed: int
    control: bool
    accuracy: list[tuple[int, float]]  # (step, held-out accuracy)
    seconds: float

    @property
    def start(self) -> float:
        return self.accuracy[0][1]

    @property
    def end(self) -> float:
        return self.accuracy[-1][1]

    def steps_to(self, target: float) -> int | None:
        return next((step for step, acc in self.accuracy if acc >= target), None)


def sanity_config(*, loss: str, seed: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": seed,
            "agent": {"max_action_tokens": 1, "temperature": 1.0},
            "optim": {"loss": loss, "learning_rate": 3e-3},
            "schedule": {"group_size": 8, "groups_per_step": 6, "publish_every": 2, "max_staleness": 1},
        }
    )


def run_arm(*, loss: str, seed: int, steps: int, control: bool, eval_every: int = 10) -> ArmResult:
    started = time.perf_counter()
    config = sanity_config(loss=loss, seed=seed)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = initial_model(config.model.source, seed=seed, precision=config.model.precision)  # for evaluation
    policy = PolicyGroup(config, timeout_s=300)  # the trainer service's worker group, one rank
    engine = PolicyEngine(config=config, max_context=64)
    version = 0
    engine.swap({k: v.detach().clone() for k, v in model.state_dict().items()}, version)
    held_out = held_out_prompts(seed)
    temperature = config.agent.temperature
    accuracy = [(0, greedy_accuracy(model, held_out, temperature=temperature))]
    generator = torch.Generator().manual_seed(seed)
    schedule = config.schedule
    for step in range(1, steps + 1):
        graded: list[GradedTrajectory] = []
        advantages: list[float] = []
        for _ in range(schedule.groups_per_step):
            target = rng.choice(TOOLS)
            number = rng.choice(TRAIN_NUMBERS)
            group, rewards = [], []
            for _ in range(schedule.group_size):
                state = engine.new_episode()
                state.append_env(prompt(target, number), engine.version)
                name = asyncio.run(act(engine, state, generator))
                rewards.append(1.0 if name == target else 0.0)
                group.append(Trajectory(
                    run_id="sanity", trajectory_id=f"{step}-{len(graded) + len(group)}", group_id=f"{step}",
                    task_id=target, taskset="sanity", **packed_arrays(state),
                ))  # fmt: skip
            if control:
                rng.shuffle(rewards)
            advantages += group_advantages(torch.tensor(rewards), estimator=config.optim.advantage).tolist()
            graded += [
                GradedTrajectory(
                    trajectory=t, reward=Reward(total=r, tests_passed=0, tests_total=0), graded_at=0.0
                )
                for t, r in zip(group, rewards, strict=True)
            ]
        policy.train([g.trajectory for g in graded], advantages)
        publish, evaluate = step % schedule.publish_every == 0, step % eval_every == 0 or step == steps
        if publish or evaluate:
            model.load_state_dict(policy.weights())
        if publish:  # the sampler lags: up to publish_every - 1 steps stale
            version += 1
            engine.swap({k: v.detach().clone() for k, v in model.state_dict().items()}, version)
        if evaluate:
            accuracy.append((step, greedy_accuracy(model, held_out, temperature=temperature)))
    policy.close()
    return ArmResult(
        loss=loss, seed=seed, control=control, accuracy=accuracy, seconds=time.perf_counter() - started
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", nargs="+", default=["ppo"], choices=["ppo", "cispo", "decoupled"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.8, help="held-out accuracy for steps-to-target")
    parser.add_argument("--no-control", action="store_true", help="skip the shuffled-reward arm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for loss in args.loss:
        for seed in args.seeds:
            for control in [False] if args.no_control else [False, True]:
                arm = run_arm(loss=loss, seed=seed, steps=args.steps, control=control)
                rows.append({
                    "loss": loss, "seed": seed, "arm": "control" if control else "rl",
                    "start": arm.start, "end": arm.end, "lift_points": 100 * (arm.end - arm.start),
                    "steps_to_target": arm.steps_to(args.target), "seconds": round(arm.seconds, 1),
                    "curve": arm.accuracy,
                })  # fmt: skip
                if not args.json:
                    r = rows[-1]
                    print(
                        f"{loss:9s} seed {seed} {r['arm']:7s} held-out {r['start']:.2f} -> {r['end']:.2f} "
                        f"({r['lift_points']:+.0f} points), steps to {args.target:.0%}: "
                        f"{r['steps_to_target']}, {r['seconds']} s"
                    )
    if args.json:
        print(json.dumps({"target": args.target, "steps": args.steps, "arms": rows}, indent=2))


if __name__ == "__main__":
    main()
