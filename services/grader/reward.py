"""The reward of a graded trajectory, as pure functions, with SWE-bench's semantics.

A task names its FAIL_TO_PASS tests (they fail on the snapshot and pass with the reference patch) and
its PASS_TO_PASS tests (they pass on both). With the run's `reward` section:

    base      resolved:     1 if every FAIL_TO_PASS test passes and every PASS_TO_PASS test passes, else 0
              fail_to_pass: FAIL_TO_PASS passed / FAIL_TO_PASS total, 0 if any PASS_TO_PASS test broke
    total = base + shaping x tools ok (submit aside) - pass_to_pass_penalty x PASS_TO_PASS broken
                 - length_penalty x share of the token budget sampled - tool_error_penalty x tools failed
                 + quality (a resolved change only, with `reward.quality` set: `quality_term`)

A trajectory that leaves the repository unchanged scores exactly 0 in every term: the snapshot fails
every FAIL_TO_PASS test by construction, and no penalty or shaping applies to doing nothing, so neither
idling nor submitting at once pays. A trajectory disqualified before its code ran (it touched the tests,
its diff does not apply) also scores 0. A listed test that did not run counts as not passed; skipped,
failed and erroring tests all count as not passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from crucible.contracts.messages import Reward, TestResult, ToolCall
from crucible.contracts.runconfig import QualitySection, RewardSection

TERMS = ("base", "shaping", "pass_to_pass_penalty", "length_penalty", "tool_error_penalty", "quality")


def _zero_terms() -> dict[str, float]:
    return dict.fromkeys(TERMS, 0.0)


def compute_reward(
    *,
    tests: Sequence[TestResult],
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    changed: bool,
    tool_calls: Sequence[ToolCall] = (),
    sampled_tokens: int = 0,
    token_budget: int = 1,
    options: RewardSection | None = None,
    quality: Mapping[str, float] | None = None,
    note: str = "",
) -> Reward:
    """The reward of the tests' outcomes (run after the trajectory's diff) for a task's test lists;
    `quality`: the change's measures (services.grader.quality), recorded when it resolved the task."""
    options = options or RewardSection()
    outcome = {test.nodeid: test.outcome for test in tests}
    f2p = sum(1 for nodeid in fail_to_pass if outcome.get(nodeid) == "passed")
    p2p = sum(1 for nodeid in pass_to_pass if outcome.get(nodeid) == "passed")
    broken = len(pass_to_pass) - p2p
    resolved = bool(fail_to_pass) and f2p == len(fail_to_pass) and broken == 0
    terms = _zero_terms()
    if changed:
        if options.kind == "resolved":
            terms["base"] = 1.0 if resolved else 0.0
        else:
            terms["base"] = f2p / len(fail_to_pass) if fail_to_pass and broken == 0 else 0.0
        worked = [call for call in tool_calls if call.name != "submit"]
        if worked:
            terms["shaping"] = options.shaping * sum(call.ok for call in worked) / len(worked)
            terms["tool_error_penalty"] = (
                -options.tool_error_penalty * sum(not call.ok for call in worked) / len(worked)
            )
        if pass_to_pass:
            terms["pass_to_pass_penalty"] = -options.pass_to_pass_penalty * broken / len(pass_to_pass)
        terms["length_penalty"] = -options.length_penalty * min(1.0, sampled_tokens / max(token_budget, 1))
        if resolved and options.quality is not None and quality is not None:
            terms["quality"] = quality_term(quality, options.quality)
    if not fail_to_pass and not note:
        note = "the task lists no FAIL_TO_PASS test"
    elif not changed and not note:
        note = "the repository is unchanged"
    terms = {name: value + 0.0 for name, value in terms.items()}  # no -0.0
    return Reward(
        total=sum(terms.values()) + 0.0,
        tests_passed=sum(1 for test in tests if test.outcome == "passed"),
        tests_total=len(tests),
        components=terms,
        tests=list(tests),
        note=note,
        resolved=resolved and changed,
        fail_to_pass=[f2p, len(fail_to_pass)],
        pass_to_pass=[p2p, len(pass_to_pass)],
        quality=dict(quality) if quality is not None and resolved and changed else {},
    )


def quality_term(measures: Mapping[str, float], weights: QualitySection) -> float:
    """The quality section's term for a resolved change's measures, each scaled to [0, 1] (a measure
    that could not be taken, e.g. ruff failed, costs nothing)."""
    scaled = {
        "lint": max(0.0, measures.get("lint_introduced", 0.0)) / 5,
        "size": max(0.0, measures.get("diff_size_ratio", 1.0) - 1.0),
        "outside": measures.get("files_outside_reference", 0.0) / 3,
        "repetition": measures.get("repetition", 0.0),
    }
    term = -sum(getattr(weights, name) * min(1.0, value) for name, value in scaled.items())
    return term + (weights.tests if measures.get("tests_added", 0.0) > 0 else 0.0)


def zero_reward(*, note: str) -> Reward:
    """The reward of a trajectory disqualified before its code ran."""
    return Reward(total=0.0, tests_passed=0, tests_total=0, components=_zero_terms(), note=note)
