"""(tests, bench) One rank of a tensor group running batched rows (`cluster.tensor.rows`):
rank 0 decodes several prompts greedily with mlx-lm's `BatchGenerator` over `GroupRows`
(the first `--at-once` inserted together, each later one joining after `--join-after`
more decode steps), then one at a time (each prompt its own B = 1 run); the other ranks
follow the commands (`tensor.step.follow_commands`). Rank 0 writes
{"batched": [[tokens]...], "single": [[tokens]...], "batched_s": s, "single_s": s,
"live_handles": caches left on rank 0 after the rows ended, "accepted" / "verify_steps":
the batched n-gram drafts' figures with --ngram} as JSON to --out.

Run with `testing.tensor_parallel.run_ranks(ports, args, workdir,
module="kimi_mlx.testing.tensor_rows")`.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import List, Optional, Sequence

import mlx.core as mx


def batched_greedy(rows, prompts: Sequence[Sequence[int]], max_tokens: int, at_once: int,
                   join_after: int, prefill_step: int = 512, drafts=None) -> List[List[int]]:
    """Greedy tokens of each prompt through `rows` (a `GroupRows`, or any model), batched:
    the first `at_once` inserted together, then one more every `join_after` decode steps.
    `drafts`: a `speculative.batch.BatchDrafts` (n-gram drafts verified in the batch)."""
    from mlx_lm.generate import BatchGenerator

    from kimi_mlx.sampling import Sampling

    n = len(prompts)
    gen = BatchGenerator(rows, max_tokens=max_tokens, completion_batch_size=max(n, 1),
                         prefill_batch_size=max(n, 1), prefill_step_size=prefill_step)
    if drafts is not None:
        from kimi_mlx.speculative.batch import install

        install(gen, drafts)

    def insert(ps):
        uids = gen.insert([list(p) for p in ps], caches=[rows.make_cache() for _ in ps])
        for u, p in zip(uids, ps):
            if drafts is not None:
                drafts.add(u, p, Sampling())
        return uids

    order = insert(prompts[:at_once])
    waiting = list(prompts[at_once:])
    out = {}
    steps = 0
    while len([u for u in out if len(out[u]) >= max_tokens]) < n:
        _, responses = gen.next()
        steps += 1
        for r in responses:
            out.setdefault(r.uid, []).append(int(r.token))
        if waiting and steps % max(join_after, 1) == 0:
            order += insert([waiting.pop(0)])
        if steps > 100 * (max_tokens + 1) * n:
            raise RuntimeError("batched rows did not finish")
    del gen, responses
    gc.collect()
    return [out[u] for u in order]


def main(argv: Optional[Sequence[str]] = None) -> None:
    from kimi_mlx.cluster.tensor.rows import GroupRows
    from kimi_mlx.cluster.tensor.step import OP_EXIT, command, follow_commands
    from kimi_mlx.testing.tensor_parallel import load_tensor_parallel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token id lists")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--at-once", type=int, default=0, help="inserted together (default all)")
    p.add_argument("--join-after", type=int, default=3)
    p.add_argument("--ngram", type=int, default=0,
                   help="n-gram drafts of up to this many tokens verified in the batch "
                        "(`speculative.batch`; 0: none)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    group = mx.distributed.init(backend="ring", strict=True)
    model, _ = load_tensor_parallel(a.model, group)
    if group.rank() != 0:
        follow_commands(model, group)
        return
    prompts = json.loads(a.prompts)
    rows = GroupRows(model, group)
    drafts = None
    if a.ngram:
        from kimi_mlx.speculative.batch import BatchDrafts
        from kimi_mlx.speculative.ngram import NgramDraft

        drafts = BatchDrafts(NgramDraft(), a.ngram)
    t0 = time.perf_counter()
    batched = batched_greedy(rows, prompts, a.max_tokens, a.at_once or len(prompts),
                             a.join_after, drafts=drafts)
    t1 = time.perf_counter()
    single = [batched_greedy(rows, [pr], a.max_tokens, 1, 1)[0] for pr in prompts]
    t2 = time.perf_counter()
    rows.new_row()  # flushes the frees of the rows that ended
    live = len(rows._local.caches) - 1
    command(group, OP_EXIT)
    with open(a.out, "w") as f:
        json.dump({"batched": batched, "single": single, "batched_s": t1 - t0,
                   "single_s": t2 - t1, "live_handles": live,
                   "accepted": drafts.stats.accepted if drafts is not None else 0,
                   "verify_steps": drafts.stats.steps if drafts is not None else 0}, f)


if __name__ == "__main__":
    main()
