"""pydantic request models of the OpenAI (chat completions, completions) and Anthropic
(messages) APIs: the fields we read, typed and range-checked. Unknown fields are kept
(`extra="allow"`) so newer clients work; fields we cannot honour and that would change
the result (`n` > 1, an unknown `response_format` type, `echo`, ...) are rejected in the API
modules, by name, never ignored."""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from typing_extensions import Annotated

from kimi_mlx.text.chat_format import EFFORTS


def _integral(v):
    # JSON has one number type and JSON Schema's "integer" includes 2.0: an integral
    # float is that integer; 2.5, true and "2" stay errors (strict mode)
    return int(v) if isinstance(v, float) and v.is_integer() else v


def Int(**bounds):
    """An integer field's type: strict (no bool, no str), an integral float accepted,
    `bounds` (ge, gt, le, lt) inside, so the JSON schema states them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def _effort():
    """reasoning_effort: a string checked by chat_format.resolve_effort (whose 400 names
    the efforts); the OpenAPI document lists them."""
    return Field(None, json_schema_extra={"enum": [*EFFORTS, None]})

# mx.random.key takes a uint64
SEED_RANGE = dict(ge=0, lt=2 ** 64)
# OpenAI's documented logit_bias range
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Model(BaseModel):
    # NaN / Infinity (which Python's json reads and writes) are never a valid setting;
    # strict: no coercion a client cannot rely on (true is not 1, "yes" is not true, "1"
    # is not a number); an integer is still a valid float, an integral float an integer
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class FunctionDef(_Model):
    """An OpenAI tool's function: name required, parameters a JSON schema object."""

    name: str = Field(..., min_length=1)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(_Model):
    """An OpenAI chat tool: only function tools exist in the chat completions API."""

    type: Literal["function"]
    function: FunctionDef


class AnthropicTool(_Model):
    """An Anthropic client tool (type absent or "custom"); Anthropic's server tools
    (web_search, bash, ...) run on Anthropic's side and are refused by their type."""

    type: Optional[Literal["custom"]] = None
    name: str = Field(..., min_length=1)
    description: Optional[str] = None
    input_schema: Dict[str, Any]


class StreamOptions(_Model):
    include_usage: bool = False


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class _Sampling(_Model):
    model: str
    temperature: Optional[float] = Field(None, ge=0, le=2)  # OpenAI's documented range
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[Int(ge=0)] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[Int(**SEED_RANGE)] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    n: Optional[Int(ge=1)] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=10)  # divides logits (float32)
    repetition_context_size: Optional[Int(ge=1)] = None  # tokens it looks back (mlx-lm: 20)
    logit_bias: Optional[Dict[str, Bias]] = None
    user: Optional[str] = None


class ChatRequest(_Sampling):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[Int(ge=1)] = None
    max_completion_tokens: Optional[Int(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Optional[Int(ge=0, le=20)] = None
    tools: Optional[List[ChatTool]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = _effort()
    response_format: Optional[Dict[str, Any]] = None
    # reasoning tokens before a constrained request's grammar closes the thinking itself
    thinking_budget: Optional[Int(ge=0)] = None


class CompletionRequest(_Sampling):
    # one prompt: a non-empty string, a list of one, or token ids (below the vocabulary
    # size, which the API module checks and the OpenAPI document states)
    prompt: Union[Annotated[str, Field(min_length=1)],
                  Annotated[List[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)],
                  Annotated[List[Int(ge=0)], Field(min_length=1)]]
    max_tokens: Optional[Int(ge=1)] = None
    logprobs: Optional[Int(ge=0, le=20)] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[Int(ge=1)] = None


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: Union[str, List[Dict[str, Any]]]


class MessagesRequest(_Model):
    model: str
    messages: List[AnthropicMessage] = Field(..., min_length=1)
    max_tokens: Int(ge=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)  # Anthropic's documented range
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[Int(ge=0)] = None
    tools: Optional[List[AnthropicTool]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[str] = _effort()
    seed: Optional[Int(**SEED_RANGE)] = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Optional[Int()] = None  # not part of a count_tokens request


class ReasoningOptions(_Model):
    effort: Optional[str] = None
    summary: Optional[str] = None


class ResponsesRequest(_Model):
    """OpenAI Responses API (POST /v1/responses). `input` is a string (one user
    message) or a list of items (messages, function_call, function_call_output,
    reasoning); the item shapes are checked in `responses_api`, naming the item."""

    model: str
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    reasoning: Optional[ReasoningOptions] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    thinking_budget: Optional[Int(ge=0)] = None  # as ChatRequest's
    max_output_tokens: Optional[Int(ge=1)] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[Int(ge=0)] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[Int(**SEED_RANGE)] = None
    stream: bool = False
    previous_response_id: Optional[str] = None
    store: bool = True
    background: Optional[bool] = None
    text: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, Any]] = None
    user: Optional[str] = None
