"""OpenAI Responses API: POST /v1/responses, non-streamed and streamed (response.created,
response.in_progress, output_item.added / content_part.added / *.delta / *.done per output
item, response.completed or response.incomplete), as the `openai` client's
`responses.create` / `responses.stream` parse them.

Input items map onto chat_format messages: a message item by its role (developer ->
system), `function_call` -> an assistant tool call, `function_call_output` -> a tool
message, `reasoning` -> the next assistant message's reasoning_content (so thinking is
sent back whole). The reply comes out as a `reasoning` item (the K3.1 thinking as
`reasoning_text` content, and with `reasoning.summary` asked the same text as its one
`summary_text` part, streamed as reasoning_summary_text deltas: K3.1 writes no shorter
summary), a `message` item (`output_text`) and one `function_call` item per call, whose
`call_id` is the model's own id (`functions.NAME:IDX`). Tools: function tools, the
function tools inside a `namespace` tool (their calls name the namespace), and hosted
tools (web_search, ...) left out of the prompt with a log line.

`previous_response_id` continues a response this server still holds: `ResponseStore`
keeps the last `capacity` conversations (LRU, in memory); an id it does not hold is a 404.
As in OpenAI's API, the earlier `instructions` and `tools` are not carried over.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Dict, List, Optional

from kimi_mlx.text.chat_format import media_in_order
from kimi_mlx.generation.request import InputError, build_chat_prompt_with_ends
from kimi_mlx.server.images import (allow_urls, job_images, lean_messages, prepare, request_images,
                                    responses_ref, setter, stored_refs)
from kimi_mlx.server.common import (APIError, Service, budget, effort_of, guarded_stream,
                                    reply_events, sampling_from, submit)
from kimi_mlx.server.structured import check_request_schemas, constrained
from kimi_mlx.server.thinking import think_budget, with_think_budget
from kimi_mlx.server.jobs import Job
from kimi_mlx.server.openai_api import chat_options
from kimi_mlx.server.reply import ReplyBuilder
from kimi_mlx.server.schemas import ResponsesRequest

log = logging.getLogger(__name__)


class ResponseStore:
    """The conversations behind recent responses, for `previous_response_id`: id ->
    chat_format messages (the request's input and the reply, without instructions).
    Least recently used entries go first past `capacity`. Thread-safe."""

    def __init__(self, capacity: int = 256):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: "OrderedDict[str, List[Dict[str, Any]]]" = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: List[Dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = messages
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[List[Dict[str, Any]]]:
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
            return found

    def __len__(self) -> int:
        return len(self._items)


def store_of(svc: Service) -> ResponseStore:
    if svc.responses is None:
        svc.responses = ResponseStore()
    return svc.responses


# ------------------------------------------------------------------ request -> messages


def _content_text(content, where: str, refs: Optional[list] = None, allow_urls: bool = False):
    """A message item's content: a string or a list of input_text / output_text parts
    (the joined text), and where `refs` is given also input_image parts (then, with an
    image, a list of chat_format parts; each image's `server.images.ImageRef` is appended
    to `refs`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts",
                       param="input")
    parts: List[Dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image" and refs is not None:
            parts.append({"type": "image"})
            refs.append(responses_ref(part, f"{where}.content[{k}]",
                                      setter(parts, len(parts) - 1), allow_urls))
        else:
            raise APIError(400, f"{where}.content[{k}]: part type {kind!r} is not supported "
                           "(input_text, input_image and output_text only)", param="input")
    if any(p["type"] != "text" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_messages(items, refs: Optional[list] = None, allow_urls: bool = False) -> List[Dict[str, Any]]:
    """Responses `input` -> chat_format messages; APIError 400 naming the item. The
    ImageRefs of input_image parts (user / system messages, function_call_output) are
    appended to `refs` (images are refused without it)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: List[Dict[str, Any]] = []
    reasoning: List[str] = []
    names: Dict[str, str] = {}

    def assistant() -> Dict[str, Any]:
        """The assistant message that reasoning / calls attach to (a new one unless the
        last message is an assistant turn without text after its calls)."""
        if not (out and out[-1]["role"] == "assistant" and not reasoning):
            out.append({"role": "assistant", "content": ""})
        msg = out[-1]
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: expected an object, got {type(item).__name__}",
                           param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}; got "
                               f"{role!r}", param="input")
            text = _content_text(item.get("content", ""), where,
                                 None if _ROLES[role] == "assistant" else refs, allow_urls)
            if _ROLES[role] == "assistant":
                msg = {"role": "assistant", "content": text}
                if reasoning:
                    msg["reasoning_content"] = "".join(reasoning)
                    reasoning.clear()
                out.append(msg)
            else:
                out.append({"role": _ROLES[role], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append("".join(str(p.get("text", "")) for p in parts if isinstance(p, dict)))
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not call_id or not name:
                raise APIError(400, f"{where}: a function_call needs call_id and name",
                               param="input")
            names[call_id] = name
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not call_id:
                raise APIError(400, f"{where}: a function_call_output needs call_id", param="input")
            output = item.get("output", "")
            if not isinstance(output, str):
                output = _content_text(output, where + ".output", refs, allow_urls)
            tool = {"role": "tool", "content": output, "tool_call_id": call_id}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
        else:
            raise APIError(400, f"{where}: item type {kind!r} is not supported (message, "
                           "reasoning, function_call and function_call_output)", param="input")
    return out


# tools OpenAI runs on its side (or the client's built-ins tied to OpenAI's models): the
# model here cannot run them, so they are left out of its prompt, with a log line
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "image_generation", "computer_use_preview",
                "computer_use", "mcp", "local_shell", "tool_search")


def _tools(req: ResponsesRequest):
    """Responses tools -> (chat tools or None, {function name: namespace}). Function
    tools are taken as they are; a `namespace` tool (Codex wraps its function tools in
    one) gives its function tools, whose calls come back naming the namespace; hosted
    tools (`HOSTED_TOOLS`, which OpenAI runs on its side) are dropped with a log line.
    APIError 400 for a function without a name or another tool type."""
    if not req.tools:
        return None, {}
    out, spaces = [], {}

    def function(t, where: str, space: Optional[str] = None):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str) \
                or not t["name"]:
            raise APIError(400, f"{where}: only function tools with a name are supported (in a "
                           f"namespace too), got type {t.get('type') if isinstance(t, dict) else t!r}",
                           param="tools")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or "",
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
        if space is not None:
            spaces[t["name"]] = space

    for i, t in enumerate(req.tools):
        kind = t.get("type")
        if kind == "namespace":
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise APIError(400, f"tools[{i}]: a namespace tool needs a list of tools",
                               param="tools")
            for k, sub in enumerate(inner):
                function(sub, f"tools[{i}].tools[{k}]", str(t.get("name") or ""))
        elif kind in HOSTED_TOOLS:
            log.info("tools[%d]: hosted tool %r dropped (this server cannot run it)", i, kind)
        else:
            function(t, f"tools[{i}]")
    return out or None, spaces


def _response_format(req: ResponsesRequest):
    """`text.format` -> the chat API's response_format (None for plain text)."""
    fmt = (req.text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise APIError(400, f"text.format type {fmt.get('type')!r} is not supported; use text, "
                   "json_object or json_schema", param="text.format")


def _effort(req: ResponsesRequest) -> str:
    return effort_of(req.reasoning.effort if req.reasoning else None, "reasoning.effort")


_SUMMARIES = ("auto", "concise", "detailed")


def _summary(req: ResponsesRequest) -> Optional[str]:
    """reasoning.summary (None: none asked); APIError 400 for a value OpenAI does not
    define. K3.1 writes no separate summary: the reasoning text itself is given as the
    summary (`summary_text`), whichever of the three is asked."""
    summary = req.reasoning.summary if req.reasoning else None
    if summary is not None and summary not in _SUMMARIES:
        raise APIError(400, f"reasoning.summary must be one of {', '.join(_SUMMARIES)}; got "
                       f"{summary!r}", param="reasoning.summary")
    return summary


class _Turn:
    """One response being made: the job, its conversation and the reply builder."""

    def __init__(self, svc: Service, req: ResponsesRequest):
        svc.check_model(req.model)
        if req.background:
            raise APIError(400, "background=true is not supported", param="background")
        for name in ("conversation", "prompt"):
            if getattr(req, name) is not None:
                raise APIError(400, f"{name} is not supported: send the input itself (and "
                               "previous_response_id to continue)", param=name)
        if req.top_logprobs:
            raise APIError(400, "top_logprobs is not supported on /v1/responses (use "
                           "/v1/chat/completions with logprobs=true)", param="top_logprobs")
        choice = req.tool_choice
        self.effort = _effort(req)
        self.summary = _summary(req)
        history: List[Dict[str, Any]] = []
        if req.previous_response_id:
            found = store_of(svc).get(req.previous_response_id)
            if found is None:
                raise APIError(404, f"previous_response_id: no response {req.previous_response_id!r} "
                               "is held by this server (it keeps the most recent "
                               f"{store_of(svc).capacity})", "not_found_error",
                               param="previous_response_id")
            history = list(found)
        # the stored conversation's images (kept as their bytes) are decoded again
        history, refs = stored_refs(history, "previous_response_id")
        self.conversation = history + input_messages(req.input, refs, allow_urls(svc))
        request_images(svc, refs)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
        messages += self.conversation
        if not any(m["role"] != "system" for m in messages):
            raise APIError(400, "input is empty: give text or at least one message item",
                           param="input")
        tools, self.namespaces = _tools(req)
        options = chat_options(tools, choice, _response_format(req))
        check_request_schemas(svc, response_format=_response_format(req), tools=tools,
                              tool_choice=choice, format_param="text.format")
        try:
            ids, ends = build_chat_prompt_with_ends(svc.tok, messages, self.effort, tools, **options)
        except InputError as e:
            raise APIError(400, str(e), param="input") from None
        self.svc, self.req = svc, req
        max_tokens = budget(svc, len(ids), req.max_output_tokens, "max_output_tokens", "input")
        think = think_budget(svc, req.thinking_budget, max_tokens)
        sampling = constrained(svc, sampling_from(svc, req), ids, tools=tools,
                               response_format=_response_format(req), tool_choice=choice,
                               think_budget=think, parallel=req.parallel_tool_calls,
                               format_param="text.format")
        sampling = with_think_budget(svc, sampling, ids, think)
        self.job = Job(ids, max_tokens, sampling,
                       None, ends, **job_images(svc, ids, media_in_order(messages)))
        self.builder = ReplyBuilder(svc.wrapper, (), chat=True)
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex

    def remember(self) -> None:
        """Keep this conversation and its reply for a later previous_response_id."""
        if not self.req.store:
            return
        b = self.builder
        reply: Dict[str, Any] = {"role": "assistant", "content": b.content}
        if b.reasoning:
            reply["reasoning_content"] = b.reasoning
        if b.tool_calls:
            reply["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in b.tool_calls]
        store_of(self.svc).put(self.id, lean_messages(self.conversation) + [reply])

    # ------------------------------------------------------------ response shapes

    def reasoning_item(self, text: Optional[str], status: str = "completed") -> dict:
        """The reasoning output item; with reasoning.summary asked, its `summary` holds the
        reasoning text as one summary_text part (K3.1 writes no shorter summary)."""
        summary = [{"type": "summary_text", "text": text}] if self.summary and text is not None else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": summary, "status": status,
                "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}

    def message_item(self, text: Optional[str], status: str = "completed") -> dict:
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status,
                "content": [] if text is None else [_text_part(text)]}

    def call_item(self, call, item_id: str, arguments: str, status: str = "completed") -> dict:
        """A function_call output item; a function of a namespace tool names it, as
        OpenAI's API does."""
        item = {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
                "arguments": arguments, "status": status}
        if self.namespaces.get(call.name):
            item["namespace"] = self.namespaces[call.name]
        return item

    def response(self, status: str, output: List[dict], done=None) -> dict:
        r = self.req
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "model": r.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": self.effort, "summary": self.summary},
            "store": r.store, "temperature": r.temperature, "top_p": r.top_p,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
            "truncation": "disabled", "metadata": r.metadata or {}, "usage": None,
        }
        if done is not None:
            out["usage"] = self.usage(done)
        return out

    def usage(self, done) -> dict:
        n_in, b = len(self.job.ids), self.builder
        return {"input_tokens": n_in,
                "input_tokens_details": {"cached_tokens": done.cached_tokens if done else 0},
                "output_tokens": b.n_tokens,
                "output_tokens_details": {"reasoning_tokens": b.reasoning_tokens},
                "total_tokens": n_in + b.n_tokens}

    def status(self, done) -> str:
        return "incomplete" if self.builder.finish_reason(done.reason) == "length" else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def responses_response(svc: Service, req: ResponsesRequest, request) -> dict:
    t = await prepare(_Turn, svc, req)
    submit(svc, t.job)
    done = None
    async for _ev, _tok, fin in reply_events(t.job, t.builder, request):
        done = fin or done
    b = t.builder
    status = t.status(done)
    output = []
    if b.reasoning:
        output.append(t.reasoning_item(b.reasoning))
    # a reply cut inside its reasoning has no message item, as on OpenAI (and as the
    # stream has none)
    if b.content or not (b.tool_calls or (status == "incomplete" and b.reasoning)):
        output.append(t.message_item(b.content))
    if status == "incomplete" and output and not b.tool_calls:
        output[-1]["status"] = "incomplete"  # the item the limit cut (a status items have)
    for k, c in enumerate(b.tool_calls):
        output.append(t.call_item(c, f"fc_{t.id[5:]}_{k}",
                                  json.dumps(c.arguments, ensure_ascii=False)))
    t.remember()
    return t.response(status, output, done)


async def responses_stream(svc: Service, req: ResponsesRequest, request):
    """Validated and queued before the first byte: returns an async iterator of SSE."""
    t = await prepare(_Turn, svc, req)
    submit(svc, t.job)
    seq = 0

    def event(kind: str, **data) -> str:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def body():
        yield event("response.created", response=t.response("in_progress", []))
        yield event("response.in_progress", response=t.response("in_progress", []))
        output: List[dict] = []
        open_kind = None  # "reasoning" / "message": the item whose text is streaming
        text = ""

        def close(item_status: str = "completed"):
            nonlocal open_kind
            out = []
            idx = len(output) - 1
            if open_kind == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                out.append(event("response.reasoning_text.done", item_id=t.reasoning_id,
                                 output_index=idx, content_index=0, text=text))
                out.append(event("response.content_part.done", item_id=t.reasoning_id,
                                 output_index=idx, content_index=0, part=part))
                if t.summary:
                    out.append(event("response.reasoning_summary_text.done", item_id=t.reasoning_id,
                                     output_index=idx, summary_index=0, text=text))
                    out.append(event("response.reasoning_summary_part.done", item_id=t.reasoning_id,
                                     output_index=idx, summary_index=0,
                                     part={"type": "summary_text", "text": text}))
                output[idx] = t.reasoning_item(text, item_status)
            elif open_kind == "message":
                out.append(event("response.output_text.done", item_id=t.message_id,
                                 output_index=idx, content_index=0, text=text, logprobs=[]))
                out.append(event("response.content_part.done", item_id=t.message_id,
                                 output_index=idx, content_index=0, part=_text_part(text)))
                output[idx] = t.message_item(text, item_status)
            if open_kind is not None:
                out.append(event("response.output_item.done", output_index=idx, item=output[idx]))
            open_kind = None
            return out

        def open_(kind):
            nonlocal open_kind, text
            out = close()
            open_kind, text = kind, ""
            idx = len(output)
            if kind == "reasoning":
                output.append(t.reasoning_item(None, "in_progress"))
                part, item_id = {"type": "reasoning_text", "text": ""}, t.reasoning_id
            else:
                output.append(t.message_item(None, "in_progress"))
                part, item_id = _text_part(""), t.message_id
            out.append(event("response.output_item.added", output_index=idx, item=output[idx]))
            out.append(event("response.content_part.added", item_id=item_id, output_index=idx,
                             content_index=0, part=part))
            if kind == "reasoning" and t.summary:
                out.append(event("response.reasoning_summary_part.added", item_id=item_id,
                                 output_index=idx, summary_index=0,
                                 part={"type": "summary_text", "text": ""}))
            return out

        done, n_calls = None, 0
        async for ev, _tok, fin in reply_events(t.job, t.builder):
            if ev.reasoning:
                if open_kind != "reasoning":
                    for s in open_("reasoning"):
                        yield s
                text += ev.reasoning
                yield event("response.reasoning_text.delta", item_id=t.reasoning_id,
                            output_index=len(output) - 1, content_index=0, delta=ev.reasoning)
                if t.summary:  # what Codex shows while the model thinks
                    yield event("response.reasoning_summary_text.delta", item_id=t.reasoning_id,
                                output_index=len(output) - 1, summary_index=0, delta=ev.reasoning)
            if ev.content:
                if open_kind != "message":
                    for s in open_("message"):
                        yield s
                text += ev.content
                yield event("response.output_text.delta", item_id=t.message_id,
                            output_index=len(output) - 1, content_index=0, delta=ev.content,
                            logprobs=[])
            for call in ev.tool_calls:
                for s in close():
                    yield s
                item_id = f"fc_{t.id[5:]}_{n_calls}"
                n_calls += 1
                args = json.dumps(call.arguments, ensure_ascii=False)
                idx = len(output)
                output.append(t.call_item(call, item_id, "", "in_progress"))
                yield event("response.output_item.added", output_index=idx, item=output[idx])
                yield event("response.function_call_arguments.delta", item_id=item_id,
                            output_index=idx, delta=args)
                yield event("response.function_call_arguments.done", item_id=item_id,
                            output_index=idx, name=call.name, arguments=args)
                output[idx] = t.call_item(call, item_id, args)
                yield event("response.output_item.done", output_index=idx, item=output[idx])
            done = fin or done
        if not output:  # never an empty output: an empty message
            for s in open_("message"):
                yield s
        status = t.status(done)
        # the item the limit cut is "incomplete" (a status the API defines for items)
        for s in close("incomplete" if status == "incomplete" else "completed"):
            yield s
        t.remember()
        yield event(f"response.{status}", response=t.response(status, output, done))

    return guarded_stream(svc, t.job, body(), "/v1/responses",
                          lambda kind, message: event("error", code=kind, message=message,
                                                      param=None))
