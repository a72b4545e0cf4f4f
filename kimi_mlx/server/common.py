"""What the API modules share: the served model (`Service`), API errors, building a
`Job` from checked parameters, and the async loop that turns a job's token events into
reply events (`reply_events`)."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ValidationError

from kimi_mlx.generation.background import lower_thread_priority
from kimi_mlx.generation.request import InputError
from kimi_mlx.sampling import Sampling
from kimi_mlx.text.chat_format import api_effort
from kimi_mlx.server import body_json
from kimi_mlx.server.jobs import Busy, Failed, Finished, Job, Started, TokenOut
from kimi_mlx.server.reply import Event, ReplyBuilder

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client. status: HTTP status; kind: OpenAI error type
    (invalid_request_error, authentication_error, not_found_error, ...); code: the OpenAI
    error `code` clients parse (context_length_exceeded, invalid_api_key; None: the
    default, `kind` for statuses other than 400)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, headers: Optional[Dict[str, str]] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers or {}
        self.code = code


KEEPALIVE_S = 10.0  # seconds of silence after which a stream sends a ping


class ClientGone(Exception):
    """The HTTP client disconnected."""


@dataclass
class Service:
    """The served model and everything a request handler needs.

    engine: `Engine` (or a cluster engine with the same `submit`); wrapper: mlx-lm
    TokenizerWrapper; tok: our KimiTokenizer; context: max prompt + generated tokens;
    model_ids: names a request's `model` may use (the first is what /v1/models lists);
    defaults: sampling defaults (generation_config.json); vocab_size: the model's logits
    width (0: not known, then the tokenizer's size stands in); responses: the
    conversations behind recent /v1/responses replies; images: the image policy
    (`server.images.ImageSettings`), None for a server without image input.
    """

    engine: Any = None
    wrapper: Any = None
    tok: Any = None
    context: int = 0
    model_ids: List[str] = field(default_factory=list)
    defaults: Sampling = field(default_factory=Sampling)
    api_key: Optional[str] = None
    max_body_bytes: int = 8 << 20
    created: int = 0
    loading_error: Optional[str] = None
    metrics: Any = None
    vocab_size: int = 0
    responses: Any = None  # responses_api.ResponseStore (previous_response_id), made on first use
    images: Any = None  # server.images.ImageSettings (vision tower, URL policy, limits); None: no images
    default_max_tokens: Optional[int] = None  # a request's budget when it sets none (--max-tokens)
    default_thinking_budget: Optional[int] = None  # reasoning tokens when a request sets none (--thinking-budget)
    keepalive_s: float = KEEPALIVE_S  # a streamed reply says something at least this often
    schema_limits: Any = None  # generation.constrain.SchemaLimits (--max-schema-bytes, --schema-timeout)
    # server.models.ModelHolder where the server loads, unloads and swaps checkpoints
    # (`kimi-mlx server`); None: the one model loaded at start stays (the cluster server)
    models: Any = None
    weights_bytes: int = 0  # the cluster server's tensor bytes, held on its stages (0: not known)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def not_ready_reason(self) -> Optional[str]:
        """None when serving; else why not (loading, failed load, lost stage)."""
        if self.loading_error:
            return self.loading_error
        if self.models is not None and self.models.ever_loaded and self.engine is None:
            return None  # unloaded (idle, a swap): the next request loads its model
        if self.engine is None:
            return "the model is loading"
        return self.engine.health()

    def check_model(self, name: str) -> None:
        if self.models is not None:
            try:
                self.models.resolve(name)
                return
            except KeyError as e:
                raise APIError(404, f"model {name!r} is not served here; this server serves "
                               f"{e.args[0]} (GET /v1/models)", "not_found_error",
                               "model") from None
        if name not in self.model_ids:
            raise APIError(404, f"model {name!r} is not served here; this server serves "
                           f"{', '.join(repr(m) for m in self.model_ids)} (GET /v1/models)",
                           "not_found_error", "model")


def n_vocab(svc) -> Optional[int]:
    """Token ids a request may name or a sampler sees: the model's logits width
    (`Service.vocab_size`), else the tokenizer's size, else None (nothing loaded)."""
    n = getattr(svc, "vocab_size", 0) or getattr(getattr(svc, "tok", None), "vocab_size", 0)
    return n or None


# deeper JSON than any real request (a tool's parameter schema included) holds, and
# shallow enough for every recursive walk after parsing (validation, prompt encoding)
MAX_NESTING = 128
# bodies up to this many bytes are parsed on the event loop (well under a millisecond);
# larger ones on `_PARSER`'s one thread, in pieces (`body_json`), so that a multi-MB body
# costs the other clients' streams nothing measurable
PARSE_INLINE_BYTES = 64 << 10
# at a lower CPU priority than decoding (`generation.background`): a body being refused
# yields the cores to the streams already running
_PARSER = ThreadPoolExecutor(1, thread_name_prefix="kimi-mlx-body", initializer=lower_thread_priority)


async def parse_body_async(raw: bytes, model: type[BaseModel], limit: int,
                           schema_bytes: Optional[int] = None) -> BaseModel:
    """`parse_body` off the event loop for a body over PARSE_INLINE_BYTES (one large body
    at a time: the GIL admits one parser anyway, and a queue of threads would only add
    switching), inline for a smaller one. Same result and errors as `parse_body`."""
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse_body(raw, model, limit, schema_bytes)
    return await asyncio.get_running_loop().run_in_executor(_PARSER, parse_body, raw, model,
                                                            limit, schema_bytes)


def max_schema_bytes(svc: "Service") -> int:
    """The server's --max-schema-bytes (`Service.schema_limits`, else its default)."""
    limits = getattr(svc, "schema_limits", None)
    if limits is None:
        from kimi_mlx.generation.constrain import SchemaLimits

        limits = SchemaLimits()
    return limits.max_bytes


def _schema_too_large(doc: body_json.Document, model: type[BaseModel], schema_bytes: int) -> None:
    """APIError 400 (the wording of `generation.constrain`'s check after parsing) naming
    the first schema among the request model's `schema_fields` whose text in the body is over
    `schema_bytes` bytes (whitespace outside strings not counted)."""
    for label, path in getattr(model, "schema_fields", ()):
        for idx, a, b in doc.find(path):
            if b - a > schema_bytes and doc.compact_size(a, b, schema_bytes) > schema_bytes:
                param = label.format(*idx)
                raise APIError(400, f"{param}: the schema is over this server's limit of "
                               f"{schema_bytes} bytes (--max-schema-bytes)", param=param)


def load_body(raw: bytes, model: type[BaseModel], limit: int,
              schema_bytes: Optional[int] = None) -> Dict[str, Any]:
    """JSON body -> its dict, before validation (`validate`; `parse_body` does both):
    APIError 413 past `limit` bytes, 400 for malformed JSON, JSON nested deeper than
    MAX_NESTING (found from the bytes before parsing, `body_json.structure`) or a body
    that is not an object. A large body is parsed in pieces (`body_json.loads`); from
    the event loop call `parse_body_async` / `parse_with_data_async`.

    `schema_bytes` (--max-schema-bytes; None: not checked here): a schema the model's
    `schema_fields` locate ((param format, key path) pairs for `body_json.Document.find`,
    e.g. ("tools[{}]", ("tools", "*", "function", "parameters"))) whose text in the body
    is longer than this, whitespace outside strings not counted, is a 400 naming it,
    found from the bytes' scan before anything is parsed (a 5 MB schema would otherwise
    build ~450k Python objects only to be refused)."""
    if len(raw) > limit:
        raise APIError(413, f"request body is {len(raw)} bytes, over the limit of {limit} "
                       "bytes (--max-body-bytes)", "request_too_large")
    try:
        # a body with at most MAX_NESTING containers is one cheap json.loads (a few
        # objects, however long its strings): scanned only when it has more
        if (schema_bytes is not None and len(raw) > schema_bytes and getattr(model, "schema_fields", ())
                and raw.count(b"[") + raw.count(b"{") > MAX_NESTING):
            doc = body_json.Document(raw, MAX_NESTING)
            _schema_too_large(doc, model, schema_bytes)
            data = doc.value()
        else:
            data = body_json.loads(raw, MAX_NESTING)
    except body_json.BodyError as e:
        if e.nested:
            raise APIError(400, f"request body is nested more than {MAX_NESTING} levels deep") from None
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def parse_body(raw: bytes, model: type[BaseModel], limit: int,
               schema_bytes: Optional[int] = None) -> BaseModel:
    """JSON body -> pydantic model (`load_body`, then `validate`): APIError 413 / 400 as
    they raise: for malformed or too deeply nested JSON, a schema over `schema_bytes`,
    fields that fail validation (naming the field), or a top-level field a model that
    forbids extras does not declare (OpenAI's "Unknown parameter: 'x'.", param x, code
    unknown_parameter; the model's `unknown_field_message` when it has one, as
    Anthropic's requests do)."""
    return validate(load_body(raw, model, limit, schema_bytes), model)


def _parse_with_data(raw: bytes, model: type[BaseModel], limit: int,
                     schema_bytes: Optional[int]) -> Tuple[BaseModel, dict]:
    data = load_body(raw, model, limit, schema_bytes)
    return validate(data, model), data


async def parse_with_data_async(raw: bytes, model: type[BaseModel], limit: int,
                                schema_bytes: Optional[int] = None) -> Tuple[BaseModel, dict]:
    """(`parse_body`'s model, the body's dict) from one parse, off the event loop as
    `parse_body_async` does; its errors."""
    if len(raw) <= PARSE_INLINE_BYTES:
        return _parse_with_data(raw, model, limit, schema_bytes)
    return await asyncio.get_running_loop().run_in_executor(
        _PARSER, _parse_with_data, raw, model, limit, schema_bytes)


def validate(data: Dict[str, Any], model: type[BaseModel]) -> BaseModel:
    """A parsed body (a dict) -> pydantic model; APIError 400 for fields that fail
    validation (naming the field, with its range for a bound) or a top-level field a
    model that forbids extras does not declare (see `parse_body`)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        unknown = [x for x in errors if x["type"] == "extra_forbidden" and len(x["loc"]) == 1]
        if unknown:  # the copied API's wording for a parameter it does not define
            name = str(unknown[0]["loc"][0])
            wording = getattr(model, "unknown_field_message", None)
            if wording:  # Anthropic's
                raise APIError(400, wording.format(name=name), param=name) from None
            raise APIError(400, f"Unknown parameter: '{name}'.", param=name,  # OpenAI's
                           code="unknown_parameter") from None
        err = errors[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        bounds = field_range(model, err["loc"]) or schema_range(model, err["loc"])
        if bounds and err["type"] in _RANGE_ERRORS:
            finite = "a finite number " if err["type"] == "finite_number" else ""
            msg = f"must be {finite}in {bounds}, got {err.get('input')!r}"
        raise APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "finite_number"}


def field_range(model: type[BaseModel], loc) -> Optional[str]:
    """The allowed range of a top-level numeric field from its pydantic bounds, in
    interval notation ("[0, 2]", "(0, 1]", "[1, inf)"), or None for a field without
    bounds or a nested location."""
    if len(loc) != 1 or loc[0] not in model.model_fields:
        return None
    lo = hi = None
    lo_open = hi_open = False
    for m in model.model_fields[loc[0]].metadata:
        for attr, is_lo, is_open in (("ge", True, False), ("gt", True, True),
                                     ("le", False, False), ("lt", False, True)):
            v = getattr(m, attr, None)
            if v is not None:
                if is_lo:
                    lo, lo_open = v, is_open
                else:
                    hi, hi_open = v, is_open
    if lo is None and hi is None:
        return None
    return (f"{'(' if lo_open or lo is None else '['}{'-inf' if lo is None else lo}, "
            f"{'inf' if hi is None else hi}{')' if hi_open or hi is None else ']'}")


def schema_range(model: type[BaseModel], loc) -> Optional[str]:
    """The allowed range, in interval notation, at a nested location of `model`'s JSON
    schema (a dict value such as logit_bias.<id>, a list item), or None."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})

    def resolve(node):
        while isinstance(node, dict) and "$ref" in node:
            node = defs.get(node["$ref"].rsplit("/", 1)[-1], {})
        return node

    def step(node, key):
        node = resolve(node)
        for branch in [node] + [resolve(b) for b in node.get("anyOf", [])]:
            if isinstance(key, int) and "items" in branch:
                return branch["items"]
            if key in branch.get("properties", {}):
                return branch["properties"][key]
            if isinstance(branch.get("additionalProperties"), dict):
                return branch["additionalProperties"]
        return None

    node = schema
    for key in loc:
        node = step(node, key)
        if node is None:
            return None
    node = resolve(node)
    for branch in [node] + [resolve(b) for b in node.get("anyOf", [])]:
        lo = branch.get("minimum", branch.get("exclusiveMinimum"))
        hi = branch.get("maximum", branch.get("exclusiveMaximum"))
        if lo is not None or hi is not None:
            return (f"{'(' if 'exclusiveMinimum' in branch or lo is None else '['}"
                    f"{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}"
                    f"{')' if 'exclusiveMaximum' in branch or hi is None else ']'}")
    return None


def sampling_from(svc: Service, req) -> Sampling:
    """The request's `Sampling` over the server's defaults (`Sampling.from_request`:
    every sampling field the request's schema has), checked against the model's
    vocabulary; APIError 400 naming the field for an out-of-range value."""
    try:
        return Sampling.from_request(req, svc.defaults).check(vocab=n_vocab(svc))
    except InputError as e:
        raise APIError(400, str(e), param=e.param) from None


def budget(svc: Service, n_prompt: int, max_tokens: Optional[int],
           field: str = "max_tokens", prompt_param: str = "messages",
           anthropic: bool = False) -> int:
    """max_tokens for the job, in the wording and codes the API's clients parse.

    A prompt that does not fit: APIError 400, Anthropic's `prompt is too long: N tokens >
    C maximum`, or OpenAI's message with code `context_length_exceeded` and param
    `prompt_param` ("messages", "input" on /v1/responses, "prompt"). A prompt that fits
    but whose max_tokens passes the context: Anthropic answers 400 `input length and
    max_tokens exceed context limit: P + M > C, ...` (Claude Code retries with a
    smaller max_tokens, as with Anthropic's API); OpenAI endpoints cut the reply at the
    context instead (finish_reason "length", as vLLM-style servers do: Qwen Code sends
    max_tokens 8000 whatever the context). No max_tokens: the server's --max-tokens
    (`svc.default_max_tokens`), else the room left."""
    if n_prompt >= svc.context:
        if anthropic:  # the context itself, the one number every route states
            rel = ">" if n_prompt > svc.context else ">="  # (a prompt must leave a token)
            raise APIError(400, f"prompt is too long: {n_prompt} tokens {rel} {svc.context} "
                           "maximum", param=prompt_param)
        raise APIError(400, f"This model's maximum context length is {svc.context} tokens. "
                       f"However, your {prompt_param} resulted in {n_prompt} tokens. Please "
                       f"reduce the length of the {prompt_param}.", param=prompt_param,
                       code="context_length_exceeded")
    room = svc.context - n_prompt
    if max_tokens is None:  # --max-tokens, else the room left (OpenAI's rule)
        return min(room, svc.default_max_tokens or room)
    if max_tokens > room and anthropic:
        raise APIError(400, f"input length and `{field}` exceed context limit: {n_prompt} + "
                       f"{max_tokens} > {svc.context}, decrease input length or `{field}` "
                       "and try again", param=field)
    return min(max_tokens, room)


def effort_of(value, param: str = "reasoning_effort") -> str:
    """K3.1's thinking effort for an API effort name (`chat_format.api_effort`: none,
    minimal and low think low; medium and high, high; xhigh and max, max; None: max);
    APIError 400 naming `param` and the accepted names otherwise."""
    try:
        return api_effort(value)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def check_tool_name(name: str, tools) -> None:
    """APIError 400 (param tool_choice) unless a tool of `tools` (chat form) is `name`."""
    names = [t.get("function", {}).get("name") for t in tools or ()]
    if name not in names:
        raise APIError(400, f"tool_choice names the tool {name!r}, which is not among the "
                       f"request's tools ({', '.join(map(repr, names)) or 'none given'})",
                       param="tool_choice")


def stop_list(stop: Union[None, str, Sequence[str]]) -> List[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise APIError(400, "stop strings must be non-empty strings", param="stop")
    return stops


# the request's hold on the loaded model (`server.models.Lease`), set by the route
# handler that took it; `submit` binds each job to it so the model stays until they end
LEASE: contextvars.ContextVar = contextvars.ContextVar("kimi_mlx_model_lease", default=None)


def submit(svc: Service, job: Job) -> Job:
    """Queue a job whose events arrive on the running event loop; 503 when full."""
    refused = svc.engine.refusal(job)
    if refused:
        raise APIError(400, refused[1], param=refused[0])
    job.attach(asyncio.get_running_loop())
    lease = LEASE.get()
    if lease is not None:
        lease.bind(job)
    try:
        return svc.engine.submit(job)
    except Busy as e:
        job.ended()
        raise APIError(503, f"the server is busy: {e}; retry later", "overloaded_error",
                       headers={"Retry-After": "1"}) from None


async def reply_events(job: Job, builder: ReplyBuilder, request=None,
                       poll: float = 0.25) -> AsyncIterator[Tuple[Event, Optional[TokenOut], Optional[Finished]]]:
    """Feed a job's tokens through `builder`; yields (reply event, token or None,
    Finished or None). The last item carries the Finished. Cancels the job when a stop
    string matched; raises ClientGone (after cancelling) when `request`'s client left,
    APIError 500 when generation failed."""
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                ev = await job.next_event(poll)
            except asyncio.TimeoutError:
                ev = None
            if request is not None and loop.time() - checked >= poll:
                # also while tokens flow: a non-streamed request learns of a client that
                # left only by asking
                checked = loop.time()
                if await request.is_disconnected():
                    raise ClientGone()
            if ev is None or isinstance(ev, Started):
                continue
            if isinstance(ev, TokenOut):
                if builder.stopped:
                    continue
                out = builder.feed(ev.token)
                if builder.stopped:
                    job.cancel()
                yield out, ev, None
            elif isinstance(ev, Finished):
                yield builder.finish(), None, ev
                return
            else:
                assert isinstance(ev, Failed)
                raise APIError(500, ev.message, "server_error")
    finally:
        job.cancel()  # no-op after Finished; frees the slot when the consumer left early


# an SSE comment: every SSE parser skips it; proxies and clients see the stream alive
PING = ": ping\n\n"
ANTHROPIC_PING = 'event: ping\ndata: {"type": "ping"}\n\n'  # what Anthropic's API sends


async def guarded_stream(svc: Service, job: Job, body: AsyncIterator[str], endpoint: str,
                         error_event: Callable[[str, str], str],
                         ping: Union[str, Callable[[], str]] = PING,
                         ping_first: bool = True) -> AsyncIterator[str]:
    """A streamed reply's bytes after its 200: `body`'s chunks, and when generation fails
    after the stream started (a Failed job, a lost stage, an internal error) one last
    chunk `error_event(kind, message)` in the endpoint's dialect, counted in /metrics
    (kimi_mlx_stream_errors_total{endpoint}). Every check that can refuse a request ran
    before the 200; this is what can still go wrong. The job is cancelled on the way out
    (done, failed, or the client left), freeing its slot.

    Signs of life: `ping` (an SSE comment; Anthropic's ping event on /v1/messages) goes
    out first when `ping_first`, and again whenever `body` has said nothing for
    `svc.keepalive_s` seconds (a long queue wait or prefill: a 40k-token prompt takes
    minutes), so that proxies and clients with read timeouts keep the stream. A callable
    `ping` is asked each time (what it returns may depend on the body's state)."""
    it = body.__aiter__()
    pending: Optional[asyncio.Future] = None
    try:
        try:
            if ping_first:
                yield ping() if callable(ping) else ping
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=svc.keepalive_s)
                if not done:
                    yield ping() if callable(ping) else ping
                    continue
                task, pending = pending, None
                try:
                    s = task.result()
                except StopAsyncIteration:
                    return
                yield s
        except APIError as e:
            kind, message = e.kind, e.message
        except Exception as e:  # noqa: BLE001 - a stream ends with an error event, not a cut
            log.exception("streamed reply failed")
            kind, message = "server_error", f"internal error: {type(e).__name__}: {e}"
        if svc.metrics is not None:
            svc.metrics.stream_errors.labels(endpoint).inc()
        yield error_event(kind, message)
    finally:
        if pending is not None:
            pending.cancel()
        job.cancel()
