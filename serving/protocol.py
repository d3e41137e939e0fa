"""The OpenAI request and response shapes the server accepts and returns (pydantic models).

Requests say what they accept: typed messages (a role from a fixed set; content as a string or a
list of text parts), token ids as lists of non-negative integers (not booleans), numbers as
numbers (no coercion from strings or booleans), ranges in the schema, and no unknown fields.
Every parameter of OpenAI's completions and chat APIs is either implemented or, at any value but
its no-op one, refused with a 400 that names it (NOOP); the README lists them.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictFloat, StrictInt]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]

# OpenAI parameters we do not implement: accepted only at the value that changes nothing
NOOP: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "parallel_tool_calls": (True, False), "store": (False,),
    "metadata": ({},), "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "web_search_options": (), "service_tier": ("auto", "default"),
    "response_format": ({"type": "text"},), "prompt_cache_key": (), "safety_identifier": (),
    "verbosity": (),
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool = False


class Body(Strict):
    """Fields both endpoints take (OpenAI's, then our extensions)."""
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, description="most tokens to generate")
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=-2**63, le=2**64 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(1, ge=1, le=1, description="only 1")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(None, description="accepted; identifies the end user")
    frequency_penalty: Number | None = Field(None, ge=-2, le=2, description="only 0")
    presence_penalty: Number | None = Field(None, ge=-2, le=2, description="only 0")
    logit_bias: dict[str, Number] | None = Field(None, description="only empty")
    top_k: StrictInt = Field(0, ge=-1, description="extension: 0 or -1 = off")
    ignore_eos: StrictBool = Field(False, description="extension: run to max_tokens")
    priority: StrictInt = Field(0, ge=-2**31, le=2**31 - 1,
                                description="extension: lower runs first (--policy priority)")
    ttft_slo: Number | None = Field(None, gt=0, le=86400, description="extension: seconds")
    tbt_slo: Number | None = Field(None, gt=0, le=86400, description="extension: seconds")


class CompletionBody(Body):
    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    echo: StrictBool | None = Field(None, description="only false")
    logprobs: StrictInt | None = Field(None, ge=0, le=5, description="only 0")
    best_of: StrictInt | None = Field(None, ge=1, description="only 1")
    suffix: StrictStr | None = Field(None, description="only empty")


class TextPart(Strict):
    type: Literal["text"]
    text: StrictStr


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]
    name: StrictStr | None = None


class ChatBody(Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = Field(None, description="only false")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="only 0")
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')
    tools: list[dict[str, Any]] | None = Field(None, description="only empty")
    tool_choice: StrictStr | dict[str, Any] | None = Field(None, description='only "none"')
    functions: list[dict[str, Any]] | None = Field(None, description="only empty")
    function_call: StrictStr | dict[str, Any] | None = Field(None, description='only "none"')
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = Field(None, description="only false")
    metadata: dict[str, StrictStr] | None = Field(None, description="only empty")
    modalities: list[StrictStr] | None = Field(None, description='only ["text"]')
    service_tier: StrictStr | None = Field(None, description='only "auto" or "default"')
    audio: dict[str, Any] | None = Field(None, description="not supported")
    prediction: dict[str, Any] | None = Field(None, description="not supported")
    reasoning_effort: StrictStr | None = Field(None, description="not supported")
    web_search_options: dict[str, Any] | None = Field(None, description="not supported")
    prompt_cache_key: StrictStr | None = Field(None, description="not supported")
    safety_identifier: StrictStr | None = Field(None, description="not supported")
    verbosity: StrictStr | None = Field(None, description="not supported")

    def text_messages(self) -> list[dict]:
        """The messages as the chat template takes them: content parts joined into one string."""
        return [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content)} for m in self.messages]


def unsupported(body: Body) -> str | None:
    """The first parameter set to something other than its no-op value, or None."""
    for name in body.model_fields_set & NOOP.keys():
        value = getattr(body, name)
        if value is not None and value not in NOOP[name]:
            allowed = " or ".join(repr(v) for v in NOOP[name]) or "nothing"
            return f"{name}: not supported by this server (accepted: {allowed}, or leave it out)"
    return None


# ---------------------------------------------------------------- responses

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
