"""The run configuration: everything that defines a run, nested by concern, in one definition.

The REST API validates it (its OpenAPI schema is this model's), RUNS carries it to the trainer and the
rollouts, and the command line loads it from TOML with `section.field=value` overrides:

    [schedule]
    max_steps = 6

    crucible demo --config run.toml --set optim.learning_rate=1e-4

Configs written before the sections existed (flat `group_size`, `model_preset`, ...) are refused with
a message that names each field's new place.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import ConfigDict, Field, field_validator, model_validator

from crucible.contracts.inputs import PRINTABLE, Input
from crucible.model.config import PRESETS
from crucible.model.sources import PACKAGE_PREFIX, PACKAGES

AgentTool = Literal["read_file", "list_dir", "grep", "replace", "run", "submit"]
"""The builtin agent's tools, in the order the byte-level tokenizer numbers them."""
AGENT_TOOLS: tuple[AgentTool, ...] = get_args(AgentTool)

MAX_GROUP_SIZE = 64
"""The most episodes one group may have: the sandbox forks a group's copies in one call, at most this many."""


class Section(Input):
    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)


def any_of(*branches: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema of a rule across fields: one of `branches` holds. A branch that constrains a field only
    where it is present also holds where it is left out, so it is written for the field's default."""
    return {"anyOf": list(branches)}


def _literal(name: str) -> str:
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", name)


_PACKAGE_SOURCES = PACKAGE_PREFIX + "(?:" + "|".join(map(_literal, PACKAGES)) + ")"
_PATH_SOURCES = r"/[^\x00-\x1f\x7f]*"
SOURCE_PATTERN = f"^(?:{'|'.join(map(_literal, PRESETS))}|{_PACKAGE_SOURCES}|{_PATH_SOURCES})$"
"""What `model.source` may be, as the JSON schema states it: a preset, package:NAME, or an absolute path."""
OWN_TEMPLATE_SOURCE = f"^(?:{_PACKAGE_SOURCES}|{_PATH_SOURCES})$"
"""A `model.source` with its own chat template: not a preset."""


class TasksSection(Section):
    taskset: str = Field(default="pybugs", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_-]+$")
    """The catalog's task set whose train split episodes are sampled from."""
    difficulties: list[Annotated[int, Field(ge=0, le=100)]] = Field(
        default=[1, 2], min_length=1, max_length=100
    )
    """Difficulty levels to sample, uniformly."""
    sampling: Literal["uniform", "learnable"] = "uniform"
    """How the catalog draws each group's task from the train split. `uniform`: every task alike.
    `learnable`: by the run's recent pass rate on each task, 4 p (1 - p), so tasks it resolves sometimes
    (groups whose rewards differ) come most, tasks it always or never resolves a tenth as often, and tasks
    it has not tried as often as the best; held-out splits are never drawn from."""


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Projections an adapter can target (crucible.model.lora), by their Hugging Face names."""
LORA_TARGETS: tuple[LoraTarget, ...] = get_args(LoraTarget)


class LoraSection(Section):
    rank: int = Field(default=8, ge=1, le=256)
    """Rank of every adapter."""
    alpha: float = Field(default=16.0, gt=0, le=4096)
    """The adapters' update is scaled by alpha / rank, as PEFT does."""
    targets: list[LoraTarget] = Field(
        default=list(LORA_TARGETS),
        min_length=1,
        max_length=len(LORA_TARGETS),
        json_schema_extra={"uniqueItems": True},  # what _targets refuses, as the schema says it
    )
    """Projections that get an adapter, in every layer that has them: attention (q_proj, k_proj, v_proj,
    o_proj) and the dense feed-forward (gate_proj, up_proj, down_proj); routed experts are not adapted."""

    @field_validator("targets")
    @classmethod
    def _targets(cls, targets: list[str]) -> list[str]:
        if len(set(targets)) != len(targets):
            raise ValueError(f"model.lora.targets names a projection twice: {targets}")
        return sorted(targets, key=LORA_TARGETS.index)


class ModelSection(Section):
    source: str = Field(
        default="tiny",
        min_length=1,
        max_length=1000,
        pattern=PRINTABLE,
        json_schema_extra={"pattern": SOURCE_PATTERN},  # what _known_source keeps, as the schema says it
    )
    """The starting weights: a Crucible preset (randomly initialised from `seed`, the byte-level agent),
    package:NAME, or the absolute path of a Hugging Face directory or a .gguf file on the trainer's and
    rollouts' machines (the model's own tokenizer, chat template and tool-call format)."""
    precision: Literal["bf16", "mxfp8", "fp32"] = "bf16"
    """Training and inference precision of the linear layers (`fp32`: the reference, e.g. to check that a
    parallel layout trains as one process does)."""
    init: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}@[0-9]{1,9}$")
    """RUN@VERSION: start from that run's published weights instead of `source`'s (same architecture),
    e.g. the warm start of an SFT-only run (`crucible sft`). Adapters in those weights are merged into
    them: this run starts from that policy."""
    lora: LoraSection | None = None
    """Train low-rank adapters instead of every weight (crucible.model.lora): the base stays frozen, each
    version carries only what the adapters changed, and `crucible model export --adapter` writes a PEFT
    adapter. None: full fine-tuning."""

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        if value in PRESETS or value.startswith("/"):
            return value
        if value.startswith(PACKAGE_PREFIX) and value.removeprefix(PACKAGE_PREFIX) in PACKAGES:
            return value
        raise ValueError(
            f"unknown model source {value!r}: a preset ({', '.join(PRESETS)}), "
            f"{', '.join(PACKAGE_PREFIX + name for name in PACKAGES)}, or an absolute path"
        )


class AgentSection(Section):
    model_config = ConfigDict(
        json_schema_extra=any_of(
            {"properties": {"driver": {"const": "builtin"}}},
            {"properties": {"context_policy": {"const": "stop"}}},
        )
    )

    max_turns: int = Field(default=3, ge=1, le=256)
    """Tool calls an episode may make before it ends."""
    max_action_tokens: int = Field(default=40, ge=1, le=4096)
    """Tokens the policy may sample for one action."""
    max_observation_bytes: int = Field(default=200, ge=16, le=65536)
    """Bytes of a tool's output that the policy sees (the rest is cut)."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature; the trainer computes its logprobs at the same temperature."""
    driver: Literal["builtin", "harness"] = "builtin"
    """Who runs the episode's turns: Crucible's own agent loop, or an agent harness (a separate program,
    the rollout's `harness_command`) that drives the policy through the replica's OpenAI-compatible
    endpoint and acts through its tool endpoint; the rollout records the conversation token for token
    as the trajectory. A harness needs a model with its own chat template (not a preset)."""
    context_policy: Literal["stop", "summarize"] = "stop"
    """What the builtin loop does when the next turn would not fit the context: end the episode
    (finish_reason "context"), or ask the policy to summarise its work so far and go on in a new context
    that begins with the task and that summary. The summary is sampled by the policy and trained like
    its actions; the trajectory records where each context began (`Trajectory.context_starts`)."""
    max_summary_tokens: int = Field(default=256, ge=8, le=8192)
    """Tokens the policy may sample for one summary."""
    tools: list[AgentTool] = Field(
        default=list(AGENT_TOOLS),
        min_length=1,
        max_length=len(AGENT_TOOLS),
        json_schema_extra={"uniqueItems": True, "contains": {"const": "submit"}},  # _tools, as a schema
    )
    """The tools the policy may call, `submit` among them: the prompt describes only these (a chat
    template's tool definitions, the byte-level system prompt) and the action grammar allows only these,
    so a small model spends no context on tools a run does not use."""

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[str]) -> list[str]:
        if len(set(tools)) != len(tools):
            raise ValueError(f"agent.tools names a tool twice: {tools}")
        if "submit" not in tools:
            raise ValueError("agent.tools must include submit: an episode ends when the policy submits")
        return [t for t in AGENT_TOOLS if t in tools]  # one order, whatever order the run lists them in


class OptimSection(Section):
    """The RL algorithm: advantages, policy loss, rollout correction, regularisers (see crucible.rl)."""

    model_config = ConfigDict(
        json_schema_extra=any_of(
            {"properties": {"correction": {"const": "none"}}},
            {"properties": {"loss": {"const": "decoupled"}}, "required": ["loss"]},
        )
    )

    learning_rate: float = Field(default=1e-3, gt=0, le=1)
    """AdamW learning rate."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradients are clipped to this global norm."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """grpo: (r - mean) / (std + eps) in the group; dr_grpo: r - mean (Dr. GRPO, no std); rloo: r minus
    the mean of the group's other members."""
    advantage_std: Literal["population", "sample"] = "population"
    """Which standard deviation grpo divides by."""
    advantage_eps: float = Field(default=1e-6, ge=0, le=1)
    """Added to grpo's std, so a group with little spread is not divided by ~0."""
    drop_uniform_groups: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (no signal) is not trained on, and
    the rollouts are asked for one more group in its place; the count is a step metric."""
    loss: Literal["ppo", "cispo", "decoupled"] = "ppo"
    """ppo: clipped ratio against the behaviour policy; cispo: clipped stop-gradient weight on log pi
    (every token keeps a gradient); decoupled: clipped against the trainer's current weights, the
    behaviour policy only as an importance weight shaped by `correction`."""
    clip_low: float = Field(default=0.2, gt=0, lt=1)
    """The ratio's lower clip: 1 - clip_low."""
    clip_high: float = Field(default=0.2, gt=0, le=10)
    """The ratio's upper clip: 1 + clip_high (DAPO's clip-higher sets it above clip_low, e.g. 0.28)."""
    dual_clip: float | None = Field(default=3.0, gt=1)
    """For negative advantages the objective is never below dual_clip * A (ppo, decoupled); null: off."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_sum_norm"] = "token_mean"
    """How per-token losses become one: mean over the step's sampled tokens, mean over sequences of
    their token means, or Dr. GRPO's sum divided by sequences x norm_tokens."""
    norm_tokens: int = Field(default=1024, ge=1, le=1_000_000)
    """seq_sum_norm's constant (about the longest response a run samples)."""
    correction: Literal["none", "tis", "mis"] = "none"
    """Rollout correction of the decoupled loss's behaviour weight: none (raw), tis (truncated at
    correction_cap), mis (masked outside [1 / cap, cap])."""
    correction_level: Literal["token", "sequence", "geometric"] = "token"
    """The weight per token, per sequence (product of the ratios), or their geometric mean."""
    correction_cap: float = Field(default=2.0, gt=1, le=1000)
    """Truncation or mask bound of the correction weight."""
    kl_coef: float = Field(default=0.0, ge=0, le=100)
    """Weight of the KL to the frozen starting policy; 0 turns it (and the reference copy) off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the per-token KL to the reference."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """The KL as a term of the loss, or subtracted from each token's advantage."""
    entropy_coef: float = Field(default=0.0, ge=0, le=100)
    """Weight of the entropy bonus; 0 is off."""

    @model_validator(mode="after")
    def _correction_needs_decoupled(self) -> OptimSection:
        if self.correction != "none" and self.loss != "decoupled":
            raise ValueError(
                f"correction {self.correction!r} shapes the decoupled loss's behaviour weight; with loss "
                f"{self.loss!r} the ratio is already against the behaviour policy: set loss = 'decoupled'"
            )
        return self


class ScheduleSection(Section):
    max_steps: int = Field(default=6, ge=0, le=1_000_000)
    """RL optimizer steps of the run (0: only the `sft` warm start)."""
    group_size: int = Field(default=4, ge=1, le=MAX_GROUP_SIZE)
    """Episodes per task; advantages are relative to the group. At most what one sandbox fork makes."""
    groups_per_step: int = Field(default=2, ge=1, le=1024)
    """Groups in one optimizer step."""
    publish_every: int = Field(default=2, ge=1, le=100_000)
    """A new weight version every this many optimizer steps."""
    max_staleness: int = Field(default=2, ge=0, le=10_000)
    """Versions a sampled token may lag the trainer's current version; older tokens are not trained on
    and rollouts admit no work that would break the bound. Counted in versions: a token may then be up
    to (max_staleness + 1) x publish_every - 1 optimizer steps old (the step metric token_age_steps_max);
    optim.loss = "decoupled" keeps a gradient for stale tokens that PPO's clip would silence."""
    save_every: int = Field(default=1, ge=1, le=100_000)
    """The trainer saves its sharded state every this many optimizer steps, and at every published
    version; the graded trajectories trained since the last save stay unacknowledged until it, so a
    trainer that dies re-trains them on resume and loses none."""


class ParallelSection(Section):
    """How the trainer lays the policy's optimisation over ranks (crucible.parallel): `world_size` ranks,
    data-parallel `dp_replicate` x `dp_shard` (HSDP: weights sharded over `dp_shard`, replicated over
    `dp_replicate`), expert groups of `ep` ranks cut out of them. World size 1 is the same code on a mesh
    of one rank. dp_replicate x dp_shard must be world_size and ep must divide it: JSON Schema cannot
    state a product, so the API refuses a layout that breaks this with a 422 naming `parallel`."""

    world_size: int = Field(default=1, ge=1, le=4096)
    """Ranks of the run's worker group: one device (or, on CPU, one process) each."""
    ep: int = Field(default=1, ge=1, le=4096)
    """Expert-parallel size: each rank of an expert group holds 1/ep of every MoE layer's experts."""
    dp_shard: int | None = Field(default=None, ge=1, le=4096)
    """Ranks a weight is sharded over; default world_size / dp_replicate."""
    dp_replicate: int | None = Field(default=None, ge=1, le=4096)
    """Replicas of each shard group; default world_size / dp_shard."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collectives: `auto` is NCCL when every rank has a GPU, else gloo."""
    launcher: Literal["local", "ray"] = "local"
    """`local`: the ranks are processes beside the trainer; `ray`: actors in a placement group of the
    trainer's Ray cluster (its `ray_address`), one bundle per device."""
    micro_batch_tokens: int = Field(default=2048, ge=1, le=10_000_000)
    """A rank runs its slice of a step in micro-batches of trajectories of at most this many (padded)
    tokens each, accumulating their gradients: what a step holds is bounded by one micro-batch (a longer
    trajectory is a micro-batch of its own). The default keeps a SmolLM2 step's working memory under
    2 GB on a CPU at the same speed as 8192 (docs/benchmarks.md); a GPU wants more per micro-batch."""
    activation_checkpointing: bool = True
    """Keep only each transformer block's input in the forward and recompute the block in backward:
    about one more forward of compute for activations that no longer grow with the number of layers."""

    @property
    def shard(self) -> int:
        return self.dp_shard or self.world_size // (self.dp_replicate or 1)

    @property
    def replicate(self) -> int:
        return self.dp_replicate or self.world_size // self.shard

    @model_validator(mode="after")
    def _shape(self) -> ParallelSection:
        if self.replicate * self.shard != self.world_size:
            raise ValueError(
                f"dp_replicate x dp_shard = {self.replicate} x {self.shard} must equal"
                f" world_size = {self.world_size}"
            )
        if self.world_size % self.ep:
            raise ValueError(f"ep = {self.ep} must divide world_size = {self.world_size}")
        return self


class QualitySection(Section):
    """Weights of the quality terms (services.grader.quality) in the reward of a resolved change, so a run
    trains for the codebase's practice, not only for passing tests. Each measure is scaled to [0, 1];
    a change that did not resolve its task gets none of them."""

    lint: float = Field(default=0.1, ge=0, le=10)
    """Subtracted times the ruff findings (E, F, W) the change introduces, over 5 (at most 1)."""
    size: float = Field(default=0.1, ge=0, le=10)
    """Subtracted times how far the change's changed lines exceed the reference patch's, as a fraction
    of them (twice the reference's lines or more: 1)."""
    outside: float = Field(default=0.1, ge=0, le=10)
    """Subtracted times the files the change touches that the reference patch does not, over 3 (at most
    1); new test modules do not count."""
    repetition: float = Field(default=0.1, ge=0, le=10)
    """Subtracted times the share of the lines the change adds that repeat, in shape (names, numbers and
    strings aside), three or more lines the repository already has elsewhere: a helper re-implemented
    instead of called."""
    tests: float = Field(default=0.0, ge=0, le=10)
    """Added when the change adds a test function (in a new test module)."""


class RewardSection(Section):
    """How a graded trajectory is scored (services.grader.reward). Whatever the options, a trajectory
    that leaves the repository unchanged scores exactly 0: doing nothing never pays."""

    kind: Literal["resolved", "fail_to_pass"] = "resolved"
    """resolved: 1 when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes, else 0
    (SWE-bench's resolved); fail_to_pass: the fraction of FAIL_TO_PASS tests that pass, paid only while
    every PASS_TO_PASS test still passes."""
    pass_to_pass_penalty: float = Field(default=0.0, ge=0, le=10)
    """Subtracted times the fraction of PASS_TO_PASS tests the change broke."""
    length_penalty: float = Field(default=0.0, ge=0, le=10)
    """Subtracted times the fraction of the episode's token budget (agent.max_turns x
    agent.max_action_tokens) the policy sampled."""
    tool_error_penalty: float = Field(default=0.0, ge=0, le=10)
    """Subtracted times the fraction of tool calls that failed."""
    shaping: float = Field(default=0.0, ge=0, le=10)
    """Added times the fraction of tool calls (submit aside) that succeeded; off by default, and paid
    only for a change, never for exploring without one."""
    quality: QualitySection | None = None
    """Quality terms of a resolved change (lint, size, files outside the reference, repetition, tests);
    None: off."""


class SftSection(Section):
    """Supervised warm start before RL (crucible.agent.demonstrations): the reference solutions of the
    task set's train split, and any imported conversations, played as episodes in the run's agent format
    and trained with the RL loss's model and precision, on the policy's tokens only. The result is the
    run's version 0, from which RL starts; a run with `schedule.max_steps = 0` is SFT alone."""

    model_config = ConfigDict(
        json_schema_extra=any_of(
            {"properties": {"steps": {"maximum": 0}}},
            {"properties": {"tasks": {"minimum": 1}}},
            {"properties": {"imported": {"type": "string"}}, "required": ["imported"]},
        )
    )

    steps: int = Field(default=0, ge=0, le=100_000)
    """Optimizer steps of the warm start; 0: none."""
    tasks: int = Field(default=64, ge=0, le=10_000)
    """Train-split tasks (in task id order, of `tasks.difficulties`) whose reference patches become
    demonstrations."""
    imported: str | None = Field(default=None, min_length=1, max_length=500, pattern=r"^[A-Za-z0-9_./-]+$")
    """Object-store key of a JSONL file of chat conversations with tool calls (`crucible sft --demos`
    uploads one)."""
    batch_size: int = Field(default=8, ge=1, le=1024)
    """Demonstrations per optimizer step (drawn in a seeded order, epoch after epoch)."""
    learning_rate: float = Field(default=1e-3, gt=0, le=1)
    """AdamW learning rate of the warm start."""


class EvalSection(Section):
    """Held-out evaluation during the run (also on demand: POST /v1/evals, `crucible eval`)."""

    every_versions: int = Field(default=0, ge=0, le=1_000_000)
    """Evaluate every this many published weight versions; 0: only on demand (and `at_end`)."""
    at_end: bool = False
    """Also evaluate the run's last published version."""
    taskset: str | None = Field(default=None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_-]+$")
    """Task set to evaluate on; default: the run's own (tasks.taskset)."""
    split: Literal["validation", "test"] = "test"
    """Held-out split to evaluate on; never train."""
    samples: int = Field(default=4, ge=0, le=64)
    """Sampled episodes per task besides the greedy one (pass@k with k = samples)."""
    max_tasks: int = Field(default=50, ge=1, le=10_000)
    """Tasks evaluated at most (the first ones of the split, in task id order)."""


class RunConfig(Section):
    """Everything that defines a run."""

    # _something_to_train's rules across sections, as JSON Schema (the OpenAPI document's run config)
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                any_of(
                    {"properties": {"schedule": {"properties": {"max_steps": {"minimum": 1}}}}},
                    {"properties": {"sft": {"properties": {"steps": {"minimum": 1}},
                                            "required": ["steps"]}},
                     "required": ["sft"]},
                ),
                any_of(
                    {"properties": {"agent": {"properties": {"driver": {"const": "builtin"}}}}},
                    {"properties": {"model": {"properties": {"source": {"pattern": OWN_TEMPLATE_SOURCE}},
                                              "required": ["source"]}},
                     "required": ["model"]},
                ),
            ]
        }
    )  # fmt: skip

    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seed of the model's initialisation, task sampling and the episodes' sampling."""
    tasks: TasksSection = Field(default_factory=TasksSection)
    model: ModelSection = Field(default_factory=ModelSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    sft: SftSection = Field(default_factory=SftSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list, max_length=3)
    """Experiment trackers that also receive the run's step metrics and evaluations (services.api.trackers):
    TensorBoard event files, an MLflow run, a Weights & Biases run (offline unless configured)."""

    @model_validator(mode="after")
    def _something_to_train(self) -> RunConfig:
        if self.schedule.max_steps == 0 and self.sft.steps == 0:
            raise ValueError("schedule.max_steps = 0 trains nothing unless sft.steps > 0")
        if self.sft.steps and not (self.sft.tasks or self.sft.imported):
            raise ValueError("sft.steps > 0 needs demonstrations: sft.tasks > 0 or sft.imported")
        if self.agent.driver == "harness" and self.model.source in PRESETS:
            raise ValueError(
                f"agent.driver = 'harness' needs a model with its own chat template; the preset "
                f"{self.model.source!r} speaks the byte-level format"
            )
        if self.agent.driver == "harness" and self.agent.context_policy == "summarize":
            raise ValueError(
                "agent.context_policy = 'summarize' is the builtin loop's; a harness keeps its own context"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_flat_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [f"`{name}` is now `{MOVED[name]}`" for name in data if name in MOVED]
            if moved:
                raise ValueError("run config fields moved into sections: " + "; ".join(moved))
        return data

    @classmethod
    def from_toml(cls, text: str, *, overrides: Sequence[str] = ()) -> RunConfig:
        """A config from TOML text, then `section.field=value` overrides (values in TOML syntax; a bare
        word is a string). Raises ValueError (pydantic's ValidationError is one) naming what is wrong."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"not valid TOML: {exc}") from None
        for override in overrides:
            apply_override(data, override)
        return cls.model_validate(data)


MOVED = {
    **{name: f"tasks.{name}" for name in TasksSection.model_fields},
    "model_preset": "model.source",
    "precision": "model.precision",
    **{name: f"agent.{name}" for name in AgentSection.model_fields},
    **{name: f"optim.{name}" for name in OptimSection.model_fields},
    "clip_eps": "optim.clip_low` and `optim.clip_high",
    **{name: f"schedule.{name}" for name in ScheduleSection.model_fields},
}
"""Flat field names of the first run config, and where each lives now."""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested `data`; the value is parsed as TOML, or taken as a string."""
    path, sep, raw = override.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise ValueError(f"override {override!r} is not of the form section.field=value")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {override!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value
