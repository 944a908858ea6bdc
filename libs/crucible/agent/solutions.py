"""Known solutions as sequences of the agent's tool calls, the material of demonstrations
(crucible.agent.demonstrations plays them). Two sources:

- a task's reference patch (`reference_actions`): read each changed file, replace each changed block,
  run the tests, submit;
- imported conversations (`imported_episodes`): JSONL, one `{"messages": [...]}` per line in the
  OpenAI chat format (assistant `tool_calls`, `tool` results), whose recorded results stand in for the
  sandbox (`RecordedSession`).

No torch here: `crucible sft` validates an imported file with it before uploading.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from crucible.agent import tokenizer
from crucible.contracts.sandbox import ToolResult

TEST_COMMAND = "python -m pytest -q -p no:cacheprovider"
"""What a reference demonstration runs to check its fix (the repository's visible tests)."""


class DemonstrationError(ValueError):
    """A solution that cannot be played as an episode within the run's agent budget, or an imported
    conversation that is malformed; the message starts with the kind of problem, then its particulars."""


@dataclass(frozen=True)
class Action:
    name: str
    arguments: dict[str, str]

    def text(self) -> str:
        """The byte-level agent's argument text (see crucible.agent.episode.tool_arguments)."""
        a = self.arguments
        try:
            if self.name == "replace":
                if "\n" in a["old"]:
                    raise DemonstrationError(
                        "a multi-line edit: the byte-level replace takes a one-line `old`"
                    )
                return f"{a['path']}\n{a['old']}\n{a['new']}"
            key = ARGUMENT.get(self.name)
            return a[key] if key else ""
        except KeyError as exc:
            raise DemonstrationError(f"a tool call without its argument: {self.name} needs {exc}") from None


ARGUMENT = {"read_file": "path", "list_dir": "path", "grep": "pattern", "run": "command"}
"""The one argument of each byte-level tool that takes one."""
SUBMIT = Action("submit", {})


def snapshot_files(archive: bytes, paths: Iterable[str]) -> dict[str, str]:
    """The text of `paths` in a task's snapshot (tar.gz); a missing path raises DemonstrationError."""
    wanted = set(paths)
    found: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if name in wanted and member.isfile():
                found[name] = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
    missing = wanted - set(found)
    if missing:
        raise DemonstrationError(f"files missing from the snapshot: {sorted(missing)}")
    return found


def changed_paths(patch: str) -> list[str]:
    from unidiff.patch import PatchSet

    return [file.path for file in PatchSet(patch)]


def reference_actions(patch: str, files: dict[str, str], *, byte_level: bool) -> list[Action]:
    """The actions that apply `patch` to `files` (path -> text): read each changed file, one replace per
    changed block (`old` grown by context lines until it occurs once; one line for the byte-level
    agent), run the tests, submit."""
    from unidiff.patch import PatchSet

    actions: list[Action] = []
    edits: list[Action] = []
    for file in PatchSet(patch):
        if not file.is_modified_file:
            raise DemonstrationError(f"a file added or deleted: {file.path} (replace edits existing files)")
        text = files[file.path]
        actions.append(Action("read_file", {"path": file.path}))
        for hunk in file:
            old, new = _block(hunk, text, one_line=byte_level)
            edits.append(Action("replace", {"path": file.path, "old": old, "new": new}))
            text = text.replace(old, new, 1)
    return [*actions, *edits, Action("run", {"command": TEST_COMMAND}), SUBMIT]


def _block(hunk: Any, text: str, *, one_line: bool) -> tuple[str, str]:
    """(old, new) for one hunk: the source lines from its first change to its last (for a pure insertion,
    the line before it), widened by the hunk's context until `old` occurs exactly once in `text`."""
    lines = list(hunk)
    changed = [i for i, line in enumerate(lines) if not line.is_context]
    first, last = changed[0], changed[-1]
    if not any(lines[i].is_removed for i in changed):  # a pure insertion: anchor on a neighbour
        if first > 0:
            first -= 1
        elif last + 1 < len(lines):
            last += 1
        else:
            raise DemonstrationError("an insertion with no line to anchor it: empty file")
    while True:
        span = lines[first : last + 1]
        old = "".join(line.value for line in span if not line.is_added).removesuffix("\n")
        new = "".join(line.value for line in span if not line.is_removed).removesuffix("\n")
        if text.count(old) == 1 and old:
            break
        if one_line or (first == 0 and last == len(lines) - 1):
            raise DemonstrationError(f"no unique block to replace: {str(hunk)[:200]!r}")
        first, last = max(first - 1, 0), min(last + 1, len(lines) - 1)
    if one_line and "\n" in old:
        raise DemonstrationError("a multi-line edit: the byte-level replace takes a one-line `old`")
    return old, new


class RecordedSession:
    """Stands in for a sandbox session: each tool call gets the next recorded result."""

    def __init__(self, results: list[str]) -> None:
        self.results = list(results)

    async def tool(self, name: str, /, **arguments: object) -> ToolResult:
        text = self.results.pop(0) if self.results else ""
        if text.startswith("error: "):
            return ToolResult(ok=False, error=text.removeprefix("error: "))
        return ToolResult(ok=True, output=text)

    async def diff(self) -> str:
        return ""


@dataclass(frozen=True)
class ImportedEpisode:
    statement: str
    actions: list[Action]
    results: list[str]


def imported_episodes(text: str) -> list[ImportedEpisode]:
    """Parse JSONL conversations: the first user message is the task statement, each assistant tool call
    an action (its `arguments` a JSON object or its encoding), each `tool` message the result of the
    call before it; the agent's own system prompt replaces any system message. Raises
    DemonstrationError naming the line of the first malformed conversation."""
    episodes = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            statement = next(m["content"] for m in messages if m["role"] == "user")
            actions: list[Action] = []
            results: list[str] = []
            for message in messages:
                if message["role"] == "assistant":
                    for call in message.get("tool_calls") or []:
                        fn = call["function"]
                        arguments = fn.get("arguments") or {}
                        if isinstance(arguments, str):
                            arguments = json.loads(arguments)
                        if not isinstance(arguments, dict):
                            raise TypeError("tool call arguments must be an object")
                        actions.append(Action(fn["name"], {k: str(v) for k, v in arguments.items()}))
                elif message["role"] == "tool":
                    results.append(str(message.get("content", "")))
        except (ValueError, KeyError, TypeError, StopIteration) as exc:
            raise DemonstrationError(
                f"line {number}: not a chat conversation with tool calls ({exc!r})"
            ) from None
        unknown = {a.name for a in actions} - set(tokenizer.TOOLS)
        if unknown:
            raise DemonstrationError(
                f"line {number}: unknown tools {sorted(unknown)}; the agent's are {tokenizer.TOOLS}"
            )
        if actions and actions[-1].name == "submit":
            actions.pop()
        episodes.append(ImportedEpisode(statement=str(statement), actions=actions, results=results))
    return episodes
