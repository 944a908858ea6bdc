"""A graded trajectory as a reader wants it: text segments by side and policy version, tool calls, reward.

Token ids decode with the byte tokenizer (0-255 are UTF-8 bytes; specials by name, unknown ones as
`<special:N>`), or, for a pretrained model's tokens, from the text of each token the rollout recorded. A new segment starts wherever the side (agent-sampled or environment) or the policy
version changes, so a mid-episode weight swap shows as two agent segments with different versions.
"""

from __future__ import annotations

from crucible.agent import tokenizer
from crucible.contracts.messages import GradedTrajectory
from crucible.contracts.packing import unpack
from services.api.schemas import Segment


def segments(graded: GradedTrajectory) -> list[Segment]:
    traj = graded.trajectory
    tokens = unpack("u32", traj.tokens)
    versions = unpack("u32", traj.versions)
    mask = unpack("u8", traj.loss_mask)
    if not len(tokens) == len(versions) == len(mask):
        counts = f"{len(tokens)} tokens, {len(versions)} versions, {len(mask)} mask"
        raise ValueError(f"trajectory {traj.trajectory_id}: {counts}")
    texts = len(traj.token_text) == len(tokens)
    out: list[Segment] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i < len(tokens) and mask[i] == mask[start] and versions[i] == versions[start]:
            continue
        out.append(
            Segment(
                role="agent" if mask[start] else "environment",
                version=versions[start],
                token_start=start,
                token_end=i,
                text="".join(traj.token_text[start:i]) if texts else tokenizer.decode(tokens[start:i]),
            )
        )
        start = i
    return out


def agent_versions(graded: GradedTrajectory) -> tuple[int, int]:
    """The lowest and highest policy version among the agent's tokens (all tokens if it sampled none)."""
    traj = graded.trajectory
    versions = unpack("u32", traj.versions)
    mask = unpack("u8", traj.loss_mask)
    sampled = [v for v, m in zip(versions, mask, strict=False) if m] or versions
    return (min(sampled), max(sampled)) if sampled else (0, 0)
