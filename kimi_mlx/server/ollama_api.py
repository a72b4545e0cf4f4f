"""Ollama's API (docs/api.md of github.com/ollama/ollama) over the same engine as the
OpenAI and Anthropic routes: POST /api/chat and /api/generate, GET /api/tags, POST
/api/show, GET /api/ps and /api/version, each also under /ollama/api/ (as exo serves
it).

An Ollama request is translated into the OpenAI chat request (`schemas.ChatRequest`)
and prepared by `openai_api.prepare_chat`, so prompt encoding, images, tools, the
`format` grammar (`server.structured`, exactly as `response_format` json_object /
json_schema), admission and the queue are the chat route's own; only the reply's
shape differs. Replies stream as NDJSON (`application/x-ndjson`: one JSON object per
line, the last with `done: true`, `done_reason` and the timings in nanoseconds), or come
whole with `stream: false` (Ollama streams by default). Errors are Ollama's
`{"error": "..."}` with the HTTP status (404 unknown model, 400 bad input).

Mapping (Ollama -> this server):
- `think`: true -> K3.1's default effort (max), false -> "none" (K3.1 always thinks;
  its lowest effort, low), "low" / "medium" / "high" -> `reasoning_effort` of that name.
  The thinking comes back in `message.thinking` (`thinking` on /api/generate).
- `options`: temperature, top_p, top_k, min_p, seed, stop, presence_penalty,
  frequency_penalty as OpenAI's; num_predict -> max_tokens (-1, -2: no limit, the
  server's own cap); repeat_penalty -> repetition_penalty; repeat_last_n ->
  repetition_context_size (0: no repetition penalty; -1: the whole context); num_ctx is
  accepted and ignored (the context is fixed when the model loads); other options
  (num_gpu, mirostat, ...) are ignored, as Ollama ignores the ones a runner lacks.
  One option of this server's own: `thinking_budget` (the chat route's field: reasoning
  tokens before a `format` grammar closes the thinking).
- `keep_alive`: how long the model stays loaded after the request (`server.models`:
  seconds, a Go duration string, 0 unloads once the reply ends, negative: forever);
  a request with nothing to generate and keep_alive 0 unloads it (`ollama stop`),
  answered with done_reason "unload". A request naming another served model swaps it in.
- `images`: base64 images on a message (or on /api/generate), routed as OpenAI
  `image_url` data-URL parts to the vision tower.
- /api/generate: `system` + `prompt` as a chat turn; `raw: true` encodes the prompt
  as-is (no chat format), as /v1/completions does; `template`, `suffix` and `context`
  are refused (400) since they would change the prompt in a way this server cannot.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import time
from datetime import datetime, timezone
from typing import Any, ClassVar, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kimi_mlx.server.common import (LEASE, APIError, ClientGone, Service, guarded_stream,
                                    max_schema_bytes, parse_body_async, parse_with_data_async,
                                    reply_events, stop_list, submit, validate)
from kimi_mlx.server.images import prepare
from kimi_mlx.server.jobs import Job
from kimi_mlx.server.models import model_lease
from kimi_mlx.server.reply import ReplyBuilder, ToolCall
from kimi_mlx.server.schemas import ChatRequest, CompletionRequest

log = logging.getLogger(__name__)

# the Ollama API level these routes follow; clients gate on it (VS Code Copilot's local
# provider needs >= 0.6.4), so it is Ollama's version number, not this package's
OLLAMA_VERSION = "0.12.0"
ARCHITECTURE = "kimi_k31"  # config.json model_type of every checkpoint this server loads
PREFIXES = ("/api", "/ollama/api")
ROUTES = {p + r for p in PREFIXES for r in ("/chat", "/generate", "/tags", "/show", "/ps",
                                            "/version")}
NDJSON = "application/x-ndjson"
# what /api/ps says for expires_at of a model that does not unload (Ollama's own
# "forever" shows as this far date)
_NEVER = "2318-08-13T00:00:00Z"


def is_ollama(path: str) -> bool:
    """Whether `path` answers in Ollama's dialect (`{"error": "..."}`)."""
    return path.startswith(PREFIXES[0] + "/") or path.startswith(PREFIXES[1] + "/")


def error_body(message: str) -> dict:
    """Ollama's error body."""
    return {"error": message}


class _Body(BaseModel):
    # fields are read from the dict; the model only checks the top-level types
    model_config = ConfigDict(extra="allow", strict=True)


class OllamaChatRequest(_Body):
    """POST /api/chat (Ollama's ChatRequest)."""

    schema_fields: ClassVar[tuple] = (("format", ("format",)),
                                      ("tools[{}]", ("tools", "*", "function", "parameters")))

    model: str
    messages: List[Dict[str, Any]] = []
    tools: Optional[List[Dict[str, Any]]] = None
    format: Optional[Any] = None
    options: Optional[Dict[str, Any]] = None
    stream: bool = True
    keep_alive: Optional[Any] = None
    think: Optional[Any] = None


class OllamaGenerateRequest(_Body):
    """POST /api/generate (Ollama's GenerateRequest)."""

    schema_fields: ClassVar[tuple] = (("format", ("format",)),)

    model: str
    prompt: Optional[str] = None
    system: Optional[str] = None
    images: Optional[List[str]] = None
    raw: bool = False
    format: Optional[Any] = None
    options: Optional[Dict[str, Any]] = None
    stream: bool = True
    keep_alive: Optional[Any] = None
    think: Optional[Any] = None
    template: Optional[str] = None
    suffix: Optional[str] = None
    context: Optional[List[Any]] = None


class OllamaShowRequest(_Body):
    """POST /api/show: `model` (or the older `name`)."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: Optional[bool] = None


# ------------------------------------------------------------------ translation


def _names(svc: Service) -> List[str]:
    """The model names requests may use (every allowed one with a `ModelHolder`)."""
    return list(svc.models.allowed) if svc.models is not None else list(svc.model_ids[:1])


def served_name(svc: Service, name: Any) -> str:
    """The served model a request names: `name`, or `name` with the tag ":latest" (what
    Ollama clients add); APIError 404 (Ollama's `model "x" not found`) otherwise."""
    if isinstance(name, str):
        base = name[:-len(":latest")] if name.endswith(":latest") else name
        for n in (name, base):
            if n in _names(svc) or (svc.models is None and n in svc.model_ids):
                return n
    raise APIError(404, f"model {name!r} not found; this server serves "
                   f"{', '.join(repr(m) for m in _names(svc))} (GET /api/tags)",
                   "not_found_error", "model")


def keep_alive(body: Dict[str, Any]):
    """The request's keep_alive as `server.models` takes it: seconds, `catalog.FOREVER`,
    or `catalog.DEFAULT` when absent; APIError 400 naming keep_alive for a bad value."""
    from kimi_mlx.server.catalog import DEFAULT, parse_keep_alive

    if body.get("keep_alive") is None:
        return DEFAULT
    try:
        return parse_keep_alive(body["keep_alive"])
    except ValueError as e:
        raise APIError(400, str(e), param="keep_alive") from None


def effort(think: Any) -> Optional[str]:
    """`reasoning_effort` for Ollama's `think` (see the module docstring); APIError 400
    for another value."""
    if think is None or think is True:
        return None
    if think is False:
        return "none"
    if think in ("low", "medium", "high"):
        return think
    raise APIError(400, f"think must be true, false, \"low\", \"medium\" or \"high\", got "
                   f"{think!r}", param="think")


def response_format(fmt: Any) -> Optional[dict]:
    """OpenAI's response_format for Ollama's `format`: "json" -> json_object, a JSON
    schema object -> json_schema (strict: the reply must validate), "" / null -> none."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt,
                                                       "strict": True}}
    raise APIError(400, f"format must be \"json\" or a JSON schema object, got {fmt!r}",
                   param="format")


_SAME = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
         "frequency_penalty")


def sampling_fields(svc: Service, options: Optional[dict]) -> dict:
    """ChatRequest fields for Ollama's `options` (see the module docstring)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise APIError(400, "options must be an object", param="options")
    out = {k: options[k] for k in _SAME if options.get(k) is not None}
    n = options.get("num_predict")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n == 0 or n < -2:
            raise APIError(400, f"options.num_predict must be a positive integer, or -1 / "
                           f"-2 for no limit, got {n!r}", param="options.num_predict")
        if n > 0:
            out["max_tokens"] = n
    if options.get("thinking_budget") is not None:
        out["thinking_budget"] = options["thinking_budget"]
    if options.get("repeat_penalty") is not None:
        out["repetition_penalty"] = options["repeat_penalty"]
    last = options.get("repeat_last_n")
    if last is not None:
        if not isinstance(last, int) or isinstance(last, bool) or last < -1:
            raise APIError(400, f"options.repeat_last_n must be an integer >= -1, got {last!r}",
                           param="options.repeat_last_n")
        if last == 0:
            out.pop("repetition_penalty", None)
        else:
            out["repetition_context_size"] = svc.context if last == -1 else last
    return out


# ChatRequest's name of a field -> the Ollama field a 400 names
_FIELD_NAMES = {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
                "repetition_context_size": "options.repeat_last_n",
                "response_format": "format", "reasoning_effort": "think",
                "thinking_budget": "options.thinking_budget"}
_FIELD_NAMES.update({k: "options." + k for k in _SAME})


def _image_part(data: Any, where: str) -> dict:
    """An OpenAI image_url part for one base64 image of an Ollama request (its media
    type read from the image's first bytes; the image loader checks the rest)."""
    if not isinstance(data, str) or not data:
        raise APIError(400, f"{where}: an image must be a non-empty base64 string",
                       param=where.split("[")[0])
    if data.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": data}}
    try:
        head = base64.b64decode("".join(data[:64].split())[:32] + "==", validate=False)
    except (binascii.Error, ValueError):
        head = b""
    media = ("image/png" if head.startswith(b"\x89PNG") else
             "image/jpeg" if head.startswith(b"\xff\xd8") else
             "image/gif" if head.startswith(b"GIF8") else
             "image/webp" if head[:4] == b"RIFF" and head[8:12] == b"WEBP" else None)
    if media is None:
        raise APIError(400, f"{where}: the image is not base64 PNG, JPEG, WebP or GIF data",
                       param=where.split("[")[0])
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def chat_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Ollama messages -> OpenAI chat messages: `images` -> image_url parts after the
    text, `thinking` -> reasoning_content, `tool_calls` (arguments an object) -> OpenAI
    calls (arguments a JSON string, ids made up), a `tool` message -> its call's id (the
    n-th tool message after an assistant turn answers its n-th call) and name
    (`tool_name`)."""
    out: List[Dict[str, Any]] = []
    ids: List[str] = []
    answered = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        d: Dict[str, Any] = {"role": role}
        content = m.get("content", "")
        images = m.get("images") or []
        if not isinstance(images, list):
            raise APIError(400, f"messages[{i}].images must be a list of base64 strings",
                           param="messages")
        if images:
            parts = [{"type": "text", "text": content}] if content else []
            d["content"] = parts + [_image_part(x, f"messages[{i}].images[{j}]")
                                    for j, x in enumerate(images)]
        else:
            d["content"] = content
        if m.get("thinking"):
            d["reasoning_content"] = m["thinking"]
        calls = m.get("tool_calls")
        if role == "assistant":
            ids, answered = [], 0
            if calls:
                if not isinstance(calls, list):
                    raise APIError(400, f"messages[{i}].tool_calls must be a list",
                                   param="messages")
                oai = []
                for j, c in enumerate(calls):
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise APIError(400, f"messages[{i}].tool_calls[{j}] needs "
                                       "function.name", param="messages")
                    args = fn.get("arguments", {})
                    cid = c.get("id") or f"call_{i}_{j}"
                    ids.append(cid)
                    oai.append({"id": cid, "type": "function", "function": {
                        "name": fn["name"], "arguments": args if isinstance(args, str)
                        else json.dumps(args, ensure_ascii=False)}})
                d["tool_calls"] = oai
        elif role == "tool":
            if m.get("tool_call_id"):
                d["tool_call_id"] = m["tool_call_id"]
            elif answered < len(ids):
                d["tool_call_id"] = ids[answered]
            answered += 1
            name = m.get("tool_name") or m.get("name")
            if name:
                d["name"] = name
        out.append(d)
    return out


def chat_request(svc: Service, body: Dict[str, Any], messages: List[Dict[str, Any]],
                 model: str) -> ChatRequest:
    """The OpenAI ChatRequest an Ollama request stands for (checked by its schema; a 400
    names the Ollama field). Validated from the dict as it is (no JSON written and read
    again: the body may carry megabytes of base64 images)."""
    d: Dict[str, Any] = {"model": model, "messages": messages,
                         **sampling_fields(svc, body.get("options"))}
    if body.get("tools"):
        d["tools"] = body["tools"]
    rf = response_format(body.get("format"))
    if rf is not None:
        d["response_format"] = rf
    e = effort(body.get("think"))
    if e is not None:
        d["reasoning_effort"] = e
    try:
        return validate(d, ChatRequest)
    except APIError as err:
        head, sep, rest = err.message.partition(":")
        first = head.split(".")[0]
        if sep and first in _FIELD_NAMES:
            err.message = _FIELD_NAMES[first] + head[len(first):] + sep + rest
            err.param = _FIELD_NAMES[first]
        raise


# ------------------------------------------------------------------ replies


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _tool_calls(calls: List[ToolCall]) -> List[dict]:
    """Ollama's tool calls: arguments an object, not a string."""
    return [{"id": c.id, "function": {"index": k, "name": c.name, "arguments": c.arguments}}
            for k, c in enumerate(calls)]


class _Run:
    """One generation: its job, reply builder and the clock for Ollama's timings."""

    def __init__(self, svc: Service, job: Job, model: str, chat: bool, stops, t0: float):
        self.svc, self.job, self.model = svc, job, model
        self.builder = ReplyBuilder(svc.wrapper, stops, chat=chat)
        self.t0 = t0  # the request's arrival (perf_counter)
        lease = LEASE.get()  # the wait for its model to load, Ollama's load_duration
        self.load_s = lease.waited_s if lease is not None else 0.0
        self.t_first: Optional[float] = None
        self.done = None

    def saw(self, tok, fin) -> None:
        if tok is not None and self.t_first is None:
            self.t_first = time.perf_counter()
        self.done = fin or self.done

    def final(self) -> dict:
        """The `done` object's fields: reason and timings (ns), counts (tokens)."""
        end = time.perf_counter()
        first = self.t_first if self.t_first is not None else end
        b = self.builder
        reason = b.finish_reason(self.done.reason if self.done else "stop")
        return {"done": True, "done_reason": "length" if reason == "length" else "stop",
                "total_duration": int((end - self.t0) * 1e9),
                "load_duration": int(self.load_s * 1e9),
                "prompt_eval_count": len(self.job.ids),
                "prompt_eval_duration": int((first - self.t0) * 1e9),
                "eval_count": b.n_tokens, "eval_duration": int((end - first) * 1e9)}

    def head(self) -> dict:
        return {"model": self.model, "created_at": _now()}


def _line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _error_line(kind: str, message: str) -> str:
    """The last line of a stream that failed after its 200 (the ollama clients raise
    ResponseError on a line with "error")."""
    return _line(error_body(message))


async def _prepared(svc: Service, req: ChatRequest) -> Job:
    from kimi_mlx.server.openai_api import prepare_chat

    return await prepare(prepare_chat, svc, req)


def _raw_job(svc: Service, body: Dict[str, Any], model: str) -> Job:
    """The job of a raw /api/generate: the prompt's tokens as /v1/completions encodes a
    string (no chat format)."""
    from kimi_mlx.server.openai_api import prepare_completion

    fields = sampling_fields(svc, body.get("options"))
    d = {"model": model, "prompt": body["prompt"], **fields}
    try:
        req = validate(d, CompletionRequest)
    except APIError as err:
        first = err.message.split(":")[0].split(".")[0]
        if first in _FIELD_NAMES:
            err.message = _FIELD_NAMES[first] + err.message[len(first):]
        raise
    return prepare_completion(svc, req)


async def _start(svc: Service, kind: str, body: Dict[str, Any], model: str):
    """(job, chat?, stops) of a chat or generate request, validated and queued."""
    opts = body.get("options") or {}
    stops = stop_list(opts.get("stop")) if isinstance(opts, dict) else []
    if kind == "generate" and body.get("raw"):
        if body.get("images"):
            raise APIError(400, "images need the chat format: send them without raw",
                           param="images")
        if body.get("format") not in (None, ""):
            raise APIError(400, "format needs the chat format (its grammar follows the "
                           "reply's channels): send it without raw", param="format")
        job, chat = _raw_job(svc, body, model), False
    else:
        if kind == "generate":
            msgs: List[Dict[str, Any]] = []
            if body.get("system"):
                msgs.append({"role": "system", "content": body["system"]})
            msgs.append({"role": "user", "content": body.get("prompt") or "",
                         "images": body.get("images") or []})
        else:
            msgs = body.get("messages") or []
        req = chat_request(svc, body, chat_messages(msgs), model)
        job, chat = await _prepared(svc, req), True
    submit(svc, job)
    return job, chat, stops


async def _respond(svc: Service, kind: str, body: Dict[str, Any], model: str, request,
                   t0: float) -> dict:
    job, chat, stops = await _start(svc, kind, body, served_name(svc, model))
    run = _Run(svc, job, model, chat, stops, t0)
    async for _ev, tok, fin in reply_events(job, run.builder, request):
        run.saw(tok, fin)
    b = run.builder
    if kind == "chat":
        msg: Dict[str, Any] = {"role": "assistant", "content": b.content}
        if b.reasoning:
            msg["thinking"] = b.reasoning
        if b.tool_calls:
            msg["tool_calls"] = _tool_calls(b.tool_calls)
        return {**run.head(), "message": msg, **run.final()}
    out = {**run.head(), "response": b.content}
    if b.reasoning:
        out["thinking"] = b.reasoning
    return {**out, **run.final()}


async def _stream(svc: Service, kind: str, body: Dict[str, Any], model: str, t0: float):
    job, chat, stops = await _start(svc, kind, body, served_name(svc, model))
    run = _Run(svc, job, model, chat, stops, t0)

    async def lines():
        n_calls = 0
        async for ev, tok, fin in reply_events(job, run.builder):
            run.saw(tok, fin)
            if not (ev.reasoning or ev.content or ev.tool_calls):
                continue
            if kind == "chat":
                msg: Dict[str, Any] = {"role": "assistant", "content": ev.content}
                if ev.reasoning:
                    msg["thinking"] = ev.reasoning
                if ev.tool_calls:
                    calls = _tool_calls(ev.tool_calls)
                    for k, c in enumerate(calls):
                        c["function"]["index"] = n_calls + k
                    n_calls += len(calls)
                    msg["tool_calls"] = calls
                yield _line({**run.head(), "message": msg, "done": False})
            else:
                out = {**run.head(), "response": ev.content, "done": False}
                if ev.reasoning:
                    out["thinking"] = ev.reasoning
                yield _line(out)
        last = ({"message": {"role": "assistant", "content": ""}} if kind == "chat"
                else {"response": ""})
        yield _line({**run.head(), **last, **run.final()})

    # no keep-alive lines: every line an ollama client reads must be a reply object
    return guarded_stream(svc, job, lines(), f"/api/{kind}", _error_line, ping="",
                          ping_first=False)


def _loaded(kind: str, model: str, reason: str = "load") -> dict:
    """Ollama's answer to a request with nothing to generate (no messages / an empty
    prompt): the model is loaded, done_reason "load" (or unloaded: "unload")."""
    base = {"model": model, "created_at": _now(), "done": True, "done_reason": reason}
    if kind == "chat":
        return {**base, "message": {"role": "assistant", "content": ""}}
    return {**base, "response": ""}


def generation_route(svc: Service, kind: str, schema, check_key, read_body):
    """POST /api/chat or /api/generate: key and body checked (`check_key`, `read_body`:
    the app's, as every route uses them), then NDJSON or one JSON."""
    async def handler(request: Request):
        t0 = time.perf_counter()
        check_key(svc, request)
        raw = await read_body(request, svc.max_body_bytes)
        # one parse gives both (off the event loop for a large body)
        req, body = await parse_with_data_async(raw, schema, svc.max_body_bytes,
                                                max_schema_bytes(svc))
        model = served_name(svc, req.model)  # 404 before anything else
        keep = keep_alive(body)
        if kind == "generate":
            for name in ("template", "suffix"):
                if body.get(name):
                    raise APIError(400, f"{name} is not supported: this server renders "
                                   "K3.1's own chat format (use raw: true for a prompt "
                                   "sent as-is)", param=name)
            if body.get("context"):
                raise APIError(400, "context is not supported: send the conversation to "
                               "/api/chat", param="context")
        empty = (not body.get("messages")) if kind == "chat" else (
            not body.get("prompt") and not body.get("images"))
        if empty and keep == 0 and svc.models is not None:  # `ollama stop`: no load first
            svc.models.unload_now(model)
            return JSONResponse(_loaded(kind, req.model, "unload"))
        async with model_lease(svc, model, keep):  # loads / swaps it in
            reason = svc.not_ready_reason()
            if reason:
                raise APIError(503, f"not ready: {reason}", "overloaded_error",
                               headers={"Retry-After": "5"})
            if empty:
                return JSONResponse(_loaded(kind, req.model))
            if req.stream:
                lines = await _stream(svc, kind, body, req.model, t0)
                return StreamingResponse(lines, media_type=NDJSON,
                                         headers={"Cache-Control": "no-cache"})
            try:
                out = await _respond(svc, kind, body, req.model, request, t0)
            except ClientGone:
                log.info("client left after %.1fs; generation stopped", time.perf_counter() - t0)
                return Response(status_code=499)
            return JSONResponse(out)

    return handler


# ------------------------------------------------------------------ model info


def _digest(svc: Service, name: str) -> str:
    return "sha256:" + hashlib.sha256(f"{name}:{svc.created}".encode()).hexdigest()


def _details() -> dict:
    return {"parent_model": "", "format": "safetensors", "family": ARCHITECTURE,
            "families": [ARCHITECTURE], "parameter_size": "", "quantization_level": ""}


def _modified(svc: Service) -> str:
    return datetime.fromtimestamp(svc.created or 0, timezone.utc).isoformat().replace("+00:00", "Z")


def capabilities(svc: Service, name: Optional[str] = None) -> List[str]:
    """What /api/show lists: completion, tools, thinking, and vision when the checkpoint
    (`name`'s, read from its folder when it is not the loaded one) has a vision tower."""
    caps = ["completion", "tools", "thinking"]
    holder = svc.models
    if holder is not None and name is not None and holder.loaded_name != holder.resolve(name):
        vision = holder.has_vision(holder.resolve(name))
    else:
        vision = svc.images is not None and getattr(svc.images, "vision", None) is not None
    if vision:
        caps.append("vision")
    return caps


def tags(svc: Service) -> dict:
    """GET /api/tags: every served model (its name without a tag: the name the OpenAI
    routes accept, which VS Code Copilot sends to /v1/chat/completions); size: its
    safetensors files' bytes (0 where not known: the cluster server, a hub id)."""
    holder = svc.models
    return {"models": [{"name": m, "model": m, "modified_at": _modified(svc),
                        "size": holder.disk_bytes(m) if holder is not None else 0,
                        "digest": _digest(svc, m), "details": _details()}
                       for m in _names(svc)]}


def show(svc: Service, name: str) -> dict:
    """POST /api/show: model_info with general.architecture and
    `<architecture>.context_length` (VS Code Copilot's context window), capabilities."""
    holder = svc.models
    context = (holder.context_of(holder.resolve(name), holder.max_kv_size)
               if holder is not None else svc.context)
    return {"license": "", "modelfile": f"# served by kimi-mlx\nFROM {name}\n",
            "parameters": "", "template": "", "details": _details(),
            "model_info": {"general.architecture": ARCHITECTURE, "general.basename": name,
                           f"{ARCHITECTURE}.context_length": context},
            "capabilities": capabilities(svc, name), "modified_at": _modified(svc)}


def _iso(t: Optional[float]) -> str:
    if t is None:
        return _NEVER
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def ps(svc: Service) -> dict:
    """GET /api/ps: the loaded model, none while it loads or after an unload. With a
    `server.models.ModelHolder`: size is MLX's active memory now (weights and caches;
    size_vram the same on a Mac, where it is all GPU memory, 0 on MLX's CPU backend),
    expires_at when it unloads (far off when it does not). The cluster server: the
    weights are on the stages, so size is the checkpoint's tensor bytes when known
    (else 0) and size_vram 0, never unloaded."""
    import mlx.core as mx

    holder = svc.models
    if holder is None:
        if not svc.ready:
            return {"models": []}
        size = int(getattr(svc, "weights_bytes", 0) or 0)
        return {"models": [{"name": m, "model": m, "size": size, "digest": _digest(svc, m),
                            "details": _details(), "expires_at": _NEVER, "size_vram": 0,
                            "context_length": svc.context} for m in svc.model_ids[:1]]}
    name = holder.held_name
    st = holder.status(name)
    if "size" not in st:  # nothing in memory (an unloading model still is, and is listed)
        return {"models": []}
    vram = st["size"] if mx.metal.is_available() else 0
    return {"models": [{"name": name, "model": name, "size": st["size"],
                        "digest": _digest(svc, name), "details": _details(),
                        "expires_at": _iso(st["expires_at"]), "size_vram": vram,
                        "context_length": svc.context}]}


def add_routes(app: FastAPI, svc: Service, check_key, read_body) -> None:
    """Every Ollama route under /api and /ollama/api. `check_key(svc, request)` (401
    without the server's key) and `read_body(request, limit)` (413 past it) are the app's
    own (`server.app`), passed in so that this module does not import the app."""
    chat = generation_route(svc, "chat", OllamaChatRequest, check_key, read_body)
    generate = generation_route(svc, "generate", OllamaGenerateRequest, check_key, read_body)

    async def get_tags(request: Request):
        check_key(svc, request)
        return tags(svc)

    async def post_show(request: Request):
        check_key(svc, request)
        req = await parse_body_async(await read_body(request, svc.max_body_bytes), OllamaShowRequest,
                         svc.max_body_bytes)
        name = req.model or req.name
        if not name:
            raise APIError(400, "model is required", param="model")
        served_name(svc, name)
        return show(svc, name)

    async def get_ps(request: Request):
        check_key(svc, request)
        return ps(svc)

    async def get_version():
        return {"version": OLLAMA_VERSION}

    for p in PREFIXES:
        app.post(p + "/chat")(chat)
        app.post(p + "/generate")(generate)
        app.get(p + "/tags")(get_tags)
        app.post(p + "/show")(post_show)
        app.get(p + "/ps")(get_ps)
        app.get(p + "/version")(get_version)
