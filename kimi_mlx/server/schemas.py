"""pydantic request models of the OpenAI (chat completions, completions, Responses) and
Anthropic (messages) APIs: the fields we read, typed and range-checked.

Unknown top-level fields: the OpenAI requests (`ChatRequest`, `CompletionRequest`,
`ResponsesRequest`) refuse them (`extra="forbid"`; `common.parse_body` answers 400
"Unknown parameter: 'x'." with param x, as OpenAI's API does), after declaring every
parameter OpenAI documents for that endpoint, so what real clients send (the openai SDK,
Codex, opencode, aider, the agents SDK: `stream_options`, `store`, `metadata`,
`service_tier`, `prompt_cache_key`, `include`, ...) is still taken. The Anthropic
requests (`MessagesRequest`, `CountTokensRequest`) refuse them too, in Anthropic's wording
("x: Extra inputs are not permitted"), after declaring Anthropic's documented and beta
fields and the ones Claude Code sends; every nested object keeps unknown keys
(`extra="allow"`): Claude Code's content blocks carry beta keys that differ by version. Fields we cannot honour and that would change the
result (`n` > 1, an unknown `response_format` type, `suffix`, legacy `functions`, ...)
are rejected in the API modules, by name, never ignored."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from typing_extensions import Annotated

from kimi_mlx.text.chat_format import API_EFFORTS


def _integral(v):
    # JSON has one number type and JSON Schema's "integer" includes 2.0: an integral
    # float is that integer; 2.5, true and "2" stay errors (strict mode)
    return int(v) if isinstance(v, float) and v.is_integer() else v


def Int(**bounds):
    """An integer field's type: strict (no bool, no str), an integral float accepted,
    `bounds` (ge, gt, le, lt) inside, so the JSON schema states them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def _effort():
    """reasoning_effort: a string checked by chat_format.api_effort (whose 400 names
    the efforts; each maps onto one of K3.1's); the OpenAPI document lists them."""
    return Field(None, json_schema_extra={"enum": [*API_EFFORTS, None]})

def _only(schema: Dict[str, Any]):
    """A field whose values beyond `schema` the API module refuses by name (with a
    message saying why): the OpenAPI document states `schema` (or null), so that what it
    calls valid is what is taken."""
    def extra(s: Dict[str, Any]) -> None:
        s.clear()
        s.update({"anyOf": [schema, {"type": "null"}]} if schema != _REFUSED else dict(schema),
                 default=None)
    return Field(None, json_schema_extra=extra)


_REFUSED = {"type": "null"}  # declared so that it is refused by name, never ignored

# mx.random.key takes a uint64
SEED_RANGE = dict(ge=0, lt=2 ** 64)
# OpenAI's documented logit_bias range
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Model(BaseModel):
    # NaN / Infinity (which Python's json reads and writes) are never a valid setting;
    # strict: no coercion a client cannot rely on (true is not 1, "yes" is not true, "1"
    # is not a number); an integer is still a valid float, an integral float an integer
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class _Strict(_Model):
    # a top-level OpenAI request: an undeclared field is a 400 naming it (parse_body)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


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
    # the document states a tool message's name as required (what the prompt needs; a
    # tool_call_id that names an earlier assistant call also gives it, see openai_api)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True,
                              json_schema_extra={
                                  "if": {"properties": {"role": {"const": "tool"}},
                                         "required": ["role"]},
                                  "then": {"required": ["name"],
                                           "properties": {"name": {"type": "string"}}}})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class _Sampling(_Strict):
    model: str
    temperature: Optional[float] = Field(None, ge=0, le=2)  # OpenAI's documented range
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[Int(ge=0)] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[Int(**SEED_RANGE)] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    n: Optional[Int(ge=1)] = _only({"type": "integer", "enum": [1]})  # one choice (openai_api)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=10)  # divides logits (float32)
    # tokens it looks back (mlx-lm: 20); below 2**31: MLX slices with 32-bit indices
    repetition_context_size: Optional[Int(ge=1, lt=2 ** 31)] = None
    logit_bias: Optional[Dict[str, Bias]] = None
    user: Optional[str] = None
    # OpenAI parameters that do not change the tokens generated here: accepted, unused
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None


class ChatRequest(_Sampling):
    # the schemas a body's bytes are measured for before parsing (`common.parse_body`)
    schema_fields: ClassVar[tuple] = (
        ("response_format", ("response_format", "json_schema", "schema")),
        ("tools[{}]", ("tools", "*", "function", "parameters")))
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
    # reasoning tokens after which the thinking is closed (`server.thinking`)
    thinking_budget: Optional[Int(ge=0)] = None
    # OpenAI parameters taken as hints or refused by name in `openai_api._unsupported`
    verbosity: Optional[str] = None
    modalities: Optional[List[str]] = _only({"type": "array", "items": {"enum": ["text"]}})
    prediction: Optional[Dict[str, Any]] = None
    audio: Optional[Dict[str, Any]] = _only(_REFUSED)
    web_search_options: Optional[Dict[str, Any]] = _only(_REFUSED)
    functions: Optional[List[Any]] = _only(_REFUSED)
    function_call: Optional[Union[str, Dict[str, Any]]] = _only(_REFUSED)


def _prompt_shape(v):
    """A completion prompt's shape, checked before the union below so that a bad one
    gets one error naming the item (pydantic's union would report a branch name such as
    `constrained-str`): a non-empty string, a list of them, a list of token ids (>= 0) or
    a list of such lists (lm-evaluation-harness sends `[[ids]]`)."""
    def ids_ok(xs, where):
        if not isinstance(xs, list) or not xs:
            raise ValueError(f"{where} must be a non-empty list of token ids")
        for j, x in enumerate(xs):
            x = _integral(x)
            if type(x) is not int or x < 0:
                raise ValueError(f"{where}[{j}] must be a token id (an integer >= 0), got {x!r}")

    forms = ("a non-empty string, a list of strings, a list of token ids or a list of "
             "token-id lists")
    if isinstance(v, str):
        if not v:
            raise ValueError("prompt is empty")
        return v
    if not isinstance(v, list) or not v:
        raise ValueError(f"prompt must be {forms}")
    if all(isinstance(x, str) for x in v):
        for i, x in enumerate(v):
            if not x:
                raise ValueError(f"prompt[{i}] is empty")
    elif all(isinstance(x, list) for x in v):
        for i, x in enumerate(v):
            ids_ok(x, f"prompt[{i}]")
    elif not any(isinstance(x, (list, str)) for x in v):
        ids_ok(v, "prompt")
    else:
        raise ValueError(f"prompt must be {forms}, not a mixed list")
    return v


TokenIds = Annotated[List[Int(ge=0)], Field(min_length=1)]


class CompletionRequest(_Sampling):
    # a non-empty string, a list of them, token ids or a list of token-id lists (ids
    # below the vocabulary size, which the API module checks and the OpenAPI document
    # states); each prompt of a list gets its own choice (not when streamed)
    prompt: Annotated[Union[Annotated[str, Field(min_length=1)],
                            Annotated[List[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
                            TokenIds,
                            Annotated[List[TokenIds], Field(min_length=1)]],
                      BeforeValidator(_prompt_shape)]
    # 0 only with echo (score the prompt, generate nothing), which the API module checks
    max_tokens: Optional[Int(ge=0)] = None
    logprobs: Optional[Int(ge=0, le=20)] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[Int(ge=1)] = _only({"type": "integer", "enum": [1]})  # (openai_api)


class AnthropicMessage(_Model):
    # "system" inside messages: Anthropic's beta mid-conversation-system-2026-04-07
    # (Claude Code sends its agent and skills list so)
    role: Literal["user", "assistant", "system"]
    content: Union[str, List[Dict[str, Any]]]


class _AnthropicStrict(_Model):
    # a top-level Anthropic request: an undeclared field is a 400 in Anthropic's own
    # wording (`parse_body`), as api.anthropic.com answers it
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    unknown_field_message: ClassVar[str] = "{name}: Extra inputs are not permitted"


class MessagesRequest(_AnthropicStrict):
    """Anthropic Messages (POST /v1/messages). Every top-level field of Anthropic's
    "Create a Message" reference (docs.anthropic.com/en/api/messages: model, messages,
    max_tokens, container, context_management, inference_geo, mcp_servers, metadata,
    output_config, service_tier, stop_sequences, stream, system, temperature, thinking,
    tool_choice, tools, top_k, top_p), its beta fields (`betas`, `output_format`,
    `speed`, ...: every key of the anthropic SDK's MessageCreateParams and
    MessageCountTokensParams, beta ones included) and the body fields Claude Code 2.1 adds (`anthropic_beta` and
    `anthropic_version` as for Bedrock/Vertex, `fallbacks`, `diagnostics`) are declared;
    any other top-level field is a 400 naming it. Nested objects keep unknown keys."""

    schema_fields: ClassVar[tuple] = (("tools[{}]", ("tools", "*", "input_schema")),)

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
    output_config: Optional[Dict[str, Any]] = None  # {"effort": ...}: Anthropic's effort
    seed: Optional[Int(**SEED_RANGE)] = None  # ours: a sampled reply's seed
    # Anthropic fields that do not change the tokens generated here: accepted, unused.
    # Documented: container (code execution), context_management (Claude Code sends its
    # clear-thinking edits), inference_geo, mcp_servers, service_tier; beta: betas (the
    # SDK moves them to the anthropic-beta header), output_format, speed ("fast").
    container: Optional[Union[str, Dict[str, Any]]] = None
    context_management: Optional[Dict[str, Any]] = None
    inference_geo: Optional[str] = None
    mcp_servers: Optional[List[Dict[str, Any]]] = None
    service_tier: Optional[str] = None
    betas: Optional[List[str]] = None
    output_format: Optional[Dict[str, Any]] = None
    speed: Optional[str] = None
    # in the anthropic SDK 2.17's create / count_tokens params besides the above
    cache_control: Optional[Dict[str, Any]] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    billing_policy: Optional[Dict[str, Any]] = None
    compaction: Optional[Dict[str, Any]] = None
    thread: Optional[Dict[str, Any]] = None
    fallback_credit_token: Optional[Union[str, Dict[str, Any]]] = None
    # what Claude Code 2.1 adds to the body (its queryModel request builder):
    # anthropic_beta (CLAUDE_CODE_EXTRA_BODY / Bedrock style), fallbacks (its refusal
    # fallback), diagnostics ({previous_message_id}); anthropic_version as Bedrock/Vertex
    anthropic_beta: Optional[List[str]] = None
    anthropic_version: Optional[str] = None
    fallbacks: Optional[List[Dict[str, Any]]] = None
    diagnostics: Optional[Dict[str, Any]] = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Optional[Int()] = None  # not part of a count_tokens request


class ReasoningOptions(_Model):
    effort: Optional[str] = None
    summary: Optional[str] = None


class ResponsesRequest(_Strict):
    """OpenAI Responses API (POST /v1/responses). `input` is a string (one user
    message) or a list of items (messages, function_call, function_call_output,
    reasoning); the item shapes are checked in `responses_api`, naming the item."""

    schema_fields: ClassVar[tuple] = (
        ("text.format", ("text", "format", "schema")),
        ("tools[{}]", ("tools", "*", "parameters")),
        ("tools[{}].tools[{}]", ("tools", "*", "tools", "*", "parameters")))  # a namespace's

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
    # OpenAI parameters that do not change the tokens generated here: accepted, unused
    # (Codex sends include, prompt_cache_key, client_metadata; the agents SDK truncation)
    include: Optional[List[str]] = None
    client_metadata: Optional[Dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    stream_options: Optional[Dict[str, Any]] = None
    truncation: Optional[str] = None
    max_tool_calls: Optional[Int(ge=1)] = None
    # refused by name when set (responses_api): they would change the reply
    top_logprobs: Optional[Int(ge=0, le=20)] = _only({"type": "integer", "enum": [0]})
    conversation: Optional[Union[str, Dict[str, Any]]] = _only(_REFUSED)
    prompt: Optional[Dict[str, Any]] = _only(_REFUSED)


class TokenizeRequest(_Model):
    """llama-server's POST /tokenize body."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Model):
    """llama-server's POST /detokenize body."""

    tokens: List[Int(ge=0)]
