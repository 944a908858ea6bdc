"""A graded trajectory as a reader wants it: text segments by side and policy version, tool calls, reward.

Token ids decode with the byte tokenizer (0-255 are UTF-8 bytes; specials by name, unknown ones as
`<special:N>`), or, for a pretrained model's tokens, from the text of each token the rollout recorded. A new
segment starts wherever the side (agent-sampled or environment) or the policy version changes, so a
mid-episode weight swap shows as two agent segments with different versions.
"""

from __future__ import annotations

from crucible.agent import tokenizer
from crucible.contracts.messages import GradedTrajectory
from crucible.contracts.trajectories import arrays
from services.api.schemas import Segment


def segments(graded: GradedTrajectory) -> list[Segment]:
    traj = graded.trajectory
    packed = arrays(traj)
    tokens, versions, sampled = packed.tokens.tolist(), packed.versions.tolist(), packed.sampled.tolist()
    out: list[Segment] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i < len(tokens) and sampled[i] == sampled[start] and versions[i] == versions[start]:
            continue
        out.append(
            Segment(
                role="agent" if sampled[start] else "environment",
                version=versions[start],
                token_start=start,
                token_end=i,
                text="".join(traj.token_text[start:i])
                if traj.token_text
                else tokenizer.decode(tokens[start:i]),
            )
        )
        start = i
    return out


def agent_versions(graded: GradedTrajectory) -> tuple[int, int]:
    """The lowest and highest policy version among the agent's tokens; (0, 0) if it sampled none, as for
    an empty trajectory (its environment tokens' versions are no policy's work)."""
    return arrays(graded.trajectory).version_span or (0, 0)
