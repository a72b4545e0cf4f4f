"""`kimi-mlx bench spec`, pipeline rows: plain vs speculative decoding through 3 stages.

Three `kimi-mlx cluster serve` processes on loopback hold the target's layers (each with
one BLAS thread: each stands for one Mac); the head, this process, runs the draft. For
each k it times greedy generation of the same prompts through the same loaded stages,
plain (`Pipeline.generate`: one round trip through every stage per token) and
speculative (`cluster.head.speculative`: one round trip per verify step of up to k + 1
tokens), alternating, and reports medians over repeats with the ratio. Tokens/s counts
generated tokens over the generation wall time (prefill excluded on both sides), as the
one-process rows do.

On a machine with fewer cores than stages + head the absolute figures are bounded by
the cores; both sides share that bound, so the ratio is what to read.

Stopping it (SIGINT, SIGTERM, SIGHUP) stops the stage processes and removes their
temporary folder before it exits (`cluster.net.lifetime.exit_on_signals`); killed
outright, its stages end themselves (they watch this process, `watch_parent_from_env`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

STAGE_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _timed(tokens: Iterator) -> Tuple[float, int]:
    """(seconds from the first token to the last, tokens after the first)."""
    it = iter(tokens)
    next(it)
    t0 = time.perf_counter()
    n = sum(1 for _ in it)
    return time.perf_counter() - t0, n


def _median_tps(runs: Dict[str, Callable[[List[int]], Iterator]], prompts: List[List[int]],
                repeats: int) -> Dict[str, float]:
    """Median over repeats of tokens/s per named generator factory; within a repeat the
    factories alternate prompt by prompt, so a burst of load hits all alike."""
    per: Dict[str, List[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        secs = {name: 0.0 for name in runs}
        toks = {name: 0 for name in runs}
        for p in prompts:
            for name, make in runs.items():
                dt, n = _timed(make(p))
                secs[name] += dt
                toks[name] += n
        for name in runs:
            per[name].append(toks[name] / max(secs[name], 1e-9))
    return {name: statistics.median(v) for name, v in per.items()}


def bench_rows(pipe, draft, model_args, prompts: List[List[int]], tokens: int,
               ks: List[int], repeats: int) -> List[Dict]:
    """Rows {k, mean_accepted, plain_tps, spec_tps, speedup} through a loaded `Pipeline`
    (greedy; one warm-up generation of each kind first)."""
    from kimi_mlx.speculative.loop import SpecStats

    from kimi_mlx.sampling import Sampling
    from kimi_mlx.cluster.head.speculative import speculative_pipeline_step

    def plain(p):
        return pipe.generate(p, Sampling(), tokens)

    def spec(k, stats):
        return lambda p: speculative_pipeline_step(
            pipe, p, draft, model_args, num_draft_tokens=k, max_tokens=tokens, stats=stats)

    from kimi_mlx.bench.spec import loop_prompt

    _median_tps({"plain": plain, "spec": spec(max(ks), SpecStats())}, prompts[:1], 1)
    for k in ks:  # every k's verify shape, also for a draft that may propose nothing
        _median_tps({"spec": spec(k, SpecStats())}, [loop_prompt(prompts[0])], 1)
    rows = []
    for k in ks:
        stats = SpecStats()
        tps = _median_tps({"plain": plain, "spec": spec(k, stats)}, prompts, repeats)
        rows.append(dict(k=k, mean_accepted=stats.mean_accepted, plain_steps=stats.plain,
                         verify_steps=stats.steps, plain_tps=tps["plain"],
                         tokens_per_pass=stats.emitted / max(stats.steps + stats.plain, 1),
                         spec_tps=tps["spec"], speedup=tps["spec"] / tps["plain"]))
    return rows


def bench_pipeline(ckpt: Path, draft, model_args, prompts: List[List[int]], tokens: int,
                   ks: List[int], repeats: int, stages: int = 3) -> List[Dict]:
    """`bench_rows` through `stages` loopback stage processes serving `ckpt` (float32
    activations and wire), started and stopped here.

    Raises:
        RuntimeError: a stage did not start or was not usable; StageFailure: lost.
    """
    return bench_pipeline_jobs(ckpt, model_args, [("", draft, prompts, ks, tokens)], tokens,
                               repeats, stages)[0]


def bench_pipeline_jobs(ckpt: Path, model_args, jobs: List[Tuple], tokens: int, repeats: int,
                        stages: int = 3) -> List[List[Dict]]:
    """`bench_rows` for each job (label, draft, prompts, ks[, tokens: default `tokens`])
    through the same `stages` loopback stage processes serving `ckpt`, started and
    stopped here; rows per job.

    Raises:
        RuntimeError: a stage did not start or was not usable; StageFailure: lost.
    """
    from kimi_mlx.cluster.net.lifetime import exit_on_signals

    restore = exit_on_signals()  # SIGTERM / SIGHUP: the `finally`s below run (`Stopped`)
    try:
        return _jobs_through_stages(ckpt, model_args, jobs, tokens, repeats, stages)
    finally:
        restore()


def _jobs_through_stages(ckpt, model_args, jobs, tokens, repeats, stages):
    from kimi_mlx.cluster.head.pipeline import Pipeline
    from kimi_mlx.cluster.net.nodes import check_nodes
    from kimi_mlx.cluster.head.plan import plan_stages
    from kimi_mlx.testing.cluster import LocalCluster
    from kimi_mlx.cluster.head.transport import GrpcTransport

    with tempfile.TemporaryDirectory(prefix="kimi-mlx-spec-bench-") as tmp:
        cluster = LocalCluster(Path(tmp), stages, prefix="specbench", ckpt=ckpt, env=STAGE_ENV)
        t = GrpcTransport(cluster.secret, peer_timeout=30)
        try:
            accepted, rejected = check_nodes(cluster.nodes(), t.stub_for, cluster.fp)
            if rejected:
                raise RuntimeError("; ".join(f"{r.node_id}: {r.reason}" for r in rejected))
            jobs = [tuple(j) + (tokens,) * (5 - len(j)) for j in jobs]
            need = max(len(p) + n + max(ks) + 1 for _, _, ps, ks, n in jobs for p in ps)
            _, assignments = plan_stages(ckpt, [n for n, _ in accepted], need)
            t.load(cluster.fp, assignments, "float32", "float32")
            return [bench_rows(Pipeline(t), draft, model_args, prompts, n, ks, repeats)
                    for _, draft, prompts, ks, n in jobs]
        finally:
            t.shutdown()
            cluster.stop()


def print_rows(rows: List[Dict], stages: int, tokens: int, n_prompts: int,
               draft: str = "", workload: str = "") -> None:
    """The pipeline table, in the one-process table's columns."""
    from kimi_mlx.bench.spec import print_table

    what = f", draft {draft}, {workload} prompts" if draft else ""
    print_table(f"speculative decoding, {stages} stage processes on loopback (draft on the "
                f"head){what}\ngreedy, {n_prompts} prompts x {tokens} tokens, medians of "
                "interleaved repeats", rows, target=f"1.5x through {stages} stages")


def main(model, draft_spec, tokens: int, ks: List[int], repeats: int, n_prompts: int,
         stages: int = 3, drafts: List[str] = ("model",), workloads: List[str] = ("ordinary",),
         ngram_ks: Optional[List[int]] = None, ngram: Optional[Tuple[int, int]] = None,
         copy_tokens: Optional[int] = None, block: Optional[str] = None) -> int:
    """Load the target's tokenizer/config and the drafts here, run every draft x workload
    through one set of stages (`bench_pipeline_jobs`), print. Returns the exit status
    (2: a draft is missing)."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.generation.generate import resolve_model_arg
    from kimi_mlx.bench.spec import load_drafts, workload_prompts

    spec = resolve_model_arg(model)
    from kimi_mlx.cluster.launch import tokenizers as _tokenizers

    wrapper, tok = _tokenizers(Path(spec))  # the head holds no target weights
    try:
        loaded = load_drafts(list(drafts), draft_spec, wrapper, spec, ngram, block=block)
        prompts = {w: workload_prompts(Path(spec), tok, w, n_prompts) for w in workloads}
    except ValueError as e:
        print(f"kimi-mlx bench spec: {e}")
        return 2
    from kimi_mlx.cluster.net.lifetime import Stopped

    args = ModelArgs.from_config(read_config(Path(spec)))
    jobs = [(f"{name}|{w}", d, ps, (ngram_ks or ks) if name.startswith("ngram") else ks,
             (copy_tokens or tokens) if w == "copy" else tokens)
            for name, d in loaded.items() for w, ps in prompts.items()]
    try:
        results = bench_pipeline_jobs(Path(spec), args, jobs, tokens, repeats, stages)
    except Stopped as e:  # its stages are stopped and their folder removed by now
        print(f"kimi-mlx bench spec: stopped ({e})", flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("kimi-mlx bench spec: stopped (SIGINT)", flush=True)
        return 130
    for (label, _, ps, _, n), rows in zip(jobs, results):
        name, w = label.split("|")
        print_rows(rows, stages, n, len(ps), name, w)
        print()
    return 0
