"""Reading what K3.1 generates: a reply's reasoning, answer and tool calls, whole
(`parse_reply`) or as it streams (`ReplyStream`, `iter_reply_events`).

The markers are the chat encoding's (`text.chat_format`, from the model's
chat_template.jinja); tool-call sections go through mlx-lm's `kimi_k3` tool parser.
"""

from __future__ import annotations

from typing import Iterable

from kimi_mlx.text.chat_format import (END_OF_MSG, MESSAGE_END, RESPONSE_END, RESPONSE_START,
                                       THINK_END, THINK_START, TOOLS_END, TOOLS_START)



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
    text in ``reasoning_content``. Whitespace between the think block and the response
    (or text) after it is dropped, as :class:`ReplyStream` does.
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
        # Whitespace between the think block and what follows is not content.
        rest = _strip_prefix(rest.lstrip(), RESPONSE_START)
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
        self._between_started = False

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
        if self.state == "between" and not self._between_started:
            text = text.lstrip()  # whitespace after the think block (parse_reply drops it)
            if not text:
                return
            self._between_started = True
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
