"""pydantic request models of the OpenAI (chat completions, completions) and Anthropic
(messages) APIs: the fields we read, typed and range-checked. Unknown fields are kept
(`extra="allow"`) so newer clients work; fields we cannot honour and that would change
the result (`n` > 1, an unknown `response_format` type, `echo`, ...) are rejected in the API
modules, by name, never ignored."""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

# mx.random.key takes a uint64
SEED_RANGE = dict(ge=0, lt=2 ** 64)
# OpenAI's documented logit_bias range
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Model(BaseModel):
    # NaN / Infinity (which Python's json reads and writes) are never a valid setting;
    # strict: no coercion a client cannot rely on (true is not 1, "yes" is not true, 1.0
    # is not an integer); an integer is still a valid float
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
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, **SEED_RANGE)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    n: Optional[int] = Field(None, ge=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
    logit_bias: Optional[Dict[str, Bias]] = None
    user: Optional[str] = None


class ChatRequest(_Sampling):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[ChatTool]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    response_format: Optional[Dict[str, Any]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int]]
    max_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1)


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: Union[str, List[Dict[str, Any]]]


class MessagesRequest(_Model):
    model: str
    messages: List[AnthropicMessage] = Field(..., min_length=1)
    max_tokens: int = Field(..., ge=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)  # Anthropic's documented range
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    tools: Optional[List[AnthropicTool]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    seed: Optional[int] = Field(None, **SEED_RANGE)


class CountTokensRequest(MessagesRequest):
    max_tokens: Optional[int] = None  # not part of a count_tokens request
