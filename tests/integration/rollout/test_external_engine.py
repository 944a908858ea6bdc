"""Rollouts on an external engine (services.rollout.external), the protocol path against `crucible serve
--weights-dir` as the server: each version is written as a Hugging Face checkpoint and reloaded
through SGLang's `/update_weights_from_disk`; episodes sample through SGLang's `/generate` or vLLM's
`/v1/completions` under the run's grammar. The trajectory is recorded exactly: the trainer recomputes
the logprobs the server sampled with, every token carries the version that made it, and a reload never
lands in the middle of a request."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import torch
from calc_task import calc_task
from chat_model import save_chat_model
from crucible_serve import crucible_serve

from crucible.agent.episode import EpisodeState, run_episode
from crucible.clients.sandbox import SandboxClient
from crucible.contracts.packing import unpack
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.trajectories import check_trajectory
from crucible.model.hf import load_pretrained
from services.rollout.external import ExternalEngine, ExternalEngineError
from services.trainer.batch import collate
from services.trainer.policy import token_logprobs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A chat model's checkpoint, and `crucible serve` on it allowed to load from a weights directory."""
    root = tmp_path_factory.mktemp("external")
    checkpoint = save_chat_model(root / "hf")
    weights = root / "weights"
    weights.mkdir()
    with crucible_serve(str(checkpoint), "--weights-dir", str(weights), "--threads", "1") as url:
        yield checkpoint, weights, url.removesuffix("/v1")


def _engine(served, kind: str, **agent) -> tuple[ExternalEngine, RunConfig]:
    checkpoint, weights, url = served
    config = RunConfig.model_validate(
        {"model": {"source": str(checkpoint)}, "agent": {"max_turns": 3, **agent}}
    )
    engine = ExternalEngine(
        config=config, url=url, kind=kind, weights_dir=weights / uuid.uuid4().hex, max_context=1800
    )
    return engine, config


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


async def _version(url: str) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(url + "/health")).json()["version"]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_an_episode_on_the_external_engine_is_recorded_exactly(served, bus, store, sandbox, kind):
    checkpoint, _, url = served
    model = load_pretrained(checkpoint).eval()
    state = _perturbed(model.state_dict(), seed=len(kind))
    model.load_state_dict(state)  # the trainer's copy of the version the server is told to load
    engine, config = _engine(served, "sglang")
    version = await _version(url) + 1
    await engine.load(state, version)
    assert await _version(url) == version and engine.version == version
    engine.kind = kind  # the weights went in through SGLang's reload; now sample in this dialect

    task = await calc_task(store)
    session = await SandboxClient(bus).create(
        run_id="external-engine-test", task_id=task.task_id, snapshot=task.snapshot
    )
    try:
        async with session:
            trajectory = await run_episode(
                engine=engine, config=config, task=task, session=session, run_id="r", group_id="g", seed=3,
                replica="test", tool_timeout_s=10,
            )  # fmt: skip
    finally:
        await engine.aclose()
    check_trajectory(trajectory)
    assert trajectory.tool_calls, trajectory.finish_reason
    mask = unpack("u8", trajectory.loss_mask)
    assert set(unpack("u32", trajectory.versions)) == {version} and sum(mask) > 0

    batch = collate([trajectory], [1.0])
    with torch.no_grad():
        recomputed = token_logprobs(model, batch, temperature=1.0, tool_calls=engine.tool_calls)[0]
    sampled = batch.mask_BT > 0
    # under the replayed grammar: the server sampled from the masked distribution, as the trainer sees it
    assert torch.allclose(recomputed[sampled], batch.behaviour_logprobs_BT[sampled], atol=1e-4)


async def test_a_reload_waits_for_the_request_in_flight_and_the_next_request_has_the_new_weights(served):
    checkpoint, _weights, url = served
    engine, _ = _engine(served, "sglang", max_summary_tokens=600)
    base = load_pretrained(checkpoint).state_dict()
    try:
        first = await _version(url) + 1
        await engine.load(_perturbed(base, seed=10), first)
        prompt = engine.tokenizer.encode("<user>Tell me everything.<|end|><assistant>")
        long = EpisodeState()
        long.append_env(prompt, first)
        generator = torch.Generator().manual_seed(0)
        summary = asyncio.create_task(engine.sample_summary(long, generator=generator))
        while engine._gate._requests == 0:  # observed: the request is under way
            await asyncio.sleep(0.005)
        reload = asyncio.create_task(engine.load(_perturbed(base, seed=11), first + 1))
        await (
            summary
        )  # each token's version, as the server reports it, must be the one the request began with
        await reload
        assert set(long.versions[len(prompt) :]) == {first}, "the reload landed inside the request"
        assert len(long) > len(prompt) + 1
        after = EpisodeState()
        after.append_env(prompt, first + 1)
        await engine.sample_summary(after, generator=generator)
        assert set(after.versions[len(prompt) :]) == {first + 1}
        assert sorted(p.name for p in engine.weights_dir.iterdir()) == [f"v{first + 1:06d}"]  # older ones go
    finally:
        await engine.aclose()


async def test_bad_reloads_are_refused_and_the_server_keeps_serving(served, tmp_path):
    checkpoint, weights, url = served
    async with httpx.AsyncClient(base_url=url) as client:
        outside = await client.post("/update_weights_from_disk", json={"model_path": str(checkpoint)})
        assert outside.status_code == 400 and "weights directory" in outside.json()["error"]["message"]
        missing = await client.post(
            "/update_weights_from_disk", json={"model_path": str(weights / "nothing")}
        )
        assert missing.status_code == 400 and "cannot load" in missing.json()["error"]["message"]
        older = await client.post(
            "/update_weights_from_disk", json={"model_path": str(weights / "x"), "weight_version": "-5"}
        )
        assert older.status_code == 400 and "older" in older.json()["error"]["message"]
        grammar = await client.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"ebnf": "start: nope"}}
        )
        assert grammar.status_code == 400 and "grammar" in grammar.json()["error"]["message"]
        unknown = await client.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}}
        )
        assert unknown.status_code == 400 and "json_schema" in unknown.json()["error"]["message"]
        kinds = await client.post(
            "/v1/completions", json={"prompt": [1, 2], "structured_outputs": {"regex": "a"}}
        )
        assert kinds.status_code == 400 and "regex" in kinds.json()["error"]["message"]
        ok = await client.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) <= 2

    engine, _ = _engine(served, "sglang")
    try:
        with pytest.raises(RuntimeError, match="no weights"):
            engine.new_episode()
        await engine.client.aclose()
        engine.client = httpx.AsyncClient(base_url="http://127.0.0.1:9")  # nothing listens there
        with pytest.raises(ExternalEngineError, match="ConnectError"):
            await engine.load(load_pretrained(checkpoint).state_dict(), 10**6)
        assert engine.version == -1  # a reload that failed changes nothing
    finally:
        await engine.aclose()
