"""The OpenAI request bodies Crucible serves, bounded: a field the API defines but Crucible does not
use (penalties, logit_bias, user...) is accepted and ignored; a value out of range is a 400. Beside
them, the two extensions external-engine clients speak (services.rollout.external): vLLM's
`structured_outputs` on `/v1/completions`, and SGLang's native `/generate` and `/update_weights_from_disk`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 4
MAX_N = 16
MAX_TOP_LOGPROBS = 20
Text = Annotated[str, Field(max_length=1_000_000)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Body):
    name: Annotated[str, Field(max_length=256)]
    arguments: Text  # JSON text, as the API sends it


class ToolCallIn(_Body):
    id: Annotated[str, Field(max_length=256)] = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    type: str
    text: Text | None = None


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=64)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, Field(max_length=10_000)] = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: Annotated[str, Field(max_length=64)]


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: Annotated[str, Field(max_length=512)] = ""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: (
        Annotated[str, Field(max_length=256)]
        | Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_STOP)]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=1_000_000)]


Grammar = Annotated[str, Field(min_length=1, max_length=200_000)]


class StructuredOutputs(BaseModel):
    """vLLM's extension: the completion is decoded under `grammar` (llguidance's Lark dialect). The other
    kinds vLLM knows (json, regex, choice) are refused by name, never ignored."""

    model_config = ConfigDict(extra="forbid")
    grammar: Grammar | None = None


class CompletionRequest(_Sampling):
    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1, max_length=64)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=64)]
    )
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    structured_outputs: StructuredOutputs | None = None


class GenerateParams(BaseModel):
    """SGLang's native `sampling_params`, the part Crucible serves; any other is refused by name."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 128
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    ebnf: Grammar | None = None
    sampling_seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


class GenerateRequest(_Body):
    """SGLang's native `/generate`, token ids in and out."""

    input_ids: TokenIds
    sampling_params: GenerateParams = Field(default_factory=GenerateParams)
    return_logprob: bool = False


class UpdateWeightsRequest(_Body):
    """SGLang's `/update_weights_from_disk`: a Hugging Face checkpoint directory to load."""

    model_path: Annotated[str, Field(min_length=1, max_length=4096)]
    weight_version: Annotated[str, Field(max_length=64)] | None = None
