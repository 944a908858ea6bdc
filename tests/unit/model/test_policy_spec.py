"""A run's `model` section resolved once (crucible.model.spec): presets without a tokenizer, a packaged
GGUF and a checkpoint directory with theirs, the context cap, the precision, and a stable digest."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
from chat_model import save_chat_model

from crucible.contracts.runconfig import AgentSection, ModelSection, RunConfig
from crucible.model import PRESETS
from crucible.model.sources import SourceError
from crucible.model.spec import PolicySpec, resolve_policy

SMOLLM = "package:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("spec") / "hf", max_positions=256)


def test_a_preset_is_byte_level_with_no_tokenizer_nor_grammar() -> None:
    spec = PolicySpec.resolve(RunConfig(model=ModelSection(source="tiny", precision="fp32")), max_context=64)
    assert (spec.kind, spec.location, spec.byte_level) == ("preset", "tiny", True)
    assert spec.architecture == PRESETS["tiny"]
    assert (spec.tokenizer, spec.chat_template, spec.tool_calls) == (None, None, None)
    assert (spec.precision, spec.max_context) == ("fp32", 64)
    with pytest.raises(SourceError, match="no tokenizer"):
        spec.grammar()
    model = spec.initial_model(seed=3)
    assert model.cfg == spec.architecture and model.precision == "fp32"


def test_the_context_is_the_smaller_of_the_models_and_the_callers() -> None:
    longest = PRESETS["tiny"].max_seq_len
    assert resolve_policy("tiny").max_context == longest
    assert resolve_policy("tiny", max_context=longest * 4).max_context == longest
    assert resolve_policy("tiny").with_context(100).max_context == 100
    assert resolve_policy("tiny").with_context(longest + 1).max_context == longest


def test_bad_precisions_and_sources_are_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        resolve_policy("tiny", precision="fp16")
    with pytest.raises(SourceError, match="neither a preset"):
        resolve_policy("/nowhere/at/all")


def test_the_packaged_model_resolves_its_tokenizer_template_and_grammar_once() -> None:
    agent = AgentSection(max_action_tokens=32)
    spec = resolve_policy(SMOLLM, precision="bf16", agent=agent, max_context=1024)
    assert spec.kind == "gguf" and spec.location.endswith(".gguf") and not spec.byte_level
    assert (spec.architecture.family, spec.architecture.vocab_size) == ("llama", 49152)
    assert spec.max_context == min(1024, spec.architecture.max_seq_len)
    assert spec.precision == "bf16" and spec.action_chars == 32
    tokenizer = spec.tokenizer
    assert tokenizer.eos_token_id is not None and "<|im_start|>" in spec.chat_template
    grammar = spec.tool_calls
    assert grammar.vocab_size == spec.architecture.vocab_size and '"maxLength": 32' in grammar.lark
    again = resolve_policy(SMOLLM, precision="bf16", agent=agent, max_context=1024)
    assert again == spec and again.tokenizer is tokenizer and again.tool_calls is grammar
    other_budget = resolve_policy(SMOLLM, agent=AgentSection(max_action_tokens=8))
    assert other_budget.tokenizer is tokenizer and other_budget.tool_calls is not grammar
    assert other_budget.digest == spec.digest


def test_a_checkpoint_directory_resolves_with_its_own_tokenizer(checkpoint: Path) -> None:
    spec = resolve_policy(str(checkpoint), precision="fp32", max_context=4096)
    assert (spec.kind, spec.location, spec.max_context) == ("hf", str(checkpoint), 256)
    assert spec.tokenizer.eos_token == "<|end|>" and spec.chat_template
    assert spec.tool_calls is not None and spec.action_chars is None
    assert spec.initial_model().cfg == spec.architecture


def test_the_digest_is_stable_and_follows_the_files_not_their_place(checkpoint: Path, tmp_path: Path) -> None:
    first = resolve_policy(str(checkpoint)).digest
    assert resolve_policy(str(checkpoint), precision="fp32").digest == first
    moved = shutil.copytree(checkpoint, tmp_path / "elsewhere")
    assert resolve_policy(str(moved)).digest == first
    (moved / "config.json").write_text((moved / "config.json").read_text() + "\n")
    assert resolve_policy(str(moved)).digest != first
    assert resolve_policy("tiny").digest != resolve_policy("small").digest


def test_a_spec_travels_to_a_worker_as_plain_data() -> None:
    spec = resolve_policy(SMOLLM, agent=AgentSection())
    assert spec.tokenizer is not None
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and copy.tokenizer is spec.tokenizer
