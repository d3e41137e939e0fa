"""The OpenAI request and response shapes the server accepts and returns (pydantic models).

Requests say what they accept: typed messages (a role from a fixed set; content as a string or a
list of text parts), token ids as lists of non-negative integers, integers as JSON Schema has
them (5.0 is 5; 5.5, "5" and true are not), numbers as numbers (no coercion from strings or
booleans), ranges in the schema, and no unknown fields.
Every parameter of OpenAI's completions and chat APIs is either implemented or accepted only at
its no-op value, in the schema itself, so anything else is a 400 that names it (NOT_SUPPORTED);
the README lists them.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool,
                      StrictFloat, StrictInt, StrictStr)


def _integral(value):
    """JSON Schema's integer: 5.0 is one (JSON has one number type), 5.5 is not, nor is true."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**limits):
    """An integer as JSON Schema means it (the schema says "integer"): no strings, no booleans.
    The limits come before the validator, so that the schema carries them as minimum/maximum."""
    return Annotated[StrictInt, Field(**limits), BeforeValidator(_integral)]


def num(**limits):
    """A JSON number (not a string or a boolean) within limits, stated per branch so that the
    schema carries them."""
    return Union[Annotated[StrictFloat, Field(**limits)], Annotated[StrictInt, Field(**limits)]]


Number = num()
# a prompt, a message or a stop string: never "" (an empty prompt is refused everywhere, the CLI
# and LLM.generate too; whitespace is text). An empty stop string would stop anywhere.
Text = Annotated[StrictStr, Field(min_length=1)]
TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]

def _false(value: bool) -> bool:
    if value:
        raise ValueError("only false is accepted")
    return value


Zero = num(ge=0, le=0)
FalseOnly = Annotated[StrictBool, AfterValidator(_false), Field(json_schema_extra={"const": False})]
Empty = Field(max_length=0)
# OpenAI parameters we do not implement: the schema accepts only the value that changes nothing
NOT_SUPPORTED = {"frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
                 "top_logprobs", "echo", "best_of", "suffix", "tools", "tool_choice", "functions",
                 "function_call", "store", "metadata", "modalities", "audio", "prediction",
                 "reasoning_effort", "web_search_options", "service_tier", "response_format",
                 "prompt_cache_key", "safety_identifier", "verbosity", "n"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = Field(False, description="vLLM's: usage in every chunk")
    include_obfuscation: StrictBool = False


class Body(Strict):
    """Fields both endpoints take (OpenAI's, then our extensions)."""
    model: StrictStr | None = None
    max_tokens: integer(ge=1) | None = Field(None, description="most tokens to generate")
    temperature: num(ge=0, le=2) = 1.0
    top_p: num(gt=0, le=1) = 1.0
    seed: integer() | None = Field(  # unbounded: a float-typed schema cannot say 2**64 - 1
        None, description="any integer, taken modulo 2**64 (as torch takes a negative one)")
    stop: Text | list[Text] | None = None
    n: integer(ge=1, le=1) = Field(1, description="only 1")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(None, description="accepted; identifies the end user")
    frequency_penalty: Zero | None = Field(None, description="not supported: only 0")
    presence_penalty: Zero | None = Field(None, description="not supported: only 0")
    logit_bias: Annotated[dict[str, Number], Empty] | None = Field(
        None, description="not supported: only empty")
    top_k: integer(ge=-1) = Field(0, description="extension: 0 or -1 = off")
    ignore_eos: StrictBool = Field(False, description="extension: run to max_tokens")
    priority: integer(ge=-2**31, le=2**31 - 1) = Field(
        0, description="extension: lower runs first (--policy priority)")
    ttft_slo: num(gt=0, le=86400) | None = Field(None, description="extension: seconds")
    tbt_slo: num(gt=0, le=86400) | None = Field(None, description="extension: seconds")


class CompletionBody(Body):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    echo: FalseOnly | None = Field(None, description="not supported: only false")
    logprobs: integer(ge=0, le=0) | None = Field(
        None, description="not supported: only 0")
    best_of: integer(ge=1, le=1) | None = Field(
        None, description="not supported: only 1")
    suffix: Annotated[StrictStr, Empty] | None = Field(None, description="not supported: only \"\"")


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class TextFormat(Strict):
    type: Literal["text"]


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)]
    name: StrictStr | None = None


class ChatBody(Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: FalseOnly | None = Field(None, description="not supported: only false")
    top_logprobs: integer(ge=0, le=0) | None = Field(
        None, description="not supported: only 0")
    response_format: TextFormat | None = Field(None, description='only {"type": "text"}')
    tools: Annotated[list[dict[str, Any]], Empty] | None = Field(
        None, description="not supported: only empty")
    tool_choice: Literal["none"] | None = Field(None, description='not supported: only "none"')
    functions: Annotated[list[dict[str, Any]], Empty] | None = Field(
        None, description="not supported: only empty")
    function_call: Literal["none"] | None = Field(None, description='not supported: "none"')
    parallel_tool_calls: StrictBool | None = None
    store: FalseOnly | None = Field(None, description="not supported: only false")
    metadata: Annotated[dict[str, StrictStr], Empty] | None = Field(
        None, description="not supported: only empty")
    modalities: list[Literal["text"]] | None = Field(None, description='only ["text"]')
    service_tier: Literal["auto", "default"] | None = None
    audio: None = Field(None, description="not supported")
    prediction: None = Field(None, description="not supported")
    reasoning_effort: None = Field(None, description="not supported")
    web_search_options: None = Field(None, description="not supported")
    prompt_cache_key: None = Field(None, description="not supported")
    safety_identifier: None = Field(None, description="not supported")
    verbosity: None = Field(None, description="not supported")

    def text_messages(self) -> list[dict]:
        """The messages as the chat template takes them: content parts joined into one string."""
        return [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content)} for m in self.messages]


# ---------------------------------------------------------------- responses

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "a bad request: the message and `param` name the field"),
    (404, "no such model or path"), (405, "method not allowed"),
    (413, "the request body is larger than the server takes"),
    (503, "the server is shutting down, or its engine stopped"))}
