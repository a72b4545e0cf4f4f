"""Kimi K3.1 chat encoding (XTML markup), as Moonshot's encoder lays it out.

Every block is ``<|open|>TAG ATTRS<|sep|>BODY<|close|>TAG<|sep|>`` where ``<|open|>``,
``<|sep|>``, ``<|close|>`` and ``<|end_of_msg|>`` are special tokens and everything else
is ordinary text. A conversation is encoded as::

    [tool-declare system block, if tools]
    <|open|>message role="system" type="thinking-effort"<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
        <|open|>think<|sep|>REASONING<|close|>think<|sep|>
        <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
        [<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
            <|open|>argument key="K" type="string"<|sep|>VALUE<|close|>argument<|sep|>
         <|close|>call<|sep|><|close|>tools<|sep|>]
    <|close|>message<|sep|><|end_of_msg|>
    ...
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>     (generation prompt)

(shown wrapped; there are no newlines between blocks). Assistant messages keep their
``reasoning_content`` inside the think block ("preserved thinking"); without it the
block is empty. The tool-call markup is the one mlx-lm's ``tool_parsers/kimi_k3.py``
parses. Message content is always encoded as ordinary text, so a user who types
``<|open|>`` gets the characters, not the structure token.

Generated text is split back with :func:`parse_reply` (whole reply) or
:class:`ReplyStream` (incremental, for a CLI that prints reasoning dimmed).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Sequence

OPEN, SEP, CLOSE, END_OF_MSG = "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"
STRUCTURE_TOKENS = (OPEN, SEP, CLOSE, END_OF_MSG)

EFFORTS = ("low", "high", "max")
DEFAULT_EFFORT = "max"

THINK_START = f"{OPEN}think{SEP}"
THINK_END = f"{CLOSE}think{SEP}"
RESPONSE_START = f"{OPEN}response{SEP}"
RESPONSE_END = f"{CLOSE}response{SEP}"
TOOLS_START = f"{OPEN}tools{SEP}"
TOOLS_END = f"{CLOSE}tools{SEP}"
MESSAGE_END = f"{CLOSE}message{SEP}"
GENERATION_PROMPT = f'{OPEN}message role="assistant"{SEP}{THINK_START}'

_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including "
    "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
_TOOLS_BODY = (
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
)
_ROLES = ("system", "user", "assistant", "tool")

# A rendered conversation is a list of (is_special, text) segments. Text segments are
# always bounded by special tokens, so encoding them one by one gives the same ids as
# encoding the joined string with specials allowed (for content without special text).
Segment = tuple[bool, str]


def resolve_effort(reasoning_effort: str | None = None, thinking_effort: str | None = None) -> str:
    """Pick the thinking effort from either spelling; default ``"max"``.

    Raises ``ValueError`` if the value is not one of ``low``/``high``/``max`` or if the
    two spellings are both given and disagree.
    """
    given = [e for e in (reasoning_effort, thinking_effort) if e is not None]
    if len(set(given)) > 1:
        raise ValueError(
            f"reasoning_effort={reasoning_effort!r} and thinking_effort={thinking_effort!r} disagree"
        )
    effort = given[0] if given else DEFAULT_EFFORT
    if effort not in EFFORTS:
        raise ValueError(
            f"thinking effort must be one of {', '.join(EFFORTS)}; got {effort!r}"
        )
    return effort


def _attr(value: Any) -> str:
    # mlx-lm's parser reads attr="..." and undoes exactly these two escapes.
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _block(tag: str, attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    head = tag + "".join(f' {k}="{_attr(v)}"' for k, v in attrs)
    return [(True, OPEN), (False, head), (True, SEP), *body, (True, CLOSE), (False, tag), (True, SEP)]


def _text(s: str) -> list[Segment]:
    return [(False, s)] if s else []


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise ValueError(f"{where}: only text content is supported, got part {part!r}")
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ValueError(f"tool argument of type {type(value).__name__} is not JSON")


def _tool_call_segments(calls: Sequence[Any], where: str) -> list[Segment]:
    body: list[Segment] = []
    for index, call in enumerate(calls, 1):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not fn.get("name"):
            raise ValueError(f"{where}: tool call {index} has no function name: {call!r}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: tool call {index} arguments are not JSON ({e})") from None
        if not isinstance(args, Mapping):
            raise ValueError(f"{where}: tool call {index} arguments must be a JSON object")
        arg_segments: list[Segment] = []
        for key, value in args.items():
            kind = _json_type(value)
            text = value if kind == "string" else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            arg_segments += _block("argument", [("key", key), ("type", kind)], _text(text))
        body += _block("call", [("tool", fn["name"]), ("index", index)], arg_segments)
    return _block("tools", [], body)


def chat_segments(
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str = DEFAULT_EFFORT,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[Segment]:
    """The conversation as ``(is_special, text)`` segments (see the module docstring).

    ``messages``: OpenAI-style dicts with ``role`` in system/user/assistant/tool and
    ``content`` (str, None, or a list of text parts); assistant messages may carry
    ``reasoning_content`` (or ``reasoning``) and ``tool_calls`` (``[{"function":
    {"name", "arguments"}}]`` or ``[{"name", "arguments"}]``, arguments a dict or JSON
    string); tool messages may carry ``name``. Raises ``ValueError`` for an unknown
    role or effort, non-text content, or malformed tool calls.
    """
    effort = resolve_effort(reasoning_effort)
    segs: list[Segment] = []
    end = [(True, END_OF_MSG)]
    if tools:
        declared = json.dumps(list(tools), ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        segs += _block(
            "message", [("role", "system"), ("type", "tool-declare")], _text(_TOOLS_BODY.format(tools=declared))
        ) + end
    segs += _block(
        "message", [("role", "system"), ("type", "thinking-effort")], _text(_EFFORT_BODY.format(effort=effort))
    ) + end
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: expected a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(_ROLES)}; got {role!r}")
        content = _content_text(msg.get("content"), where)
        if role == "assistant":
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")
            body = _block("think", [], _text(_content_text(reasoning, where)))
            body += _block("response", [], _text(content))
            if msg.get("tool_calls"):
                body += _tool_call_segments(msg["tool_calls"], where)
            segs += _block("message", [("role", role)], body) + end
        else:
            attrs = [("role", role)]
            if role == "tool" and msg.get("name"):
                attrs.append(("name", msg["name"]))
            segs += _block("message", attrs, _text(content)) + end
    if add_generation_prompt:
        segs += [(True, OPEN), (False, 'message role="assistant"'), (True, SEP)]
        segs += [(True, OPEN), (False, "think"), (True, SEP)]
    return segs


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str = DEFAULT_EFFORT,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The encoded conversation as one display string (special tokens as their text).

    For display and logs. Do not re-tokenize it with specials allowed: content that
    contains special-token text would then turn into structure; use :func:`encode_chat`.
    """
    return "".join(text for _, text in chat_segments(messages, reasoning_effort, add_generation_prompt, tools))


def encode_chat(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str = DEFAULT_EFFORT,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids (``list[int]``) of the conversation for ``tokenizer``.

    ``tokenizer``: a :class:`kimi_mlx.tokenizer.KimiTokenizer` (or our transformers
    ``TikTokenTokenizer``, which wraps one as ``.kimi``). Markup becomes special-token
    ids; all message text is encoded as ordinary text. Raises ``ValueError`` as
    :func:`chat_segments`, or if the vocabulary lacks a structure token.
    """
    tok = getattr(tokenizer, "kimi", tokenizer)
    missing = [t for t in STRUCTURE_TOKENS if t not in tok.special_tokens]
    if missing:
        raise ValueError(f"tokenizer has no K3 structure tokens {missing}")
    ids: list[int] = []
    for special, text in chat_segments(messages, reasoning_effort, add_generation_prompt, tools):
        if special:
            ids.append(tok.special_tokens[text])
        else:
            ids += tok.encode(text, allow_special=False)
    return ids


# ------------------------------------------------------------------------- replies


def _strip_prefix(text: str, prefix: str) -> str:
    return text[len(prefix):] if text.startswith(prefix) else text


def parse_tool_section(section: str) -> list[dict]:
    """Tool calls in ``<|open|>tools<|sep|>...`` text as ``[{"name", "arguments"}]``.

    Uses mlx-lm's ``kimi_k3`` tool parser (imported only when needed); calls it cannot
    parse are skipped, no calls gives ``[]``.
    """
    from mlx_lm.tool_parsers.kimi_k3 import parse_tool_call

    try:
        return parse_tool_call(section)
    except ValueError:
        return []


def parse_reply(text: str) -> dict:
    """Split a generated continuation into reasoning, content and tool calls.

    ``text`` is what the model produced after the generation prompt, so it starts inside
    the think channel (a leading ``<|open|>think<|sep|>`` is tolerated). Returns
    ``{"reasoning_content": str, "content": str, "tool_calls": list[dict]}``, tool calls
    as ``{"name": str, "arguments": dict}``. A reply cut off inside thinking has all its
    text in ``reasoning_content``.
    """
    text = _strip_prefix(text, THINK_START)
    for stop in (END_OF_MSG, MESSAGE_END):
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]
    reasoning, sep, rest = text.partition(THINK_END)
    tool_calls: list[dict] = []
    if sep:
        tools_at = rest.find(TOOLS_START)
        if tools_at >= 0:
            tool_calls = parse_tool_section(rest[tools_at:])
            rest = rest[:tools_at]
        rest = _strip_prefix(rest, RESPONSE_START)
        content = rest.split(RESPONSE_END, 1)[0]
    else:
        content = ""
    return {"reasoning_content": reasoning, "content": content, "tool_calls": tool_calls}


class ReplyStream:
    """Incremental :func:`parse_reply`: feed decoded text pieces, get channel events.

    ``feed(piece)`` returns a list of ``("reasoning" | "content", text)`` events; markup
    and tool-call sections produce no events (their text is kept in ``tool_text``).
    Markers split across pieces are held back until they can be decided. Call
    ``finish()`` at the end to flush. ``reasoning``/``content`` accumulate what was
    emitted; ``result()`` gives :func:`parse_reply` of everything fed.
    """

    # state -> {marker: next state}
    _TRANSITIONS = {
        "reasoning": {THINK_END: "between"},
        "between": {RESPONSE_START: "content", TOOLS_START: "tools"},
        "content": {RESPONSE_END: "after", TOOLS_START: "tools"},
        "after": {TOOLS_START: "tools"},
        "tools": {TOOLS_END: "after"},
        "done": {},
    }
    _CHANNEL = {"reasoning": "reasoning", "between": "content", "content": "content", "after": "content"}
    _ENDS = (MESSAGE_END, END_OF_MSG)
    _ALL_MARKERS = (THINK_START, THINK_END, RESPONSE_START, RESPONSE_END, TOOLS_START, TOOLS_END) + _ENDS

    def __init__(self):
        self.state = "reasoning"
        self.reasoning = ""
        self.content = ""
        self.tool_text = ""
        self._buf = ""
        self._fed: list[str] = []
        self._at_start = True

    @property
    def done(self) -> bool:
        """True once the end of the assistant message was seen."""
        return self.state == "done"

    def _emit(self, text: str, events: list) -> None:
        if not text:
            return
        if self.state == "tools":
            self.tool_text += text
            return
        channel = self._CHANNEL.get(self.state)
        if channel is None:
            return
        if self.state == "after" and not text.strip():
            return  # whitespace between markup blocks
        if channel == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        if events and events[-1][0] == channel:
            events[-1] = (channel, events[-1][1] + text)
        else:
            events.append((channel, text))

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that may start a marker."""
        longest = max(map(len, self._ALL_MARKERS))
        start = text.find("<", max(0, len(text) - longest + 1))
        while start >= 0:
            tail = text[start:]
            if any(m.startswith(tail) for m in self._ALL_MARKERS):
                return len(text) - start
            start = text.find("<", start + 1)
        return 0

    def _process(self, final: bool) -> list:
        events: list = []
        while self._buf and self.state != "done":
            if self._at_start:
                if THINK_START.startswith(self._buf) and not final:
                    return events  # could still be a leading think opener
                self._buf = _strip_prefix(self._buf, THINK_START)
                self._at_start = False
                continue
            markers = dict(self._TRANSITIONS[self.state])
            if self.state != "tools":
                markers.update({m: "done" for m in self._ENDS})
            best = None
            for marker, nxt in markers.items():
                at = self._buf.find(marker)
                if at >= 0 and (best is None or at < best[0]):
                    best = (at, marker, nxt)
            if best is None:
                keep = 0 if final else self._holdback(self._buf)
                self._emit(self._buf[: len(self._buf) - keep], events)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, marker, nxt = best
            self._emit(self._buf[:at], events)
            self._buf = self._buf[at + len(marker):]
            self.state = nxt
        if self.state == "done":
            self._buf = ""
        return events

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """Add decoded text; returns the ``(channel, text)`` events it completes."""
        self._fed.append(piece)
        self._buf += piece
        return self._process(final=False)

    def finish(self) -> list[tuple[str, str]]:
        """Flush text held back as a possible marker prefix."""
        return self._process(final=True)

    def result(self) -> dict:
        """:func:`parse_reply` of all text fed so far."""
        return parse_reply("".join(self._fed))


def iter_reply_events(pieces: Iterable[str]):
    """Generator form of :class:`ReplyStream`: yields ``(channel, text)`` events."""
    stream = ReplyStream()
    for piece in pieces:
        yield from stream.feed(piece)
    yield from stream.finish()
