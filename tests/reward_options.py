"""Every combination of the run config's reward options, for tests that must hold under all of them."""

from __future__ import annotations

import itertools

from crucible.contracts.runconfig import QualitySection, RewardSection

OPTIONS = [
    RewardSection(kind=kind, shaping=s, pass_to_pass_penalty=p, length_penalty=length, tool_error_penalty=e,
                  quality=quality)
    for kind, s, p, length, e, quality in itertools.product(
        ("resolved", "fail_to_pass"), (0, 1), (0, 1), (0, 1), (0, 1), (None, QualitySection(tests=1.0))
    )
]  # fmt: skip
