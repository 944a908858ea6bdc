"""Which split a task belongs to, fixed when its task set is made and stored with it.

Generated and synthesized tasks are split by their index (one in five to test, one in five to
validation), so a split never changes when a set grows. Imported tasks are split by repository, so no
repository's code is seen in training and then again in evaluation: repositories are ranked by a hash
of (task set, repository) and the first fifth (at least one, when there are two or more) go to test,
the next fifth (at least one, from three on) to validation, the rest to train.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from crucible.contracts.messages import SPLITS


def index_split(index: int) -> str:
    return {1: "test", 3: "validation"}.get(index % 5, "train")


def repository_splits(*, taskset: str, repos: Iterable[str]) -> dict[str, str]:
    ranked = sorted(set(repos), key=lambda repo: hashlib.sha256(f"{taskset}:{repo}".encode()).hexdigest())
    n = len(ranked)
    n_test = max(1, round(n / 5)) if n >= 2 else 0
    n_validation = max(1, round(n / 5)) if n >= 3 else 0
    out = {}
    for rank, repo in enumerate(ranked):
        out[repo] = "test" if rank < n_test else "validation" if rank < n_test + n_validation else "train"
    return out


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: one of {', '.join(SPLITS)}")
    return split
