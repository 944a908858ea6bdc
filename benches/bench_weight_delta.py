"""Weight deltas on a real model: how small an exact delta is after one RL-sized step, and how fast a
rollout replica refreshes from it, against raw S3 GETs of the same objects in the same run.

SmolLM2-135M-Instruct (from its package) in bf16 takes one AdamW step at lr 1e-6 on next-token NLL of a
page of this repository's docs; version 0 (full) and version 1 (a delta against it) are published through
the checkpoints service (in-process, on its own nats-server and a fresh SeaweedFS). Then, in alternating
blocks:

- refresh: `WeightsFollower.load(1)` on a replica that holds version 0 (manifest over the bus, delta
  shards fetched in parallel, decompressed, XORed onto the base, every tensor's sha256 checked);
- raw GET: the same delta objects read with the bare minio client at the same concurrency;
- and, for scale, a raw GET of the full snapshot's objects (what a refresh without deltas moves).

Then the swap itself, on the rollout's engine (`PolicyEngine`, SmolLM2 at the run's bf16): sequences
decode on its continuous batcher while `engine.swap(version 1)` builds the new model beside the running
one and hands it over between two decode steps. Reported: the median decode step without a swap, the
longest gap between two steps of one sequence while the swap runs, how many steps ran meanwhile, and
the swap's own time. On two cores the swap's work slows the steps it overlaps; it blocks none.

    python -m benches.bench_weight_delta --json        # [--reps 5] [--shard-mb 64] [--weights fp32-master]

`--weights fp32-master` keeps fp32 parameters (as Crucible's trainer does) and publishes their bf16 cast.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from crucible.clients.checkpoints import CONCURRENCY, PUBLISH_SHARD_BYTES, WeightsFollower, WeightsPublisher
from crucible.contracts.messages import WeightsManifest
from crucible.contracts.runconfig import RunConfig
from crucible.localstack.processes import LOOPBACK, port_open
from crucible.localstack.servers import start_nats, start_redis, start_seaweedfs
from crucible.model.hf import load_pretrained
from crucible.model.sources import load_tokenizer, package_file
from crucible.model.weight_delta import tensor_sha256
from crucible.objectstore import ObjectStore, parse_uri
from crucible.runtime import running
from crucible.telemetry import configure_logging
from services.checkpoints.app import setup
from services.checkpoints.settings import Settings
from services.rollout.engine import PolicyEngine

SOURCE = "smollm2-135m-instruct"
TEXT = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def rl_step(weights: str, tokens: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Versions 0 and 1 of the published weights (bf16), around one AdamW step at lr 1e-6."""
    torch.manual_seed(0)
    model = load_pretrained(package_file(SOURCE), dtype=torch.bfloat16)
    if weights == "bf16":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    tokenizer = load_tokenizer(f"package:{SOURCE}")
    ids = torch.tensor([tokenizer.encode(TEXT.read_text())[: tokens + 1]])

    def published() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16, copy=True) for k, v in model.state_dict().items()}

    before = published()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    logits = model(ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    optimizer.step()
    return before, published(), sum(p.numel() for p in model.parameters())


def raw_get(store: ObjectStore, manifest: WeightsManifest) -> None:
    """The manifest's objects through the bare minio client, CONCURRENCY at a time (threads)."""
    from concurrent.futures import ThreadPoolExecutor

    def get(uri: str) -> int:
        bucket, key = parse_uri(uri)
        response = store.client.get_object(bucket, key)
        try:
            return len(response.read())
        finally:
            response.close()
            response.release_conn()

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        sizes = list(pool.map(get, [s.uri for s in manifest.shards]))
    assert sizes == [s.size for s in manifest.shards]


class _Decoding:
    """A sequence that decodes greedily for `tokens` steps, stamping each step's time."""

    def __init__(self, prompt: list[int], tokens: int) -> None:
        self.tokens, self.fed, self.routes = list(prompt), 0, []
        self.left, self.stamps, self.versions = tokens, [], []

    def choose(self, logits: torch.Tensor, version: int) -> bool:
        self.stamps.append(time.perf_counter())
        self.versions.append(version)
        self.tokens.append(int(logits.argmax()))
        self.left -= 1
        return self.left == 0


def swap_pause(
    v0: dict[str, torch.Tensor], v1: dict[str, torch.Tensor], *, sequences: int = 4, tokens: int = 48
) -> dict:
    """Decode `sequences` sequences on the engine, once without a swap and once with version 1 swapped in
    while they decode (started after a few steps)."""
    import threading

    config = RunConfig.model_validate({"model": {"source": f"package:{SOURCE}"}})
    engine = PolicyEngine(config=config, max_context=512, max_sequences=sequences)
    engine.swap(v0, 0)
    prompt = load_tokenizer(config.model.source).encode(TEXT.read_text())[:32]

    def decode(swap_to: int | None) -> tuple[list[_Decoding], tuple[float, float] | None]:
        running_ = [_Decoding(prompt[: 24 + i], tokens) for i in range(sequences)]
        futures = [engine.batcher.submit(seq, seq.choose) for seq in running_]
        window = None
        if swap_to is not None:
            while len(running_[0].stamps) < 8:  # decoding has settled
                time.sleep(0.001)
            started = time.perf_counter()
            worker = threading.Thread(target=engine.swap, args=(v1, swap_to))
            worker.start()
            worker.join()
            window = (started, time.perf_counter())
        for future in futures:
            assert future.result() is None
        for seq in running_:
            engine.batcher.release(seq)
        return running_, window

    decode(None)  # warm-up
    plain, _ = decode(None)
    steps = [b - a for seq in plain for a, b in itertools.pairwise(seq.stamps[1:])]
    swapped, (start, end) = decode(1)
    gaps = [b - a for seq in swapped for a, b in itertools.pairwise(seq.stamps) if b > start and a < end]
    during = sum(1 for t in swapped[0].stamps if start < t < end)
    engine.close()
    assert all(seq.versions[-1] == 1 for seq in swapped), "the swap did not reach the decoding sequences"
    median = statistics.median(steps)
    return {
        "decode_step_median_s": round(median, 4),
        "swap_s": round(end - start, 3),
        "decode_steps_during_swap": during,
        "longest_gap_during_swap_s": round(max(gaps), 4),
        "longest_gap_over_median_step": round(max(gaps) / median, 2),
    }


async def measure(args: argparse.Namespace, settings: Settings) -> dict:
    v0, v1, params = await asyncio.to_thread(rl_step, args.weights, args.tokens)
    changed = sum(
        int((a.view(torch.int16) != b.view(torch.int16)).sum())
        for a, b in zip(v0.values(), v1.values(), strict=True)
    )
    async with running("checkpoints", settings, setup) as rt:
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        publisher = WeightsPublisher(
            bus=rt.bus, store=rt.store, run_id=run_id, shard_bytes=args.shard_mb << 20
        )
        t0 = time.perf_counter()
        full = await publisher.publish(version=0, step=0, state_dict=v0)
        t1 = time.perf_counter()
        delta = await publisher.publish(version=1, step=1, state_dict=v1)
        t2 = time.perf_counter()
        assert (full.kind, delta.kind, delta.base_version) == ("full", "delta", 0)

        t3 = time.perf_counter()
        follower = WeightsFollower(bus=rt.bus, store=rt.store, run_id=run_id)
        await follower.load(0)
        full_load_s = time.perf_counter() - t3
        _, state = await follower.load(1)
        exact = state.keys() == v1.keys() and all(
            tensor_sha256(state[n]) == tensor_sha256(t) for n, t in v1.items()
        )

        times: dict[str, list[float]] = {"refresh": [], "raw_get": [], "raw_get_full": []}
        candidates = {
            "refresh": lambda: follower.load(1),
            "raw_get": lambda: asyncio.to_thread(raw_get, rt.store, delta),
            "raw_get_full": lambda: asyncio.to_thread(raw_get, rt.store, full),
        }
        for _ in range(args.reps):
            for name, call in candidates.items():
                t = time.perf_counter()
                await call()
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(t) for name, t in times.items()}
    full_bytes, delta_bytes = (sum(s.size for s in m.shards) for m in (full, delta))
    return {
        "model": SOURCE,
        "weights": args.weights,
        "params": params,
        "changed_fraction": round(changed / sum(t.numel() for t in v1.values()), 5),
        "shards": len(full.shards),
        "full_bytes": full_bytes,
        "delta_bytes": delta_bytes,
        "delta_over_full": round(delta_bytes / full_bytes, 5),
        "exact": exact,
        "publish_full_s": round(t1 - t0, 3),
        "publish_delta_s": round(t2 - t1, 3),
        "load_full_s": round(full_load_s, 3),
        "refresh_s": round(med["refresh"], 4),
        "raw_get_s": round(med["raw_get"], 4),
        "raw_get_full_s": round(med["raw_get_full"], 4),
        "refresh_over_raw_get": round(med["refresh"] / med["raw_get"], 2),
        "refresh_over_raw_get_full": round(med["refresh"] / med["raw_get_full"], 3),
        **await asyncio.to_thread(swap_pause, v0, v1),
    }


async def main(args: argparse.Namespace) -> dict:
    configure_logging(service="bench", replica="bench", level="WARNING")
    state = Path(tempfile.mkdtemp(prefix="crucible-bench-"))
    secret = uuid.uuid4().hex
    servers = [start_nats(state_dir=state)]  # its own: the checkpoints queue group is not shared
    try:
        if port_open(host=LOOPBACK, port=6379):
            redis_url = f"redis://{LOOPBACK}:6379/0"
        else:
            servers.append(start_redis(state_dir=state))
            redis_url = servers[-1].url
        servers.append(start_seaweedfs(state_dir=state, access_key="crucible-bench", secret_key=secret))
        settings = Settings(
            nats_url=servers[0].url,
            redis_url=redis_url,
            s3_endpoint=servers[-1].endpoint,
            s3_access_key="crucible-bench",
            s3_secret_key=secret,
            s3_bucket=f"crucible-bench-{uuid.uuid4().hex[:8]}",
            log_level="WARNING",
        )
        store = ObjectStore.from_settings(settings)
        await store.ensure_bucket()
        return await measure(args, settings)
    finally:
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="tokens of the training text")
    parser.add_argument("--shard-mb", type=int, default=PUBLISH_SHARD_BYTES >> 20)
    parser.add_argument("--weights", choices=["bf16", "fp32-master"], default="bf16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    result = asyncio.run(main(args))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
