"""Demonstrations: reference patches become the agent's tool calls, and the Teacher plays them (or an
imported conversation) through the agent loop with exactly the policy's token layout: its action tokens
trainable, everything else the environment's, every constrained token one the sampler could draw."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from crucible.agent import grammar, tokenizer
from crucible.agent.demonstrations import Teacher
from crucible.agent.episode import run_episode
from crucible.agent.solutions import (
    Action,
    DemonstrationError,
    RecordedSession,
    changed_paths,
    imported_episodes,
    reference_actions,
)
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.contracts.messages import ObjectRef, TaskSpec
from crucible.contracts.packing import unpack
from crucible.contracts.runconfig import RunConfig
from crucible.model.scoring import unpack_allowed
from services.catalog.generator import generate_task

CONFIG = RunConfig.model_validate(
    {"agent": {"max_turns": 6, "max_action_tokens": 400, "max_observation_bytes": 300}}
)


def applied(files: dict[str, str], actions) -> dict[str, str]:
    out = dict(files)
    for action in actions:
        if action.name == "replace":
            a = action.arguments
            assert out[a["path"]].count(a["old"]) == 1, "the tool requires a unique `old`"
            out[a["path"]] = out[a["path"]].replace(a["old"], a["new"], 1)
    return out


@pytest.mark.parametrize("byte_level", [True, False])
def test_reference_actions_reproduce_the_reference_patch(tmp_path, byte_level) -> None:
    played = 0
    for difficulty, index in [(1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (3, 1)]:
        task = generate_task(seed=0, difficulty=difficulty, index=index, taskset="pybugs")
        files = {p: task.files[p] for p in changed_paths(task.reference_patch)}
        try:
            actions = reference_actions(task.reference_patch, files, byte_level=byte_level)
        except DemonstrationError as exc:
            assert byte_level and str(exc).startswith(("a multi-line edit", "no unique block"))
            continue
        played += 1
        names = [a.name for a in actions]
        assert names[0] == "read_file" and names[-2:] == ["run", "submit"] and "replace" in names
        repo = tmp_path / f"{difficulty}-{index}"
        for path, text in task.files.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        subprocess.run(["git", "apply", "-"], cwd=repo, input=task.reference_patch, text=True, check=True)
        assert applied(files, actions) == {p: (repo / p).read_text() for p in files}
    assert played >= 5


def test_a_change_the_byte_level_agent_cannot_express_is_refused() -> None:
    patch = "--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n x = 1\n-y = 2\n-z = 3\n+y = 3\n+z = 2\n"
    files = {"m.py": "x = 1\ny = 2\nz = 3\n"}
    with pytest.raises(DemonstrationError, match="multi-line edit"):
        reference_actions(patch, files, byte_level=True)
    (_read, replace, *_) = reference_actions(patch, files, byte_level=False)
    assert replace.arguments == {"path": "m.py", "old": "y = 2\nz = 3", "new": "y = 3\nz = 2"}


CONVERSATION = {
    "messages": [
        {"role": "system", "content": "ignored: the agent's own system prompt is used"},
        {"role": "user", "content": "add() subtracts"},
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "read_file", "arguments": '{"path": "calc.py"}'}}],
        },
        {"role": "tool", "content": "def add(a, b):\n    return a - b\n"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "function": {
                        "name": "replace",
                        "arguments": {"path": "calc.py", "old": "return a - b", "new": "return a + b"},
                    }
                }
            ],
        },
        {"role": "tool", "content": "calc.py: replaced; new text at lines 2-2"},
        {
            "role": "assistant",
            "content": "Fixed.",
            "tool_calls": [{"function": {"name": "submit", "arguments": "{}"}}],
        },
    ]
}


def play(actor, episode):
    task = TaskSpec(task_id="t", taskset="s", difficulty=0, statement=episode.statement,
                    snapshot=ObjectRef(uri="", sha256="", size=0))  # fmt: skip
    return asyncio.run(
        run_episode(
            engine=actor,
            config=CONFIG,
            task=task,
            session=RecordedSession(episode.results),
            run_id="r",
            group_id="g",
            seed=0,
            replica="test",
            tool_timeout_s=1.0,
        )
    )


def test_an_imported_conversation_plays_in_the_byte_level_format() -> None:
    (episode,) = imported_episodes(json.dumps(CONVERSATION) + "\n\n")
    assert episode.statement == "add() subtracts" and [a.name for a in episode.actions] == [
        "read_file",
        "replace",
    ]
    trajectory = play(Teacher(episode.actions, agent=CONFIG.agent, max_context=2048), episode)
    assert trajectory.finish_reason == "submitted"
    tokens, mask = unpack("u32", trajectory.tokens), unpack("u8", trajectory.loss_mask)
    trained = tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m])
    assert trained == (
        "<tool:read_file>calc.py<end><tool:replace>calc.py\nreturn a - b\nreturn a + b<end><tool:submit>"
    )
    text = tokenizer.decode(tokens)
    assert "<obs>def add(a, b):" in text and "Task: add() subtracts" in text and "ignored" not in text
    constraints = unpack("u8", trajectory.constraints)
    assert {c for c, m in zip(constraints, mask, strict=True) if m} == {grammar.TOOL, grammar.ARGS}


def test_an_imported_conversation_plays_in_a_chat_models_format(tokenizer) -> None:
    calls = ToolCallGrammar.for_agent(tokenizer, vocab_size=len(tokenizer), agent=CONFIG.agent)
    (episode,) = imported_episodes(json.dumps(CONVERSATION))
    actor = Teacher(
        episode.actions, agent=CONFIG.agent, max_context=4096, tokenizer=tokenizer, tool_calls=calls
    )
    trajectory = play(actor, episode)
    assert trajectory.finish_reason == "submitted"
    tokens, mask = unpack("u32", trajectory.tokens), unpack("u8", trajectory.loss_mask)
    constraints = unpack("u8", trajectory.constraints)
    # The trainer's replay of the grammar allows every trained token: its logprob is finite.
    constrained = [c == grammar.TOOL_CALL for c in constraints]
    masks = unpack_allowed(calls.replay(tokens, constrained), calls.vocab_size)
    at = [t for t, inside in enumerate(constrained) if inside]
    assert all(constrained[t] for t in range(len(tokens)) if mask[t])
    assert all(masks[row, tokens[t]] for row, t in enumerate(at) if mask[t])
    actions = tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m])
    assert (
        actions.count("<tool_call>") == 3
        and '"return a + b"' in actions
        and actions.endswith(tokenizer.eos_token)
    )
    assert "def add(a, b)" in tokenizer.decode(tokens)


def test_a_demonstration_over_the_agent_budget_is_refused() -> None:
    (episode,) = imported_episodes(json.dumps(CONVERSATION))
    small = RunConfig.model_validate({"agent": {"max_turns": 6, "max_action_tokens": 20}}).agent
    with pytest.raises(DemonstrationError, match="over the action budget"):
        play(Teacher(episode.actions, agent=small, max_context=2048), episode)
    with pytest.raises(DemonstrationError, match="over the turn budget"):
        Teacher(episode.actions * 4, agent=CONFIG.agent, max_context=2048)
    with pytest.raises(DemonstrationError, match="without its argument: replace needs 'new'"):
        Action("replace", {"path": "a.py", "old": "x"}).text()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 1: not a chat conversation"),
        (json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}), "line 1: not a chat"),
        (
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "x"},
                        {
                            "role": "assistant",
                            "tool_calls": [{"function": {"name": "rm_rf", "arguments": {}}}],
                        },
                    ]
                }
            ),
            "line 1: unknown tools",
        ),
    ],
)
def test_malformed_imports_name_their_line(line, message) -> None:
    with pytest.raises(DemonstrationError, match=message):
        imported_episodes(line)


def test_sft_lowers_the_loss_on_demonstrations() -> None:
    from services.trainer.group import PolicyGroup

    (episode,) = imported_episodes(json.dumps(CONVERSATION))
    trajectory = play(Teacher(episode.actions, agent=CONFIG.agent, max_context=2048), episode)
    policy = PolicyGroup(CONFIG, timeout_s=120)  # the trainer's worker group, one rank
    try:
        losses = [policy.sft([trajectory], learning_rate=3e-3)["loss"] for _ in range(40)]
    finally:
        policy.close()
    assert losses[-1] < 0.5 * losses[0]
