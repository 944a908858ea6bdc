"""Bus throughput for trajectory-sized messages: the Crucible bus layer vs raw nats-py, same run.

Both publish the same encoded trajectory to JetStream and wait for each ack; the bus layer adds
encoding, claim-check size checks and de-duplication ids. Then both consume the messages back through a
durable pull consumer with explicit acks. Prints messages/s for each and the ratio bus/raw.

    python benches/bench_bus.py [--messages 2000] [--tokens 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from crucible.bus import Bus
from crucible.contracts import encode, subjects
from crucible.contracts.messages import Trajectory
from crucible.contracts.packing import pack
from crucible.localstack.servers import start_nats
from crucible.settings import CommonSettings


def make_trajectory(tokens: int) -> Trajectory:
    return Trajectory(
        run_id="bench",
        trajectory_id=uuid.uuid4().hex,
        group_id="g",
        task_id="t",
        taskset="pybugs",
        tokens=pack("u32", [i % 256 for i in range(tokens)]),
        logprobs=pack("f32", [-0.5] * tokens),
        versions=pack("u32", [3] * tokens),
        loss_mask=pack("u8", [1] * tokens),
        constraints=pack("u8", [2] * tokens),
    )


async def raw_round(url: str, payloads: list[bytes], name: str) -> tuple[float, float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    t0 = time.perf_counter()
    for i, data in enumerate(payloads):
        await js.publish(f"rollouts.{name}", data, headers={"Nats-Msg-Id": f"{name}-{i}"})
    publish_s = time.perf_counter() - t0
    config = ConsumerConfig(
        durable_name=name, ack_policy=AckPolicy.EXPLICIT, filter_subject=f"rollouts.{name}"
    )
    sub = await js.pull_subscribe(f"rollouts.{name}", durable=name, stream=subjects.ROLLOUTS, config=config)
    t0, got = time.perf_counter(), 0
    while got < len(payloads):
        for msg in await sub.fetch(min(64, len(payloads) - got), timeout=5):
            await msg.ack()
            got += 1
    consume_s = time.perf_counter() - t0
    await nc.close()
    return publish_s, consume_s


async def bus_round(url: str, messages: list[Trajectory], name: str) -> tuple[float, float]:
    bus = await Bus.connect(CommonSettings(nats_url=url), name="bench")
    t0 = time.perf_counter()
    for m in messages:
        await bus.publish(f"rollouts.{name}", m, msg_id=f"{name}-{m.trajectory_id}")
    publish_s = time.perf_counter() - t0
    stop, got = asyncio.Event(), 0

    async def handler(message: Trajectory, delivery) -> None:
        nonlocal got
        got += 1
        if got == len(messages):
            stop.set()

    t0 = time.perf_counter()
    await bus.consume(
        stream=subjects.ROLLOUTS,
        durable=name,
        filter_subject=f"rollouts.{name}",
        handler=handler,
        message_type=Trajectory,
        stop=stop,
        batch=64,
    )
    consume_s = time.perf_counter() - t0
    await bus.close()
    return publish_s, consume_s


async def main(messages: int, tokens: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as state:
        server = start_nats(state_dir=Path(state))
        try:
            setup = await Bus.connect(CommonSettings(nats_url=server.url), name="bench-setup")
            await setup.ensure_streams()
            await setup.close()
            trajectories = [make_trajectory(tokens) for _ in range(messages)]
            payloads = [encode(t) for t in trajectories]
            size = len(payloads[0])
            raw, bus = [], []
            for r in range(rounds):  # alternate who goes first, so drift on a shared machine hits both alike
                if r % 2:
                    bus.append(await bus_round(server.url, trajectories, f"bus{r}"))
                    raw.append(await raw_round(server.url, payloads, f"raw{r}"))
                else:
                    raw.append(await raw_round(server.url, payloads, f"raw{r}"))
                    bus.append(await bus_round(server.url, trajectories, f"bus{r}"))
            raw_pub, raw_con = (statistics.median(x) for x in zip(*raw, strict=True))
            bus_pub, bus_con = (statistics.median(x) for x in zip(*bus, strict=True))
        finally:
            server.stop()
    print(
        f"{messages} trajectories of {tokens} tokens ({size / 1024:.1f} KiB each), median of {rounds} rounds"
    )
    print(
        f"publish (ack per message): raw {messages / raw_pub:8.0f} msg/s"
        f"   bus {messages / bus_pub:8.0f} msg/s   bus/raw {raw_pub / bus_pub:.2f}"
    )
    print(
        f"consume (decode + ack):    raw {messages / raw_con:8.0f} msg/s"
        f"   bus {messages / bus_con:8.0f} msg/s   bus/raw {raw_con / bus_con:.2f}"
    )
    print(
        f"publish throughput: raw {messages * size / raw_pub / 2**20:.1f} MiB/s,"
        f" bus {messages * size / bus_pub / 2**20:.1f} MiB/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.tokens, args.rounds))
