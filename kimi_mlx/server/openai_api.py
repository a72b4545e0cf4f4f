"""OpenAI API: POST /v1/chat/completions and /v1/completions (request -> `Job`, reply
events -> response JSON or server-sent-event chunks)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Optional

from kimi_mlx.text.chat_format import resolve_effort
from kimi_mlx.generation.request import InputError, build_chat_prompt_with_ends
from kimi_mlx.server.common import (APIError, Service, budget, guarded_stream,
                                    reply_events, sampling_from, stop_list, submit)
from kimi_mlx.server.structured import constrained, prompt_tool_choice
from kimi_mlx.server.images import allow_urls, job_images, openai_refs, prepare, request_images
from kimi_mlx.server.jobs import Job
from kimi_mlx.server.reply import ReplyBuilder, ToolCall, token_bytes, token_logprobs
from kimi_mlx.server.schemas import ChatRequest, CompletionRequest


def _unsupported(req, chat: bool) -> None:
    """400 for fields that would change the result and that we cannot honour."""
    if req.n not in (None, 1):
        raise APIError(400, f"n={req.n} is not supported: this server returns one choice "
                       "per request (n=1)", param="n")
    if chat:
        rf = req.response_format
        if rf is not None and rf.get("type") not in _RESPONSE_FORMATS:
            raise APIError(400, f"response_format type {rf.get('type')!r} is not supported; "
                           f"use one of {', '.join(_RESPONSE_FORMATS)}", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    else:
        if req.echo:
            raise APIError(400, "echo=true is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", param="best_of")


def chat_messages(req: ChatRequest) -> List[Dict[str, Any]]:
    """OpenAI messages -> chat_format messages (developer -> system; a tool message gets
    its function name from the assistant call it answers)."""
    names: Dict[str, str] = {}
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        for call in d.get("tool_calls") or []:
            fn = call.get("function")
            # (malformed calls are left for the prompt encoder, whose 400 names them)
            if isinstance(fn, dict) and isinstance(call.get("id"), str) and isinstance(fn.get("name"), str):
                names[call["id"]] = fn["name"]
        if d["role"] == "tool" and "name" not in d and d.get("tool_call_id") in names:
            d["name"] = names[d["tool_call_id"]]
        out.append(d)
    return out


# K3.1 is told these in its prompt, as Moonshot's reference encoder does (no constrained
# decoding): "text" changes nothing, the JSON kinds add the reference's system block
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_TOOL_CHOICES = ("auto", "required", "none")


def chat_options(tools, choice, response_format) -> dict:
    """encode_chat options for OpenAI tool_choice / response_format (a named function is
    told as "required"; the grammar, `server.structured`, enforces the name); 400 for a
    tool_choice form we do not know."""
    choice = prompt_tool_choice(choice)
    opts = {}
    if tools and choice in ("required", "none"):
        opts["tool_choice"] = choice
    if response_format and response_format.get("type") in ("json_object", "json_schema"):
        opts["response_format"] = response_format
    return opts


def prepare_chat(svc: Service, req: ChatRequest) -> Job:
    svc.check_model(req.model)
    _unsupported(req, chat=True)
    try:
        effort = resolve_effort(req.reasoning_effort)
    except ValueError as e:
        raise APIError(400, f"reasoning_effort: {e}", param="reasoning_effort") from None
    messages = chat_messages(req)
    images = request_images(svc, openai_refs(messages, allow_urls(svc)))
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    options = chat_options(tools, req.tool_choice, req.response_format)
    try:
        ids, ends = build_chat_prompt_with_ends(svc.tok, messages, effort, tools, **options)
    except InputError as e:
        raise APIError(400, str(e), param="messages") from None
    max_tokens = req.max_completion_tokens or req.max_tokens
    sampling = constrained(svc, sampling_from(svc, req), ids, tools=tools,
                           response_format=req.response_format, tool_choice=req.tool_choice,
                           think_budget=req.thinking_budget, parallel=req.parallel_tool_calls)
    return Job(ids, budget(svc, len(ids), max_tokens), sampling,
               (req.top_logprobs or 0) if req.logprobs else None, ends, None,
               **job_images(svc, ids, images))


def prepare_completion(svc: Service, req: CompletionRequest) -> Job:
    svc.check_model(req.model)
    _unsupported(req, chat=False)
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise APIError(400, f"prompt: a list of {len(p)} prompts is not supported; send "
                           "one per request", param="prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = svc.tok.encode(p)
    else:
        ids = [int(x) for x in p]
        bad = [x for x in ids if not 0 <= x < len(svc.tok)]
        if not ids or bad:
            raise APIError(400, f"prompt: token ids must be in [0, {len(svc.tok)}), got "
                           f"{bad[:3] or 'none'}", param="prompt")
    return Job(ids, budget(svc, len(ids), req.max_tokens),
               sampling_from(svc, req),
               req.logprobs)


def _usage(job: Job, builder: ReplyBuilder, done) -> dict:
    n_prompt = len(job.ids)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": builder.n_tokens,
        "total_tokens": n_prompt + builder.n_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens if done else 0},
        "completion_tokens_details": {"reasoning_tokens": builder.reasoning_tokens},
    }


def _tool_call_json(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}


class _Completion:
    """Shared state of one response (ids, timestamps, builder)."""

    def __init__(self, svc: Service, job: Job, model: str, chat: bool, stops):
        self.svc, self.job, self.model, self.chat = svc, job, model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.builder = ReplyBuilder(svc.wrapper, stops, chat=chat)


async def chat_response(svc: Service, req: ChatRequest, request) -> dict:
    job = await prepare(prepare_chat, svc, req)
    stops = stop_list(req.stop)
    c = _Completion(svc, job, req.model, True, stops)
    submit(svc, job)
    lps, done = [], None
    async for _ev, tok, fin in reply_events(job, c.builder, request):
        if tok is not None and job.logprobs is not None:
            lps.append(token_logprobs(svc.wrapper, tok.token, tok.logprob, tok.top))
        done = fin or done
    b = c.builder
    msg: Dict[str, Any] = {"role": "assistant", "content": b.content}
    if b.reasoning:
        msg["reasoning_content"] = b.reasoning
    if b.tool_calls:
        msg["tool_calls"] = [_tool_call_json(t) for t in b.tool_calls]
    return {
        "id": c.id, "object": "chat.completion", "created": c.created, "model": req.model,
        "choices": [{"index": 0, "message": msg,
                     "logprobs": {"content": lps} if job.logprobs is not None else None,
                     "finish_reason": b.finish_reason(done.reason)}],
        "usage": _usage(job, b, done),
    }


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _split_args(text: str, pieces: int = 3) -> List[str]:
    """Argument JSON in a few fragments (as a client sees them streamed)."""
    n = max(1, -(-len(text) // pieces))
    return [text[i:i + n] for i in range(0, len(text), n)] or [""]


async def chat_stream(svc: Service, req: ChatRequest, request):
    """Validated and queued before the first byte: returns an async iterator of SSE."""
    job = await prepare(prepare_chat, svc, req)
    stops = stop_list(req.stop)
    c = _Completion(svc, job, req.model, True, stops)
    submit(svc, job)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta, finish=None, logprobs=None):
        return _sse({"id": c.id, "object": "chat.completion.chunk", "created": c.created,
                     "model": req.model, "choices": [{"index": 0, "delta": delta,
                     "logprobs": logprobs, "finish_reason": finish}]})

    async def body():
        yield chunk({"role": "assistant", "content": ""})
        done, n_calls = None, 0
        async for ev, tok, fin in reply_events(job, c.builder):
            lp = None
            if tok is not None and job.logprobs is not None:
                lp = {"content": [token_logprobs(svc.wrapper, tok.token, tok.logprob, tok.top)]}
            if ev.reasoning:
                yield chunk({"reasoning_content": ev.reasoning}, logprobs=lp)
                lp = None
            if ev.content:
                yield chunk({"content": ev.content}, logprobs=lp)
                lp = None
            for call in ev.tool_calls:
                args = json.dumps(call.arguments, ensure_ascii=False)
                yield chunk({"tool_calls": [{"index": n_calls, "id": call.id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]})
                for frag in _split_args(args):
                    yield chunk({"tool_calls": [{"index": n_calls,
                                                 "function": {"arguments": frag}}]})
                n_calls += 1
            if lp is not None:  # a token whose text is still held back
                yield chunk({}, logprobs=lp)
            done = fin or done
        yield chunk({}, finish=c.builder.finish_reason(done.reason))
        if include_usage:
            yield _sse({"id": c.id, "object": "chat.completion.chunk", "created": c.created,
                        "model": req.model, "choices": [], "usage": _usage(job, c.builder, done)})
        yield "data: [DONE]\n\n"

    return guarded_stream(svc, job, body(), "/v1/chat/completions", _error_sse)


def _error_sse(kind: str, message: str) -> str:
    """The OpenAI-style error chunk that ends a stream which failed after its 200."""
    return _sse({"error": {"message": message, "type": kind, "param": None, "code": kind}})


def _legacy_logprobs(svc, toks, text_start=0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = text_start
    for t in toks:
        s = token_bytes(svc.wrapper, t.token).decode("utf-8", errors="replace")
        out["tokens"].append(s)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({token_bytes(svc.wrapper, i).decode("utf-8", errors="replace"): lp
                                    for i, lp in (t.top or [])})
        out["text_offset"].append(pos)
        pos += len(s)
    return out


async def completion_response(svc: Service, req: CompletionRequest, request) -> dict:
    job = prepare_completion(svc, req)
    c = _Completion(svc, job, req.model, False, stop_list(req.stop))
    submit(svc, job)
    toks, done = [], None
    async for _ev, tok, fin in reply_events(job, c.builder, request):
        if tok is not None:
            toks.append(tok)
        done = fin or done
    return {
        "id": c.id, "object": "text_completion", "created": c.created, "model": req.model,
        "choices": [{"index": 0, "text": c.builder.content,
                     "logprobs": _legacy_logprobs(svc, toks) if job.logprobs is not None else None,
                     "finish_reason": c.builder.finish_reason(done.reason)}],
        "usage": _usage(job, c.builder, done),
    }


async def completion_stream(svc: Service, req: CompletionRequest, request):
    job = prepare_completion(svc, req)
    c = _Completion(svc, job, req.model, False, stop_list(req.stop))
    submit(svc, job)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(text, finish=None, logprobs=None):
        return _sse({"id": c.id, "object": "text_completion", "created": c.created,
                     "model": req.model, "choices": [{"index": 0, "text": text,
                     "logprobs": logprobs, "finish_reason": finish}]})

    async def body():
        done = None
        async for ev, tok, fin in reply_events(job, c.builder):
            lp = _legacy_logprobs(svc, [tok]) if tok is not None and job.logprobs is not None else None
            if ev.content or lp:
                yield chunk(ev.content, logprobs=lp)
            done = fin or done
        yield chunk("", finish=c.builder.finish_reason(done.reason))
        if include_usage:
            yield _sse({"id": c.id, "object": "text_completion", "created": c.created,
                        "model": req.model, "choices": [], "usage": _usage(job, c.builder, done)})
        yield "data: [DONE]\n\n"

    return guarded_stream(svc, job, body(), "/v1/completions", _error_sse)
