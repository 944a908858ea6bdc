"""LoRA (model.lora) against full fine-tuning for SmolLM2-135M-Instruct, measured in the same run: the
trainer's RL step (PolicyRank.train, one rank) on the same SmolLM2 chat episodes, its peak resident
memory, its time, and the bytes of the version it publishes: the zstd-compressed XOR delta against the
version before, per 64 MiB shard, as the trainer's publisher encodes it (crucible.clients.checkpoints),
over the fp32 weights the trainer holds. Each arm runs in a fresh process, so its peak RSS is its own.

    python -m benches.bench_lora --json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from benches.bench_trainer_memory import MODEL, episodes, rss_bytes


def arm(name: str, count: int, tokens: int, steps: int) -> dict:
    """`steps` RL steps of arm `name` ("full" or "lora") in this process."""
    import torch.distributed as dist

    from crucible.clients.checkpoints import PUBLISH_SHARD_BYTES
    from crucible.contracts.runconfig import RunConfig
    from crucible.model.lora import is_adapter
    from crucible.model.shards import plan_shards
    from crucible.model.spec import PolicySpec
    from crucible.model.weight_delta import encode_delta
    from services.trainer.group import slices
    from services.trainer.policy import PolicyRank

    lora = name == "lora"
    config = RunConfig.model_validate({
        "model": {"source": MODEL, "lora": {} if lora else None},  # rank 8, alpha 16, every projection
        "optim": {"learning_rate": 1e-4 if lora else 1e-6},
    })  # fmt: skip
    trajectories, advantages = episodes(count, tokens)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank = PolicyRank(config, PolicySpec.resolve(config))
    (part,) = slices(trajectories, advantages, world_size=1)
    start = rank.weights()
    assert start is not None  # rank 0
    before = {k: v.clone() for k, v in start.items()}  # version 0, as published (on CPU: the parameters)
    floor = rss_bytes()
    t0 = time.perf_counter()
    losses = [float(rank.train(part)["loss"]) for _ in range(steps)]
    seconds = (time.perf_counter() - t0) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    after = rank.weights()
    assert after is not None  # rank 0
    sizes = {n: t.numel() * t.element_size() for n, t in after.items()}
    delta = sum(
        len(encode_delta([after[n] for n in names], [before[n] for n in names]))
        for names in plan_shards(sizes=sizes, shard_bytes=PUBLISH_SHARD_BYTES)
    )
    trained = [p for p in rank.model.parameters() if p.requires_grad]
    return {
        "arm": name, "episodes": count, "tokens": sum(len(t.tokens) // 4 for t in trajectories),
        "losses": losses, "step_seconds": round(seconds, 1),
        "trained_parameters": sum(p.numel() for p in trained),
        "adapter_bytes": sum(sizes[n] for n in sizes if is_adapter(n)),
        "weights_bytes": sum(sizes.values()), "version_bytes": delta,
        "peak_rss_gb": peak / 2**30, "loaded_rss_gb": floor / 2**30,
        "base_unchanged": all(torch.equal(after[n], before[n]) for n in after if not is_adapter(n)),
    }  # fmt: skip


def run_arm(name: str, count: int, tokens: int, steps: int) -> dict:
    command = [sys.executable, "-m", "benches.bench_lora", "--arm", name]
    command += ["--episodes", str(count), "--tokens", str(tokens), "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"arm": name, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=2, help="RL steps per arm (A moves from the second)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--arm", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm, args.episodes, args.tokens, args.steps)))
        return
    full, lora = (run_arm(a, args.episodes, args.tokens, args.steps) for a in ("full", "lora"))
    result = {"model": MODEL, "full": full, "lora": lora}
    if "error" not in full and "error" not in lora:
        result |= {
            "lora_version_fraction": lora["version_bytes"] / lora["weights_bytes"],
            "full_version_fraction": full["version_bytes"] / full["weights_bytes"],
            "step_time_ratio": lora["step_seconds"] / full["step_seconds"],
            "peak_rss_saved_gb": full["peak_rss_gb"] - lora["peak_rss_gb"],
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for r in (full, lora):
        print(r)
    print({k: v for k, v in result.items() if k not in ("full", "lora")})


if __name__ == "__main__":
    main()
