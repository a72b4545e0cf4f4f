"""Structured output by constrained decoding: `Constraint` (one request's grammar) and
`GrammarProcessor` (the logits processor that enforces it).

A request that asks for JSON (`response_format` json_object / json_schema) or forces a
tool (`tool_choice` required / a named function, Anthropic `any` / `tool`) gets a
grammar, in llguidance's Lark dialect, over what K3.1 writes *after* its thinking::

    <|open|>response<|sep|>JSON<|close|>response<|sep|><|close|>message<|sep|>       (JSON)
    <|open|>tools<|sep|>CALL+<|close|>tools<|sep|><|close|>message<|sep|>            (tools)
    CALL = <|open|>call tool="NAME" index="N"<|sep|>
           <|open|>json type="object"<|sep|>ARGS<|close|>json<|sep|><|close|>call<|sep|>

with NAME one of the request's tools (or the named one) and ARGS valid against that
tool's `parameters` JSON schema (the single raw-JSON argument block that K3's format and
mlx-lm's `kimi_k3` tool parser accept). A request with tools and no forcing is left
free until the model itself opens `<|open|>tools<|sep|>`; from there its calls follow
the same CALL grammar. The reasoning section is never constrained: the grammar starts
once the model closes its thinking (`<|close|>think<|sep|>`), or at once when the
prompt already left the think block.

The grammar engine is llguidance (Microsoft's, Rust, no torch): per-token masks for
K3.1's 163,840-token vocabulary take ~20 us median on one CPU core
(`kimi_mlx/bench/grammar.py`). The mask is applied as a logits processor (disallowed
tokens -> -inf) through `Sampling.constraint`, so every engine that honours logits
processors (one process, batched, pipeline head, tensor rank 0) enforces it. The
speculative loops that verify on this process (draft model, n-gram) mask each verify row
with the grammar advanced over the drafts before it (`GrammarProcessor.verify_logits`),
so a forbidden draft is rejected like any mismatch.

Once the grammar is complete (the message's `<|close|>message<|sep|>`), the processor
forces `<|end_of_msg|>`, the end-of-turn token every engine stops on: a constrained reply
ends when its value (or its calls) are written, with finish reason "stop" ("tool_calls"
when it holds calls), instead of decoding on, unconstrained, to `max_tokens`.

Every schema is compiled at admission (`build_constraint`, on the request's worker
thread), never while decoding: each schema on its own (and each of its `$defs` entries),
its first mask computed, so that what llguidance refuses, including a schema no value
satisfies (`$ref`s that only refer to each other), is a 400 naming `response_format` or
`tools[i]` before any stream starts; then the whole grammar, whose matcher each
sequence's processor copies. `SchemaLimits` bounds a schema's size in bytes and the
compile's wall time (llguidance releases the GIL while it compiles, so a neighbour's
decoding is not held up; a compile past the time-out is refused and left to finish on
one of `COMPILE_THREADS` threads, and the same grammar is then refused at once).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from kimi_mlx.generation.background import lower_thread_priority
from kimi_mlx.generation.grammar_tools import first_line as _first_line
from kimi_mlx.generation.grammar_tools import json_size as _json_size
from kimi_mlx.generation.grammar_tools import matcher as _matcher
from kimi_mlx.generation.grammar_tools import reason as _why
from kimi_mlx.generation.grammar_tools import rules_digest as _digest
from kimi_mlx.generation.grammar_tools import schema_roots as _roots
from kimi_mlx.sampling import InputError
from kimi_mlx.text.chat_format import (CLOSE, END_OF_MSG, OPEN, SEP, THINK_END, THINK_START,
                                       TOOLS_START)

__all__ = ["COMPILE_THREADS", "Constraint", "GrammarBusy", "GrammarProcessor", "SchemaLimits",
           "build_constraint", "check_schemas", "grammar_tokenizer", "think_budget_constraint",
           "tool_choice_of"]

log = logging.getLogger(__name__)
_TOKENIZERS: dict = {}
_LOCK = threading.Lock()


def grammar_tokenizer(tok):
    """llguidance's `LLTokenizer` for our `KimiTokenizer` `tok` (its tiktoken ranks,
    pre-tokenizer regex and special tokens), cached per tokenizer: building it takes
    ~1-4 s for 163,840 tokens. EOS tokens: `<|end_of_msg|>` and `[EOS]` when present."""
    enc = tok.model
    with _LOCK:
        hit = _TOKENIZERS.get(id(enc))
        if hit is not None and hit[0] is enc:
            return hit[1]
        import llguidance

        eos = [tok.special_tokens[n] for n in ("<|end_of_msg|>", "[EOS]") if n in tok.special_tokens]
        ll = llguidance.LLTokenizer.from_tiktoken(
            encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens,
            pattern=enc._pat_str, eos_token=eos or None, n_vocab=enc.n_vocab)
        _TOKENIZERS[id(enc)] = (enc, ll)
        return ll


def tool_choice_of(choice: Any, api: str = "openai") -> Any:
    """A request's tool_choice in one form: None/"auto", "none", "required" or
    ("named", NAME). Takes OpenAI chat's `{"type": "function", "function": {"name": N}}`,
    the Responses API's `{"type": "function", "name": N}`, Anthropic's
    `{"type": "auto" | "any" | "tool" | "none", "name": N}`, and `allowed_tools` (its mode;
    the subset itself is not enforced). InputError (param
    tool_choice) for a form it does not know."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if kind == "function":
            fn = choice.get("function") if isinstance(choice.get("function"), Mapping) else choice
            if isinstance(fn.get("name"), str) and fn["name"]:
                return ("named", fn["name"])
        elif kind in ("auto", "none"):
            return kind
        elif kind == "any":
            return "required"
        elif kind == "tool" and isinstance(choice.get("name"), str) and choice["name"]:
            return ("named", choice["name"])
        elif kind == "allowed_tools":  # Responses: mode at the top; chat: under allowed_tools
            inner = choice.get("allowed_tools")
            mode = choice.get("mode") or (inner.get("mode") if isinstance(inner, Mapping) else None)
            if mode in (None, "auto", "required"):
                return mode or "auto"
    raise InputError(f"tool_choice {choice!r} is not understood: use auto, none, required or a "
                     "named function", "tool_choice")


@dataclass(frozen=True)
class Constraint:
    """One request's grammar (immutable, shared by the processors made from it).

    grammar: llguidance Lark text; trigger: "think_end" (starts after the model closes
    its thinking), "tools" (starts after the model opens a tools section) or "now";
    tokenizer: the `LLTokenizer`; decode: ids -> bytes (to spot the trigger marker);
    sep_id: `<|sep|>`'s id (every marker ends with it); field: the API field that asked
    for it; think_budget: the reasoning tokens after which the model is made to close its
    thinking (`think_end_ids` forced one by one), None for no limit (or a prompt that does
    not leave the model thinking); matcher: the grammar compiled at admission (an
    `llguidance.LLMatcher` in its start state, copied by each processor; None: compiled
    when the processor starts); end_ids: the tokens forced once the grammar is complete
    (`<|end_of_msg|>`). An empty `grammar` constrains nothing after the thinking (a
    thinking budget alone, `think_budget_constraint`). `processor()` makes the stateful
    logits processor for one sequence."""

    grammar: str
    trigger: str
    tokenizer: Any
    decode: Any  # ids -> bytes (the KimiTokenizer's decode_bytes)
    sep_id: int
    field: str = "response_format"  # the API field that asked for it (for refusals)
    think_budget: Optional[int] = None  # reasoning tokens before the think block is closed
    think_end_ids: tuple = ()  # `<|close|>think<|sep|>` as token ids (forced at the budget)
    matcher: Any = None  # llguidance.LLMatcher compiled at admission (start state)
    end_ids: tuple = ()  # forced after the grammar completes: `<|end_of_msg|>`

    def processor(self) -> "GrammarProcessor":
        """A fresh processor (own matcher state) for one sequence."""
        return GrammarProcessor(self)


class GrammarProcessor:
    """mlx-lm logits processor (tokens [n], logits [1, V]) -> logits enforcing a
    `Constraint` on one sequence. Stateful: made per sequence (`Constraint.processor`).

    Called once per generated token, first with the last prompt token as `tokens[-1]`
    and then with the previous step's token last (mlx-lm's generate_step, its
    BatchGenerator, the pipeline head's chooser): each call after the first consumes
    `tokens[-1]`. Until the trigger marker the logits pass unchanged; after it, tokens
    the grammar forbids get -inf, and once the grammar is complete the constraint's
    `end_ids` are forced (the engine then stops on `<|end_of_msg|>`). RuntimeError when a
    token the grammar forbade was chosen anyway (a processor after this one undid the
    mask)."""

    def __init__(self, constraint: Constraint):
        self.c = constraint
        self.calls = 0
        self.tail = b""
        self.matcher = None
        self.done = False
        self.thought = 0  # reasoning tokens seen
        self.forced: list = []  # marker ids still to force (budget reached)
        self.ending: list = []  # end-of-message ids still to force (grammar complete)
        # inside the think block with a budget to hold (a prompt that leaves the model
        # thinking: build_constraint sets think_budget only then)
        self.thinking = constraint.think_budget is not None and constraint.trigger != "now"
        self.free = False  # past the thinking with no grammar to follow
        if constraint.trigger == "now":
            self._start()

    def _start(self):
        if not self.c.grammar:  # a thinking budget alone: nothing after the thinking
            self.free = True
            return
        if self.c.matcher is not None:
            self.matcher = self.c.matcher.deep_copy()
        else:
            self.matcher = _matcher(self.c.tokenizer, self.c.grammar)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar failed: {_first_line(self.matcher.get_error())}")

    def feed(self, token: int) -> None:
        """Advance over one generated token."""
        if self.done:
            if self.ending and token == self.ending[0]:
                self.ending.pop(0)
            return
        if self.free:
            return
        if self.matcher is None:
            self._budget_due()  # (a verify step masks a copy: this one learns it here)
            if self.forced:
                if token != self.forced[0]:
                    raise RuntimeError(f"token {token} is not the forced end of thinking "
                                       f"({self.forced[0]})")
                self.forced.pop(0)
            self.thought += 1
            self.tail = (self.tail + self.c.decode([token]))[-64:]
            if token == self.c.sep_id and self.tail.endswith(THINK_END.encode()):
                self.thinking = False
            marker = (THINK_END if self.c.trigger == "think_end" else TOOLS_START).encode()
            if token == self.c.sep_id and self.tail.endswith(marker):
                self._start()
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} breaks the request's grammar: "
                               f"{_first_line(self.matcher.get_error())}")
        if self.matcher.is_stopped():
            self.done = True
            self.ending = list(self.c.end_ids)

    def _budget_due(self) -> None:
        """Start forcing the end of thinking once the budget is spent."""
        if self.matcher is None and self.thinking and not self.forced \
                and self.thought >= self.c.think_budget:
            self.forced = list(self.c.think_end_ids)

    def allowed(self):
        """numpy bool [tokenizer vocab]: the tokens the grammar allows next, or None
        when it does not constrain this step."""
        import numpy as np

        self._budget_due()
        force = self.forced or (self.ending if self.done else None)
        if force:
            # (a budget alone has no grammar tokenizer: the mask ends at the forced id and
            # the callers pad it with False to the logits' width)
            n = getattr(self.c.tokenizer, "vocab_size", 0) or force[0] + 1
            ok = np.zeros(max(n, force[0] + 1), bool)
            ok[force[0]] = True
            return ok
        if self.matcher is None or self.done:
            return None
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar failed: {_first_line(self.matcher.get_error())}")
        return np.unpackbits(words, bitorder="little").view(bool)

    def copy(self) -> "GrammarProcessor":
        """An independent processor in this one's state (the matcher deep-copied)."""
        c = GrammarProcessor.__new__(GrammarProcessor)
        c.__dict__.update(self.__dict__)
        c.forced, c.ending = list(self.forced), list(self.ending)
        c.matcher = None if self.matcher is None else self.matcher.deep_copy()
        return c

    def verify_logits(self, logits, drafts: Sequence[int]):
        """Speculative decoding's verify step: target logits [k+1, V] at [y, d1..dk] with
        row i masked by the grammar advanced over d1..di (this processor's state is left
        as it is: it has consumed every token emitted before y's logits). Rows past the
        first draft the grammar forbids are left unmasked: that draft is rejected by the
        masked row before it (its logit is -inf there), so no later row is ever used. The
        caller then `feed`s the tokens it emits. Unchanged logits when nothing is
        constrained at any row."""
        import mlx.core as mx
        import numpy as np

        sim = self.copy()
        rows = []
        for i in range(len(drafts) + 1):
            ok = sim.allowed()
            rows.append(ok)
            # (a draft past the mask's end is forbidden: masks end at the vocabulary, or
            # at the forced id for a thinking budget alone)
            if i == len(drafts) or (ok is not None and (drafts[i] >= ok.shape[0]
                                                        or not ok[drafts[i]])):
                break
            sim.feed(int(drafts[i]))
        if all(r is None for r in rows):
            return logits
        width = logits.shape[-1]
        mask = np.ones((logits.shape[0], width), bool)
        for i, ok in enumerate(rows):
            if ok is not None:
                mask[i] = False
                mask[i, :min(width, ok.shape[0])] = ok[:width]
        return mx.where(mx.array(mask), logits, mx.array(-mx.inf, logits.dtype))

    def __call__(self, tokens, logits):
        import mlx.core as mx
        import numpy as np

        if self.calls:
            self.feed(int(tokens[-1].item()))
        self.calls += 1
        if self.matcher is not None or self.forced or self.ending:
            mx.async_eval(logits)  # the forward pass runs while the mask is computed
        ok = self.allowed()
        if ok is None:
            return logits
        width = logits.shape[-1]
        if ok.shape[0] < width:
            ok = np.concatenate([ok, np.zeros(width - ok.shape[0], bool)])
        return mx.where(mx.array(ok[:width]), logits, mx.array(-mx.inf, logits.dtype))


# ------------------------------------------------------------------ grammar text


def _lit(s: str) -> str:
    return json.dumps(s)


def _tok(tok, text: str) -> str:
    return f"<[{tok.special_tokens[text]}]>"


# JSON whitespace a reply may use between tokens: none or one space (`{"a":1}` and
# json.dumps' `{"a": 1, "b": 2}`), never a run of blanks or newlines: a model that
# likes whitespace (micro does) would otherwise spend its max_tokens on indentation and
# leave the JSON unfinished
JSON_WHITESPACE = r"[ ]?"


def _json_rule(schema: Any, strict: bool) -> str:
    opts = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE,
            "lenient": not strict}
    body = dict(schema) if isinstance(schema, Mapping) else schema
    if isinstance(body, dict):
        body = {**body, "x-guidance": {**opts, **(body.get("x-guidance") or {})}}
    return "%json " + json.dumps(body)


def _tool_schema(tool: Mapping) -> tuple:
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
    name = fn.get("name")
    params = fn.get("parameters", fn.get("input_schema")) or {"type": "object"}
    return name, params


def _calls_grammar(tok, tools: Sequence[Mapping], only: Optional[str], parallel: bool = True) -> list:
    o, c, s = _tok(tok, OPEN), _tok(tok, CLOSE), _tok(tok, SEP)
    rules, alts = [], []
    for i, tool in enumerate(tools):
        name, params = _tool_schema(tool)
        if not isinstance(name, str) or (only is not None and name != only):
            continue
        attr = name.replace("&", "&amp;").replace('"', "&quot;")
        rules.append(f'call_{i}: {_lit(attr)} "\\" index=\\"" INDEX "\\"" {s} {o} '
                     f'"json type=\\"object\\"" {s} args_{i} {c} "json" {s} {c} "call" {s}')
        # a tool's schema is held to every keyword only when it says `strict: true`
        # (OpenAI's flag); otherwise keywords llguidance lacks are ignored, not refused
        strict = (tool.get("function", tool) if isinstance(tool, Mapping) else {}).get("strict") is True
        rules.append(f"args_{i}: {_json_rule(params, strict=strict)}")
        alts.append(f"call_{i}")
    rules.append(f'call: {o} "call tool=\\"" ({" | ".join(alts)})')
    rules.append(f'calls: call{"+" if parallel else ""} {c} "tools" {s} {c} "message" {s}')
    rules.append('INDEX: /[1-9][0-9]{0,2}/')
    return rules


def build_constraint(tok, prompt_ids: Sequence[int], *, response_format: Any = None,
                     tools: Optional[Sequence[Mapping]] = None, tool_choice: Any = None,
                     think_budget: Optional[int] = None, parallel: bool = True,
                     limits: Optional["SchemaLimits"] = None) -> Optional[Constraint]:
    """The grammar a request asks for, or None when it asks for nothing to enforce.

    Args:
        tok: our `KimiTokenizer`.
        prompt_ids: the prompt (to see whether it leaves the model inside its thinking).
        response_format: OpenAI's `{"type": "json_object"}` or `{"type": "json_schema",
            "json_schema": {"schema": ..., "strict": bool}}` ("text"/None: nothing).
        tools: the request's tools (OpenAI `{"type": "function", "function": {name,
            parameters}}`, or Anthropic `{name, input_schema}`).
        tool_choice: `tool_choice_of`'s form (None/"auto", "none", "required",
            ("named", NAME)).
        think_budget: reasoning tokens allowed before the constraint closes the think
            block itself (None: the model closes it when it will).
        parallel: False allows one call per tools section (OpenAI
            `parallel_tool_calls: false`, Anthropic `disable_parallel_tool_use`).
        limits: the schema size and compile time bounds (`SchemaLimits()` when None).
    Raises:
        InputError: param "response_format" or "tools[i]" (i: the tool's index in
            `tools` as given) when the schema is over `limits.max_bytes`, cannot be
            compiled or admits no value (the message names the construct llguidance
            refused, never its parser state or the grammar), or did not compile within
            `limits.timeout_s`; "tool_choice" when it names a tool that is not in
            `tools`. With tools and nothing forced, a tool schema that llguidance
            refuses is no error: the calls are then left unconstrained (None, logged),
            as before; a size or time limit is refused all the same.
        GrammarBusy: every compile thread is still busy with earlier time-outs.
    """
    limits = limits or SchemaLimits()
    given = list(tools or ())
    tools = [t for t in given if isinstance(_tool_schema(t)[0], str)]
    kind = (response_format or {}).get("type") if isinstance(response_format, Mapping) else None
    named = tool_choice[1] if isinstance(tool_choice, tuple) else None
    if named is not None and named not in [_tool_schema(t)[0] for t in tools]:
        raise InputError(f"tool_choice names the function {named!r}, which is not in tools "
                         f"({', '.join(repr(_tool_schema(t)[0]) for t in tools) or 'none given'})",
                         "tool_choice")
    forced = bool(tools) and (tool_choice == "required" or named is not None)
    use_tools = bool(tools) and tool_choice != "none"
    o, c, s = _tok(tok, OPEN), _tok(tok, CLOSE), _tok(tok, SEP)
    rules = []
    if forced:
        rules = [f'start: {o} "tools" {s} calls'] + _calls_grammar(tok, tools, named, parallel)
        trigger, param = "think_end", "tools"
    elif kind in ("json_object", "json_schema"):
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            schema = schema if schema is not None else {"type": "object"}
            strict = bool(spec.get("strict")) if isinstance(spec, Mapping) else False
        else:
            schema, strict = {"type": "object"}, True
        if not isinstance(schema, (Mapping, bool)):
            raise InputError("response_format.json_schema.schema must be a JSON schema object",
                             "response_format")
        resp = (f'response: {o} "response" {s} value {c} "response" {s}\n'
                f"value: {_json_rule(schema, strict)}")
        if use_tools:
            rules = [f'start: response {c} "message" {s} | {o} "tools" {s} calls', resp] \
                + _calls_grammar(tok, tools, None, parallel)
        else:
            rules = [f'start: response {c} "message" {s}', resp]
        trigger, param = "think_end", "response_format"
    elif use_tools:
        rules = ["start: calls"] + _calls_grammar(tok, tools, None, parallel)
        trigger, param = "tools", "tools"
    else:
        return None
    grammar = "\n".join(rules)
    ll = grammar_tokenizer(tok)
    try:
        rules = _rules(_checks(response_format, given, tool_choice), limits)
        if _digest(rules) not in _PASSED:  # `check_schemas` has not compiled them yet
            _timed(lambda at: _check_each(rules, at, ll), rules, limits)
        matcher = _timed(lambda at: _whole(grammar, ll, at), rules, limits)
    except _Refused as e:
        if trigger == "tools" and e.content:  # nothing was forced: runs as it did before
            log.warning("tool schemas cannot be enforced (%s); tool calls are not constrained", e)
            return None
        raise InputError(str(e), e.param) from None
    thinking = _leaves_thinking(tok, prompt_ids)
    if trigger == "think_end" and not thinking:
        trigger = "now"  # the prompt left the think block (no thinking)
    field = "response_format" if param == "response_format" else "tool_choice"
    end = tok.special_tokens.get(END_OF_MSG, tok.eos_token_id)
    return Constraint(grammar, trigger, ll, tok.decode_bytes, tok.special_tokens[SEP], field,
                      think_budget if thinking else None,
                      tuple(tok.encode(THINK_END, allow_special=True)),
                      matcher, () if end is None else (end,))


def _leaves_thinking(tok, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside an open think block (`<|open|>think<|sep|>`)."""
    return tok.decode_bytes(list(prompt_ids[-8:])).endswith(THINK_START.encode())


def think_budget_constraint(tok, prompt_ids: Sequence[int], think_budget: Optional[int],
                            field: str = "thinking_budget") -> Optional[Constraint]:
    """A thinking budget alone, for a request with no grammar: its processor lets the
    model think `think_budget` tokens, then forces `<|close|>think<|sep|>` (K3.1's end of
    thinking, `chat_format.THINK_END`) one token at a time, and constrains nothing after
    it. None when there is no budget or the prompt does not leave the model thinking.
    No llguidance work: the processor only counts tokens and masks to the forced id."""
    if think_budget is None or not _leaves_thinking(tok, prompt_ids):
        return None
    return Constraint("", "think_end", None, tok.decode_bytes, tok.special_tokens[SEP], field,
                      think_budget, tuple(tok.encode(THINK_END, allow_special=True)))


# ------------------------------------------------------------------ admission compile

COMPILE_THREADS = 1  # schema compiles at once (one core left to decoding); a timed-out one holds it till done
# compiles run at a lower CPU priority than decoding (`generation.background`)
_POOL = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kimi-mlx-grammar",
                           initializer=lower_thread_priority)
_MEMO_MAX = 256
_REFUSED: "OrderedDict[str, _Refused]" = OrderedDict()  # rules digest -> time-out refusal
_PASSED: "OrderedDict[str, bool]" = OrderedDict()  # rules digests whose schemas each compiled


@dataclass(frozen=True)
class SchemaLimits:
    """Bounds on what one request's schemas may cost at admission.

    max_bytes: a schema's size as compact JSON (bytes, ASCII escapes), each schema on its
    own (`response_format`'s, each tool's parameters): larger is refused before any
    compiling (`--max-schema-bytes`). timeout_s: wall seconds for compiling a request's
    schemas, and again for its whole grammar (`--schema-timeout`); llguidance's cost
    grows faster than size (10,000 optional properties, 330 KB, take ~14 s on micro's
    4,352 tokens), so size alone does not bound it."""

    max_bytes: int = 256 << 10
    timeout_s: float = 5.0


class GrammarBusy(RuntimeError):
    """Every compile thread is held by earlier schemas that ran past their time-out: the
    request did not start compiling within its own time-out (a 503, retry later)."""


class _Refused(Exception):
    def __init__(self, message: str, param: str, content: bool):
        super().__init__(message)
        self.param, self.content = param, content  # content: llguidance refused the schema


def _checks(response_format: Any, tools: Sequence[Mapping], tool_choice: Any) -> list:
    """(param, schema, strict) of each schema a request's grammar enforces:
    response_format's (unless a tool call is forced), then each tool's parameters (only
    the named tool's when one is named), param "tools[i]" by the tool's index in `tools`
    as given."""
    named = tool_choice[1] if isinstance(tool_choice, tuple) else None
    usable = [t for t in tools if isinstance(_tool_schema(t)[0], str)]
    forced = bool(usable) and (tool_choice == "required" or named is not None)
    out = []
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind in ("json_object", "json_schema") and not forced:
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            spec = spec if isinstance(spec, Mapping) else {}
            schema = spec.get("schema") if spec.get("schema") is not None else {"type": "object"}
            out.append(("response_format", schema, bool(spec.get("strict"))))
        else:
            out.append(("response_format", {"type": "object"}, True))
    if usable and tool_choice != "none":
        for i, t in enumerate(tools):
            name, params = _tool_schema(t)
            if isinstance(name, str) and (not forced or named is None or name == named):
                fn = t.get("function", t) if isinstance(t, Mapping) else {}
                out.append((f"tools[{i}]", params, fn.get("strict") is True))
    return out


def check_schemas(tok, response_format: Any = None, tools: Optional[Sequence[Mapping]] = None,
                  tool_choice: Any = None, limits: Optional[SchemaLimits] = None) -> None:
    """Admission before a request's prompt is built (the prompt carries its schemas as
    text, which takes seconds to tokenize for a large one): each schema's size against
    `limits.max_bytes`, then each compiled on its own within `limits.timeout_s` (what
    passes is remembered, so `build_constraint` does not compile it twice).

    Args: tok: our `KimiTokenizer`; the rest as `build_constraint` (`tool_choice` in
    `tool_choice_of`'s form). Raises InputError naming `response_format` or `tools[i]`
    as `build_constraint` does (a tool on auto that llguidance refuses is no error);
    GrammarBusy when no compile thread came free in time."""
    limits = limits or SchemaLimits()
    checks = _checks(response_format, list(tools or ()), tool_choice)
    if not checks:
        return
    try:
        rules = _rules(checks, limits)
        _timed(lambda at: _check_each(rules, at, grammar_tokenizer(tok)), rules, limits)
    except _Refused as e:
        kind = response_format.get("type") if isinstance(response_format, Mapping) else None
        forced = tool_choice == "required" or isinstance(tool_choice, tuple)
        if not e.content or forced or kind in ("json_object", "json_schema"):
            raise InputError(str(e), e.param) from None


def _rules(checks, limits: SchemaLimits) -> list:
    """(param, JSON rule) of each check, once its size passed `limits.max_bytes`."""
    for param, schema, _ in checks:
        if _json_size(schema, limits.max_bytes) > limits.max_bytes:
            raise _Refused(f"{param}: the schema is over this server's limit of "
                           f"{limits.max_bytes} bytes (--max-schema-bytes)", param, False)
    return [(param, _json_rule(schema, strict)) for param, schema, strict in checks]


def _remember(memo: OrderedDict, key: str, value) -> None:
    with _LOCK:
        memo[key] = value
        memo.move_to_end(key)
        while len(memo) > _MEMO_MAX:
            memo.popitem(last=False)


def _check_one(ll, rule: str) -> Optional[str]:
    """llguidance's error for one schema rule compiled on its own and its first mask
    computed (each definition's too), or None when every one can start a value."""
    for root in _roots(rule):
        m = _matcher(ll, "start: " + root)
        if not m.is_error():
            m.compute_bitmask()
        if m.is_error():
            return m.get_error()
    return None


def _check_each(rules, at, ll):
    """Each schema rule through `_check_one`: a `_Refused` naming the first that
    llguidance refuses, else None (the rules' digest remembered as passed)."""
    for param, rule in rules:
        at["param"] = param
        err = _check_one(ll, rule)
        if err is not None:
            return _Refused(f"{param}: the schema cannot be enforced by constrained "
                            f"decoding: {_why(err)}", param, True)
    _remember(_PASSED, _digest(rules), True)
    return None


def _whole(grammar: str, ll, at):
    """The whole grammar's matcher in its start state, or a `_Refused`."""
    m = _matcher(ll, grammar)
    if m.is_error():
        return _Refused(f"{at['param']}: the schemas cannot be enforced by constrained "
                        f"decoding: {_why(m.get_error())}", at["param"], True)
    return m


def _timed(work, rules, limits: SchemaLimits):
    """`work(at)` on a compile thread within `limits.timeout_s` (at["param"]: the schema
    being compiled); its result, raised when a `_Refused`. At the time-out: a `_Refused`
    naming that param (remembered: the same rules are then refused at once; the compile
    runs on to its end on its thread, without the GIL), or `GrammarBusy` when no compile
    thread came free."""
    import time

    digest = _digest(rules)
    with _LOCK:
        hit = _REFUSED.get(digest)
    if hit is not None:
        raise _Refused(str(hit), hit.param, hit.content)
    at = {"param": rules[0][0] if rules else "response_format", "started": False}

    def run():
        at["started"] = True
        return work(at)

    t0 = time.perf_counter()
    fut = _POOL.submit(run)
    try:
        out = fut.result(timeout=limits.timeout_s)
    except FutureTimeout:
        if fut.cancel() or not at["started"]:
            raise GrammarBusy(f"no grammar compile thread came free within {limits.timeout_s:g} s "
                              "(earlier schemas still compiling); retry later") from None
        refused = _Refused(f"{at['param']}: the schema did not compile within "
                           f"{limits.timeout_s:g} s (--schema-timeout); simplify it (fewer "
                           "optional properties, alternatives or definitions)", at["param"], False)
        _remember(_REFUSED, digest, refused)
        log.warning("a schema compile ran past %.1f s and was refused", time.perf_counter() - t0)
        raise refused from None
    if isinstance(out, _Refused):
        raise out
    return out
