"""`generation.constrain` without a model: the logits processor's masks against texts a
grammar must accept or refuse (references: `json` / `jsonschema` on the same texts, and
mlx-lm's `kimi_k3` tool parser), the thinking budget, the tool_choice forms, and how
`Sampling` carries the constraint (processors, never the stage wire)."""

import json

import jsonschema
import mlx.core as mx
import pytest

from kimi_mlx.generation.constrain import build_constraint, tool_choice_of
from kimi_mlx.generation.request import default_model
from kimi_mlx.sampling import InputError, Sampling
from kimi_mlx.text.chat_format import THINK_START
from kimi_mlx.text.reply_parse import parse_reply
from kimi_mlx.text.tokenizer import KimiTokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_pretrained(default_model())


def _walk(tok, constraint, text, prompt_last):
    """Feed `text`'s tokens through a fresh processor; index of the first token the mask
    forbids, or None when every token is allowed."""
    p = constraint.processor()
    hist = [prompt_last]
    for i, t in enumerate(tok.encode(text, allow_special=True)):
        out = p(mx.array(hist), mx.zeros((1, len(tok))))
        if not bool(out[0, t] > -1e30):
            return i
        hist.append(t)
    return None


def _json_reply(body):
    return f"hm<|close|>think<|sep|><|open|>response<|sep|>{body}<|close|>response<|sep|><|close|>message<|sep|>"


@pytest.mark.parametrize("body", ['{"a":1,"b":"x"}', '{"a": -7, "b": "y"}', '{"a":1}',
                                  '{"a":1,"b":"z"}', '{"a":1.5,"b":"x"}', '{"a":1,"b":"x","c":2}',
                                  '[1]', '{"a":1,  "b":"x"}'])
def test_json_schema_mask_agrees_with_jsonschema(tok, body):
    prompt = tok.encode(THINK_START, allow_special=True)
    c = build_constraint(tok, prompt, response_format={"type": "json_schema", "json_schema": {
        "schema": SCHEMA, "strict": True}})
    try:
        jsonschema.validate(json.loads(body), SCHEMA)
        valid = "  " not in body  # two blanks in a row: outside the allowed whitespace
    except (ValueError, jsonschema.ValidationError):
        valid = False
    assert (_walk(tok, c, _json_reply(body), prompt[-1]) is None) == valid


def test_tool_call_grammar_names_and_arguments(tok):
    prompt = tok.encode(THINK_START, allow_special=True)
    c = build_constraint(tok, prompt, tools=TOOLS, tool_choice=("named", "add"))

    def call(name, args):
        return ('x<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="' + name
                + '" index="1"<|sep|><|open|>json type="object"<|sep|>' + args
                + "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")

    good = call("add", '{"a": 3}')
    assert _walk(tok, c, good, prompt[-1]) is None
    assert parse_reply(good)["tool_calls"] == [{"name": "add", "arguments": {"a": 3}}]
    assert _walk(tok, c, call("sub", '{"a": 3}'), prompt[-1]) is not None
    assert _walk(tok, c, call("add", '{"a": "3"}'), prompt[-1]) is not None
    # a plain answer instead of the call is refused right after the thinking
    opened = len(tok.encode("x<|close|>think<|sep|><|open|>", allow_special=True))
    assert _walk(tok, c, "x<|close|>think<|sep|><|open|>response<|sep|>hi", prompt[-1]) == opened


def test_thinking_is_free_and_the_budget_closes_it(tok):
    prompt = tok.encode(THINK_START, allow_special=True)
    c = build_constraint(tok, prompt, response_format={"type": "json_object"}, think_budget=2)
    p = c.processor()
    hist = [prompt[-1]]
    free = mx.zeros((1, len(tok)))
    forced = []
    n = len(tok.encode("<|close|>think<|sep|>", allow_special=True))
    for step in range(2 + n + 1):
        out = p(mx.array(hist), free)
        allowed = [i for i, ok in enumerate((out[0] > -1e30).tolist()) if ok]
        if step < 2:
            assert len(allowed) == len(tok)  # thinking: nothing masked
            hist.append(tok.encode("ab")[0])
        else:
            forced.append(allowed)
            hist.append(allowed[0])
    assert tok.decode_bytes([a[0] for a in forced[:n]]) == b"<|close|>think<|sep|>"
    assert all(len(a) == 1 for a in forced)
    assert tok.decode_bytes([forced[n][0]]) == b"<|open|>"  # the grammar took over


def test_tool_choice_forms():
    assert tool_choice_of({"type": "function", "function": {"name": "f"}}) == ("named", "f")
    assert tool_choice_of({"type": "function", "name": "f"}) == ("named", "f")
    assert tool_choice_of({"type": "tool", "name": "f"}) == ("named", "f")
    assert tool_choice_of({"type": "any"}) == "required"
    assert tool_choice_of({"type": "auto"}) == "auto" and tool_choice_of(None) is None
    with pytest.raises(InputError) as e:
        tool_choice_of({"type": "wizard"})
    assert e.value.param == "tool_choice"


def test_sampling_carries_the_constraint_to_processors_not_the_wire(tok):
    from kimi_mlx.cluster.net.wire import sampling_to_pb

    c = build_constraint(tok, tok.encode(THINK_START, allow_special=True), tools=TOOLS,
                         tool_choice="required")
    s = Sampling(temp=0.5, constraint=c)
    assert s.has_processors and len(s.logits_processors()) == 1
    assert s.logits_processors()[0] is not s.logits_processors()[0]  # fresh state each
    assert not s.without_processors().has_processors
    assert sampling_to_pb(s) == sampling_to_pb(Sampling(temp=0.5))
    assert build_constraint(tok, [1, 2], tools=TOOLS, tool_choice="none") is None
    assert build_constraint(tok, [1, 2]) is None


@pytest.mark.parametrize("draft", ["ngram", "micro-draft"])
def test_speculative_drafts_are_checked_against_the_grammar(tok, draft):
    """Greedy decoding under a grammar with drafts (n-gram lookup, the micro-draft model)
    gives the tokens of mlx-lm's plain `generate_step` with the same grammar processor:
    a draft the grammar forbids is rejected like any mismatch."""
    from mlx_lm.generate import generate_step

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.speculative.loop import SpecStats, speculative_generate_step
    from kimi_mlx.speculative.ngram import NgramDraft

    model = load_model(default_model(), verbose=False)[0]
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["ab", "cd", "abcd"]}, "maxItems": 12}},
        "required": ["tags"]}
    prompt = tok.encode("Tags: ab, cd, ab, cd, ab, cd.<|close|>think<|sep|>", allow_special=True)
    c = build_constraint(tok, prompt, response_format={"type": "json_schema", "json_schema": {
        "schema": schema, "strict": True}})
    assert c.trigger == "now"
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=40,
                                            logits_processors=[c.processor()])]
    stats = SpecStats()
    if draft == "ngram":
        gen = NgramDraft().generate_step(prompt, model, None, num_draft_tokens=3, max_tokens=40,
                                         sampling=Sampling(constraint=c), stats=stats)
    else:
        dm = load_model(default_model().parent / "micro-draft", verbose=False)[0]
        gen = speculative_generate_step(prompt, model, dm, num_draft_tokens=3, max_tokens=40,
                                        sampling=Sampling(constraint=c), stats=stats)
    got = [int(t) for t, _, _ in gen]
    assert got == ref, (tok.decode(got), tok.decode(ref))
    assert stats.steps > 0 and stats.accepted > 0
    assert stats.accepted < stats.drafted or draft == "ngram"


def test_one_call_when_parallel_calls_are_off(tok):
    prompt = tok.encode(THINK_START, allow_special=True)
    call = ('<|open|>call tool="add" index="1"<|sep|><|open|>json type="object"<|sep|>{"a": 1}'
            '<|close|>json<|sep|><|close|>call<|sep|>')
    two = "x<|close|>think<|sep|><|open|>tools<|sep|>" + call + call + "<|close|>tools<|sep|>"
    many = build_constraint(tok, prompt, tools=TOOLS, tool_choice="required")
    one = build_constraint(tok, prompt, tools=TOOLS, tool_choice="required", parallel=False)
    assert _walk(tok, many, two, prompt[-1]) is None
    assert _walk(tok, one, two, prompt[-1]) == len(tok.encode(two.rsplit(call, 1)[0], allow_special=True))


def test_a_request_cannot_send_a_constraint_itself():
    from types import SimpleNamespace

    s = Sampling.from_request(SimpleNamespace(constraint="x", temperature=0.5))
    assert s.constraint is None and s.temp == 0.5 and not s.has_processors


def test_tool_schemas_strict_only_when_they_say_so(tok):
    """A tool schema with a keyword llguidance lacks: ignored (non-strict tools), a 400
    when forced with `strict: true`, and never an error for tools left on auto."""
    prompt = tok.encode(THINK_START, allow_special=True)
    odd = {"type": "object", "properties": {"u": {"type": "string", "format": "uri-template"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": odd}}]
    strict = [{"type": "function", "function": {"name": "f", "parameters": odd, "strict": True}}]
    assert build_constraint(tok, prompt, tools=tools, tool_choice="required") is not None
    with pytest.raises(InputError) as e:
        build_constraint(tok, prompt, tools=strict, tool_choice="required")
    assert e.value.param == "tools[0]" and "uri-template" in str(e.value)
    assert build_constraint(tok, prompt, tools=strict) is None
