"""Experiment trackers: a run's step metrics, warm start and finished evaluations, also sent to the
trackers its config names (`trackers = ["tensorboard", "mlflow", "wandb"]`).

The api is where all three meet (steps and warm starts arrive as events, an evaluation's numbers exist once
its last episode is graded), so its ingest forwards them here after storing them. Names: `train/<metric>` at
the optimizer step, `sft/loss` after each warm-start step (1-based, like RL steps), `eval/<split>/<measure>`
at the step of the evaluated version. Writers are the libraries' own: TensorBoard event files (tensorboardX,
which needs no torch) under `<tracking_dir>/tensorboard/<run>`, an MLflow run per Crucible run (tag
`crucible.run_id`) at `mlflow_tracking_uri` (default: an SQLite store, `<tracking_dir>/mlflow.db`), a
Weights & Biases run (`wandb_mode`, offline by default) under `<tracking_dir>`. A tracker that fails is logged
and skipped: the run history in PostgreSQL is the record, trackers a copy.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Literal

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.contracts.events import (
    TERMINAL_STATUSES,
    EvalReport,
    Event,
    RunStatus,
    StepReport,
    WarmStartReport,
)
from crucible.contracts.messages import GradedTrajectory
from crucible.db.models import Checkpoint, Evaluation, Run
from services.api.queries.evals import get_eval

log = structlog.get_logger("crucible.api")
EVAL_MEASURES = ("pass_at_1", "pass_at_k", "resolved_rate")

WandbMode = Literal["offline", "online", "disabled"]


class Trackers:
    """Writers per (run, tracker), opened on a run's first metric."""

    def __init__(
        self,
        *,
        root: Path,
        mlflow_tracking_uri: str | None = None,
        wandb_mode: WandbMode = "offline",
    ) -> None:
        self.root = root
        self.mlflow_uri = mlflow_tracking_uri or f"sqlite:///{(root / 'mlflow.db').resolve()}"
        self.wandb_mode: WandbMode = wandb_mode
        self._writers: dict[tuple[str, str], Any] = {}
        self._logged_evals: set[str] = set()
        self._lock = asyncio.Lock()

    async def observe_event(self, session: AsyncSession, event: Event) -> None:
        data = event.data
        if isinstance(data, StepReport):
            await self._log(
                session, event.run_id, [(data.step, {f"train/{k}": v for k, v in data.metrics.items()})]
            )
        elif isinstance(data, WarmStartReport):
            points = [(1 + i * data.loss_every, {"sft/loss": loss}) for i, loss in enumerate(data.losses)]
            await self._log(session, event.run_id, points)
        elif isinstance(data, EvalReport):
            await self._eval(session, data.request.eval_id)
        elif isinstance(data, RunStatus) and data.status in TERMINAL_STATUSES:
            async with self._lock:  # the files complete (an evaluation finishing later opens new ones)
                await asyncio.to_thread(self.close, event.run_id)

    async def observe_graded(self, session: AsyncSession, graded: GradedTrajectory) -> None:
        if graded.trajectory.eval_id:
            await self._eval(session, graded.trajectory.eval_id)

    async def _names(self, session: AsyncSession, run_id: str) -> list[str]:
        run = await session.get(Run, run_id)
        return list((run.config or {}).get("trackers") or []) if run is not None else []

    async def _eval(self, session: AsyncSession, eval_id: str) -> None:
        """Log an evaluation once, when its last episode is graded (and only for a run with trackers)."""
        if eval_id in self._logged_evals:
            return
        row = await session.get(Evaluation, eval_id)
        if row is None or not await self._names(session, row.run_id):
            return
        result = await get_eval(session=session, eval_id=eval_id)
        if result.status != "finished":
            return
        self._logged_evals.add(eval_id)
        checkpoint = await session.get(Checkpoint, (result.run_id, result.version))
        step = checkpoint.step if checkpoint is not None else result.version
        metrics = {
            f"eval/{result.split}/{name}": getattr(result, name).value
            for name in EVAL_MEASURES
            if getattr(result, name).value is not None
        }
        await self._log(session, result.run_id, [(step, metrics)])

    async def _log(
        self, session: AsyncSession, run_id: str, points: list[tuple[int, dict[str, float]]]
    ) -> None:
        names = await self._names(session, run_id)
        points = [(step, metrics) for step, metrics in points if metrics]
        if not names or not points:
            return
        async with self._lock:  # one writer per (run, tracker); the libraries are not re-entrant
            for name in names:
                try:
                    await asyncio.to_thread(self._write, name, run_id, points)
                except Exception as exc:
                    log.warning("tracker failed", tracker=name, run_id=run_id, error=repr(exc))

    def _write(self, name: str, run_id: str, points: list[tuple[int, dict[str, float]]]) -> None:
        writer = self._writers.get((name, run_id))
        if writer is None:
            writer = self._writers[(name, run_id)] = OPENERS[name](self, run_id)
        if name == "tensorboard":
            for step, metrics in points:
                for key, value in metrics.items():
                    writer.add_scalar(key, value, global_step=step)
            writer.flush()
        elif name == "mlflow":
            from mlflow.entities import Metric

            client, mlflow_run = writer
            now = int(time.time() * 1000)
            batch = [Metric(k, float(v), now, step) for step, metrics in points for k, v in metrics.items()]
            client.log_batch(mlflow_run, metrics=batch)
        else:
            for step, metrics in points:
                writer.log(metrics, step=step)

    def _tensorboard(self, run_id: str) -> Any:
        from tensorboardX import SummaryWriter

        return SummaryWriter(logdir=str(self.root / "tensorboard" / run_id))

    def _mlflow(self, run_id: str) -> Any:
        from mlflow.tracking import MlflowClient

        self.root.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=self.mlflow_uri)
        experiment = client.get_experiment_by_name("crucible")
        experiment_id = experiment.experiment_id if experiment else client.create_experiment("crucible")
        found = client.search_runs([experiment_id], filter_string=f"tags.`crucible.run_id` = '{run_id}'")
        mlflow_run = (
            found[0].info.run_id
            if found
            else client.create_run(
                experiment_id, run_name=run_id, tags={"crucible.run_id": run_id}
            ).info.run_id
        )
        return client, mlflow_run

    def _wandb(self, run_id: str) -> Any:
        import wandb

        return wandb.init(
            project="crucible", id=run_id, name=run_id, dir=str(self.root), mode=self.wandb_mode,
            resume="allow", reinit="create_new",
        )  # fmt: skip

    def close(self, run_id: str | None = None) -> None:
        """Close the writers of one run, or of all."""
        for key in [k for k in self._writers if run_id is None or k[1] == run_id]:
            name, writer = key[0], self._writers.pop(key)
            try:
                if name == "tensorboard":
                    writer.close()
                elif name == "mlflow":
                    writer[0].set_terminated(writer[1])
                else:
                    writer.finish()
            except Exception as exc:
                log.warning("tracker did not close", tracker=name, run_id=key[1], error=repr(exc))


OPENERS = {"tensorboard": Trackers._tensorboard, "mlflow": Trackers._mlflow, "wandb": Trackers._wandb}
