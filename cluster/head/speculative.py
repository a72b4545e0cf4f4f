"""Speculative decoding through the pipeline: the head drafts, the stages verify.

The head runs the draft model; each verify step sends [y, d1..dk] through the stages as
ONE message per hop (`Activation.verify`). Every stage snapshots its caches and records
its KDA inputs before that forward (`kimi_mlx.speculative.rollback.begin_verify`) and keeps them
until the head says how many of the k + 1 positions were accepted; that count rides on
the next step's message (`Activation.keep`: no extra round trip), and each stage rolls
back exactly (`rollback` + `end_verify`) before running it. The last stage returns the
k + 1 rows of logits (float32), from which the head applies the acceptance rule.

The loop itself is the one-process one, `kimi_mlx.speculative.loop.speculative_generate_step`
(draft, acceptance rule `accept_drafts` at temperature > 0, mlx-lm's greedy rule at 0,
draft snapshots): here the target it drives is `head.pipeline.PipelineTarget`, a stand-in
model whose forward pass is a message through the stages and whose one "cache" is the
pipeline's position, trimmed (= the next message's `keep`, `net.session.RemoteSession`)
by the loop's own `rollback` call. So
greedy output is token for token the plain pipeline's (and one process's), and sampled
output keeps the target's distribution, by the same code in both places.

Block drafters (DFlash / DSpark, `kimi_mlx.speculative.block_loop`) run the same
way over `PipelineTarget.forward_capture`: prefill chunks and verify steps carry the
drafter's `target_layer_ids` (`Activation.capture_layers`); the stages that own those
layers add their hidden states to the message as it passes (`node.capture`), and the last
stage returns them with its answer (`Event.hidden`), for a prefill chunk too. Without a
block drafter no message asks, and nothing is captured or sent.

A stage lost mid-verify raises the transport's `StageFailure` out of the forward pass,
as for any other message (the launcher's existing stage-loss path reports it).
"""

from __future__ import annotations

from typing import Generator, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.cluster.head.pipeline import Pipeline, PipelineTarget
from kimi_mlx.cluster.net.session import generate, speculative_run
from kimi_mlx.sampling import DEFAULT_MAX_TOKENS
from kimi_mlx.speculative.settings import DEFAULT_NUM_DRAFT_TOKENS

__all__ = ["PipelineTarget", "speculative_pipeline_step"]  # PipelineTarget: head.pipeline


def speculative_pipeline_step(
    pipeline: Pipeline,
    prompt: Sequence[int],
    draft_model,
    model_args,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling=None,
    stats=None,
    session: Optional[str] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding through `pipeline`; yields (token, logprobs [V], from_draft)
    like `kimi_mlx.speculative.loop.speculative_generate_step`.

    Args:
        pipeline: a `Pipeline` over loaded stages (its prefill_chunk and step_timeout).
        prompt: token ids (at least one).
        draft_model: the draft, run here on the head (same tokenizer as the target), or
            an `NgramDraft` (prompt lookup on the head, `kimi_mlx.speculative.ngram`).
        model_args: the target checkpoint's `ModelArgs` (its vocab_size).
        num_draft_tokens: k (>= 1), or "auto" / an `AutoK` (k chosen as it runs,
            `kimi_mlx.speculative.auto_k`). max_tokens: tokens to yield (-1: no limit).
        sampling: `kimi_mlx.sampling.Sampling` (default greedy).
        stats: `SpecStats` to update.
        session: session id (default: a new one).
    Raises:
        StageFailure: a stage was lost or refused (also mid-verify); the session is
            cancelled (`net.session.generate`).
        ValueError: empty prompt, k < 1.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    # A draft with its own loop (`--draft ngram`: `NgramDraft.generate_step`) runs it over
    # the same session; its plain steps (no match) are 1-token verify messages. The
    # stages' own sampler is not used: every token comes from a verify step here.
    run = speculative_run(prompt, draft_model, num_draft_tokens=num_draft_tokens,
                          max_tokens=max_tokens, sampling=sampling, stats=stats,
                          prefill_step=pipeline.prefill_chunk)
    yield from generate(lambda: pipeline.open(len(prompt), record=True, args=model_args,
                                              session=session),
                        prompt, max_tokens, run=run)
