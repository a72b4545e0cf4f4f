"""Anthropic Messages API: POST /v1/messages, non-streamed and streamed (message_start,
content_block_start / _delta / _stop, message_delta, message_stop), so Claude Code-style
clients work. Thinking blocks carry the K3.1 reasoning; tool_use blocks keep the model's
call ids (`functions.NAME:IDX`) so they survive being sent back as tool_result."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Dict, List, Optional

from kimi_mlx.generation.request import InputError, build_chat_prompt_with_ends
from kimi_mlx.server.common import (ANTHROPIC_PING, APIError, Service, budget, check_tool_name,
                                    effort_of, guarded_stream, reply_events, sampling_from,
                                    stop_list, submit)
from kimi_mlx.server.structured import check_request_schemas, constrained
from kimi_mlx.server.thinking import think_budget, with_think_budget
from kimi_mlx.server.images import allow_urls, anthropic_ref, job_images, request_images, setter
from kimi_mlx.server.images import prepare as off_loop
from kimi_mlx.server.jobs import Job
from kimi_mlx.server.reply import ReplyBuilder
from kimi_mlx.server.schemas import MessagesRequest

log = logging.getLogger(__name__)

_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


_KINDS = {str: "a string", dict: "an object", list: "a list"}


def _get(block, key: str, where: str, kind=str, default=""):
    """block[key] (or `default`) when it is a `kind`; APIError 400 naming it otherwise."""
    value = block.get(key, default)
    if not isinstance(value, kind):
        raise APIError(400, f"{where}: a {block.get('type')!r} block's {key!r} must be "
                       f"{_KINDS[kind]}, got {type(value).__name__}", param="messages")
    return value


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of blocks",
                       param="messages")
    parts = []
    for block in content:
        if not isinstance(block, dict):
            raise APIError(400, f"{where}: a content block must be an object, got "
                           f"{type(block).__name__}", param="messages")
        if block.get("type") == "text":
            parts.append(_get(block, "text", where))
        else:
            raise APIError(400, f"{where}: content block type {block.get('type')!r} is not "
                           "supported here (text only)", param="messages")
    return "".join(parts)


# Claude Code's first system block: `x-anthropic-billing-header: cc_version=...; ...`. It
# changes with versions (in some releases per request) and means nothing to the model:
# left in, it would change the prompt's first tokens and miss the whole prompt cache.
BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(system, where: str = "system") -> str:
    """The text of a system prompt (a string or text blocks, joined), without Claude
    Code's billing-header lines (`BILLING_HEADER`), which would defeat the prompt cache."""
    if isinstance(system, list):  # a block of its own (Claude Code's first) goes whole
        system = [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                            and b["text"].lstrip().startswith(BILLING_HEADER))]
    text = _text(system, where)
    if BILLING_HEADER not in text:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not line.lstrip().startswith(BILLING_HEADER))


def _user_parts(blocks, where: str, refs: list, allow: bool) -> List[Dict[str, Any]]:
    """Text and image blocks (a tool_result's content) -> chat_format content parts; each
    image's ImageRef is appended to `refs` (it resolves the part in place)."""
    parts: List[Dict[str, Any]] = []
    for k, b in enumerate(blocks):
        if not isinstance(b, dict):
            raise APIError(400, f"{where}: a content block must be an object, got "
                           f"{type(b).__name__}", param="messages")
        if b.get("type") == "text":
            parts.append({"type": "text", "text": _get(b, "text", where)})
        elif b.get("type") == "image":
            parts.append({"type": "image"})
            refs.append(anthropic_ref(b, f"{where}.content[{k}]", setter(parts, len(parts) - 1), allow))
        else:
            raise APIError(400, f"{where}: content block type {b.get('type')!r} is not "
                           "supported here (text and image only)", param="messages")
    return parts


def _collapse(parts: List[Dict[str, Any]]):
    """Content of a message: the joined text when there is no image (the prompt of a
    text-only request is unchanged), else the parts."""
    if any(p.get("type") != "text" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def to_chat_messages(req: MessagesRequest, refs: Optional[list] = None,
                     allow_urls: bool = False) -> List[Dict[str, Any]]:
    """Anthropic system + messages -> chat_format messages (tool_result blocks become
    tool messages, tool_use blocks assistant tool_calls, thinking blocks reasoning).
    Image blocks (in user messages and tool results) become image parts, and their
    `server.images.ImageRef`s are appended to `refs` in prompt order (naming each as
    `messages[i].content[j]`, `...content[j].content[k]` inside a tool_result)."""
    refs = [] if refs is None else refs
    out: List[Dict[str, Any]] = []
    if req.system:
        text = system_text(req.system)
        if text:
            out.append({"role": "system", "content": text})
    names: Dict[str, str] = {}
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "system":
            # mid-conversation system message (beta mid-conversation-system-2026-04-07):
            # a system message at this point, as the reference encoder renders one
            out.append({"role": "system", "content": system_text(m.content, where)})
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            text, reasoning, calls = [], [], []
            for b in m.content:
                t = b.get("type")
                if t == "text":
                    text.append(_get(b, "text", where))
                elif t == "thinking":
                    reasoning.append(_get(b, "thinking", where))
                elif t == "redacted_thinking":
                    continue
                elif t == "tool_use":
                    call_id, name = _get(b, "id", where), _get(b, "name", where)
                    names[call_id] = name
                    calls.append({"id": call_id or None, "type": "function", "function": {
                        "name": name, "arguments": _get(b, "input", where, dict, {})}})
                else:
                    raise APIError(400, f"{where}: assistant content block {t!r} is not supported",
                                   param="messages")
            msg: Dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        parts: List[Dict[str, Any]] = []
        for j, b in enumerate(m.content):
            t = b.get("type")
            if t == "text":
                parts.append({"type": "text", "text": _get(b, "text", where)})
            elif t == "image":
                parts.append({"type": "image"})
                refs.append(anthropic_ref(b, f"{where}.content[{j}]",
                                          setter(parts, len(parts) - 1), allow_urls))
            elif t == "tool_result":
                if parts:
                    out.append({"role": "user", "content": _collapse(parts)})
                    parts = []
                body = b.get("content", "")
                if not isinstance(body, str):
                    if not isinstance(body, list):
                        raise APIError(400, f"{where} tool_result: content must be a string or "
                                       "a list of blocks", param="messages")
                    body = _collapse(_user_parts(body, f"{where}.content[{j}]", refs, allow_urls))
                call_id = _get(b, "tool_use_id", where)
                tool = {"role": "tool", "content": body, "tool_call_id": call_id or None}
                if names.get(call_id):
                    tool["name"] = names[call_id]
                out.append(tool)
            else:
                raise APIError(400, f"{where}: user content block {t!r} is not supported "
                               "(text, image and tool_result only)", param="messages")
        if parts:
            out.append({"role": "user", "content": _collapse(parts)})
    return out


_TOOL_CHOICE = {"auto": None, "any": "required", "none": "none", "tool": None}


def _tools(req: MessagesRequest):
    """(tools in OpenAI form or None, encode_chat options) of a messages request.
    tool_choice auto / any (-> "required") / none / tool: a named tool reaches the model
    as Moonshot's reference encoder passes one, i.e. as auto (see
    `openai_api.chat_options`); APIError 400 when it names no tool of the request."""
    choice = (req.tool_choice or {}).get("type", "auto")
    if not isinstance(choice, str) or choice not in _TOOL_CHOICE:
        raise APIError(400, f"tool_choice {choice!r} is not supported: use one of "
                       f"{', '.join(_TOOL_CHOICE)}", param="tool_choice")
    tools = [{"type": "function", "function": {"name": t.name,
              "description": t.description or "", "parameters": t.input_schema}}
             for t in req.tools] if req.tools else None
    if choice == "tool":
        check_tool_name(req.tool_choice.get("name"), tools)
    if not tools:
        return None, {}
    return tools, ({"tool_choice": _TOOL_CHOICE[choice]} if _TOOL_CHOICE[choice] else {})


async def count_tokens(svc: Service, req) -> dict:
    """POST /v1/messages/count_tokens: the prompt's token count (Claude Code asks), each
    image counted as its `<|media_pad|>` tokens (the preprocessing rule's count) plus its
    media block's markers and `image WxH` text."""
    ids = (await off_loop(_prompt, svc, req))[0]
    return {"input_tokens": len(ids)}


_THINKING_TYPES = ("enabled", "adaptive", "disabled")


def thinking_enabled(req) -> bool:
    """False for `thinking: {"type": "disabled"}`; True when absent, "enabled" or
    "adaptive". APIError 400 for another type."""
    kind = (req.thinking or {}).get("type", "enabled")
    if kind not in _THINKING_TYPES:
        raise APIError(400, f"thinking.type {kind!r} is not supported: use one of "
                       f"{', '.join(_THINKING_TYPES)}", param="thinking")
    return kind != "disabled"


def _effort(req) -> str:
    """The K3.1 thinking effort of a messages request: `reasoning_effort` or Anthropic's
    `output_config.effort`, mapped as `common.effort_of` maps OpenAI's names (default
    max). K3.1 always thinks (its encoding has no non-thinking mode, chat_format), so
    `thinking: {"type": "disabled"}` is honoured as the lowest effort, "low", with the
    thinking block left out of the reply; asking for a higher effort at the same time is
    a 400."""
    given = req.reasoning_effort
    param = "reasoning_effort"
    config = req.output_config or {}
    if given is None and config.get("effort") is not None:
        given, param = config.get("effort"), "output_config.effort"
        if not isinstance(given, str):
            raise APIError(400, f"output_config.effort must be a string, got {given!r}",
                           param=param)
    effort = effort_of(given, param)
    if not thinking_enabled(req):
        if given is not None and effort != "low":
            raise APIError(400, f"thinking disabled asks for the lowest effort (low); it "
                           f"contradicts {param} {given!r}", param="thinking")
        effort = "low"
    return effort


def _prompt(svc: Service, req):
    """(prompt ids, segment ends, images) of a messages request; APIError 400/404."""
    svc.check_model(req.model)
    effort = _effort(req)
    refs: list = []
    messages, (tools, options) = to_chat_messages(req, refs, allow_urls(svc)), _tools(req)
    images = request_images(svc, refs)
    try:
        ids, ends = build_chat_prompt_with_ends(svc.tok, messages, effort, tools, **options)
    except InputError as e:
        raise APIError(400, str(e), param="messages") from None
    return ids, ends, images


def _budget(req) -> Optional[int]:
    """`thinking.budget_tokens` of an enabled thinking block (None when absent); 0 when
    thinking is disabled. The thinking is closed there (`server.thinking`)."""
    if not thinking_enabled(req):
        return 0
    n = (req.thinking or {}).get("budget_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise APIError(400, f"thinking.budget_tokens must be an integer >= 0, got {n!r}",
                       param="thinking")
    return n


def prepare(svc: Service, req: MessagesRequest) -> Job:
    tools = [{"name": t.name, "parameters": t.input_schema} for t in req.tools or ()]
    check_request_schemas(svc, tools=tools, tool_choice=req.tool_choice)
    ids, ends, images = _prompt(svc, req)
    max_tokens = budget(svc, len(ids), req.max_tokens, anthropic=True)
    think = think_budget(svc, _budget(req), max_tokens)
    sampling = constrained(svc, sampling_from(svc, req), ids, tools=tools,
                           tool_choice=req.tool_choice, think_budget=think)
    sampling = with_think_budget(svc, sampling, ids, think, "thinking")
    return Job(ids, max_tokens, sampling, None, ends, **job_images(svc, ids, images))


def _stop_reason(b: ReplyBuilder, done) -> str:
    return _STOP_REASON[b.finish_reason(done.reason)]


def _usage(job: Job, output_tokens: int, cached: int) -> dict:
    """Anthropic usage: input_tokens are the prompt tokens not read from the cache."""
    return {"input_tokens": len(job.ids) - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def messages_response(svc: Service, req: MessagesRequest, request) -> dict:
    job = await off_loop(prepare, svc, req)
    b = ReplyBuilder(svc.wrapper, stop_list(req.stop_sequences), chat=True)
    submit(svc, job)
    done = None
    async for _ev, _tok, fin in reply_events(job, b, request):
        done = fin or done
    content: List[Dict[str, Any]] = []
    if b.reasoning and thinking_enabled(req):
        content.append({"type": "thinking", "thinking": b.reasoning, "signature": ""})
    if b.content or not (content or b.tool_calls):  # never an empty content list
        content.append({"type": "text", "text": b.content})
    for c in b.tool_calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments})
    reason = _stop_reason(b, done)
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
            "model": req.model, "content": content, "stop_reason": "stop_sequence"
            if b.stopped and reason == "end_turn" else reason,
            "stop_sequence": b.stop.matched,
            "usage": _usage(job, b.n_tokens, done.cached_tokens if done else 0)}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def messages_stream(svc: Service, req: MessagesRequest, request):
    job = await off_loop(prepare, svc, req)
    b = ReplyBuilder(svc.wrapper, stop_list(req.stop_sequences), chat=True)
    submit(svc, job)
    msg_id = "msg_" + uuid.uuid4().hex
    live: Dict[str, Any] = {"open": None, "index": -1}  # the open block, for keep_alive

    def keep_alive() -> str:
        """What a quiet stream sends every svc.keepalive_s: inside an open thinking block
        (a long prefill) an empty thinking_delta, which adds no text but is an event
        the client's SDK hands on (Claude Code resets its stream idle timer on every
        event except ping); elsewhere Anthropic's ping."""
        if live["open"] == "thinking":
            return _event("content_block_delta", {"index": live["index"], "delta": {
                "type": "thinking_delta", "thinking": ""}})
        return ANTHROPIC_PING

    async def body():
        # message_start waits for the admission, which tells the prompt-cache hit: its
        # usage is the one message_delta repeats (Claude Code reads it from here); but
        # it is the stream's first event, so a request still queued when a keep-alive
        # ping would be due sends it without the count (message_delta then has it)
        try:
            started = await asyncio.wait_for(job.started(), svc.keepalive_s / 2)
        except asyncio.TimeoutError:
            started = None
        cached = started.cached_tokens if started else 0
        yield _event("message_start", {"message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(job, 0, cached)}})
        index, open_kind, done = -1, None, None

        def start(kind, block):
            nonlocal index, open_kind
            out = []
            if open_kind is not None:
                out.append(_event("content_block_stop", {"index": index}))
            index += 1
            open_kind = live["open"] = kind
            live["index"] = index
            out.append(_event("content_block_start", {"index": index, "content_block": block}))
            return out

        show_thinking = thinking_enabled(req)
        if show_thinking:
            # the generation prompt ends inside K3.1's think block (chat_format), so the
            # reply's thinking block is open from admission on: opened now, the prefill
            # runs inside it (keep_alive sends its empty deltas meanwhile)
            for s in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                yield s
        async for ev, _tok, fin in reply_events(job, b):
            if ev.reasoning and show_thinking:
                if open_kind != "thinking":
                    for s in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield s
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": ev.reasoning}})
            if ev.content:
                if open_kind != "text":
                    for s in start("text", {"type": "text", "text": ""}):
                        yield s
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": ev.content}})
            for c in ev.tool_calls:
                for s in start("tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}):
                    yield s
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(c.arguments, ensure_ascii=False)}})
            done = fin or done
        if open_kind is None:
            for s in start("text", {"type": "text", "text": ""}):
                yield s
        live["open"] = None
        yield _event("content_block_stop", {"index": index})
        reason = _stop_reason(b, done)
        yield _event("message_delta", {"delta": {
            "stop_reason": "stop_sequence" if b.stopped and reason == "end_turn" else reason,
            "stop_sequence": b.stop.matched},
            "usage": _usage(job, b.n_tokens, done.cached_tokens if done else cached)})
        yield _event("message_stop", {})

    # message_start is the first event (it goes out at admission); pings only after it
    return guarded_stream(svc, job, body(), "/v1/messages", _error_event, keep_alive,
                          ping_first=False)


def _error_event(kind: str, message: str) -> str:
    """The Anthropic `error` event that ends a stream which failed after its 200."""
    return _event("error", {"error": {"type": "api_error", "message": message}})
