"""The trainer state of a run in the object store: two save slots, what a torn save looks like, resume.

A save writes every rank's torch.distributed.checkpoint shards to a directory, uploads the files to
`runs/<run>/trainer/state-<slot>/`, then writes the slot's index (`SavedState`: the run's books and each
file's sha256) last. Saves alternate between the two slots, so a save torn at any point leaves the
slot before it whole. A slot is torn when its index does not decode or a file it names is missing or
does not verify; resume takes the newest slot that reads whole, and fails the run only when slots exist
and none does. An unreachable object store is an outage, never a torn state.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog

from crucible.contracts.events import StepReport
from crucible.contracts.keys import trainer_state_key
from crucible.contracts.messages import ObjectRef
from crucible.objectstore import IntegrityError, ObjectNotFound, ObjectStore
from crucible.outage import Unavailable


class StateUnreadable(RuntimeError):
    """Saved states exist and none reads whole: the run cannot resume."""


class Books(msgspec.Struct, kw_only=True):
    """What the run's job knows beyond the ranks' shards."""

    step: int
    version: int
    trained: list[str]
    last_step: StepReport | None = None


class SavedState(Books, kw_only=True):
    """The index of one saved state: the books, the world size that wrote it, and the ranks' files
    with the sha256 each must read back with."""

    world_size: int
    files: dict[str, ObjectRef]


class StateStore:
    def __init__(self, *, store: ObjectStore, run_id: str, work_dir: Path, world_size: int) -> None:
        self.store, self.run_id, self.work_dir, self.world_size = store, run_id, work_dir, world_size
        self.slot = 1  # the slot of the last state saved (the first save goes to slot 0)
        self.log = structlog.get_logger("crucible.trainer").bind(run_id=run_id)

    async def save(self, write: Callable[[str], None], books: Books) -> None:
        """`write(directory)` writes the state's files there (every rank its shards); they go to the
        object store, the index last."""
        slot = 1 - self.slot  # the other slot keeps the state before this one
        directory = self.work_dir / f"slot-{slot}"
        shutil.rmtree(directory, ignore_errors=True)
        await asyncio.to_thread(write, str(directory))
        files = {}
        for path in sorted(directory.iterdir()):
            data = await asyncio.to_thread(path.read_bytes)
            files[path.name] = await self.store.put_bytes(
                trainer_state_key(self.run_id, slot, path.name), data
            )
        shutil.rmtree(directory, ignore_errors=True)
        index = SavedState(**msgspec.structs.asdict(books), world_size=self.world_size, files=files)
        await self.store.put_bytes(trainer_state_key(self.run_id, slot), msgspec.json.encode(index))
        self.slot = slot

    async def resume(self, read: Callable[[str], None]) -> Books | None:
        """Hand the newest saved state that reads whole to `read(directory)` (the ranks load it) and return
        its books; None for a new run. Raises StateUnreadable when states exist and none reads whole (one torn
        or corrupt save costs at most the steps since the save before it), ValueError when the state was
        written by a different number of ranks, Unavailable while the object store is away."""
        found, unreadable = [], []
        for slot in (0, 1):
            try:
                data = await self.store.get_bytes(
                    self.store.uri(trainer_state_key(self.run_id, slot)), verify=False
                )
                found.append((slot, msgspec.json.decode(data, type=SavedState)))
            except ObjectNotFound:
                continue
            except Unavailable:  # the newest state may be in this slot: resume once S3 answers
                raise
            except Exception as exc:  # a torn or foreign object: the other slot holds the state before it
                unreadable.append(slot)
                self.log.warning("trainer state unreadable", slot=slot, error=repr(exc))
        for slot, state in sorted(found, key=lambda item: (item[1].step, item[1].version), reverse=True):
            if state.world_size != self.world_size:
                raise ValueError(
                    f"the saved state is of {state.world_size} ranks, the run's config has {self.world_size}"
                )
            directory = self.work_dir / f"resume-{slot}"
            try:
                await self._download(state.files, directory)
            except (IntegrityError, ObjectNotFound) as exc:  # torn: files of a later save, or missing
                unreadable.append(slot)
                self.log.warning("trainer state unreadable", slot=slot, error=repr(exc))
                continue
            await asyncio.to_thread(read, str(directory))
            shutil.rmtree(directory, ignore_errors=True)
            self.slot = slot
            self.log.info("resumed run", step=state.step, version=state.version, slot=slot)
            return Books(
                step=state.step, version=state.version, trained=state.trained, last_step=state.last_step
            )
        if unreadable:
            raise StateUnreadable(
                f"no saved trainer state reads whole (slots {sorted(set(unreadable))}): the run cannot resume"
            )
        return None

    async def _download(self, files: dict[str, ObjectRef], directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for name, ref in files.items():
            (directory / name).write_bytes(await self.store.get_bytes(ref))
