"""`cluster launch` through the pipeline: the tokens of one generation (plain or
speculative steps) and, with --replan, a new placement when a stage is lost; and the one
error line a failed launch ends with."""

from __future__ import annotations

import sys
from typing import List, Optional

from kimi_mlx.cluster.head.cluster import Cluster
from kimi_mlx.cluster.head.transport import StageFailure


def failure_text(e, replan: bool) -> str:
    """A StageFailure as one line: the stage and node (named once, by the transport) and
    what to do next: restart the lost node's `cluster serve`, or --replan when not given."""
    nodes = ", ".join(dict.fromkeys(e.node_ids)) or "the node"
    if not e.lost:
        return f"{e}; the node's `kimi-mlx cluster serve` log says more"
    step = f"restart `kimi-mlx cluster serve` on {nodes}"
    return f"{e}; {step}" + ("" if replan else ", or pass --replan to carry on over the nodes left")


def launch_failure(e: BaseException, replan: bool):
    """The one error line for a failed launch: a plan's reasons one per line, a lost stage
    with what to do next (`failure_text`), anything else as it says."""
    from kimi_mlx.placement.planner import PlanError

    if isinstance(e, PlanError):
        return str(e).replace("; ", "\n  ")
    return failure_text(e, replan) if isinstance(e, StageFailure) else e


class LaunchRun:
    """The tokens of one `cluster launch` generation through the pipeline: plain or
    speculative steps, and with --replan (`NodeSettings.replan` of the `Cluster`'s finder) a new
    placement (from the tokens generated so far) when a stage is lost. `failure` holds
    the error that ended it early.

    Args:
        cluster: the connected `Cluster`. pipeline: its `Pipeline`.
        ids: prompt token ids. sampling: the stages' `Sampling`. max_tokens: to generate.
        speculation: a `speculative.loop.Speculation` (draft on this head) or None.
        margs: the target's ModelArgs (speculative steps). media: (pad id, image rows)
            for `Pipeline.generate`, or None. seed: seeds this head's random draws
            (draft, acceptance) before a speculative run.
    """

    def __init__(self, cluster: Cluster, pipeline, ids: List[int], sampling, max_tokens: int,
                 speculation=None, margs=None, media=None, seed: Optional[int] = None):
        self.cluster, self.pipeline, self.ids = cluster, pipeline, ids
        self.sampling, self.max_tokens = sampling, max_tokens
        self.speculation, self.margs, self.media, self.seed = speculation, margs, media, seed
        self.replan = cluster.finder.settings.replan
        self.failure: Optional[BaseException] = None

    def step(self, prompt_ids: List[int], max_tokens: int):
        """(token, logprobs, from_draft) from the pipeline, plain or speculative."""
        speculation = self.speculation
        if speculation is None:
            extra = {} if self.media is None else {"media": self.media}
            return ((t, lp, False) for t, lp in
                    self.pipeline.generate(prompt_ids, self.sampling, max_tokens, **extra))
        from kimi_mlx.cluster.head.speculative import speculative_pipeline_step

        if self.seed is not None:  # the head draws every random number (draft, acceptance)
            import mlx.core as mx

            mx.random.seed(self.seed)
        return speculative_pipeline_step(self.pipeline, prompt_ids, speculation.draft,
                                         self.margs, **speculation.kwargs(),
                                         max_tokens=max_tokens)

    def tokens(self):
        """Yields (token, logprobs, from_draft) until done, or until a stage is lost
        (without --replan, or when no placement is left: `failure` says why)."""
        ids = self.ids
        generated: List[int] = []
        while True:
            try:
                for tok_id, lp, from_draft in self.step(ids + generated,
                                                        self.max_tokens - len(generated)):
                    generated.append(tok_id)
                    yield tok_id, lp, from_draft
                return
            except StageFailure as e:
                if not self._replan(e):
                    return

    def _replan(self, e) -> bool:
        """After a lost stage: free the sessions, and with --replan place the model again
        over the nodes left. False when the generation ends here."""
        from kimi_mlx.placement.planner import PlanError

        cluster = self.cluster
        left = cluster.transport.abort()
        print(file=sys.stderr)  # ends the streamed text's line
        if self.replan:  # otherwise the final error says it, once
            print(f"[cluster] {e}", file=sys.stderr)
        print("[cluster] freed the session on: " + ", ".join(
            f"{n} ({'unreachable' if k < 0 else f'{k} sessions left'})"
            for n, k in sorted(left.items())), file=sys.stderr)
        if not self.replan:
            self.failure = e
            return False
        excluded = cluster.finder.excluded
        excluded |= set(e.node_ids)
        cluster.transport.shutdown()
        print(f"[cluster] replanning without {', '.join(sorted(excluded))}",
              file=sys.stderr)
        try:
            self.pipeline = cluster.connect()
        except (PlanError, StageFailure, RuntimeError, ValueError) as e2:
            self.failure = e2
            return False
        return True
