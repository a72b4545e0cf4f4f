"""Thinking budgets for every API request, constrained or not.

A request's budget is its own (`thinking_budget` on chat completions and Responses,
Anthropic's `thinking.budget_tokens`, 0 for Anthropic's `thinking: {"type":
"disabled"}`), else the server's `--thinking-budget` (`Service.default_thinking_budget`),
else none. A budget is then lowered so that the reply keeps room for its answer after
the thinking: at least min(max_tokens // 2, `ANSWER_ROOM`) of the job's `max_tokens`
(`common.budget`) are left.

The budget is held by a logits processor on the head: the structured-output grammar's
(`generation.constrain.GrammarProcessor`, whose `Constraint.think_budget` it is) when
the request has one, else a budget-only `Constraint` (`constrain.think_budget_constraint`).
Both let the model think that many tokens, then force K3.1's end of thinking
(`<|close|>think<|sep|>`, `chat_format.THINK_END`), after which the model answers. Every
deployment applies it where it applies a grammar (one process, batched, the pipeline
head, the tensor group's rank 0).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from kimi_mlx.generation.constrain import think_budget_constraint
from kimi_mlx.sampling import Sampling

__all__ = ["ANSWER_ROOM", "think_budget", "with_think_budget"]

# tokens of a reply's max_tokens kept for the answer after a budgeted thinking (or half
# of max_tokens when that is less)
ANSWER_ROOM = 1024


def think_budget(svc, requested: Optional[int], max_tokens: int) -> Optional[int]:
    """The reasoning tokens a job may think before its thinking is closed, or None for
    no limit.

    Args:
        svc: the `common.Service` (its `default_thinking_budget`, --thinking-budget).
        requested: the request's own budget (None: it set none).
        max_tokens: the job's reply budget (tokens, >= 0).
    Returns:
        min(budget, max_tokens - min(max_tokens // 2, ANSWER_ROOM)), never below 0; None
        when neither the request nor the server sets a budget.
    """
    n = requested if requested is not None else getattr(svc, "default_thinking_budget", None)
    if n is None:
        return None
    return max(0, min(int(n), max_tokens - min(max_tokens // 2, ANSWER_ROOM)))


def with_think_budget(svc, sampling: Sampling, ids: Sequence[int],
                      budget: Optional[int], field: str = "thinking_budget") -> Sampling:
    """`sampling` holding the thinking budget `budget` (`think_budget`'s) of a prompt
    `ids`: unchanged when there is none, when the prompt does not leave the model
    thinking, or when a structured-output constraint already holds it (built with the
    same budget by `server.structured.constrained`); else with a budget-only
    constraint. `field`: the API field named if an engine refuses it."""
    if budget is None or sampling.constraint is not None:
        return sampling
    c = think_budget_constraint(svc.tok, ids, budget, field)
    return sampling if c is None else replace(sampling, constraint=c)
