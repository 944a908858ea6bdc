"""One training run: the job that wires the run's parts to the bus, its worker group and the object store.

- the run's steps, its step and version: `services.trainer.steps.RunSteps`;
- what a step trains and with which advantages: `crucible.rl.planner.plan_step` (pure);
- which graded messages are held, trained, saved and acked: `services.trainer.ledger.Ledger`;
- where the state is saved and how a run resumes: `services.trainer.state.StateStore`;
- how weight versions, evaluation requests and events leave: `services.trainer.publishing.RunPublisher`;
- the policy's ranks: `services.trainer.group.PolicyGroup`.

A trainer (or a rank) that dies at any point resumes from the saved state in a fresh group: messages
it had not acked are redelivered and trained again, those the saved state already trained on are acked
and skipped, and a version the state holds but the checkpoints never announced is published again (the
same bytes, so the commit is idempotent).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from crucible.agent.solutions import DemonstrationError
from crucible.bus import Delivery
from crucible.clients.checkpoints import committed_weights, load_weights
from crucible.contracts import ContractError, subjects
from crucible.contracts.events import RunStatus, RunStatusName
from crucible.contracts.keys import finished_key
from crucible.contracts.messages import GradedTrajectory, RunCreated
from crucible.contracts.trajectories import check_trajectory
from crucible.model import lora
from crucible.model.spec import PolicySpec
from crucible.outage import Unavailable
from crucible.runs import end_run, run_end
from crucible.runtime import Runtime
from services.trainer.group import NonFiniteStep, PolicyGroup
from services.trainer.publishing import ADAPTER_FULL_EVERY, RunPublisher
from services.trainer.settings import Settings
from services.trainer.sft import warm_start
from services.trainer.state import Books, StateStore, StateUnreadable
from services.trainer.steps import RunFailed, RunSteps


class RunJob:
    def __init__(self, *, rt: Runtime[Settings], created: RunCreated) -> None:
        self.rt, self.settings = rt, rt.settings
        self.run_id, self.config = created.run_id, created.config
        self.spec = PolicySpec.resolve(self.config, max_context=self.settings.max_context)
        self.policy: PolicyGroup | None = None  # the run's worker group, started by `run`
        self.steps: RunSteps | None = None  # the run's progress, once its state is known
        if self.settings.state_dir is not None:
            self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"{self.run_id}-", dir=self.settings.state_dir))
        self.states = StateStore(
            store=rt.store,
            run_id=self.run_id,
            work_dir=self.work_dir,
            world_size=self.config.parallel.world_size,
        )
        self.out = RunPublisher(
            bus=rt.bus, store=rt.store, run_id=self.run_id, config=self.config,
            full_every=ADAPTER_FULL_EVERY if self.config.model.lora else self.settings.full_every,
            source=self.settings.replica,
        )  # fmt: skip
        self.stop_consuming = asyncio.Event()
        self.consumer: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------------

    async def run(self, run_delivery: Delivery) -> None:
        """Train the run to its end; `run_delivery` (its RunCreated message) is held until then."""
        try:
            if await run_end(self.rt.bus, self.run_id) is not None:  # ended before a trainer took it up
                await self._end(run_delivery, None)
                return
            steps = await self._start()
            while steps.step < self.config.schedule.max_steps and not self.rt.stopping.is_set():
                if await run_end(self.rt.bus, self.run_id) is not None:  # cancelled, or failed by rollouts
                    await self._end(run_delivery, None)
                    return
                await steps.wait_or_train()
            if self.rt.stopping.is_set():  # hand everything back at once: a trainer resumes the run
                await self._stop_consuming()
                for delivery in [*steps.ledger.held(), run_delivery]:
                    await delivery.nak()
                return
            await self._finish(steps)
            await self._end(run_delivery, "finished")
        except RunFailed as exc:
            self.rt.log.error("run failed", run_id=self.run_id, error=str(exc))
            await self._end(run_delivery, "failed", str(exc))
        except BaseException:
            await self._let_go()
            raise
        finally:
            await self._stop_consuming()
            if self.policy is not None:
                await asyncio.to_thread(self.policy.close)
            shutil.rmtree(self.work_dir, ignore_errors=True)

    async def _start(self) -> RunSteps:
        """The worker group, the run's state (resumed, version 0 left by an earlier attempt, or version 0
        made), that version published, the KL reference, and the graded consumer."""
        if self.spec.lora is not None:
            try:
                lora.check_targets(self.spec.lora, self.spec.architecture)
            except ValueError as exc:  # the config's, not the trainer's: the run fails saying so, once
                raise RunFailed(str(exc)) from exc
        policy = await self.start_group()
        books = await self.resume()
        steps = self.steps = RunSteps(
            rt=self.rt,
            run_id=self.run_id,
            config=self.config,
            policy=policy,
            states=self.states,
            out=self.out,
            books=books,
        )
        await self.out.event(RunStatus(status="running"))
        if books is None:
            # Step 0's state is version 0 (its weights, no optimizer state yet), published before any
            # step: it needs no save of its own. An attempt that ended before the first save left it.
            rt = self.rt
            left = await committed_weights(bus=rt.bus, store=rt.store, run_id=self.run_id, version=0)
            if left is None:
                await self._initial_weights(policy)
            else:
                await asyncio.to_thread(policy.load_weights, left)
            if self.rt.stopping.is_set():
                return steps
            steps.version = 0
        await steps.publish()
        if self.config.optim.kl_coef > 0:  # the KL term's reference: version 0 as published
            _, state = await load_weights(bus=self.rt.bus, store=self.rt.store, run_id=self.run_id, version=0)
            await asyncio.to_thread(policy.set_reference, state)
        if steps.last_step:  # saved with the state; its event may have been lost in a crash
            await self.out.event(steps.last_step)
        self.consumer = self.rt.spawn(self._consume(), name=f"graded-{self.run_id}")
        steps.last_arrival = time.monotonic()
        return steps

    async def start_group(self) -> PolicyGroup:
        self.policy = await asyncio.to_thread(
            PolicyGroup, self.config, spec=self.spec, timeout_s=self.settings.step_timeout_s,
            threads=self.settings.torch_threads, ray_address=self.settings.ray_address,
        )  # fmt: skip
        self.rt.log.info("worker group started", run_id=self.run_id, world_size=self.policy.world_size,
                         launcher=self.policy.launcher)  # fmt: skip
        return self.policy

    async def resume(self) -> Books | None:
        """The newest saved state that reads whole, loaded into the ranks; None for a new run."""

        def load(directory: str) -> None:
            if self.policy is None:
                raise RuntimeError("a saved state can only be loaded into a started worker group")
            self.policy.load(directory)

        try:
            return await self.states.resume(load)
        except (StateUnreadable, ValueError) as exc:
            raise RunFailed(str(exc)) from exc

    async def _initial_weights(self, policy: PolicyGroup) -> None:
        """A new run's version 0: the source's weights (or `model.init`'s), then the warm start if any."""
        if init := self.config.model.init:
            run_id, _, version = init.partition("@")
            try:
                _, state = await load_weights(
                    bus=self.rt.bus, store=self.rt.store, run_id=run_id, version=int(version)
                )
                # That run's policy: its adapters, if it trained any, folded into its weights.
                state = await asyncio.to_thread(lora.merge, state, self.spec.architecture)
                await asyncio.to_thread(policy.load_weights, state)
            except Unavailable:
                raise  # an outage, not a bad init: the run starts once the checkpoints service answers
            except Exception as exc:
                raise RunFailed(f"model.init {init}: cannot start from it: {exc}") from exc
            self.rt.log.info("starting from another run's weights", run_id=self.run_id, init=init)
        if not self.config.sft.steps:
            return
        try:
            report = await warm_start(
                self.rt, policy, run_id=self.run_id, config=self.config, tokenizer=self.spec.tokenizer,
                tool_calls=self.spec.tool_calls, max_context=self.spec.max_context,
            )  # fmt: skip
        except (DemonstrationError, NonFiniteStep) as exc:
            raise RunFailed(str(exc) if isinstance(exc, DemonstrationError) else f"sft: {exc}") from exc
        if report is not None:
            await self.out.event(report)

    async def _finish(self, steps: RunSteps) -> None:
        """The last steps' version published and their state saved; the evaluation at the end asked for."""
        publish = steps.step % self.config.schedule.publish_every != 0
        if publish:
            steps.version += 1
        if publish or steps.steps_unsaved:
            await steps.save()
        if publish:
            await steps.publish()
        if self.config.eval.at_end:
            await self.out.request_eval(steps.version)

    async def _end(self, run_delivery: Delivery, status: RunStatusName | None, error: str = "") -> None:
        """The run is over: its end announced (unless another service ended it: `status` None), the
        groups nobody will train acked, the run's message acked and its consumer deleted."""
        step, version = (0, -1) if self.steps is None else (self.steps.step, self.steps.version)
        if status is None:
            end = await run_end(self.rt.bus, self.run_id)
            self.rt.log.info("run ended elsewhere", run_id=self.run_id, status=end and end.status,
                             error=end and end.error, step=step, version=version)  # fmt: skip
        else:
            await end_run(
                self.rt.bus, run_id=self.run_id, status=status, step=step, version=version, error=error,
                source=self.settings.replica,
            )  # fmt: skip
            await self.rt.redis.set(finished_key(self.run_id), "1", ex=7 * 86400)
        await self._stop_consuming()
        if self.steps is not None:
            await self.steps.ledger.release()
        await run_delivery.ack()
        durable = subjects.trainer_run_durable(self.run_id)
        try:
            await self.rt.bus.js.delete_consumer(subjects.GRADED, durable)
        except Exception as exc:  # already gone, or the server is busy: it only costs a little memory
            self.rt.log.warning("could not delete the run's consumer", durable=durable, error=repr(exc))

    async def _let_go(self) -> None:
        """This job failed: hand back everything it holds, so the next job (this trainer's, after a
        backoff, or another's) gets it again instead of their keep-alives holding it."""
        await self._stop_consuming()
        for delivery in [] if self.steps is None else self.steps.ledger.held():
            try:
                await delivery.nak()
            except Exception as exc:
                # the bus is away: with its keep-alive stopped, it returns after ack_wait
                self.rt.log.debug("could not hand back a held trajectory", error=repr(exc))

    # -- graded trajectories in ------------------------------------------------------------------------

    async def _consume(self) -> None:
        await self.rt.bus.consume(
            stream=subjects.GRADED,
            durable=subjects.trainer_run_durable(self.run_id),
            filter_subject=subjects.graded(self.run_id),
            handler=self.on_graded,
            message_type=GradedTrajectory,
            stop=self.stop_consuming,
            ack_wait=self.settings.ack_wait_s,
            batch=8,
            max_ack_pending=4096,
            max_deliver=100,  # held messages come back once per trainer restart
        )

    async def _stop_consuming(self) -> None:
        """Stop taking graded messages, and wait until the consumer has stopped: before messages are
        handed back, or the consumer would take them straight back into this job."""
        self.stop_consuming.set()
        if self.consumer is not None:
            await asyncio.gather(self.consumer, return_exceptions=True)

    async def on_graded(self, graded: GradedTrajectory, delivery: Delivery) -> None:
        trajectory = graded.trajectory
        if trajectory.run_id != self.run_id:
            raise ContractError(
                f"graded trajectory of run {trajectory.run_id} on run {self.run_id}'s subject"
            )
        check_trajectory(trajectory)  # a non-finite reward is the step's to skip, with its reason
        if trajectory.eval_id:
            return  # an evaluation's episode: graded for the record, never trained on
        assert self.steps is not None  # the consumer starts once the run's progress is known
        if self.steps.ledger.hold(graded, delivery, keep_alive_s=self.settings.heartbeat_s):
            self.steps.arrival()
