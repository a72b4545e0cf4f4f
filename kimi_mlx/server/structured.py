"""Structured output for the API handlers: a request's `response_format` / `tool_choice`
/ tools -> its `Sampling` with the grammar that enforces them
(`generation.constrain`), or a 400 naming the field and the construct that cannot be
enforced. Shared by the chat, Responses and Anthropic handlers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

from kimi_mlx.generation.constrain import GrammarBusy, build_constraint, check_schemas, tool_choice_of
from kimi_mlx.sampling import InputError, Sampling
from kimi_mlx.server.common import APIError

__all__ = ["check_request_schemas", "constrained", "prompt_tool_choice", "warm_grammar_tokenizer"]


def warm_grammar_tokenizer(tok) -> None:
    """Build llguidance's view of `tok` (`grammar_tokenizer`, seconds at K3.1's 163,840
    tokens) on a daemon thread, so the first structured request need not; a failure is
    only logged (the request that needs it then raises it as a 500 naming it)."""
    import logging
    import threading

    from kimi_mlx.generation.constrain import grammar_tokenizer

    def build():
        try:
            grammar_tokenizer(tok)
        except Exception as e:  # noqa: BLE001 - logged; a structured request retries it
            logging.getLogger(__name__).warning("grammar tokenizer: %s", e)

    threading.Thread(target=build, daemon=True, name="kimi-mlx-grammar-tokenizer").start()


def prompt_tool_choice(choice: Any) -> Any:
    """What the prompt encoder is told for a tool_choice (its `tool_choice` option: None,
    "required" or "none"): a named function or Anthropic's any / tool is "required"
    (the grammar then restricts the call to the named tool). APIError 400 for a form
    `tool_choice_of` does not know."""
    try:
        c = tool_choice_of(choice)
    except InputError as e:
        raise APIError(400, str(e), param=e.param) from None
    return "required" if isinstance(c, tuple) else (None if c == "auto" else c)


def _api_error(e: InputError, format_param: str) -> APIError:
    msg, param = str(e), e.param
    if param == "response_format" and format_param != param:
        param, msg = format_param, msg.replace("response_format", format_param, 1)
    return APIError(400, msg, param=param)


def check_request_schemas(svc, *, response_format: Any = None,
                          tools: Optional[Sequence[Mapping]] = None, tool_choice: Any = None,
                          format_param: str = "response_format") -> None:
    """Before the prompt is built (it carries the schemas as text): APIError 400 naming
    response_format (`format_param`) / tools[i] for a schema over the server's
    --max-schema-bytes, or one llguidance refuses or that compiles past --schema-timeout
    (each schema on its own; 503 when the compile threads are all busy). Nothing for a
    request without schemas; `constrained` then compiles the whole grammar."""
    if not (tools or response_format):
        return
    try:
        check_schemas(svc.tok, response_format, tools, tool_choice_of(tool_choice),
                      getattr(svc, "schema_limits", None))
    except InputError as e:
        raise _api_error(e, format_param) from None
    except GrammarBusy as e:
        raise APIError(503, str(e), "overloaded_error", headers={"Retry-After": "5"}) from None


def constrained(svc, sampling: Sampling, ids: Sequence[int], *, response_format: Any = None,
                tools: Optional[Sequence[Mapping]] = None, tool_choice: Any = None,
                think_budget: Optional[int] = None, parallel: Optional[bool] = None,
                format_param: str = "response_format") -> Sampling:
    """`sampling` with the request's structured-output constraint (unchanged when it asks
    for none); `think_budget`: reasoning tokens before the grammar closes the thinking
    itself (the request's `thinking_budget`, Anthropic's `thinking.budget_tokens`; None:
    unlimited); `parallel` False: one tool call per reply (`parallel_tool_calls`;
    Anthropic's `tool_choice.disable_parallel_tool_use` is read from `tool_choice`).
    The schemas are compiled here, within `svc.schema_limits` (a `SchemaLimits`; None:
    the defaults). `format_param`: the field the API calls `response_format` in its
    errors (the Responses API's "text.format"). APIError 400 naming response_format /
    tools[i] / tool_choice when a
    schema is too large, cannot be compiled, admits no value or compiles too slowly, or
    the named tool is not among the tools; 503 when the compile threads are all busy."""
    if isinstance(tool_choice, Mapping) and tool_choice.get("disable_parallel_tool_use") is True:
        parallel = False
    try:
        c = build_constraint(svc.tok, ids, response_format=response_format, tools=tools,
                             tool_choice=tool_choice_of(tool_choice), think_budget=think_budget,
                             parallel=parallel is not False,
                             limits=getattr(svc, "schema_limits", None))
    except InputError as e:
        raise _api_error(e, format_param) from None
    except GrammarBusy as e:
        raise APIError(503, str(e), "overloaded_error", headers={"Retry-After": "5"}) from None
    return sampling if c is None else replace(sampling, constraint=c)
