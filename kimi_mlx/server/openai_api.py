"""OpenAI API: POST /v1/chat/completions and /v1/completions (request -> `Job`, reply
events -> response JSON or server-sent-event chunks)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from kimi_mlx.generation.request import InputError, build_chat_prompt_with_ends
from kimi_mlx.server.common import (APIError, Service, budget, check_tool_name, effort_of,
                                    guarded_stream, reply_events, sampling_from, stop_list,
                                    submit)
from kimi_mlx.server.structured import check_request_schemas, constrained
from kimi_mlx.server.thinking import think_budget, with_think_budget
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
        for name, why in (("functions", "use tools"), ("function_call", "use tool_choice"),
                          ("audio", "this model writes text only"),
                          ("web_search_options", "this server has no web search")):
            if getattr(req, name) is not None:
                raise APIError(400, f"{name} is not supported: {why}", param=name)
        if req.modalities is not None and any(m != "text" for m in req.modalities):
            raise APIError(400, f"modalities {req.modalities!r} are not supported: this model "
                           "writes text only", param="modalities")
    else:
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


# K3.1 is told these in its prompt, as Moonshot's reference encoder does; the grammar
# (`server.structured`) then enforces them: "text" changes nothing, the JSON kinds add the
# reference's system block
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_TOOL_CHOICES = ("auto", "required", "none")


def chat_options(tools, choice, response_format) -> dict:
    """encode_chat options for a tool_choice / response_format, in every form the APIs
    define: "auto" / "required" / "none"; a named function as chat (`{"type":
    "function", "function": {"name"}}`) and Responses (`{"type": "function", "name"}`)
    send it; Responses' `{"type": "allowed_tools", "mode"}`. Moonshot's reference encoder
    renders a block for "required" and "none" only: a named function reaches the model as
    the reference passes it, i.e. as "auto" (the grammar, `server.structured`, enforces
    the name). APIError 400 for another form, or a name that is not among `tools`."""
    name = None
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
            if not isinstance(name, str) or not name:
                raise APIError(400, "tool_choice: a function tool_choice needs the function's "
                               "name", param="tool_choice")
            choice = "auto"
        elif kind == "allowed_tools":  # Responses: mode at the top; chat: under allowed_tools
            inner = choice.get("allowed_tools")
            choice = choice.get("mode") or (inner.get("mode") if isinstance(inner, dict) else None) or "auto"
        else:
            raise APIError(400, f"tool_choice type {kind!r} is not supported: use auto, "
                           "required, none or a function", param="tool_choice")
    if choice not in (None, *_TOOL_CHOICES):
        raise APIError(400, f"tool_choice {choice!r} is not supported: use one of "
                       f"{', '.join(_TOOL_CHOICES)} or a function", param="tool_choice")
    if name is not None:
        check_tool_name(name, tools)
    opts = {}
    if tools and choice in ("required", "none"):
        opts["tool_choice"] = choice
    if response_format and response_format.get("type") in ("json_object", "json_schema"):
        opts["response_format"] = response_format
    return opts


def prepare_chat(svc: Service, req: ChatRequest) -> Job:
    svc.check_model(req.model)
    _unsupported(req, chat=True)
    effort = effort_of(req.reasoning_effort)
    messages = chat_messages(req)
    images = request_images(svc, openai_refs(messages, allow_urls(svc)))
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    options = chat_options(tools, req.tool_choice, req.response_format)
    check_request_schemas(svc, response_format=req.response_format, tools=tools,
                          tool_choice=req.tool_choice)
    try:
        ids, ends = build_chat_prompt_with_ends(svc.tok, messages, effort, tools, **options)
    except InputError as e:
        raise APIError(400, str(e), param="messages") from None
    max_tokens = budget(svc, len(ids), req.max_completion_tokens or req.max_tokens)
    think = think_budget(svc, req.thinking_budget, max_tokens)
    sampling = constrained(svc, sampling_from(svc, req), ids, tools=tools,
                           response_format=req.response_format, tool_choice=req.tool_choice,
                           think_budget=think, parallel=req.parallel_tool_calls)
    sampling = with_think_budget(svc, sampling, ids, think)
    return Job(ids, max_tokens, sampling,
               (req.top_logprobs or 0) if req.logprobs else None, ends, None,
               **job_images(svc, ids, images))


def completion_prompts(svc: Service, req: CompletionRequest) -> List[List[int]]:
    """The token ids of each prompt of a completion request (a string, a list of strings,
    token ids or a list of token-id lists; strings encoded without special tokens, as
    `kimi-mlx eval` reads text). APIError 400 naming the prompt for an id outside the
    vocabulary."""
    p = req.prompt
    if isinstance(p, str):
        return [svc.tok.encode(p)]
    if isinstance(p[0], str):
        return [svc.tok.encode(x) for x in p]
    if isinstance(p[0], list):
        return [_vocab_ids(svc, x, f"prompt[{i}]") for i, x in enumerate(p)]
    return [_vocab_ids(svc, p, "prompt")]


def _vocab_ids(svc: Service, ids, where: str) -> List[int]:
    n = len(svc.tok)
    ids = [int(x) for x in ids]
    bad = [x for x in ids if not 0 <= x < n]
    if bad:
        raise APIError(400, f"{where}: token ids must be in [0, {n}) (this model's "
                       f"vocabulary), got {bad[:3]}", param="prompt")
    return ids


def prepare_completion(svc: Service, req: CompletionRequest, ids: Optional[List[int]] = None,
                       where: str = "prompt") -> Job:
    """The Job of one prompt of a completion request (`ids`: that prompt's tokens; the
    request's only prompt when None). With echo and logprobs the engine scores the
    prompt's own tokens too (`Job.score`); max_tokens 0 (score only) needs echo."""
    svc.check_model(req.model)
    _unsupported(req, chat=False)
    if ids is None:
        prompts = completion_prompts(svc, req)
        if len(prompts) != 1:
            raise APIError(400, f"prompt: a list of {len(prompts)} prompts is not supported "
                           "here; send one", param="prompt")
        ids = prompts[0]
    if not ids:
        raise APIError(400, f"{where} is empty", param="prompt")
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise APIError(400, "max_tokens: 0 generates nothing; it is allowed only with "
                       "echo=true (to score the prompt)", param="max_tokens")
    if score_only and len(ids) > svc.context:
        raise APIError(400, f"{where} is {len(ids)} tokens; this model's context is "
                       f"{svc.context} tokens (a prompt that is scored with max_tokens 0 "
                       "may fill it)", param="prompt", code="context_length_exceeded")
    score = req.logprobs if req.echo else None
    if score is not None and not svc.engine.supports_scoring:
        raise APIError(400, "echo with logprobs (scoring the prompt) is not supported by "
                       "this server", param="echo")
    max_tokens = 0 if score_only else budget(svc, len(ids), req.max_tokens, prompt_param="prompt")
    return Job(ids, max_tokens, sampling_from(svc, req), req.logprobs, score=score)


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


def _token_text(svc, token: int) -> str:
    return token_bytes(svc.wrapper, token).decode("utf-8", errors="replace")


def _legacy_logprobs(svc, toks, text_start=0, prompt=None) -> dict:
    """OpenAI's legacy completions `logprobs` object: per token its text, log-probability,
    top alternatives {text: logprob} and character offset in the choice's text. `prompt`:
    the scored prompt (ids, `Job.prompt_scores`) put first (echo), its first token with a
    null log-probability and null alternatives, as OpenAI reports them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = text_start

    def add(token, logprob, top):
        nonlocal pos
        text = _token_text(svc, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top if top is None else
                                   {_token_text(svc, i): lp for i, lp in top})
        out["text_offset"].append(pos)
        pos += len(text)

    if prompt is not None:
        ids, scores = prompt
        add(ids[0], None, None)
        for t in scores:
            add(t.token, t.logprob, t.top or [])
    for t in toks:
        add(t.token, t.logprob, t.top or [])
    return out


def _prompt_text(svc, req: CompletionRequest, index: int, ids: List[int]) -> str:
    """What echo puts before the completion: the prompt string as sent, or the decoded
    ids."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if isinstance(p[0], str):
        return p[index]
    return svc.tok.decode(ids)


async def _complete_one(svc: Service, req: CompletionRequest, job: Job, index: int,
                        request) -> Tuple[dict, dict]:
    """(choice, usage) of one prompt's job, run to its end."""
    c = _Completion(svc, job, req.model, False, stop_list(req.stop))
    toks, done = [], None
    if job.max_tokens > 0 or job.score is not None:
        submit(svc, job)
        async for _ev, tok, fin in reply_events(job, c.builder, request):
            if tok is not None:
                toks.append(tok)
            done = fin or done
        reason = c.builder.finish_reason(done.reason)
    else:  # echo of a prompt with max_tokens 0 and no logprobs: nothing to run
        reason = "length"
    text, logprobs = c.builder.content, None
    if req.echo:
        head = _prompt_text(svc, req, index, job.ids)
        text = head + text
        if job.logprobs is not None:
            # the end-of-turn token that stopped it counts as the token after the prompt
            # (its text is not in `text`): lm-eval scores up to the token before the last
            ends = [job.stop_token] if job.stop_token is not None else []
            logprobs = _legacy_logprobs(svc, toks + ends, prompt=(job.ids, job.prompt_scores or []))
    elif job.logprobs is not None:
        logprobs = _legacy_logprobs(svc, toks)
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return choice, _usage(job, c.builder, done)


async def completion_response(svc: Service, req: CompletionRequest, request) -> dict:
    prompts = completion_prompts(svc, req)
    multi = len(prompts) > 1
    jobs = [prepare_completion(svc, req, ids, f"prompt[{i}]" if multi else "prompt")
            for i, ids in enumerate(prompts)]  # every prompt checked before any runs
    choices, usage = [], None
    for i, job in enumerate(jobs):
        choice, u = await _complete_one(svc, req, job, i, request)
        choices.append(choice)
        usage = u if usage is None else _add_usage(usage, u)
    return {
        "id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion",
        "created": int(time.time()), "model": req.model, "choices": choices, "usage": usage,
    }


def _add_usage(a: dict, b: dict) -> dict:
    """Usage of two prompts' jobs together (nested counts added)."""
    return {k: _add_usage(v, b[k]) if isinstance(v, dict) else v + b[k] for k, v in a.items()}


async def completion_stream(svc: Service, req: CompletionRequest, request):
    prompts = completion_prompts(svc, req)
    if len(prompts) != 1:
        raise APIError(400, f"prompt: {len(prompts)} prompts cannot be streamed in one "
                       "request; send them one per request or with stream=false", param="prompt")
    job = prepare_completion(svc, req, prompts[0])
    c = _Completion(svc, job, req.model, False, stop_list(req.stop))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    run = job.max_tokens > 0 or job.score is not None
    if run:
        submit(svc, job)

    def chunk(text, finish=None, logprobs=None):
        return _sse({"id": c.id, "object": "text_completion", "created": c.created,
                     "model": req.model, "choices": [{"index": 0, "text": text,
                     "logprobs": logprobs, "finish_reason": finish}]})

    def echo_chunk():
        head = _prompt_text(svc, req, 0, job.ids)
        lp = None
        if job.logprobs is not None:
            lp = _legacy_logprobs(svc, [], prompt=(job.ids, job.prompt_scores or []))
        return chunk(head, logprobs=lp), len(head)

    async def body():
        done, offset, echoed = None, 0, not req.echo
        if run:
            async for ev, tok, fin in reply_events(job, c.builder):
                if not echoed:  # the prompt's scores are in once the first event is
                    text, offset = echo_chunk()
                    echoed = True
                    yield text
                lp = (_legacy_logprobs(svc, [tok], offset) if tok is not None
                      and job.logprobs is not None else None)
                if lp is not None:
                    offset += len(lp["tokens"][0])
                if ev.content or lp:
                    yield chunk(ev.content, logprobs=lp)
                done = fin or done
            if job.stop_token is not None and job.logprobs is not None:  # see _complete_one
                yield chunk("", logprobs=_legacy_logprobs(svc, [job.stop_token], offset))
        elif not echoed:
            yield echo_chunk()[0]
        reason = c.builder.finish_reason(done.reason) if done is not None else "length"
        yield chunk("", finish=reason)
        if include_usage:
            yield _sse({"id": c.id, "object": "text_completion", "created": c.created,
                        "model": req.model, "choices": [], "usage": _usage(job, c.builder, done)})
        yield "data: [DONE]\n\n"

    return guarded_stream(svc, job, body(), "/v1/completions", _error_sse)
