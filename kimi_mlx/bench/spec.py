"""`kimi-mlx bench spec`: speculative decoding against plain decoding, in one process.

Drafts: the draft model (`--draft-model`, default the shipped micro-draft), a block
drafter (`--block-draft`, DFlash / DSpark, default the shipped micro-dspark;
`kimi_mlx.speculative.block_loop`) and prompt lookup (`--draft ngram`,
`kimi_mlx.speculative.ngram`). Workloads: the ordinary prompts
(`default_prompts`: held-out code and prose) and a copy-heavy one (`copy_prompts`: a block
of source code followed by its first half again, to be continued).
For each draft, workload and k (drafts per verify step) it reports the mean accepted drafts per verify step
and the generation tokens/s of greedy speculative decoding next to plain greedy decoding
(mlx-lm's `generate_step`) of the same prompts, with the ratio. Plain and speculative runs
alternate, repeated, and each figure is the median over repeats: on a shared machine a
burst of load then hits both sides alike. Tokens/s counts generated tokens over the
generation wall time (the prompt's prefill excluded, for both sides). The ratio is the
median over repeats of each repeat's speculative/plain ratio: within a repeat the two
sides alternate prompt by prompt, so a change of machine load between repeats cancels
in the ratio (on a shared 2-core machine the load swings plain tokens/s by 1.5x
between repeats).

It also prints what the rollback costs at K3.1's size (one KDA layer: 96 heads x 128 x
128 float32 state): replay of m accepted tokens from the snapshot, against the memory
that keeping every per-step state of a k+1-token verify would write.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

REAL_KDA_HEADS, REAL_KDA_DIM, REAL_KDA_LAYERS = 96, 128, 69


def default_draft() -> Optional[Path]:
    path = Path(__file__).resolve().parents[1] / "assets" / "micro-draft"
    return path if (path / "config.json").exists() else None


def default_block_draft() -> Optional[Path]:
    """The shipped DSpark drafter of micro (`make micro-dspark`), when present."""
    path = Path(__file__).resolve().parents[1] / "assets" / "micro-dspark"
    return path if (path / "config.json").exists() else None


def default_prompts(model_dir: Path, tokenizer, n: int = 4, length: int = 32) -> List[List[int]]:
    """n prompts of `length` tokens from the checkpoint's held-out text (code and prose),
    or from a fixed sentence when it ships none."""
    texts = []
    for name in ("code", "prose"):
        f = Path(model_dir) / "heldout" / f"{name}.txt"
        if f.exists():
            texts.append(f.read_text(encoding="utf-8"))
    if not texts:
        texts = ["The quick brown fox jumps over the lazy dog. " * 40]
    prompts = []
    i = 0
    while len(prompts) < n:
        ids = tokenizer.encode(texts[i % len(texts)])
        start = (i // len(texts)) * 997 % max(1, len(ids) - length)
        prompts.append(ids[start : start + length])
        i += 1
    return prompts


def copy_texts(model_dir: Path, n: int = 2, lines: int = 24) -> List[str]:
    """n copy-heavy prompt texts: a block of `lines` lines of source code from the
    checkpoint's held-out code (for micro: Python standard library files, its training
    domain), a blank line, then the block's first half again, so the continuation is the
    rest of that second copy. Falls back to a repeated sentence without held-out code."""
    f = Path(model_dir) / "heldout" / "code.txt"
    text = f.read_text(encoding="utf-8") if f.exists() else "The quick brown fox jumps.\n" * 400
    all_lines = text.splitlines(keepends=True)
    out = []
    for i in range(n):
        start = (i * 997) % max(1, len(all_lines) - lines)
        block = all_lines[start : start + lines]
        out.append("".join(block) + "\n" + "".join(block[: lines // 2]))
    return out


def copy_prompts(model_dir: Path, tokenizer, n: int = 2, lines: int = 24) -> List[List[int]]:
    """`copy_texts`, tokenized."""
    return [tokenizer.encode(t) for t in copy_texts(model_dir, n, lines)]


def workload_prompts(model_dir: Path, tokenizer, workload: str, n: int) -> List[List[int]]:
    """`default_prompts` for "ordinary", `copy_prompts` for "copy" (ValueError otherwise)."""
    if workload == "ordinary":
        return default_prompts(model_dir, tokenizer, n)
    if workload == "copy":
        return copy_prompts(model_dir, tokenizer, n)
    raise ValueError(f"unknown workload {workload!r} (ordinary or copy)")


def loop_prompt(prompt: List[int]) -> List[int]:
    """The prompt's first 6 tokens, 4 times over (a warm-up prompt the n-gram draft
    matches from its first step)."""
    return prompt[:6] * 4


def _gen_time(fn) -> float:
    """Seconds from the first yielded token to the end (prefill excluded)."""
    it = fn()
    next(it)
    t0 = time.perf_counter()
    n = 1
    for _ in it:
        n += 1
    return (time.perf_counter() - t0), n - 1


def run_plain(model, prompt: List[int], tokens: int):
    from mlx_lm.generate import generate_step

    return _gen_time(lambda: generate_step(mx.array(prompt), model, max_tokens=tokens))


def run_spec(model, draft, prompt: List[int], tokens: int, k: int, stats):
    """Speculative generation with a draft model, or with a draft that brings its own loop
    (`NgramDraft.generate_step`)."""
    from kimi_mlx.speculative.loop import loop_for

    step = loop_for(draft)
    return _gen_time(lambda: step(
        prompt, model, draft, num_draft_tokens=k, max_tokens=tokens, stats=stats))


def bench(model, draft, prompts: List[List[int]], tokens: int, ks: List,
          repeats: int, log=None) -> List[Dict]:
    """Rows {k, mean_accepted, plain_tps, spec_tps (medians over repeats), speedup (median
    of the per-repeat ratios)}; k=0 is not a row. A k of "auto" / "auto:N" runs
    `--num-draft-tokens auto` (one `AutoK` for the row's prompts and repeats, as a server
    keeps one), its row also saying which k it settled on ("auto")."""
    from kimi_mlx.speculative.auto_k import AutoK, auto_cap
    from kimi_mlx.speculative.loop import SpecStats

    # warm up both paths (compilation of the decode graphs and of each k's draft chain,
    # first-call allocations): one-time costs, left out of both sides alike
    run_plain(model, prompts[0], 4)
    warm = sorted({j for k in ks for j in (range(1, auto_cap(k) + 1) if auto_cap(k) else [k])})
    for k in warm:
        run_spec(model, draft, prompts[0], 2 * k + 2, k, SpecStats())
        # and a prompt that repeats itself: an n-gram draft then proposes k tokens, so
        # the k + 1-token verify graphs are compiled here too, not inside a timed run
        run_spec(model, draft, loop_prompt(prompts[0]), 2 * k + 2, k, SpecStats())
    rows = []
    for k in ks:
        plain_tps, spec_tps, ratios, stats = [], [], [], SpecStats()
        policy = AutoK(auto_cap(k)) if auto_cap(k) else k
        for _ in range(repeats):
            tp = np_ = ts = ns = 0
            for p in prompts:
                dt, n = run_plain(model, p, tokens)
                tp, np_ = tp + dt, np_ + n
                dt, n = run_spec(model, draft, p, tokens, policy, stats)
                ts, ns = ts + dt, ns + n
            plain_tps.append(np_ / tp)
            spec_tps.append(ns / ts)
            ratios.append(spec_tps[-1] / plain_tps[-1])
        row = dict(k=k, mean_accepted=stats.mean_accepted, plain_steps=stats.plain,
                   verify_steps=stats.steps,
                   tokens_per_pass=stats.emitted / max(stats.steps + stats.plain, 1),
                   plain_tps=statistics.median(plain_tps), spec_tps=statistics.median(spec_tps),
                   speedup=statistics.median(ratios))
        if isinstance(policy, AutoK):
            row["auto"] = policy.describe()
        rows.append(row)
        if log:
            log(row)
    return rows


def rollback_cost(max_m: int = 6, repeats: int = 5) -> Dict:
    """At one K3.1 KDA layer: ms to replay m tokens (1..max_m) from a snapshot with the
    rollback's own replay op, and MB a per-step-state scheme would keep for a verify of m
    tokens (m states of 6.3 MB)."""
    from kimi_mlx.speculative.rollback import _compiled_decode as kda_decode

    H, D = REAL_KDA_HEADS, REAL_KDA_DIM
    mx.random.seed(0)
    state = mx.random.normal((1, H, D, D)) * 0.1
    T = max_m
    q, k, v, a = (mx.random.normal((1, T, H, D)) for _ in range(4))
    b = mx.random.normal((1, T, H))
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,)))
    dt = mx.random.normal((H, D)) * 0.5
    mx.eval(state, q, k, v, a, b, A_log, dt)
    out = {"state_mb": H * D * D * 4 / 1e6, "replay_ms": {}, "per_step_mb": {}}
    for m in range(1, max_m + 1):
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            mx.eval(kda_decode(q[:, :m], k[:, :m], v[:, :m], a[:, :m], b[:, :m], A_log, dt,
                               state, -5.0, D**-0.5)[1])
            best = min(best, time.perf_counter() - t0)
        out["replay_ms"][m] = best * 1e3
        out["per_step_mb"][m] = m * out["state_mb"]
    return out


def print_table(title: str, rows: List[Dict], target: str = "1.3x") -> None:
    """One draft's rows on one workload: k, accepted per verify step, tokens/s, ratio."""
    print(title)
    print(f"{'k':>3} {'accepted/step':>14} {'plain steps':>12} {'tokens/pass':>12} "
          f"{'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>7}")
    for r in rows:
        share = r.get("plain_steps", 0) / max(r.get("plain_steps", 0) + r.get("verify_steps", 0), 1)
        print(f"{r['k']:>3} {r['mean_accepted']:>14.2f} {100 * share:>11.0f}% "
              f"{r.get('tokens_per_pass', 0):>12.2f} {r['plain_tps']:>12.1f} "
              f"{r['spec_tps']:>11.1f} {r['speedup']:>6.2f}x")
        if r.get("auto"):
            print(f"    {r['auto']}")
    best = max(rows, key=lambda r: r["speedup"])
    print(f"best: k={best['k']} at {best['speedup']:.2f}x plain (target >= {target})")


def print_report(rows: List[Dict], cost: Dict, target: str, draft: str, tokens: int,
                 n_prompts: int) -> None:
    print_table(f"speculative decoding, one process: target {target}, draft {draft}\n"
                f"greedy, {n_prompts} prompts x {tokens} tokens, medians of interleaved "
                "repeats (ratio: median of the per-repeat ratios)", rows)
    print()
    print_report_cost(cost)


def print_report_cost(cost: Dict) -> None:
    """What the rollback costs at K3.1's size (see `rollback_cost`)."""
    print(f"rollback at K3.1 size (one KDA layer, 96 x 128 x 128 f32 = "
          f"{cost['state_mb']:.1f} MB state; x{REAL_KDA_LAYERS} layers):")
    print(f"{'m':>3} {'replay ms/layer':>16} {'x69 ms':>8} {'per-step states MB/layer':>25} "
          f"{'x69 GB':>7}")
    for m, ms in cost["replay_ms"].items():
        mb = cost["per_step_mb"][m]
        print(f"{m:>3} {ms:>16.2f} {ms * REAL_KDA_LAYERS:>8.1f} {mb:>25.1f} "
              f"{mb * REAL_KDA_LAYERS / 1e3:>7.2f}")
    print("replay runs only after a rejection, over the accepted tokens; per-step states "
          "would be written on every verify step (and need the token-by-token form).")


DRAFTS, WORKLOADS = ("model", "block", "ngram"), ("ordinary", "copy")
NGRAM_KS = [2, 3, 4, 5, 6, 7, 8]


def load_drafts(drafts: List[str], draft: Optional[str], wrapper, spec: str,
                ngram: Optional[Tuple[int, int]] = None, target=None,
                block: Optional[str] = None) -> Dict[str, object]:
    """{"model PATH": the draft model (the shipped micro-draft by default), "block PATH":
    a DFlash / DSpark block drafter bound to `target` (one process), or without one to
    the checkpoint `spec`'s embedding and lm_head read alone (a pipeline head: its stages
    send the hidden states; the shipped micro-dspark by default), "ngram N..M": an `NgramDraft` of sizes `ngram` (n_max,
    n_min; default the module's)}, for the names asked. ValueError for another name, no
    draft model, or "block" without a drafter."""
    from kimi_mlx.speculative.loop import load_draft
    from kimi_mlx.speculative.ngram import NgramDraft

    out = {}
    for name in drafts:
        if name == "model":
            path = draft or default_draft()
            if path is None:
                raise ValueError("no --draft-model and no shipped micro-draft")
            out[f"model {path}"] = load_draft(str(path), wrapper, spec)
        elif name == "block":
            from kimi_mlx.speculative.block_drafter import load_block_drafter
            from kimi_mlx.speculative.block_loop import BlockDraft

            path = block or default_block_draft()
            if path is None:
                raise ValueError("the block draft needs --block-draft (or the shipped "
                                 "micro-dspark)")
            if target is not None:
                out[f"block {path}"] = BlockDraft(load_block_drafter(path, target))
            else:
                from kimi_mlx.speculative.factory import PIPELINE, build_speculation
                from kimi_mlx.speculative.settings import DraftSettings

                out[f"block {path}"] = build_speculation(DraftSettings(model=str(path)),
                                                         where=PIPELINE, target_name=spec).draft
        elif name == "ngram":
            d = NgramDraft(*ngram) if ngram else NgramDraft()
            out[f"ngram {d.n_min}..{d.n_max}"] = d
        else:
            raise ValueError(f"unknown draft {name!r} (model or ngram)")
    return out


def main(model: Optional[str], draft: Optional[str], tokens: int, ks: List[int],
         repeats: int, n_prompts: int, drafts: List[str] = ("model",),
         workloads: List[str] = ("ordinary",), ngram_ks: Optional[List[int]] = None,
         ngram: Optional[Tuple[int, int]] = None, copy_tokens: Optional[int] = None,
         block: Optional[str] = None) -> int:
    """Rows for every draft x workload (the n-gram draft over `ngram_ks`, default `ks`;
    the copy workload generating `copy_tokens`, default `tokens`), printed, then the
    rollback cost. Returns the exit status (2: a draft is missing)."""
    from kimi_mlx.generation.generate import resolve_model_arg
    from kimi_mlx.checkpoint.loader import load_for_generation

    spec = resolve_model_arg(model)
    target, wrapper, tok, _ = load_for_generation(spec)
    try:
        loaded = load_drafts(list(drafts), draft, wrapper, spec, ngram, target, block)
        prompts = {w: workload_prompts(Path(spec), tok, w, n_prompts) for w in workloads}
    except ValueError as e:
        print(f"kimi-mlx bench spec: {e}")
        return 2
    for name, d in loaded.items():
        for w, ps in prompts.items():
            dks = (ngram_ks or ks) if name.startswith("ngram") else ks
            n = (copy_tokens or tokens) if w == "copy" else tokens
            rows = bench(target, d, ps, n, dks, repeats)
            print_table(f"speculative decoding, one process: target {spec}, draft {name}, "
                        f"{w} prompts ({len(ps)} x {n} tokens, greedy; medians of "
                        "interleaved repeats, ratio: median of per-repeat ratios)", rows)
            print()
    cost = rollback_cost(max([k for k in ks if isinstance(k, int)] or [6]))
    print_report_cost(cost)
    return 0
