"""Crucible's reference agent harness: a program apart from the rollout that drives one episode the way
any OpenAI-API agent harness does ("replace base_url"), so that it exercises the same path as an
external one. It reads the task from the episode's endpoint, asks the policy for one tool call per turn
through the official `openai` client, runs the call through the episode's tool endpoint, and keeps the
conversation verbatim (the rollout records it token for token).

    OPENAI_BASE_URL=http://HOST:PORT/episodes/ID/v1 CRUCIBLE_EPISODE_URL=http://HOST:PORT/episodes/ID \\
        python -m crucible.agent.harness

The rollout starts it (its `harness_command`) with both set; it needs no torch.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import openai


def main() -> int:
    episode = httpx.Client(base_url=os.environ["CRUCIBLE_EPISODE_URL"], timeout=600)
    task = episode.get("/task").raise_for_status().json()
    client = openai.OpenAI(
        max_retries=0, timeout=600
    )  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages: list[Any] = [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["statement"]},
    ]
    for _ in range(task["max_turns"]):
        try:
            reply = client.chat.completions.create(
                model=task["model"], messages=messages, tools=task["tools"], tool_choice="required"
            )
        except openai.BadRequestError as exc:  # the episode is over (its context or its turns are spent)
            print(f"harness: {exc.message}", file=sys.stderr)
            return 0
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
            return 0  # the call did not close within the action budget
        call = choice.message.tool_calls[0]
        if call.type != "function":  # the episode's API serves function calls only
            raise RuntimeError(f"unexpected tool call type {call.type!r}")
        result = episode.post(f"/tools/{call.function.name}", json=json.loads(call.function.arguments))
        result.raise_for_status()
        if call.function.name == "submit":
            return 0
        output = result.json()
        text = output["output"] if output["ok"] else f"error: {output['error']}"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
