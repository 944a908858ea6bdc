"""The rollout path as a whole against its engine, on a pretrained model (SmolLM2-135M-Instruct from its
package), measured in one run on the same weights:

- episodes: B real episodes of the builtin agent (the chat template, every action token sampled at
  temperature 1 under the tool-call grammar, tool calls in real sandboxes of the sandbox service, their
  results prefilled as observations), T generated pybugs tasks x G episodes each, all admitted together
  as the rollout admits a step's groups, on the rollout's PolicyEngine; with --waves W, W x T x G
  episodes through T x G slots, each finished episode's slot taken by the next (a run's steady state:
  the rollout admits the next groups as slots free);
- raw: the same engine's batcher with nothing of an episode around it: B sequences, each one of the
  episodes' own prompts, decoding as many tokens as the episodes sampled on average, sampled from the
  plain softmax (no grammar), all at once.

The ratio is the episodes' sampled tokens per second over the raw decode's, both counted from the first
token to the last (the episodes' sandboxes are made before the clock starts; their tool calls and
observation prefills are inside it). The engine's own accounts say where the episodes' time went:
model forwards, the per-token `choose` (grammar mask, log-softmax, sampling), and neither (the
sequences all waiting on tools, or the event loop). Starts its own nats-server, Redis, SeaweedFS and
an in-process sandbox service (as root: bubblewrap, overlays and cgroups, as in production).

    python -m benches.bench_rollout --json              # --tasks 4 --group 4 --reps 2 --threads 2
    python -m benches.bench_rollout --tasks 8 --group 4 --waves 3 --json    # steady state, 32 slots
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from benches.bench_engine import Seq
from crucible.agent.episode import run_episode
from crucible.bus import Bus
from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts.messages import TaskSpec, Trajectory
from crucible.contracts.packing import unpack
from crucible.contracts.runconfig import RunConfig
from crucible.localstack.servers import start_nats, start_redis, start_seaweedfs
from crucible.model.batcher import BatcherStats, ContinuousBatcher
from crucible.model.sampling import sample
from crucible.runtime import running
from crucible.telemetry import configure_logging
from services.catalog.generator import generate_task
from services.catalog.snapshots import tarball
from services.rollout.engine import PolicyEngine
from services.sandbox.app import setup
from services.sandbox.settings import Settings

SOURCE = "package:smollm2-135m-instruct"
AGENT = {"max_turns": 4, "max_action_tokens": 128, "max_observation_bytes": 1000}
MAX_CONTEXT = 4096


def stats_delta(after: BatcherStats, before: BatcherStats) -> dict[str, float]:
    return {k: getattr(after, k) - getattr(before, k) for k in vars(after)}


async def episodes(
    engine: PolicyEngine,
    config: RunConfig,
    client: SandboxClient,
    tasks: list[TaskSpec],
    group: int,
    waves: int,
    rep: int,
) -> tuple[float, list[Trajectory], dict[str, float]]:
    """Seconds for `waves` x every task's group of episodes, with at most one wave's episodes in flight
    (a finished episode's slot goes to the next, as the rollout's slots do in a run); the trajectories;
    what the engine's batcher counted meanwhile."""
    sessions: list[tuple[TaskSpec, SandboxSession]] = []
    for _ in range(waves):
        for task in tasks:
            async with await client.create(
                run_id="bench", task_id=task.task_id, snapshot=task.snapshot, ttl_s=900
            ) as prepared:
                sessions.extend((task, s) for s in await prepared.fork(group, ttl_s=900))
    slots = asyncio.Semaphore(len(tasks) * group)

    async def one(i: int, task: TaskSpec, session: SandboxSession) -> Trajectory:
        async with slots, session:
            return await run_episode(
                engine=engine, config=config, task=task, session=session, run_id="bench",
                group_id=task.task_id, seed=1000 * rep + i, replica="bench", tool_timeout_s=10.0,
            )  # fmt: skip

    before = BatcherStats(**vars(engine.batcher.stats))
    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i, t, s) for i, (t, s) in enumerate(sessions)))
    seconds = time.perf_counter() - t0
    return seconds, list(done), stats_delta(engine.batcher.stats, before)


def raw(model, prompts: list[list[int]], new: int, temperature: float, seed: int) -> tuple[float, dict]:
    """Seconds for `new` tokens after each prompt, sampled from the plain softmax, all together."""
    batcher = ContinuousBatcher(max_context=MAX_CONTEXT, max_slots=len(prompts))
    batcher.swap(model, 0)
    warm = Seq([1, 2])
    batcher.run(warm, None)  # allocates the slots before the clock starts
    batcher.release(warm)
    generator = torch.Generator().manual_seed(seed)
    seqs = [Seq(list(p)) for p in prompts]

    def sampler(seq: Seq):
        stop = len(seq.tokens) + new

        def choose(logits: torch.Tensor, version: int) -> bool:
            seq.tokens.append(sample(torch.log_softmax(logits.float() / temperature, dim=-1), generator))
            return len(seq.tokens) >= stop

        return choose

    t0 = time.perf_counter()
    errors = [f.result() for f in [batcher.submit(s, sampler(s)) for s in seqs]]
    seconds = time.perf_counter() - t0
    assert not any(errors), errors
    stats = vars(batcher.stats).copy()
    batcher.close()
    return seconds, stats


async def main(args: argparse.Namespace) -> dict:
    configure_logging(service="bench", replica="bench", level="WARNING")
    torch.set_num_threads(args.threads)
    config = RunConfig.model_validate({"model": {"source": SOURCE}, "agent": AGENT})
    # room to grow past the slots' bound; `cache_slots` says whether it did (a sequence outliving its
    # episode would)
    engine = PolicyEngine(config=config, max_context=MAX_CONTEXT, max_sequences=2 * args.tasks * args.group)
    from crucible.model.hf import load_pretrained
    from crucible.model.sources import package_file

    engine.swap(load_pretrained(package_file(SOURCE.removeprefix("package:"))).state_dict(), 0)
    model = engine.batcher.model
    generated = [generate_task(seed=0, difficulty=1, index=i, taskset="pybugs") for i in range(args.tasks)]

    state = Path(tempfile.mkdtemp(prefix="crucible-bench-"))
    root = Path(tempfile.mkdtemp(prefix="crucible-bench-sandbox-"))
    root.chmod(0o711)  # the unprivileged sandbox uid must traverse it
    servers = []
    try:
        servers.append(start_nats(state_dir=state))  # its own: no other replica takes our creates
        nats_url = servers[-1].url
        servers.append(start_redis(state_dir=state))
        redis_url = servers[-1].url
        secret = uuid.uuid4().hex
        servers.append(start_seaweedfs(state_dir=state, access_key="crucible-bench", secret_key=secret))
        name = f"bench-{uuid.uuid4().hex[:8]}"
        settings = Settings(
            nats_url=nats_url, redis_url=redis_url, s3_endpoint=servers[-1].endpoint,
            s3_access_key="crucible-bench", s3_secret_key=secret, s3_bucket=f"crucible-{name}",
            workspace_root=root / "service", replica=name, max_sessions=256, log_level="WARNING",
        )  # fmt: skip
        async with running("sandbox", settings, setup) as rt:
            tasks = []
            for g in generated:
                snapshot = await rt.store.put_bytes(
                    f"bench/{g.task_id}.tar.gz", tarball(g.files), content_type="application/gzip"
                )
                tasks.append(TaskSpec(task_id=g.task_id, taskset=g.taskset, difficulty=g.difficulty,
                                      statement=g.statement, snapshot=snapshot))  # fmt: skip
            bus = await Bus.connect(settings, store=rt.store, name="bench-client")
            client = SandboxClient(bus)
            results: dict[str, list] = {"episodes": [], "raw": []}
            try:
                for rep in range(args.reps):  # alternating, so that drift hits both
                    seconds, trajectories, stats = await episodes(
                        engine, config, client, tasks, args.group, args.waves, rep
                    )
                    sampled = [sum(unpack("u8", t.loss_mask)) for t in trajectories]
                    prompts = [unpack("u32", t.tokens)[: t.token_usage.system + t.token_usage.task]
                               for t in trajectories if t.token_usage is not None]  # fmt: skip
                    prompts = prompts[: args.tasks * args.group]  # the raw decode runs one batch
                    new = max(1, round(statistics.mean(sampled)))
                    results["episodes"].append({
                        "seconds": seconds, "sampled": sum(sampled), "tokens_per_s": sum(sampled) / seconds,
                        "finish": [t.finish_reason for t in trajectories],
                        "tool_calls": sum(len(t.tool_calls) for t in trajectories),
                        "tool_seconds": sum(c.duration_s for t in trajectories for c in t.tool_calls),
                        "in_flight_mean": sum(t.finished_at - t.started_at for t in trajectories) / seconds,
                        "usage_mean": {k: statistics.mean(getattr(t.token_usage, k) for t in trajectories)
                                       for k in ("system", "task", "observations", "actions")},
                        **stats,
                    })  # fmt: skip
                    raw_seconds, raw_stats = await asyncio.to_thread(
                        raw, model, prompts, new, config.agent.temperature, rep
                    )
                    total = new * len(prompts)
                    results["raw"].append({"seconds": raw_seconds, "sampled": total,
                                           "tokens_per_s": total / raw_seconds, **raw_stats})  # fmt: skip
            finally:
                await bus.close()
    finally:
        cache_slots = engine.batcher.cache_slots
        engine.close()
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    ep = statistics.median(r["tokens_per_s"] for r in results["episodes"])
    rw = statistics.median(r["tokens_per_s"] for r in results["raw"])
    return {
        "model": SOURCE,
        "batch": args.tasks * args.group,
        "tasks": args.tasks,
        "group": args.group,
        "waves": args.waves,
        "threads": args.threads,
        "episodes_tokens_per_s": round(ep, 2),
        "raw_tokens_per_s": round(rw, 2),
        "episodes_over_raw": round(ep / rw, 3),
        "cache_slots": cache_slots,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "reps": results,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4, help="tasks (T), one group each")
    parser.add_argument("--group", type=int, default=4, help="episodes per task (G)")
    parser.add_argument(
        "--waves",
        type=int,
        default=1,
        help="episodes per rep: this many x T x G, at most T x G in flight (1: one wave, all at once)",
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    summary = asyncio.run(main(args))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            if key != "reps":
                print(f"{key:24s} {value}")
