"""From generated token ids to what an API returns: text that never splits a UTF-8
character (mlx-lm's streaming detokenizer), stop strings matched across token boundaries
(`request.StopMatcher`), the K3.1 reply split into reasoning / content / tool calls
(`reply_parse.ReplyStream` and mlx-lm's kimi_k3 tool parser) and the token counts that
`usage` reports.

One `ReplyBuilder` serves streamed and non-streamed responses alike, so both carry the
same text for the same tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from kimi_mlx.text.chat_format import STRUCTURE_TOKENS, TOOLS_END, TOOLS_START
from kimi_mlx.text.reply_parse import ReplyStream, parse_tool_section
from kimi_mlx.generation.request import StopMatcher

_CALL_ATTRS = re.compile(r'<\|open\|>call((?:(?!<\|sep\|>).)*)<\|sep\|>', re.DOTALL)
_INDEX_ATTR = re.compile(r'\bindex="(\d+)"')


@dataclass
class ToolCall:
    """One parsed call: `id` is the model's own call id `functions.NAME:IDX` (IDX = the
    call's `index` attribute), `arguments` a dict."""

    id: str
    name: str
    arguments: dict


@dataclass
class Event:
    """What one token (or the end) produced: channel text and finished tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)


def tool_calls_from_text(section: str, first_index: int = 0) -> List[ToolCall]:
    """Calls in the text of one `<|open|>tools<|sep|>...` section (markers optional)."""
    calls = parse_tool_section(TOOLS_START + section + TOOLS_END)
    indices = [_INDEX_ATTR.search(a) for a in _CALL_ATTRS.findall(section)]
    out = []
    for k, call in enumerate(calls):
        m = indices[k] if k < len(indices) else None
        idx = int(m.group(1)) if m else first_index + k + 1
        out.append(ToolCall(f"functions.{call['name']}:{idx}", call["name"], call["arguments"]))
    return out


class ReplyBuilder:
    """Feed generated token ids; get text events.

    Args:
        tokenizer: mlx-lm TokenizerWrapper (its `detokenizer` gives a fresh streaming
            detokenizer per call).
        stops: stop strings. In chat mode they are matched in the visible answer only
            (the content channel), never inside the reasoning or tool-call markup, as
            OpenAI-compatible servers with reasoning parsers do: a "\n\n" meant for the
            answer does not end the reply while the model thinks. In raw mode
            (completions) on all the decoded text.
        chat: True to split the K3.1 reply into channels (chat / messages APIs); False
            for raw text (completions API: everything is `content`).

    Special tokens never reach the reply's text (as vLLM's and llama-server's
    skip_special_tokens): they are counted but not decoded, except, in chat mode, the
    structure tokens the K3.1 markup is made of (`chat_format.STRUCTURE_TOKENS`), which
    the channel parser needs; one of those left over as text (a `<|close|>` that closes
    nothing) is removed from the reasoning and content the parser emits.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = (), chat: bool = True):
        self.detok = tokenizer.detokenizer
        specials = getattr(_kimi(tokenizer), "special_tokens", None) or {}
        kept = set(STRUCTURE_TOKENS) if chat else set()
        self._skip = {tid for name, tid in specials.items() if name not in kept}
        self._leftover = [name for name in STRUCTURE_TOKENS if name in specials] if chat else []
        self.stop = StopMatcher(list(stops))
        self.parser = ReplyStream() if chat else None
        self.stopped = False  # a stop string matched
        self.n_tokens = 0
        self.reasoning_tokens = 0
        self.tool_calls: List[ToolCall] = []
        self.reasoning = ""
        self.content = ""
        self._tool_done = 0  # length of parser.tool_text already turned into calls

    def feed(self, token: int) -> Event:
        """One generated token (not EOS) -> the text it completes."""
        self.n_tokens += 1
        if self.parser is not None and self.parser.state == "reasoning":
            self.reasoning_tokens += 1
        if self.stopped or token in self._skip:
            return Event()
        self.detok.add_token(token)
        return self._text(self.detok.last_segment, final=False)

    def finish(self) -> Event:
        """End of generation: flush held-back text, parse an unterminated tool section."""
        if self.stopped:  # already flushed when the stop string matched
            return Event()
        self.detok.finalize()
        return self._text(self.detok.last_segment, final=True)

    def _text(self, text: str, final: bool) -> Event:
        if self.parser is None:
            safe = self._visible(text, final)
            self.content += safe
            return Event(content=safe)
        return self._channels(text, final)

    def _visible(self, text: str, final: bool) -> str:
        """The answer's text after the stop strings (matched in the answer only)."""
        safe, stopped = self.stop.feed(text)
        if stopped:
            self.stopped = True
        elif final:
            safe += self.stop.flush()
        return safe

    def _channels(self, text: str, final: bool) -> Event:
        p = self.parser
        was_tools = p.state == "tools"
        events = p.feed(text) if text else []
        if final:
            events += p.finish()
        ev = Event()
        for channel, t in events:
            for name in self._leftover:
                t = t.replace(name, "")
            if channel == "reasoning":
                ev.reasoning += t
            else:
                ev.content += self._visible(t, False)
                if self.stopped:
                    break
        if final and not self.stopped:
            ev.content += self._visible("", True)
        if self.stopped:
            # the reply ends at the stop string: text after it, and the tool calls of a
            # section not yet closed, are dropped
            self.reasoning += ev.reasoning
            self.content += ev.content
            return ev
        self.reasoning += ev.reasoning
        self.content += ev.content
        # a tools section closed (or generation ended inside one): its calls are complete
        if (was_tools or p.tool_text[self._tool_done:]) and (p.state != "tools" or final):
            new = tool_calls_from_text(p.tool_text[self._tool_done:], len(self.tool_calls))
            self._tool_done = len(p.tool_text)
            self.tool_calls += new
            ev.tool_calls = new
        return ev

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI finish_reason: tool_calls when calls were made, stop for EOS or a stop
        string, length when max_tokens (or the context) ended it."""
        if self.tool_calls:
            return "tool_calls"
        if self.stopped:
            return "stop"
        return engine_reason


def token_logprobs(tokenizer, token: int, logprob: float,
                   top: Optional[Sequence[Tuple[int, float]]]) -> dict:
    """OpenAI chat `logprobs.content` entry for one token (token text, its UTF-8 bytes)."""
    def entry(t, lp):
        b = token_bytes(tokenizer, t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    out = entry(token, logprob)
    out["top_logprobs"] = [entry(t, lp) for t, lp in (top or [])]
    return out


def _kimi(tokenizer):
    """Our KimiTokenizer behind mlx-lm's wrapper (and the transformers adapter), or None."""
    return getattr(getattr(tokenizer, "_tokenizer", tokenizer), "kimi", None)


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes of one token id (our KimiTokenizer behind mlx-lm's wrapper)."""
    kimi = _kimi(tokenizer)
    if kimi is not None:
        return kimi.decode_bytes([token])
    return tokenizer.decode([token]).encode("utf-8")
