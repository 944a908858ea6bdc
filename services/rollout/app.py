"""Rollout service: follows weight announcements and runs a worker for each live run it hears of, and
runs the evaluations asked for on EVALS (one at a time per replica). Runs and evaluations share the
replica's episode slots (`max_episodes`)."""

from __future__ import annotations

import torch

from crucible.bus import Delivery
from crucible.contracts import subjects
from crucible.contracts.messages import EvalRequest, WeightsAnnounced
from crucible.runs import run_config, run_end
from crucible.runtime import Runtime
from services.rollout.admission import budget_spent
from services.rollout.evaluation import handle_eval_request
from services.rollout.harness import Episodes, episodes_app
from services.rollout.settings import Settings
from services.rollout.slots import EpisodeSlots
from services.rollout.worker import RunWorker


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings
    torch.set_num_threads(settings.torch_threads)
    workers: dict[str, RunWorker] = {}
    episodes = Episodes()
    slots = EpisodeSlots(settings.max_episodes)
    port = await rt.serve_http(
        episodes_app(episodes), host=settings.episodes_host, port=settings.episodes_port, name="episodes"
    )
    reachable = "127.0.0.1" if settings.episodes_host in ("0.0.0.0", "") else settings.episodes_host
    episodes.url = f"http://{reachable}:{port}"  # the harnesses run beside the replica

    async def on_announced(announced: WeightsAnnounced) -> None:
        worker = workers.get(announced.run_id)
        if worker is None:
            config = await run_config(rt.bus, announced.run_id)
            if config is None:
                rt.log.error("weights announced for an unknown run", run_id=announced.run_id)
                return
            if await run_end(rt.bus, announced.run_id) is not None or await budget_spent(
                redis=rt.redis, run_id=announced.run_id, config=config
            ):
                return
            worker = RunWorker(rt=rt, run_id=announced.run_id, config=config, episodes=episodes, slots=slots)
            workers[announced.run_id] = worker
            rt.spawn(work(worker), name=f"run-{announced.run_id}")
            rt.log.info("joined run", run_id=announced.run_id)
        await worker.on_announced(announced)

    async def work(worker: RunWorker) -> None:
        try:
            await worker.run()
        finally:
            workers.pop(worker.run_id, None)

    await rt.bus.watch(subjects.WEIGHTS_ANNOUNCED_ALL, WeightsAnnounced, on_announced, last_per_subject=True)

    async def on_eval(request: EvalRequest, delivery: Delivery) -> None:
        await handle_eval_request(rt, slots, request, delivery)

    rt.spawn(
        rt.bus.consume(
            stream=subjects.EVALS,
            durable=subjects.ROLLOUT_EVALS_DURABLE,
            filter_subject=subjects.STREAMS[subjects.EVALS].all_subjects,
            handler=on_eval,
            message_type=EvalRequest,
            stop=rt.stopping,
            ack_wait=60.0,
            max_deliver=3,
        ),
        name="evaluations",
    )
