"""The run config: one definition, nested by concern, loaded from TOML with overrides, carried on RUNS."""

from __future__ import annotations

import itertools
import re

import jsonschema
import msgspec
import pytest
from pydantic import ValidationError

from crucible.contracts import ContractError, decode, encode
from crucible.contracts.messages import RunCreated
from crucible.contracts.runconfig import MOVED, RunConfig, apply_override

SMOL = "package:smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"schedule": {"group_size": 0}}, "schedule.group_size\n.*greater than or equal to 1"),
        ({"model": {"precision": "fp4"}}, "'bf16', 'mxfp8' or 'fp32'"),
        ({"model": {"source": "huge"}}, "unknown model source 'huge': a preset \\(tiny"),
        ({"model": {"source": "package:nope"}}, "unknown model source 'package:nope'"),
        ({"optim": {"learning_rate": -1}}, "greater than 0"),
        ({"tasks": {"difficulties": []}}, "at least 1 item"),
        ({"tasks": {"taskset": "a b"}}, "should match pattern"),
        ({"bogus": 1}, "Extra inputs are not permitted"),
        ({"agent": {"bogus": 1}}, "agent.bogus\n.*Extra inputs are not permitted"),
        # what no service can serve: more episodes than one sandbox fork makes, numbers past any store
        ({"schedule": {"group_size": 100}}, "schedule.group_size\n.*less than or equal to 64"),
        ({"seed": 2**70}, "seed\n.*less than 4294967296"),
        ({"schedule": {"max_steps": 10**12}}, "schedule.max_steps\n.*less than or equal to 1000000"),
        # only the JSON kinds the schema promises: no flag for a number, no text for a flag, no NaN
        ({"sft": {"tasks": False}}, "sft.tasks\n.*a number, not true or false"),
        ({"seed": "5"}, "seed\n.*a number, not a string"),
        ({"eval": {"at_end": 1}}, "eval.at_end\n.*true or false"),
        ({"tasks": {"difficulties": [1, True]}}, "a number, not true or false"),
        ({"optim": {"learning_rate": float("nan")}}, "finite number"),
        ({"model": {"source": "tiny\x00"}}, "should match pattern"),
        # a parallel layout that does not fit its ranks
        ({"parallel": {"world_size": 4, "ep": 3}}, "ep = 3 must divide world_size = 4"),
        ({"parallel": {"world_size": 4, "dp_shard": 3}}, "dp_replicate x dp_shard = 1 x 3 must equal world_"),
        ({"parallel": {"launcher": "slurm"}}, "'local' or 'ray'"),
        (
            {"agent": {"driver": "harness", "context_policy": "summarize"}, "model": {"source": SMOL}},
            "builtin loop",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_field(config: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig.model_validate(config)


def test_an_integral_float_is_an_integer_as_json_schema_reads_it() -> None:
    assert RunConfig.model_validate({"seed": 3.0, "tasks": {"difficulties": [2.0]}}).seed == 3


def test_flat_fields_of_the_first_config_name_their_new_place() -> None:
    with pytest.raises(ValidationError) as caught:
        RunConfig.model_validate({"group_size": 2, "model_preset": "tiny", "learning_rate": 1e-4})
    text = str(caught.value)
    assert "`group_size` is now `schedule.group_size`" in text
    assert "`model_preset` is now `model.source`" in text
    assert "`learning_rate` is now `optim.learning_rate`" in text
    for old, new in MOVED.items():  # every place named exists
        for place in re.findall(r"\w+\.\w+", new):
            section, field = place.split(".")
            assert field in type(getattr(RunConfig(), section)).model_fields, (old, new)


def test_every_field_has_a_docstring_for_the_schema() -> None:
    schema = RunConfig.model_json_schema()
    for name, section in schema["$defs"].items():
        for field, spec in section["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no docstring"


def test_toml_with_overrides() -> None:
    text = "seed = 3\n[schedule]\nmax_steps = 4\ngroup_size = 2\n"
    config = RunConfig.from_toml(
        text, overrides=["optim.learning_rate=1e-4", "tasks.taskset=mine", "tasks.difficulties=[1]"]
    )
    assert config.seed == 3 and config.schedule.max_steps == 4 and config.schedule.group_size == 2
    assert config.optim.learning_rate == 1e-4
    assert config.tasks.taskset == "mine" and config.tasks.difficulties == [1]
    assert config.agent == RunConfig().agent


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("[schedule\n", [], "not valid TOML"),
        ("", ["schedule.max_steps"], "not of the form section.field=value"),
        ("seed = 1", ["seed.x=1"], "'seed' is a value, not a section"),
        ("", ["schedule.max_steps=0"], "schedule.max_steps"),
    ],
)
def test_bad_toml_or_overrides_are_clear_errors(text: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig.from_toml(text, overrides=overrides)


def test_apply_override_builds_sections() -> None:
    data: dict = {}
    apply_override(data, "agent.temperature = 0.5")
    assert data == {"agent": {"temperature": 0.5}}


def test_the_config_travels_on_the_bus_and_is_validated_on_arrival() -> None:
    config = RunConfig.model_validate({"seed": 7, "model": {"precision": "mxfp8"}})
    created = RunCreated(run_id="r", name="n", config=config, created_at=1.0)
    assert decode(encode(created), RunCreated) == created
    forged = msgspec.msgpack.encode(
        {"type": "run.created.v1", "run_id": "r", "name": "n", "created_at": 1.0,
         "config": {"schedule": {"group_size": 0}}}
    )  # fmt: skip
    with pytest.raises(ContractError, match="greater than or equal to 1"):
        decode(forged, RunCreated)


def _valid(config: dict) -> bool:
    try:
        RunConfig.model_validate(config)
    except ValidationError:
        return False
    return True


AGREEMENT_CASES = [
    {"optim": {"correction": correction, "loss": loss}}
    for correction, loss in itertools.product(["none", "tis", "mis"], ["ppo", "cispo", "decoupled"])
] + [{"optim": {"correction": "tis"}}, {"optim": {"loss": "ppo"}}, {"optim": {}}] + [
    {"agent": agent, "model": model}
    for agent in [
        {}, {"driver": "builtin"}, {"driver": "harness"}, {"context_policy": "summarize"},
        {"driver": "harness", "context_policy": "summarize"}, {"driver": "harness", "context_policy": "stop"},
    ]
    for model in [{}, {"source": "tiny"}, {"source": "small"}, {"source": SMOL}, {"source": "/models/x.gguf"}]
] + [
    {"schedule": schedule, "sft": sft}
    for schedule in [{}, {"max_steps": 0}, {"max_steps": 3}]
    for sft in [
        {}, {"steps": 0}, {"steps": 2}, {"steps": 2, "tasks": 0}, {"tasks": 0},
        {"steps": 2, "tasks": 0, "imported": "demos/a.jsonl"}, {"steps": 2, "imported": None, "tasks": 0},
    ]
] + [
    {"model": {"source": source}}
    for source in [
        "tiny", "huge", "package:nope", SMOL, "relative/path", "/", "/abs path", "tiny ", "package:",
    ]
]  # fmt: skip


@pytest.mark.parametrize("config", AGREEMENT_CASES)
def test_the_json_schema_states_the_rules_across_fields(config: dict) -> None:
    """The schema the OpenAPI document carries accepts a config exactly when the model does, so a client
    (or schemathesis) that keeps to it is never refused; only `parallel`'s arithmetic is beyond it."""
    schema_says = jsonschema.Draft202012Validator(RunConfig.model_json_schema()).is_valid(config)
    assert schema_says == _valid(config), config


@pytest.mark.parametrize(
    "parallel",
    [
        {"world_size": 4, "ep": 3},
        {"world_size": 6, "dp_shard": 4},
        {"world_size": 2, "dp_replicate": 2, "dp_shard": 2},
    ],
)
def test_only_the_parallel_arithmetic_is_beyond_the_schema(parallel: dict) -> None:
    schema = RunConfig.model_json_schema()
    assert jsonschema.Draft202012Validator(schema).is_valid({"parallel": parallel})
    assert not _valid({"parallel": parallel})
    assert "dp_replicate x dp_shard must be world_size" in schema["$defs"]["ParallelSection"]["description"]
