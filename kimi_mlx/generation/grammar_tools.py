"""llguidance helpers that the structured-output admission check and the grammar
processors of `generation.constrain` share: matchers whose errors carry no parser
internals, an error's client-facing reason, a schema's size as compact JSON counted up to
a cap, its `$defs` entries as roots of their own, and the digest that keys what has been
compiled. Nothing here holds state.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

__all__ = ["first_line", "json_size", "matcher", "parser_limits", "reason", "rules_digest",
           "schema_roots"]


def json_size(obj: Any, cap: int) -> int:
    """Bytes of `obj` as compact JSON (ASCII escapes), counted only until past `cap` (a
    5 MB schema is found over the limit after its first `cap` bytes)."""
    n, stack = 0, [obj]
    while stack and n <= cap:
        v = stack.pop()
        if isinstance(v, Mapping):
            n += 1 + 2 * max(len(v), 1)
            for k, x in v.items():
                n += len(json.dumps(str(k)))
                stack.append(x)
                if n > cap:
                    break
        elif isinstance(v, (list, tuple)):
            n += 1 + max(len(v), 1)
            stack.extend(v)
        else:
            n += len(json.dumps(v))
    return n


def rules_digest(rules) -> str:
    """sha256 hex of a request's (param, JSON rule) list: the key of what passed or timed out."""
    return hashlib.sha256(json.dumps(list(rules)).encode()).hexdigest()


def first_line(err: str) -> str:
    """The first non-empty line of an llguidance error ("unknown error" for none)."""
    return (err or "").strip().splitlines()[0] if (err or "").strip() else "unknown error"


def parser_limits():
    """llguidance parser limits whose errors omit the parser state and the grammar."""
    import llguidance

    # verbose_errors False: errors say what failed, not the parser state and the grammar
    return llguidance.LLParserLimits(verbose_errors=False)


def matcher(ll, grammar: str):
    """An `llguidance.LLMatcher` of `grammar` (Lark text) over the `LLTokenizer` `ll`,
    quiet and with `parser_limits`; check `is_error()` before use."""
    import llguidance

    return llguidance.LLMatcher(ll, grammar, log_level=0, limits=parser_limits())


def reason(err: str) -> str:
    """llguidance's error as a reason a client can act on (its first line, without the
    grammar position); "NoExtensionBias" (no token can start a value) in words."""
    why = first_line(err).split("failed to compile JSON schema: ", 1)[-1]
    if why.startswith("NoExtensionBias"):
        return ("no JSON value satisfies it (for instance `$ref`s that only refer to each "
                "other)")
    return why


def schema_roots(rule: str) -> list:
    """A schema's JSON rule, then one per `$defs` / `definitions` entry made the root (a
    definition no value satisfies is found only when decoding reaches it otherwise)."""
    body = json.loads(rule[len("%json "):])
    out = [rule]
    if isinstance(body, dict):
        for key in ("$defs", "definitions"):
            defs = body.get(key)
            if isinstance(defs, dict):
                for name in defs:
                    ref = f"#/{key}/" + name.replace("~", "~0").replace("/", "~1")
                    out.append("%json " + json.dumps({key: defs, "$ref": ref,
                                                      "x-guidance": body.get("x-guidance")}))
    return out
