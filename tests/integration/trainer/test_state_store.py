"""The trainer's state store on a real S3 server: saves alternate between two slots, the index is
written last, resume takes the newest slot that reads whole (a torn index or a file that does not verify
costs one save, never the run), and refuses what it cannot resume from with the reason."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from crucible.contracts.keys import trainer_state_key
from crucible.objectstore import ObjectStore
from crucible.outage import Unavailable
from services.trainer.state import Books, StateStore, StateUnreadable

pytestmark = pytest.mark.integration


def writer(label: str):
    """What the ranks do on save: each writes its shard file into the directory."""

    def write(directory: str) -> None:
        Path(directory).mkdir(parents=True)
        for rank in range(2):
            (Path(directory) / f"__{rank}_0.distcp").write_text(f"{label} rank {rank}")

    return write


class Reader:
    """What the ranks do on resume: read the files handed to them."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}

    def __call__(self, directory: str) -> None:
        self.files = {p.name: p.read_text() for p in sorted(Path(directory).iterdir())}


def _store(store: ObjectStore, tmp_path: Path, run_id: str, world_size: int = 2) -> StateStore:
    return StateStore(store=store, run_id=run_id, work_dir=tmp_path, world_size=world_size)


async def test_resume_takes_the_newest_state_that_reads_whole(store: ObjectStore, tmp_path: Path) -> None:
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    states = _store(store, tmp_path, run_id)
    assert await states.resume(Reader()) is None  # a new run
    await states.save(writer("first"), Books(step=1, version=0, trained=["a"]))
    await states.save(writer("second"), Books(step=2, version=1, trained=["a", "b"]))
    assert states.slot == 1

    reader = Reader()
    books = await _store(store, tmp_path, run_id).resume(reader)
    assert books == Books(step=2, version=1, trained=["a", "b"])
    assert reader.files == {"__0_0.distcp": "second rank 0", "__1_0.distcp": "second rank 1"}

    # the newest save's file is replaced behind its index: it no longer verifies, the slot before it serves
    await store.put_bytes(trainer_state_key(run_id, 1, "__1_0.distcp"), b"torn")
    reader = Reader()
    resumed = _store(store, tmp_path, run_id)
    assert (await resumed.resume(reader)).step == 1
    assert reader.files["__1_0.distcp"] == "first rank 1" and resumed.slot == 0
    # the next save goes to the other slot, keeping the one it resumed from
    await resumed.save(writer("third"), Books(step=3, version=2, trained=["a", "b", "c"]))
    assert (await _store(store, tmp_path, run_id).resume(Reader())).step == 3

    await store.put_bytes(trainer_state_key(run_id, 0), b"not an index")
    await store.put_bytes(trainer_state_key(run_id, 1), b"not one either")
    with pytest.raises(StateUnreadable, match=r"reads whole \(slots \[0, 1\]\)"):
        await _store(store, tmp_path, run_id).resume(Reader())


async def test_a_state_of_another_world_size_or_an_absent_store_is_refused(
    store: ObjectStore, common_settings, tmp_path: Path
) -> None:
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    await _store(store, tmp_path, run_id).save(writer("x"), Books(step=1, version=0, trained=[]))
    with pytest.raises(ValueError, match="of 2 ranks, the run's config has 4"):
        await _store(store, tmp_path, run_id, world_size=4).resume(Reader())
    away = ObjectStore.from_settings(common_settings(s3_endpoint="127.0.0.1:9"))
    with pytest.raises(Unavailable):  # an outage is never taken for a torn state
        await _store(away, tmp_path, run_id).resume(Reader())
