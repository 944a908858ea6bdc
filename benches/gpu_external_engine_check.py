"""GPU check of the external-engine path (services.rollout.external) against a real vLLM or SGLang server.

    python benches/gpu_external_engine_check.py --kind vllm            # starts `vllm serve` itself
    python benches/gpu_external_engine_check.py --kind sglang
    python benches/gpu_external_engine_check.py --kind sglang --url http://127.0.0.1:30000 --model DIR
    # the protocol path on CPU, against `crucible serve DIR --weights-dir W --port 30011`:
    python benches/gpu_external_engine_check.py --kind sglang --url http://127.0.0.1:30011 --model DIR \\
        --weights-dir W

It prepares SmolLM2-135M-Instruct (from its package) as a Hugging Face directory, starts the engine on it
with the flags services/rollout/external.py names (unless --url is given: a server already started on
--model with those flags), then, through the rollout's own ExternalEngine:

  1. reloads perturbed weights as version 1 through the engine's reload endpoint, from a weights dir;
  2. samples --calls tool calls under the run's grammar (temperature 1) for one episode prompt;
  3. replays the grammar over every call and recomputes every sampled token's logprob with Crucible's
     transformer on the same weights, reporting |server - trainer| (p50, p99, max);
  4. times --calls concurrent calls against the same calls one at a time (tokens/s, the ratio).

Exit status 1 if the reload did not take (greedy output unchanged by the perturbation), a call has a
token the grammar does not allow, or the median logprob error exceeds 1e-2: the server then reports raw
logprobs, or decodes without the grammar, and the run's importance ratios would be wrong. Neither engine
is installed on the machines Crucible's tests run on; this is the check for a GPU machine that has one.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from crucible.agent.episode import CHAT_SYSTEM_PROMPT, EpisodeState
from crucible.agent.grammar import TOOL_CALL
from crucible.agent.toolcalls import ToolCallError, render_prompt
from crucible.contracts.runconfig import RunConfig
from crucible.model.hf import export_pretrained, load_pretrained
from crucible.model.scoring import unpack_allowed
from crucible.model.sources import initial_model, load_tokenizer
from services.rollout.external import ExternalEngine

SOURCE = "package:smollm2-135m-instruct"


def prepare(model_dir: Path) -> None:
    export_pretrained(initial_model(SOURCE, seed=0, precision="fp32"), model_dir)
    load_tokenizer(SOURCE).save_pretrained(model_dir)


def launch(kind: str, model_dir: Path, port: int) -> subprocess.Popen:
    if kind == "vllm":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--port", str(port), "--host", "127.0.0.1", "--logprobs-mode", "processed_logprobs",
                "--structured-outputs-config", '{"backend": "guidance"}', "--enforce-eager"]  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    else:
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_dir),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--grammar-backend",
            "llguidance",
        ]
        env = {**os.environ, "SGLANG_DISABLE_REQUEST_LOGGING": "1"}
    return subprocess.Popen(argv, env=env)


def wait_up(url: str, process: subprocess.Popen | None, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the engine exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit("the engine did not come up")


async def check(args, model_dir: Path, url: str) -> int:
    config = RunConfig.model_validate(
        {"model": {"source": str(model_dir)}, "agent": {"max_action_tokens": 96}}
    )
    weights = args.weights_dir or Path(tempfile.mkdtemp(prefix="crucible-weights-"))
    engine = ExternalEngine(config=config, url=url, kind=args.kind, weights_dir=weights, max_context=2048)
    model = load_pretrained(model_dir).eval()
    tok = engine.tokenizer
    prompt = render_prompt(tok, [{"role": "system", "content": CHAT_SYSTEM_PROMPT},
                                 {"role": "user", "content": "Fix add() in calc/ops.py."}])  # fmt: skip
    failures = []

    async def greedy() -> list[int]:
        state = EpisodeState(greedy=True)
        state.append_env(prompt, engine.version)
        await engine.sample_tool_call(state, generator=torch.Generator().manual_seed(0))
        return state.tokens[len(prompt) :]

    engine._version = 0  # the server started on these weights
    before = await greedy()
    generator = torch.Generator().manual_seed(1)
    perturbed = {
        k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()
    }
    model.load_state_dict(perturbed)
    await engine.load(perturbed, 1)
    if await greedy() == before:
        failures.append("the reload did not change the greedy call: the weights were not loaded")

    async def one(seed: int) -> EpisodeState:
        state = EpisodeState()
        state.append_env(prompt, engine.version)
        await engine.sample_tool_call(state, generator=torch.Generator().manual_seed(seed))
        return state

    t0 = time.perf_counter()
    states = await asyncio.gather(*(one(s) for s in range(args.calls)))
    batched_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(args.calls):
        await one(1000 + s)
    serial_s = time.perf_counter() - t0
    tokens = sum(len(s) - len(prompt) for s in states)

    errors, parsed, outside = [], 0, 0
    for state in states:
        sampled = state.tokens[len(prompt) :]
        try:
            engine.tool_calls.parse(tok.decode(sampled))
            parsed += 1
        except ToolCallError:
            pass  # the action budget ran out before the call closed
        try:
            constrained = [c == TOOL_CALL for c in state.constraints]
            replayed = engine.tool_calls.replay(state.tokens, constrained)
        except ToolCallError:
            outside += 1
            continue
        at = itertools.compress(range(len(state)), constrained)
        masks = dict(zip(at, unpack_allowed(replayed, engine.tool_calls.vocab_size), strict=False))
        with torch.no_grad():
            logits = model(torch.tensor([state.tokens])).logits[0].float()
        for t in range(len(prompt), len(state)):
            if not state.loss_mask[t]:
                continue
            logp = torch.log_softmax(logits[t - 1].masked_fill(~masks[t], float("-inf")), dim=-1)
            errors.append(abs(float(logp[state.tokens[t]]) - state.logprobs[t]))
    errors_t = torch.tensor(errors)
    p50, p99 = (float(errors_t.quantile(q)) for q in (0.5, 0.99))
    print(
        f"{args.kind}: {parsed}/{args.calls} calls closed within the budget, {outside} left the grammar; "
        f"|server - trainer| logprob p50 {p50:.2e} "
        f"p99 {p99:.2e} max {float(errors_t.max()):.2e} over {len(errors)} tokens"
    )
    print(f"{args.calls} calls: concurrent {tokens / batched_s:.1f} tokens/s, one at a time "
          f"{tokens / serial_s:.1f} tokens/s, ratio {serial_s / batched_s:.2f}")  # fmt: skip
    if outside:
        failures.append(f"{outside} calls sampled tokens the grammar does not allow: it was not applied")
    if p50 > 1e-2:
        failures.append("logprobs differ from the trainer's: raw logprobs, or another distribution")
    await engine.aclose()
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", choices=["vllm", "sglang"], required=True)
    parser.add_argument("--url", help="a server already running (on --model, with the flags above)")
    parser.add_argument("--model", type=Path, help="its Hugging Face directory (default: prepared here)")
    parser.add_argument("--weights-dir", type=Path, help="where versions are written (one the server sees)")
    parser.add_argument("--port", type=int, default=30011)
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    model_dir = args.model or Path(tempfile.mkdtemp(prefix="crucible-model-"))
    if args.model is None:
        prepare(model_dir)
    process = None if args.url else launch(args.kind, model_dir, args.port)
    url = (args.url or f"http://127.0.0.1:{args.port}").rstrip("/")
    try:
        wait_up(url, process)
        sys.exit(asyncio.run(check(args, model_dir, url)))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
