"""A run's tools (agent.tools): the prompt describes only those, the action grammar allows only those, a
demonstration that calls another is refused; and every episode says where its tokens went (system and
tools, task, observations, actions), the system part being exactly what every task's prompt shares."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from crucible.agent import grammar, tokenizer
from crucible.agent.demonstrations import Teacher
from crucible.agent.episode import run_episode
from crucible.agent.solutions import Action, DemonstrationError, RecordedSession
from crucible.agent.toolcalls import ToolCallError, ToolCallGrammar, agent_tools, render_prompt
from crucible.contracts.messages import TOKEN_PARTS, ObjectRef, TaskSpec, Trajectory
from crucible.contracts.packing import unpack
from crucible.contracts.runconfig import RunConfig

SOME = ["read_file", "replace", "submit"]
FIX = [
    Action("read_file", {"path": "calc.py"}),
    Action("replace", {"path": "calc.py", "old": "return a - b", "new": "return a + b"}),
]
RESULTS = ["def add(a, b):\n    return a - b\n", "calc.py: replaced; new text at lines 2-2"]


def config(tools: list[str] | None = None) -> RunConfig:
    agent = {"max_turns": 4, "max_action_tokens": 200, "max_observation_bytes": 300}
    return RunConfig.model_validate({"agent": agent if tools is None else {**agent, "tools": tools}})


def play(actor: Teacher, cfg: RunConfig, statement: str) -> Trajectory:
    task = TaskSpec(task_id="t", taskset="s", difficulty=0, statement=statement,
                    snapshot=ObjectRef(uri="", sha256="", size=0))  # fmt: skip
    episode = run_episode(
        engine=actor, config=cfg, task=task, session=RecordedSession(list(RESULTS)), run_id="r",
        group_id="g", seed=0, replica="test", tool_timeout_s=1.0,
    )  # fmt: skip
    return asyncio.run(episode)


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_the_tools_are_validated_and_kept_in_one_order() -> None:
    assert config(["submit", "replace", "read_file"]).agent.tools == SOME
    assert config().agent.tools == list(tokenizer.TOOLS)
    with pytest.raises(ValidationError, match="must include submit"):
        config(["read_file", "replace"])
    with pytest.raises(ValidationError, match="names a tool twice"):
        config(["submit", "submit"])
    with pytest.raises(ValidationError, match=r"tools\.0"):
        config(["rm_rf", "submit"])


def test_the_byte_level_table_allows_only_the_run_s_tools() -> None:
    table = grammar.allowed_table(tools=SOME)
    allowed = {tokenizer.tool_name(t) for t in table[grammar.TOOL].nonzero().flatten().tolist()}
    assert allowed == set(SOME)
    assert grammar.allowed_table()[grammar.TOOL].sum() == len(tokenizer.TOOLS)


def test_a_chat_prompt_and_grammar_carry_only_the_run_s_tools(tokenizer) -> None:
    messages = [{"role": "user", "content": "Fix add()."}]
    narrow = tokenizer.decode(render_prompt(tokenizer, messages, tools=agent_tools(SOME)))
    wide = tokenizer.decode(render_prompt(tokenizer, messages, tools=agent_tools(None)))
    assert '"list_dir"' in wide and '"list_dir"' not in narrow and '"replace"' in narrow
    assert len(narrow) < len(wide)
    calls = ToolCallGrammar(tokenizer, tools=agent_tools(SOME), vocab_size=len(tokenizer))
    allowed, refused = (
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>',
        '<tool_call>\n{"name": "list_dir", "arguments": {"path": "."}}\n</tool_call>',
    )
    for text, ok in ((allowed, True), (refused, False)):
        matcher = calls.matcher()
        try:
            for token in tokenizer.encode(text, add_special_tokens=False):
                calls.advance(matcher, token)
        except ToolCallError:
            assert not ok
        else:
            assert ok
    with pytest.raises(ToolCallError, match="unknown tools"):
        agent_tools(["rm_rf"])


def test_a_demonstration_that_calls_a_tool_outside_the_run_s_is_refused() -> None:
    narrow = config(["replace", "submit"])
    teacher = Teacher(list(FIX), agent=narrow.agent, max_context=2048)
    with pytest.raises(DemonstrationError, match=r"read_file, which is not in agent\.tools"):
        play(teacher, narrow, "add() subtracts")


@pytest.mark.parametrize("chat", [False, True])
def test_every_episode_says_where_its_tokens_went(chat, tokenizer) -> None:
    cfg = config(SOME)
    extra = {}
    if chat:
        calls = ToolCallGrammar.for_agent(tokenizer, vocab_size=len(tokenizer), agent=cfg.agent)
        extra = {"tokenizer": tokenizer, "tool_calls": calls}
    one, two = (
        play(Teacher(list(FIX), agent=cfg.agent, max_context=4096, **extra), cfg, statement)
        for statement in ("add() subtracts instead of adding", "mul() is wrong")
    )
    for trajectory in (one, two):
        usage = trajectory.token_usage
        assert usage is not None and trajectory.finish_reason == "submitted"
        tokens, mask = unpack("u32", trajectory.tokens), unpack("u8", trajectory.loss_mask)
        assert sum(getattr(usage, part) for part in TOKEN_PARTS) == len(tokens)
        # the byte-level submit's <end> is the environment's, counted with the action it closes
        assert usage.actions == sum(mask) + (0 if chat else 1)
        assert usage.task > 0 and usage.observations > 0
    a, b = unpack("u32", one.tokens), unpack("u32", two.tokens)
    assert one.token_usage.system == two.token_usage.system == common(a, b)  # type: ignore[union-attr]
    text = tokenizer.decode(a) if chat else "".join(map(chr, (t for t in a if t < 256)))
    assert "list_dir" not in text and "replace" in text
