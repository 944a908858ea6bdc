"""A one-bug repository (add() subtracts) as a task whose snapshot is in the object store: what the
rollout tests run their episodes on."""

from __future__ import annotations

import io
import tarfile
import uuid

from crucible.contracts.messages import TaskSpec

CALC_REPO = {"calc/__init__.py": "", "calc/ops.py": "def add(a, b):\n    return a - b\n"}


def tar_gz(files: dict[str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def calc_task(store) -> TaskSpec:
    snapshot = await store.put_bytes(f"tasksets/test/{uuid.uuid4().hex}.tar.gz", tar_gz(CALC_REPO))
    return TaskSpec(task_id="calc-1", taskset="test", difficulty=1, statement="Fix add().", snapshot=snapshot)
