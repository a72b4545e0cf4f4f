"""Kimi K3.1 chat encoding (XTML markup), laid out as Moonshot's K3 reference encoder does.

Reference: ``encoding_k3.py`` (Moonshot's K3 encoder, carried in vLLM as
``vllm/tokenizers/encoding_k3.py``) and llama.cpp's ``models/templates/Kimi-K3.jinja``.
K3.1's own encoder is not public; K3's is the reference. Every block is
``<|open|>TAG ATTRS<|sep|>BODY<|close|>TAG<|sep|>`` where ``<|open|>``, ``<|sep|>``,
``<|close|>`` and ``<|end_of_msg|>`` are special tokens and everything else is ordinary
text. A conversation is encoded as::

    [tool-declare system block, if tools]
    <|open|>message role="system" type="thinking-effort"<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"[ name="N"]<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
        <|open|>think<|sep|>REASONING<|close|>think<|sep|>
        <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
        [<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
            <|open|>argument key="K" type="string"<|sep|>VALUE<|close|>argument<|sep|>
         <|close|>call<|sep|><|close|>tools<|sep|>]
    <|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="NAME" index="1"<|sep|>RESULT<|close|>message<|sep|><|end_of_msg|>
    [tool-choice / response-format system blocks]
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>     (generation prompt)

(shown wrapped; there are no newlines between blocks). Assistant messages keep their
``reasoning_content`` inside the think block ("preserved thinking"); without it the
block is empty. The tool-call markup is the one mlx-lm's ``tool_parsers/kimi_k3.py``
parses. As in the reference, every piece of text (tag name, `` key``, ``="``, attribute
value, ``"``, message text) is its own segment and is tokenized on its own, and message
content is always ordinary text: a user who types ``<|open|>`` gets the characters, not
the structure token, on every path (:func:`encode_chat`, :class:`RenderedChat`).

Where we differ from the reference, on purpose:

* an image part must be *resolved* before rendering: the request path decodes and
  preprocesses it and puts the result under the part's ``"media"`` key (any object with
  ``width``, ``height`` and ``num_tokens``, e.g. ``kimi_mlx.vision.preprocess.
  ProcessedImage``). A resolved image renders, in content order, as the reference's
  ``<|media_begin|>image WxH<|media_content|><|media_pad|>...<|media_end|>`` with WxH the
  original size as text and the pad already expanded to the image's token count (the
  reference renders one pad and the engine expands it); the model then replaces the
  pads' embeddings with the projector's rows, in :func:`media_in_order`'s order. An
  unresolved image part in a user, system or assistant message raises ``ValueError``
  (the model would not see it); in a tool result it becomes the reference's
  ``<|kimi_image_placeholder|>``, as text;
* an unknown role or a message that is not a dict raises instead of being skipped;
* effort is one of low/high/max (no ``"none"``/non-thinking mode);
* reasoning given as a list of text parts is joined like content (the reference
  would render the list's ``str``).

Generated text is split back with :func:`parse_reply` (whole reply) or
:class:`ReplyStream` (incremental, for a CLI that prints reasoning dimmed).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Sequence

OPEN, SEP, CLOSE, END_OF_MSG = "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"
STRUCTURE_TOKENS = (OPEN, SEP, CLOSE, END_OF_MSG)
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
IMAGE_PART_TYPES = ("image", "image_url")

EFFORTS = ("low", "high", "max")
DEFAULT_EFFORT = "max"
# The effort names the OpenAI (reasoning_effort, reasoning.effort) and Anthropic
# (output_config.effort) APIs define, onto K3.1's three (the reference encoder accepts
# only EFFORTS; its prompt text also names `medium`, which it refuses): no thinking is
# not a K3.1 mode, so none/minimal think as little as it does (low); medium, OpenAI's
# usual default, is high; xhigh is max.
API_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "high",
               "high": "high", "xhigh": "max", "max": "max"}

THINK_START = f"{OPEN}think{SEP}"
THINK_END = f"{CLOSE}think{SEP}"
RESPONSE_START = f"{OPEN}response{SEP}"
RESPONSE_END = f"{CLOSE}response{SEP}"
TOOLS_START = f"{OPEN}tools{SEP}"
TOOLS_END = f"{CLOSE}tools{SEP}"
MESSAGE_END = f"{CLOSE}message{SEP}"
GENERATION_PROMPT = f'{OPEN}message role="assistant"{SEP}{THINK_START}'
# Markers that front ends look up as whole strings (mlx-lm's TokenizerWrapper asks the
# tokenizer for the think and tool-call markers' ids; stop words may name END_OF_MSG).
MARKERS = (THINK_START, THINK_END, RESPONSE_START, RESPONSE_END, TOOLS_START, TOOLS_END,
           MESSAGE_END) + STRUCTURE_TOKENS

_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including "
    "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
_TOOLS_BODY = (
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
)
_DYNAMIC_TOOLS_BODY = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n```json\n{tools}\n```"
)
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\n"
                "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
            "You MUST NOT call any tools in the next message.",
}
_RAW_JSON = ("The system is invoked with `response_format={kind}`.\nYour response must be raw "
             "JSON data without markdown code blocks (```json) or any additional formatting.")
_SCHEMA_TAIL = "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"
_ROLES = ("system", "user", "assistant", "tool")

# A rendered conversation is a list of (is_special, text) segments, tokenized one by one:
# special segments are single special tokens, text segments ordinary text.
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


def api_effort(value: str | None) -> str:
    """K3.1's effort (one of EFFORTS) for an API's effort name (a key of API_EFFORTS;
    None: DEFAULT_EFFORT). Raises ``ValueError`` naming the accepted names."""
    if value is None:
        return DEFAULT_EFFORT
    if value not in API_EFFORTS:
        raise ValueError(f"must be one of {', '.join(API_EFFORTS)}; got {value!r}")
    return API_EFFORTS[value]


def _text(s: Any) -> list[Segment]:
    s = str(s)
    return [(False, s)] if s else []


def _escape_attr(value: Any) -> str:
    # mlx-lm's parser reads attr="..." and undoes exactly these two escapes.
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    segs: list[Segment] = [(True, OPEN), *_text(tag)]
    for key, value in attrs:
        segs += [(False, f" {key}"), (False, '="'), *_text(_escape_attr(value)), (False, '"')]
    return segs + [(True, SEP)]


def _close(tag: str) -> list[Segment]:
    return [(True, CLOSE), *_text(tag), (True, SEP)]


def _block(tag: str, attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _open(tag, attrs) + body + _close(tag)


def _message(attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _block("message", attrs, body) + [(True, END_OF_MSG)]


def _system_block(kind: str, body: str) -> list[Segment]:
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def _compact_json(value: Any) -> str:
    # Tools and schemas: key-sorted at every level, compact, as the reference writes them.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def media_segments(width: int, height: int, num_tokens: int) -> list[Segment]:
    """One image in the prompt: ``<|media_begin|>image WxH<|media_content|>`` then
    ``num_tokens`` ``<|media_pad|>`` then ``<|media_end|>`` (K31_SPEC.md section 7)."""
    if num_tokens < 1:
        raise ValueError(f"an image needs at least one token, got {num_tokens}")
    return ([(True, MEDIA_BEGIN), (False, f"image {int(width)}x{int(height)}"), (True, MEDIA_CONTENT)]
            + [(True, MEDIA_PAD)] * int(num_tokens) + [(True, MEDIA_END)])


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES


def media_in_order(messages: Sequence[Any]) -> list:
    """The resolved images (each part's ``"media"``) in the order :func:`chat_segments`
    renders them (tool results put in call order first, as there): the order in which
    their projector rows replace the ``<|media_pad|>`` positions."""
    out = []
    for msg in order_tool_results(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, (list, tuple)):
            out += [part["media"] for part in content if _is_image(part) and part.get("media") is not None]
    return out


def _content(content: Any, where: str, images: bool = False) -> list[Segment]:
    """Message content as segments: a string, None, or a list of parts (strings,
    ``{"type": "text", "text"}``, resolved images; unresolved image parts only where
    ``images``, as the placeholder text)."""
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content)
    if isinstance(content, (list, tuple)):
        segs: list[Segment] = []
        for part in content:
            if isinstance(part, str):
                segs += _text(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                segs += _text(part.get("text", ""))
            elif _is_image(part) and part.get("media") is not None:
                m = part["media"]
                segs += media_segments(m.width, m.height, m.num_tokens)
            elif images and _is_image(part):
                segs.append((False, IMAGE_PLACEHOLDER))
            else:
                raise ValueError(f"{where}: only text content is supported here, got part {part!r}")
        return segs
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _content_text(content: Any, where: str) -> str:
    segs = _content(content, where)
    if any(special for special, _ in segs):
        raise ValueError(f"{where}: only text is supported here, got an image part")
    return "".join(text for _, text in segs)


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


def _call_arguments(args: Any, where: str) -> tuple[Mapping, str | None]:
    """(arguments, raw): a JSON-object string is parsed; one that is not JSON at all (a
    call cut off in history) is kept raw for a ``json`` block, as the reference does."""
    if args is None:
        return {}, None
    if isinstance(args, str):
        if not args.strip():
            return {}, None
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {}, args
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}: arguments must be a JSON object (or its JSON text)")
    return args, None


def _tool_call_segments(calls: Sequence[Any], where: str) -> list[Segment]:
    body: list[Segment] = []
    for index, call in enumerate(calls, 1):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not fn.get("name"):
            raise ValueError(f"{where}: tool call {index} has no function name: {call!r}")
        args, raw = _call_arguments(fn.get("arguments"), f"{where}: tool call {index}")
        call_body: list[Segment] = []
        if raw is not None:
            call_body = _block("json", [("type", "object")], _text(raw))
        for key, value in args.items():
            try:
                kind = _json_type(value)
                text = value if kind == "string" else json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: tool call {index} argument {key!r} is not JSON ({e})") from None
            call_body += _block("argument", [("key", key), ("type", kind)], _text(text))
        body += _block("call", [("tool", fn["name"]), ("index", index)], call_body)
    return _block("tools", [], body)


def _call_name(call: Any) -> Any:
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    return fn.get("name") if isinstance(fn, Mapping) else None


def order_tool_results(messages: Sequence[Any]) -> list:
    """Tool results put in call order, as the reference does before rendering.

    Each run of consecutive ``role: "tool"`` messages is matched, by ``tool_call_id``
    (or ``id``), against the ``tool_calls[].id`` of the latest assistant message. When
    every result of the run matches, the run is sorted into call order and each result's
    tool name is set from its call (``tool``, and ``name`` if present). A run with any
    unmatched result is left as it is. Returns a new list; messages are copied before
    any change, never modified.
    """
    out: list = []
    calls: dict = {}
    i = 0
    while i < len(messages):
        msg = messages[i]
        if not (isinstance(msg, Mapping) and msg.get("role") == "tool"):
            if isinstance(msg, Mapping) and msg.get("role") == "assistant":
                calls = {}
                for pos, call in enumerate(msg.get("tool_calls") or [], 1):
                    if isinstance(call, Mapping) and call.get("id") is not None:
                        calls.setdefault(str(call["id"]), (pos, _call_name(call)))
            out.append(msg)
            i += 1
            continue
        run = []
        while i < len(messages) and isinstance(messages[i], Mapping) and messages[i].get("role") == "tool":
            result = messages[i]
            call_id = result.get("tool_call_id", result.get("id"))
            run.append((calls.get(str(call_id)) if call_id is not None else None, len(run), result))
            i += 1
        if any(match is None for match, _, _ in run):
            out += [result for _, _, result in run]
            continue
        for (pos, name), _, result in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is not None:
                result = {**result, "tool": name, **({"name": name} if "name" in result else {})}
            out.append(result)
    return out


def _response_schema(response_format: Any) -> Any:
    spec = response_format.get("json_schema") if isinstance(response_format, Mapping) else None
    if isinstance(spec, Mapping):
        return spec.get("schema", spec.get("json_schema", spec))
    return spec


def chat_segments(
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str = DEFAULT_EFFORT,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    tool_choice: Any = None,
    response_format: Any = None,
) -> list[Segment]:
    """The conversation as ``(is_special, text)`` segments (see the module docstring).

    ``messages``: OpenAI-style dicts with ``role`` in system/user/assistant/tool,
    ``content`` (str, None, or a list of text parts) and an optional ``name``.
    Assistant messages may carry ``reasoning_content`` (or ``reasoning``, used when the
    former is empty) and ``tool_calls`` (``[{"id", "function": {"name", "arguments"}}]``
    or ``[{"name", "arguments"}]``; arguments a dict or JSON text; text that is not JSON
    is rendered raw in a ``json`` block). A tool message's tool name is, in order: the
    call its ``tool_call_id`` matches, its ``tool``/``name``, the call at its position;
    results are put in call order when all of a run match (:func:`order_tool_results`).
    A system message with ``tools`` declares more tools. ``tool_choice`` ("required" /
    "none") and ``response_format`` (``{"type": "json_object"}`` or ``"json_schema"``
    with a schema) add the reference's closing system blocks.

    Image parts with a ``"media"`` value (resolved) render as media blocks in any
    message content; see the module docstring.

    Raises ``ValueError`` for an unknown role or effort, non-text content (unresolved
    images are allowed in tool results only, as placeholder text), malformed tool calls, or a tool result whose tool
    name cannot be resolved.
    """
    effort = resolve_effort(reasoning_effort)
    segs: list[Segment] = []
    if tools:
        segs += _system_block("tool-declare", _TOOLS_BODY.format(tools=_compact_json(list(tools))))
    segs += _system_block("thinking-effort", _EFFORT_BODY.format(effort=effort))
    calls: Sequence[Any] | None = None
    tool_index = 0
    for i, msg in enumerate(order_tool_results(messages)):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: expected a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(_ROLES)}; got {role!r}")
        attrs: list[tuple[str, Any]] = [("role", role)]
        if role != "tool" and msg.get("name"):
            attrs.append(("name", msg["name"]))
        if role == "system" and msg.get("tools"):
            segs += _system_block("tool-declare", _DYNAMIC_TOOLS_BODY.format(tools=_compact_json(msg["tools"])))
        elif role == "assistant":
            calls, tool_index = msg.get("tool_calls"), 0
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            reasoning = _content_text(reasoning, where)
            body = _block("think", [], _text(reasoning) if reasoning.strip() else [])
            body += _block("response", [], _content(msg.get("content"), where))
            if calls:
                body += _tool_call_segments(calls, where)
            segs += _message(attrs, body)
        elif role == "tool":
            tool_index += 1
            name = msg.get("tool", msg.get("name"))
            if name is None and calls and tool_index <= len(calls):
                name = _call_name(calls[tool_index - 1])
            if name is None:
                raise ValueError(f"{where}: tool result without a tool name: give tool_call_id, "
                                 "tool or name, or follow an assistant message's tool_calls")
            attrs = [("role", "tool"), ("tool", name), ("index", tool_index)]
            segs += _message(attrs, _content(msg.get("content"), where, images=True))
        else:
            segs += _message(attrs, _content(msg.get("content"), where))
    if tool_choice in _TOOL_CHOICE_BODY:
        segs += _system_block("tool-choice", _TOOL_CHOICE_BODY[tool_choice])
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    if kind == "json_object":
        segs += _system_block("response-format", _RAW_JSON.format(kind=kind))
    elif kind == "json_schema":
        schema = _compact_json(_response_schema(response_format))
        segs += _system_block("response-format", _RAW_JSON.format(kind=kind) + _SCHEMA_TAIL.format(schema=schema))
    if add_generation_prompt:
        segs += _open("message", [("role", "assistant")]) + _open("think")
    return segs


class RenderedChat(str):
    """:func:`render_chat`'s string, which remembers which parts are structure tokens.

    It is an ordinary ``str`` (display, logs, ``==``); :func:`encode_segments` and our
    tokenizers' ``encode`` use :attr:`segments`, so encoding it gives exactly
    :func:`encode_chat`'s ids: this is how mlx-lm's render-then-encode path
    (``apply_chat_template(tokenize=False)`` then ``tokenizer.encode``) keeps user text
    that looks like markup as text. A slice (``s[i:j]``, as mlx_lm.generate takes with
    a prompt cache) is again a ``RenderedChat``; a cut through a special token leaves
    its remaining characters as text. Any other string operation gives a plain ``str``.
    """

    segments: tuple[Segment, ...]

    def __new__(cls, segments: Iterable[Segment]):
        segments = tuple((bool(s), t) for s, t in segments if t)
        obj = super().__new__(cls, "".join(t for _, t in segments))
        obj.segments = segments
        return obj

    def __getitem__(self, key):
        if not isinstance(key, slice):
            return str.__getitem__(self, key)
        start, stop, step = key.indices(len(self))
        if step != 1:
            return str.__getitem__(self, key)
        out, at = [], 0
        for special, text in self.segments:
            lo, hi = max(start - at, 0), min(stop - at, len(text))
            if lo < hi:
                out.append((special and (lo, hi) == (0, len(text)), text[lo:hi]))
            at += len(text)
        return RenderedChat(out)

    def __reduce__(self):
        return RenderedChat, (self.segments,)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str = DEFAULT_EFFORT,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **options: Any,
) -> RenderedChat:
    """The encoded conversation as one string (special tokens as their text).

    Arguments and errors as :func:`chat_segments` (``options``: ``tool_choice``,
    ``response_format``). The result is a :class:`RenderedChat`: our tokenizers encode
    it to :func:`encode_chat`'s ids. Text rebuilt from it (concatenation, formatting)
    is plain ``str`` again, whose markup-looking text a tokenizer encodes as text.
    """
    return RenderedChat(chat_segments(messages, reasoning_effort, add_generation_prompt, tools, **options))


def _kimi(tokenizer):
    tok = getattr(tokenizer, "kimi", tokenizer)
    missing = [t for t in STRUCTURE_TOKENS if t not in tok.special_tokens]
    if missing:
        raise ValueError(f"tokenizer has no K3 structure tokens {missing}")
    return tok


def encode_segments(tokenizer, segments: Iterable[Segment]) -> list[int]:
    """Token ids of ``(is_special, text)`` segments, each tokenized on its own.

    A special segment is its special token's id; a text segment is ordinary text,
    special-token look-alikes included. ``tokenizer`` as in :func:`encode_chat`.
    Raises ``ValueError`` if the vocabulary lacks a structure token or a special
    segment is not a special token of the vocabulary.
    """
    tok = _kimi(tokenizer)
    ids: list[int] = []
    for special, text in segments:
        if not special:
            ids += tok.encode(str(text), allow_special=False)
        elif text in tok.special_tokens:
            ids.append(tok.special_tokens[text])
        else:
            raise ValueError(f"tokenizer has no special token {text!r}")
    return ids


def encode_chat(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str = DEFAULT_EFFORT,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **options: Any,
) -> list[int]:
    """Token ids (``list[int]``) of the conversation for ``tokenizer``.

    ``tokenizer``: a :class:`kimi_mlx.text.tokenizer.KimiTokenizer` (or our transformers
    ``TikTokenTokenizer``, which wraps one as ``.kimi``). Markup becomes special-token
    ids; all message text is encoded as ordinary text, segment by segment, as the
    reference does. ``options`` as in :func:`chat_segments`. Raises ``ValueError`` as
    :func:`chat_segments`, or if the vocabulary lacks a structure token.
    """
    tok = _kimi(tokenizer)
    return encode_segments(tok, chat_segments(messages, reasoning_effort, add_generation_prompt, tools, **options))
