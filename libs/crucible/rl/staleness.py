"""Staleness rules shared by the rollout's admission and the trainer's filter.

Versions count weight publications: v0 is the initial policy and the trainer publishes version w after
optimizer step w * publish_every. Groups are consumed in order, `groups_per_step` per step, so the
g-th admitted group (0-based) will be trained at step g // groups_per_step, when the trainer's newest
published version is (g // groups_per_step) // publish_every. A group sampled with version v is then
that many versions behind; admission lets it start only if the lag can stay within `max_staleness`.
"""

from __future__ import annotations


def trainer_version_at_group(*, group_index: int, groups_per_step: int, publish_every: int) -> int:
    return (group_index // groups_per_step) // publish_every


def admission_limit(*, version: int, max_staleness: int, groups_per_step: int, publish_every: int) -> int:
    """How many groups may have been admitted in total while rollouts run `version`."""
    return (version + max_staleness + 1) * publish_every * groups_per_step


def staleness(*, trainer_version: int, token_versions: list[int]) -> int:
    """Versions by which the oldest sampled token lags the trainer (0 if none was sampled)."""
    if not token_versions:
        return 0
    return max(0, trainer_version - min(token_versions))
