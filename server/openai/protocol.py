"""OpenAI request/response models (field names exactly as OpenAI's, plus vLLM's extras)."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_serializer

from engine.core.request import check_cache_salt
from engine.sampling_params import GrammarError, GrammarSpec, SamplingParams, SamplingParamsError


def _now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    """Serializes optional fields that OpenAI omits (rather than nulls) only when set."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unset_optionals(self, handler) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if not (v is None and k in self.omit_if_none)}


# ---- errors ----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI's schema: a string or null

    @field_validator("code", mode="before")
    @classmethod
    def _code_as_string(cls, value):
        return str(value) if isinstance(value, int) else value


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests --------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


# vLLM's structured_outputs keys we honour (exactly one) and the grammar kind each becomes.
_STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _spec_from(kind: str, value: Any, param: str) -> GrammarSpec:
    """One grammar source -> its spec; a malformed value is a 400 naming `param`."""
    try:
        if kind == "json":
            return GrammarSpec.json_schema(value)
        if kind == "choice":
            if not isinstance(value, list):
                raise GrammarError("choice must be a list of strings")
            return GrammarSpec.choice(value)
        if kind == "json_object":
            return GrammarSpec("json_object")
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{kind} must be a non-empty string")
        return GrammarSpec(kind, value)
    except GrammarError as e:
        raise SamplingParamsError(param, str(e)) from e


def _structured_outputs_spec(value: Any) -> GrammarSpec:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise SamplingParamsError(param, "structured_outputs must be an object")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unsupported = sorted(set(given) - set(_STRUCTURED_OUTPUT_KEYS))
    if unsupported:
        accepted = ", ".join(_STRUCTURED_OUTPUT_KEYS)
        msg = f"structured_outputs.{unsupported[0]} is not supported; accepted: {accepted}"
        raise SamplingParamsError(param, msg)
    if len(given) != 1:
        keys = ", ".join(_STRUCTURED_OUTPUT_KEYS)
        raise SamplingParamsError(param, f"structured_outputs needs exactly one of {keys}")
    ((kind, v),) = given.items()
    return _spec_from(kind, v, param)


def response_format_spec(fmt: dict | None, param: str = "response_format") -> GrammarSpec | None:
    """OpenAI's response_format: text (no grammar), json_object, json_schema {name, schema}."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
        raise SamplingParamsError(param, "response_format.json_schema must be an object")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise SamplingParamsError(param, "response_format.json_schema.schema is required")
        return _spec_from("json", schema, param)
    accepted = "text, json_object, json_schema"
    msg = f"response_format type {kind!r} is not supported; accepted: {accepted}"
    raise SamplingParamsError(param, msg)


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, like vLLM
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[StrictInt] | None = None  # strict: a JSON true is no token id
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # beam search (n = beam width): vLLM's fields, transformers' meanings
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: dict | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    # a vLLM extra that would change the output if ignored: refused
    prompt_logprobs: int | None = None
    # vLLM's tenant salt for the prefix cache: requests share KV blocks only under equal salts
    cache_salt: str | None = None

    _check_cache_salt = field_validator("cache_salt", mode="before")(check_cache_salt)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options", "stream_options requires stream=true")
        if self.prompt_logprobs is not None:
            msg = "prompt_logprobs is not supported; use echo with logprobs"
            raise SamplingParamsError("prompt_logprobs", msg)

    def grammar_source(self) -> tuple[GrammarSpec, str] | None:
        """The one grammar the request asks for and the field it came from (400 for two)."""
        found = []
        if self.structured_outputs is not None:
            found.append((_structured_outputs_spec(self.structured_outputs), "structured_outputs"))
        for name in _GUIDED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                found.append((_spec_from(name.removeprefix("guided_"), value, name), name))
        spec = response_format_spec(self.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
        if len(found) > 1:
            msg = f"{found[1][1]} cannot be combined with {found[0][1]}: give one grammar"
            raise SamplingParamsError(found[1][1], msg)
        return found[0] if found else None

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): float(v) for k, v in self.logit_bias.items()}
        except ValueError as e:
            raise SamplingParamsError("logit_bias", "logit_bias keys must be token ids") from e

    def sampling_kwargs(self, defaults: dict | None = None) -> dict[str, Any]:
        """defaults: the model's generation_config values for the fields the request left unset
        (temperature, top_p, top_k, min_p, repetition_penalty), else OpenAI's and vLLM's."""
        self.check_stream_options()
        d = defaults or {}

        def pick(name: str, neutral):
            value = getattr(self, name)
            return d.get(name, neutral) if value is None else value

        return dict(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0) or 0,
            min_p=pick("min_p", 0.0) or 0.0,
            seed=self.seed,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=self.logit_bias_ids(),
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            structured_outputs=(self.grammar_source() or (None,))[0],
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # refused unless 1
    suffix: str | None = None  # refused
    add_special_tokens: bool = True

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != 1:
            msg = f"best_of {self.best_of} is not supported; accepted: 1 (or leave it unset)"
            raise SamplingParamsError("best_of", msg)
        if self.suffix is not None:
            msg = f"suffix is not supported (got {len(self.suffix)} characters); leave it unset"
            raise SamplingParamsError("suffix", msg)
        return SamplingParams(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            **self.sampling_kwargs(defaults),
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    # image parts: chat's {"url", "detail"}, Responses' URL string (server/openai/images.py)
    image_url: dict | str | None = None
    detail: str | None = None
    file_id: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    add_special_tokens: bool = False

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs", "top_logprobs requires logprobs=true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                **self.sampling_kwargs(defaults),
            )
        except SamplingParamsError as e:  # report the chat names of the fields
            renamed = {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_param}
            raise SamplingParamsError(renamed.get(e.param, e.param), str(e)) from e


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


# ---- responses -------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that matched


class CompletionResponse(OpenAIModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"name"})

    name: str | None = None
    arguments: str = ""


class DeltaToolCall(OpenAIModel):
    """OpenAI's streamed call: the first piece has id, type and name, the rest arguments."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"role", "content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None
    input_modalities: list[str] = ["text"]  # ["text", "image"] for a vision-language model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
