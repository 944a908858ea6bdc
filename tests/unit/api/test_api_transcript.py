from __future__ import annotations

import pytest

from crucible.agent import tokenizer
from crucible.contracts import ContractError
from crucible.contracts.messages import GradedTrajectory, Reward, Trajectory
from crucible.contracts.packing import pack
from services.api.transcript import agent_versions, segments


def graded(parts: list[tuple[list[int], int, int]]) -> GradedTrajectory:
    """parts: (tokens, sampled-by-policy 0/1, version)."""
    tokens = [t for toks, _, _ in parts for t in toks]
    mask = [m for toks, m, _ in parts for _ in toks]
    versions = [v for toks, _, v in parts for _ in toks]
    traj = Trajectory(
        run_id="r",
        trajectory_id="t",
        group_id="g",
        task_id="k",
        taskset="s",
        tokens=pack("u32", tokens),
        logprobs=pack("f32", [0.0] * len(tokens)),
        versions=pack("u32", versions),
        loss_mask=pack("u8", mask),
        constraints=pack("u8", [0] * len(tokens)),
    )
    return GradedTrajectory(
        trajectory=traj, reward=Reward(total=1.0, tests_passed=1, tests_total=1), graded_at=1.0
    )


def test_segments_split_on_side_and_version_and_decode_text() -> None:
    g = graded(
        [
            ([tokenizer.BOS, *tokenizer.encode("Fix the bug")], 0, 0),
            ([tokenizer.ACT, tokenizer.tool_token("grep"), *tokenizer.encode("héllo")], 1, 0),
            (tokenizer.encode(" more"), 1, 1),
            ([tokenizer.OBS, *tokenizer.encode("3 matches"), 300], 0, 1),
        ]
    )
    out = segments(g)
    assert [(s.role, s.version, s.token_start, s.token_end) for s in out] == [
        ("environment", 0, 0, 12),
        ("agent", 0, 12, 20),
        ("agent", 1, 20, 25),
        ("environment", 1, 25, 36),
    ]
    assert [s.text for s in out] == [
        "<bos>Fix the bug",
        "<act><tool:grep>héllo",
        " more",
        "<obs>3 matches<special:300>",
    ]
    assert agent_versions(g) == (0, 1)


def test_empty_trajectory_has_no_segments() -> None:
    g = graded([])
    assert segments(g) == [] and agent_versions(g) == (0, 0)


def test_without_agent_tokens_there_are_no_agent_versions() -> None:
    assert agent_versions(graded([(tokenizer.encode("hi"), 0, 4)])) == (0, 0)


def test_arrays_of_different_lengths_are_refused() -> None:
    g = graded([(tokenizer.encode("abc"), 1, 0)])
    g.trajectory.versions = pack("u32", [0, 0])
    with pytest.raises(ContractError, match="3 tokens, 3 logprobs, 2 versions, 3 loss_mask"):
        segments(g)


def test_a_pretrained_model_s_tokens_show_the_text_the_rollout_recorded() -> None:
    g = graded([([5000, 6000], 0, 0), ([7000, 8000, 9000], 1, 1)])
    g.trajectory.token_text.extend(["<|im_start|>", "user", "<tool_call>", '{"name"', "}"])
    assert [(s.role, s.text) for s in segments(g)] == [
        ("environment", "<|im_start|>user"),
        ("agent", '<tool_call>{"name"}'),
    ]
