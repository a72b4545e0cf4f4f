"""micro-dspark against micro-draft on held-out text, per k (`make micro-dspark` writes
the table into the drafter's eval.json and card; `python -m kimi_mlx.micro.dspark_eval
[--dspark DIR] [--draft DIR]` prints it for any pair of folders).

Workloads, all from the teacher checkpoint's `heldout/` folder (`kimi_mlx/assets/micro/
heldout/{code,prose}.txt`: files and prose blocks of the stdlib corpus that
`kimi_mlx.micro.corpus` holds out of every training split, so neither drafter nor micro
saw them):

* **code**: `n` prompts of `length` tokens from held-out code, at offsets 997 apart;
* **prose**: the same from held-out prose;
* **copy**: `bench.spec.copy_texts` (a block of held-out source lines, a blank line, then
  the block's first half again: the continuation is the rest of the copy).

Held out by document is not unseen: the language reference repeats paragraphs across
topics, so about 18% of held-out prose (120-character windows) also occurs in the training
split. A candidate prompt is therefore used only when no 64-character window of it and of
the text after it (`AHEAD` tokens) occurs in the training text of the running
interpreter's corpus (`unseen`); candidates are taken in order until `n` pass.

Each cell is greedy speculative decoding of micro with the drafter at k drafts per verify
step (`micro.evaluation.acceptance`, the loops the drafters run in `generate`), `max_tokens`
per prompt: drafts accepted per verify step over all the workload's prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

WORKLOADS = ("code", "prose", "copy")
KS = (1, 2, 3, 4, 6, 8)
WINDOW, STRIDE = 64, 16  # characters: a shared window this long counts as seen
AHEAD = 64  # tokens after a prompt that must be unseen too
CANDIDATES = 64  # candidate prompts per workload, at most


def unseen(text: str, train: str) -> bool:
    """True when no WINDOW-character window of `text` (every STRIDE characters, and the
    last) occurs in `train`."""
    starts = list(range(0, max(1, len(text) - WINDOW), STRIDE)) + [max(0, len(text) - WINDOW)]
    return not any(text[s : s + WINDOW] in train for s in starts)


def heldout_prompts(teacher_dir: Path, tokenizer, n: int = 4, length: int = 32,
                    train: Optional[Dict[str, str]] = None) -> Dict[str, List[List[int]]]:
    """{"code" | "prose" | "copy": n prompts (lists of token ids)} from the checkpoint's
    held-out text that do not occur in `train` ({"code" | "prose": training text}; default
    the training split of `micro.corpus.build_corpus()`), see the module docstring.

    Raises:
        FileNotFoundError: `teacher_dir/heldout/<domain>.txt` missing (named).
        ValueError: fewer than n unseen candidates in a workload (named)."""
    from kimi_mlx.bench.spec import copy_texts

    if train is None:
        from kimi_mlx.micro.corpus import build_corpus

        corpus = build_corpus()
        train = {d: corpus.text("train", d) for d in ("code", "prose")}
    out: Dict[str, List[List[int]]] = {}
    for d in ("code", "prose"):
        f = Path(teacher_dir) / "heldout" / f"{d}.txt"
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no held-out {d} text (the micro checkpoint ships it)")
        ids = tokenizer.encode(f.read_text(encoding="utf-8"))
        starts = ((i * 997) % max(1, len(ids) - length - AHEAD) for i in range(CANDIDATES))
        out[d] = [ids[s : s + length] for s in starts
                  if unseen(tokenizer.decode(ids[s : s + length + AHEAD]), train[d])][:n]
    out["copy"] = [tokenizer.encode(t) for t in copy_texts(Path(teacher_dir), CANDIDATES)
                   if unseen(t, train["code"])][:n]
    for w, ps in out.items():
        if len(ps) < n:
            raise ValueError(f"{teacher_dir}/heldout: only {len(ps)} {w} prompts of "
                             f"{CANDIDATES} candidates are unseen in training, {n} asked")
    return out


def block_run(model, drafter, max_tokens: int):
    """`run(prompt, k, stats)` for `evaluation.acceptance`: the block drafter's loop."""
    from kimi_mlx.speculative.block_loop import BlockDraft, block_generate_step

    bd = BlockDraft(drafter)
    return lambda p, k, st: block_generate_step(p, model, bd, num_draft_tokens=k,
                                                max_tokens=max_tokens, stats=st)


def model_run(model, draft, max_tokens: int):
    """`run(prompt, k, stats)` for `evaluation.acceptance`: a draft model's loop."""
    from kimi_mlx.speculative.loop import speculative_generate_step

    return lambda p, k, st: speculative_generate_step(p, model, draft, num_draft_tokens=k,
                                                      max_tokens=max_tokens, stats=st)


def per_k(runs: Dict[str, object], prompts: Dict[str, List[List[int]]],
          ks: Sequence[int] = KS) -> List[Dict]:
    """Rows {"drafter", "workload", "k", "steps", "mean_accepted", "acceptance_rate",
    "tokens_per_step"} for every drafter in `runs` ({name: run}), workload and k."""
    from kimi_mlx.micro.evaluation import acceptance

    rows = []
    for name, run in runs.items():
        for w, ps in prompts.items():
            for k in ks:
                rows.append({"drafter": name, "workload": w, **acceptance(run, ps, k)})
    return rows


def table(rows: List[Dict], ks: Sequence[int] = KS) -> str:
    """Markdown: one line per workload x drafter, accepted drafts per verify step per k."""
    head = "| workload | drafter | " + " | ".join(f"k={k}" for k in ks) + " |"
    lines = [head, "|---|---|" + "---:|" * len(ks)]
    cell = {(r["workload"], r["drafter"], r["k"]): r["mean_accepted"] for r in rows}
    for w in dict.fromkeys(r["workload"] for r in rows):
        for d in dict.fromkeys(r["drafter"] for r in rows):
            lines.append(f"| {w} | {d} | " + " | ".join(
                f"{cell[(w, d, k)]:.2f}" if (w, d, k) in cell else "" for k in ks) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.micro.train import ASSET_DIR
    from kimi_mlx.speculative.block_drafter import load_block_drafter
    from kimi_mlx.text.tokenizer import KimiTokenizer

    p = argparse.ArgumentParser(prog="python -m kimi_mlx.micro.dspark_eval")
    p.add_argument("--teacher", type=Path, default=ASSET_DIR)
    p.add_argument("--dspark", type=Path, action="append",
                   help="block drafter folder (repeatable; default the shipped micro-dspark)")
    p.add_argument("--draft", type=Path, default=ASSET_DIR.parent / "micro-draft",
                   help="draft model folder to compare with ('' for none)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--ks", default=",".join(map(str, KS)))
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args(argv)
    ks = [int(x) for x in a.ks.split(",")]
    model, _, _ = load_model(a.teacher)
    model.eval()
    tok = KimiTokenizer.from_pretrained(a.teacher)
    prompts = heldout_prompts(a.teacher, tok, a.prompts)
    runs = {}
    for d in a.dspark or [ASSET_DIR.parent / "micro-dspark"]:
        runs[str(d)] = block_run(model, load_block_drafter(d, target=model), a.max_tokens)
    if str(a.draft) not in ("", "."):
        runs[str(a.draft)] = model_run(model, load_model(a.draft)[0], a.max_tokens)
    rows = per_k(runs, prompts, ks)
    print(table(rows, ks))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
