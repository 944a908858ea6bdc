"""Tool calls in a pretrained model's own chat format, decoded under a JSON-schema grammar.

An action is the Hermes / Qwen tool-call block that most chat templates use,

    <tool_call>
    {"name": "read_file", "arguments": {"path": "calc/ops.py"}}
    </tool_call><end of turn>

and every token of it is sampled from the model's distribution masked by a grammar (llguidance, decision
0009) built from the tools' JSON schemas, so an action always parses and names a real tool with valid
arguments. The logprob recorded for a sampled token is that of the masked distribution; the trainer
replays the grammar over the sampled tokens (`replay`) and gets the same masks, so the importance
ratio is exactly 1 on-policy.

The prompt comes from the tokenizer's chat template with the tools passed as the template expects; a
template that does not render tools (SmolLM2's) gets them in the system message instead, in the same
`<tools>` block the Hermes format uses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from crucible.contracts.runconfig import AgentSection

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }
    for name, description, properties in (
        ("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
        ("list_dir", "List a directory of the repository.", {"path": {"type": "string"}}),
        ("grep", "Search the repository for a regular expression.", {"pattern": {"type": "string"}}),
        (
            "replace",
            "Replace the text `old` by `new` in a file.",
            {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
        ),
        ("run", "Run a shell command in the repository.", {"command": {"type": "string"}}),
        ("submit", "Finish: the repository is fixed.", {}),
    )
]
"""The agent's tools as OpenAI-style function definitions (the byte-level agent's six, by name)."""
OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


class ToolCallError(ValueError):
    """A tokenizer or template the tool-call format cannot work with, or text that is not a tool call."""


def agent_tools(names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The definitions of a run's tools (agent.tools), in TOOLS' order; None: all of them."""
    if names is None:
        return TOOLS
    unknown = set(names) - {tool["function"]["name"] for tool in TOOLS}
    if unknown:
        raise ToolCallError(f"unknown tools {sorted(unknown)}")
    return [tool for tool in TOOLS if tool["function"]["name"] in names]


def action_schema(tools: list[dict[str, Any]] = TOOLS, *, max_chars: int | None = None) -> dict[str, Any]:
    """JSON schema of one call: {"name": one tool, "arguments": that tool's parameters, nothing else};
    with `max_chars`, no string argument is longer."""
    variants = []
    for tool in tools:
        fn = tool["function"]
        parameters = {**fn["parameters"], "additionalProperties": False}
        if max_chars is not None:
            parameters["properties"] = {
                k: {**v, "maxLength": max_chars} if v.get("type") == "string" else v
                for k, v in parameters.get("properties", {}).items()
            }
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"oneOf": variants}


class ToolCallGrammar:
    """The action grammar for one tokenizer: a fresh matcher per action, masks, and replay."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: list[dict[str, Any]] = TOOLS,
        vocab_size: int | None = None,
        max_chars: int | None = None,
        lark: str | None = None,
    ):
        import llguidance
        import llguidance.hf

        if tokenizer.eos_token_id is None:
            raise ToolCallError("the tokenizer has no end-of-turn (eos) token to close an action with")
        self.tokenizer = tokenizer
        self.tools = tools
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab_size = vocab_size or self.ll_tokenizer.vocab_size
        if self.vocab_size < self.ll_tokenizer.vocab_size:
            raise ToolCallError(f"the model's vocabulary ({self.vocab_size}) is smaller than the tokenizer's")
        if lark is None:
            schema = json.dumps(action_schema(tools, max_chars=max_chars))
            lark = f"start: {json.dumps(OPEN)} call {json.dumps(CLOSE)}\ncall: %json {schema}"
        self.lark = lark
        """The grammar's text (llguidance's Lark dialect), as an external engine is sent it."""
        self.grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        problem = llguidance.LLMatcher.validate_grammar(self.grammar, self.ll_tokenizer)
        if problem:
            raise ToolCallError(f"the grammar does not compile: {problem}")

    @classmethod
    def for_agent(cls, tokenizer: Any, *, vocab_size: int, agent: AgentSection) -> ToolCallGrammar:
        """The grammar a run's rollouts sample under and its trainer replays: a call to one of the run's
        tools, string arguments bounded by the action budget, so that a call can always close within it."""
        tools = agent_tools(agent.tools)
        return cls(tokenizer, tools=tools, vocab_size=vocab_size, max_chars=agent.max_action_tokens)

    def matcher(self) -> Any:
        import llguidance

        return llguidance.LLMatcher(self.ll_tokenizer, self.grammar)

    def allowed(self, matcher: Any) -> torch.Tensor:
        """Boolean [vocab_size]: the tokens the grammar allows next (ids past the tokenizer's: never)."""
        import llguidance.torch as lt

        from crucible.model.scoring import unpack_allowed

        bitmask = lt.allocate_token_bitmask(1, self.ll_tokenizer.vocab_size)
        lt.fill_next_token_bitmask(matcher, bitmask)
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[: self.ll_tokenizer.vocab_size] = unpack_allowed(bitmask[0], self.ll_tokenizer.vocab_size)
        return allowed

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise ToolCallError(f"token {token} is not allowed here: {matcher.get_error()}")

    def replay(self, tokens: list[int], constrained: list[bool]) -> torch.Tensor:
        """The grammar's allowed tokens at each constrained position, in order, packed 32 to a word:
        int32 [n_constrained, ceil(vocab_size / 32)] (crucible.model.scoring.unpack_allowed). Each run of
        constrained positions is one action, parsed from its start."""
        import llguidance.torch as lt

        at = [t for t, inside in enumerate(constrained) if inside]
        packed = lt.allocate_token_bitmask(max(len(at), 1), self.vocab_size)[: len(at)]
        packed.zero_()
        matcher, row = None, 0
        for token, inside in zip(tokens, constrained, strict=True):
            if not inside:
                matcher = None
                continue
            if matcher is None:
                matcher = self.matcher()
            lt.fill_next_token_bitmask(matcher, packed, row)
            row += 1
            if matcher.is_stopped():
                matcher = None  # the action ended with its end-of-turn token
                continue
            self.advance(matcher, token)
        return packed

    def parse(self, text: str) -> tuple[str, dict[str, Any]]:
        """(tool name, arguments) of an action's text."""
        body = text.strip()
        if body.endswith(self.tokenizer.eos_token):
            body = body[: -len(self.tokenizer.eos_token)].strip()
        if not (body.startswith(OPEN.strip()) and body.endswith(CLOSE.strip())):
            raise ToolCallError(f"not a tool call: {text[:80]!r}")
        try:
            call = json.loads(body[len(OPEN.strip()) : -len(CLOSE.strip())])
            return call["name"], call["arguments"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ToolCallError(f"malformed tool call {text[:80]!r}: {exc}") from None


def render_text(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    tools: list[dict[str, Any]] = TOOLS,
    generation: bool = True,
) -> str:
    """The conversation through the chat template (with the assistant's next turn opened if `generation`);
    tools passed as the template expects, or described in the system message where it ignores them; no
    tools, a plain conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise ToolCallError("the tokenizer has no chat template")
    try:
        if not tools:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        if _renders_tools(tokenizer):
            return tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation, tokenize=False
            )
        described = "\n".join(json.dumps(tool) for tool in tools)
        system = (
            "You may call one of these tools per turn. Answer with exactly one call, as "
            f'{OPEN.strip()}{{"name": ..., "arguments": {{...}}}}{CLOSE.strip()}\n'
            f"<tools>\n{described}\n</tools>"
        )
        if messages and messages[0]["role"] == "system":
            messages = [
                {"role": "system", "content": messages[0]["content"] + "\n\n" + system},
                *messages[1:],
            ]
        else:
            messages = [{"role": "system", "content": system}, *messages]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    except ToolCallError:
        raise
    except Exception as exc:  # jinja raises its own types for a role or field the template lacks
        raise ToolCallError(
            f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}"
        ) from None


def render_prompt(
    tokenizer: Any, messages: list[dict[str, str]], *, tools: list[dict[str, Any]] = TOOLS
) -> list[int]:
    """Token ids of the conversation so far, ending where the assistant's next turn begins."""
    return tokenizer.encode(render_text(tokenizer, messages, tools=tools), add_special_tokens=False)


def after_action(
    tokenizer: Any, messages: list[dict[str, str]], *, tools: list[dict[str, Any]] = TOOLS
) -> list[int]:
    """Token ids that follow the end-of-turn token of the assistant's last action, when `messages` ends
    with that action and the tool's result: the rest of the template up to the next assistant turn."""
    if len(messages) < 2 or messages[-2]["role"] != "assistant" or messages[-1]["role"] != "tool":
        raise ValueError("messages must end with the assistant's action and the tool's result")
    return after_turn(tokenizer, messages[:-1], messages, tools=tools)


def after_turn(
    tokenizer: Any,
    history: list[dict[str, str]],
    messages: list[dict[str, str]],
    *,
    tools: list[dict[str, Any]] = TOOLS,
) -> list[int]:
    """Token ids that follow the end-of-turn token closing `history` (which ends with an assistant turn),
    when the conversation goes on to `messages`: the template's rendering of the new messages, up to
    the next assistant turn."""
    if messages[: len(history)] != history or not history or history[-1]["role"] != "assistant":
        raise ToolCallError("the conversation must extend the history, which ends with the assistant's turn")
    full = render_text(tokenizer, messages, tools=tools)
    before = render_text(tokenizer, history, tools=tools, generation=False)
    cut = before.rfind(tokenizer.eos_token)
    if cut < 0 or not full.startswith(before[: cut + len(tokenizer.eos_token)]):
        raise ToolCallError("the chat template does not extend a conversation by appending to it")
    return tokenizer.encode(full[cut + len(tokenizer.eos_token) :], add_special_tokens=False)


def _renders_tools(tokenizer: Any) -> bool:
    probe = [
        {"type": "function", "function": {"name": "crucible_probe_tool", "parameters": {"type": "object"}}}
    ]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=probe, tokenize=False)
    return "crucible_probe_tool" in text
