"""Encoding parity with Moonshot's K3 reference encoder on a hand-written corpus
(tests/data/chat_corpus.json), reply round trips, and the choices where we differ."""

import json
from pathlib import Path

import pytest

from kimi_mlx.text.chat_format import (
    THINK_START,
    RenderedChat,
    chat_segments,
    encode_chat,
    encode_segments,
    render_chat,
)
from kimi_mlx.text.reply_parse import parse_reply
from kimi_mlx.generation.generate import default_model
from kimi_mlx.text.tokenizer import KimiTokenizer

CORPUS = json.loads((Path(__file__).parent / "data" / "chat_corpus.json").read_text("utf-8"))["cases"]
EFFORT = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how '
    "much to think in your thinking channel (not including the response channel), supported "
    "values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort={}`.<|close|>message<|sep|><|end_of_msg|>"
)
GEN = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'


def expected(case):
    out = []
    for piece in case["expected"]:
        if piece.startswith("@effort:"):
            out.append(EFFORT.format(piece.split(":", 1)[1]))
        elif piece == "@gen":
            out.append(GEN)
        else:
            out.append(piece)
    return "".join(out)


def options(case):
    keys = ("reasoning_effort", "add_generation_prompt", "tools", "tool_choice", "response_format")
    return {k: case[k] for k in keys if k in case}


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_pretrained(default_model())


def test_corpus_is_big_enough():
    assert len(CORPUS) >= 30
    assert len({c["name"] for c in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_render_matches_the_reference_rules(case, tok):
    before = json.dumps(case["messages"], sort_keys=True)
    text = render_chat(case["messages"], **options(case))
    assert text == expected(case)
    assert json.dumps(case["messages"], sort_keys=True) == before  # inputs are never modified
    # Every path to ids agrees: encode_chat, the rendered string's own segments.
    ids = encode_chat(tok, case["messages"], **options(case))
    assert encode_segments(tok, text.segments) == ids
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_text_is_tokenized_segment_by_segment_as_the_reference_does(tok):
    """The reference encodes tag name, ` key`, `="`, value and `"` each on its own, so a
    value ending in punctuation does not merge with the closing quote (the micro
    vocabulary has a `)"` token)."""
    sp = tok.special_tokens
    open_, close, sep, eom = sp["<|open|>"], sp["<|close|>"], sp["<|sep|>"], sp["<|end_of_msg|>"]
    e = tok.encode
    msgs = [{"role": "user", "content": "Hi.", "name": "(Bob)"}]
    got = encode_chat(tok, msgs, add_generation_prompt=False)
    effort = encode_chat(tok, [], add_generation_prompt=False)
    want = effort + ([open_] + e("message") + e(" role") + e('="') + e("user") + e('"') + e(" name")
                     + e('="') + e("(Bob)") + e('"') + [sep] + e("Hi.") + [close] + e("message") + [sep, eom])
    assert got == want
    joined = e('message role="user" name="(Bob)"')  # what one text segment would give
    assert joined != want[len(effort) + 1:len(effort) + 1 + len(joined)]


# ------------------------------------------------------------------------ round trips


def _replies():
    for case in CORPUS:
        for i, msg in enumerate(case["messages"]):
            if msg.get("role") == "assistant":
                yield f"{case['name']} [{i}]", msg


def _expected_calls(msg):
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments")
        if isinstance(args, str):
            if not args.strip():
                args = {}
            else:
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    # Loss we accept: mlx-lm's kimi_k3 parser skips a call whose json block
                    # is not JSON (the reference renders malformed history raw).
                    continue
        calls.append({"name": fn["name"], "arguments": args or {}})
    return calls


@pytest.mark.parametrize("name,msg", list(_replies()), ids=[n for n, _ in _replies()])
def test_parse_reply_inverts_render(name, msg):
    text = render_chat([msg], add_generation_prompt=False)
    reply = text[text.index(THINK_START):]
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    content = msg.get("content") or ""
    if isinstance(content, list):
        content = "".join(p["text"] for p in content)
    assert parse_reply(reply) == {
        # Loss we accept, as the reference: whitespace-only reasoning renders as none.
        "reasoning_content": reasoning if reasoning.strip() else "",
        "content": content,
        "tool_calls": _expected_calls(msg),
    }


def test_parse_reply_drops_whitespace_between_think_and_response():
    reply = "r<|close|>think<|sep|>\n<|open|>response<|sep|>c<|close|>response<|sep|><|close|>message<|sep|>"
    assert parse_reply(reply) == {"reasoning_content": "r", "content": "c", "tool_calls": []}
    tools = ("r<|close|>think<|sep|> \n<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>"
             "<|close|>call<|sep|><|close|>tools<|sep|>")
    assert parse_reply(tools) == {"reasoning_content": "r", "content": "",
                                  "tool_calls": [{"name": "f", "arguments": {}}]}


# --------------------------------------------------------------- where we differ, on purpose


def test_choice_images_outside_tool_results_are_refused():
    """Reference: a placeholder in any message. Ours: this build is text-only, so an image
    the user (or system, or assistant) sends is refused rather than silently unseen."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for role in ("user", "system", "assistant"):
        with pytest.raises(ValueError, match=r"messages\[0\]: only text content"):
            render_chat([{"role": role, "content": [image]}])


def test_choice_unknown_roles_and_non_dict_messages_are_refused():
    """Reference: skipped silently. Ours: a clear error naming the message."""
    with pytest.raises(ValueError, match=r"messages\[1\]: role must be one of"):
        render_chat([{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\]: expected a dict"):
        render_chat(["hello"])


def test_choice_efforts_are_low_high_max():
    """The reference encoder takes low/high/max (the jinja also medium); no non-thinking mode."""
    for bad in ("medium", "none"):
        with pytest.raises(ValueError, match="low, high, max"):
            render_chat([], reasoning_effort=bad)


def test_unresolvable_tool_result_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"messages\[0\]: tool result without a tool name"):
        render_chat([{"role": "tool", "tool_call_id": "x", "content": "r"}])
    with pytest.raises(ValueError, match="must be a JSON object"):
        render_chat([{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "[1]"}]}])
    with pytest.raises(ValueError, match="argument 'x' is not JSON"):
        render_chat([{"role": "assistant", "tool_calls": [{"name": "f", "arguments": {"x": {1, 2}}}]}])


# ----------------------------------------------------------------------- RenderedChat


def test_rendered_chat_slices_keep_structure(tok):
    msgs = [{"role": "user", "content": "look: <|open|>x"}]
    text = render_chat(msgs)
    assert isinstance(text, RenderedChat) and isinstance(text, str)
    cut = text.index("look")
    tail = text[cut:]
    assert isinstance(tail, RenderedChat) and tail == str(text)[cut:]
    assert tok.encode(tail) == encode_segments(tok, chat_segments(msgs))[-len(tok.encode(tail)):]
    # A cut through a special token leaves its remaining characters as text.
    partial = text[1:]
    assert partial.segments[0] == (False, "|open|>")
    assert str(text + "") == str(text) and type(text + "") is str
