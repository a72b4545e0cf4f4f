"""`kimi-mlx eval`: perplexity and tokens/s of a checkpoint on a text file
(the measurement is `kimi_mlx.generation.evaluate`).

    kimi-mlx eval --model DIR --data FILE
    kimi-mlx eval --compare FULL BUILD DATA [DATA ...]

`--compare` prints what a pruned build lost against its full model, per domain of the
data (a file's name, a folder's subfolder, or a JSONL record's `domain` field, as
`kimi-mlx prune --calib` reads them): full and build perplexity, gate KL, routing kept and
the experts kept per layer, the table `kimi-mlx prune` writes into the build's card
(`kimi_mlx.prune.compare`; both models run one layer at a time)."""

from __future__ import annotations

import json
import sys

from kimi_mlx.generation.evaluate import (DEFAULT_BATCH, DEFAULT_SEQ_LEN, perplexity, read_texts,
                                          read_tokens)

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder or Hugging Face id (default: the shipped micro model)")
    p.add_argument("--data", default=None, help="UTF-8 text file to measure")
    p.add_argument("--compare", nargs=2, metavar=("FULL", "BUILD"), default=None,
                   help="compare a pruned BUILD with its FULL model on the DATA files: per "
                        "domain full / build perplexity, gate KL, routing kept, experts kept "
                        "per layer (the table of the build's card)")
    p.add_argument("files", nargs="*", metavar="DATA",
                   help="with --compare: text / JSONL files or folders, one domain per file "
                        "(or subfolder, or JSONL `domain` field)")
    p.add_argument("--json", default=None, help="with --compare: also write the table here")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                   help=f"tokens predicted per window (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="measure only the first N predicted tokens of the file")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help=f"windows per forward pass (default {DEFAULT_BATCH})")
    p.add_argument("--per-text", action="store_true",
                   help="--data is JSON Lines of {\"text\": ...}: score each text on its own "
                        "and print one JSON line per text (index, predicted tokens, summed "
                        "logprob in nats, perplexity); the first token of a text is not "
                        "predicted, as /v1/completions echo reports it")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars while loading and measuring (shown only on a terminal)")
    from kimi_mlx.placement.wired import add_allow_paging_argument

    add_allow_paging_argument(p)
    from kimi_mlx.generation.kv_args import add_kv_arguments

    add_kv_arguments(p)


def run(args) -> int:
    from kimi_mlx.checkpoint.hub import resolve
    from kimi_mlx.checkpoint.loader import byte_bar, load_model
    from kimi_mlx.generation.kv_args import apply_kv_quant, kv_quant
    from kimi_mlx.generation.request import InputError, resolve_model_arg
    from kimi_mlx.text.tokenizer import KimiTokenizer

    if args.compare:
        return run_compare(args)
    if args.files:
        print("kimi-mlx eval: error: DATA files are for --compare; use --data FILE",
              file=sys.stderr)
        return 2
    if not args.data:
        print("kimi-mlx eval: error: --data FILE is required (or --compare FULL BUILD DATA...)",
              file=sys.stderr)
        return 2
    try:
        if args.seq_len < 1:
            raise InputError(f"--seq-len must be >= 1, got {args.seq_len}")
        if args.batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise InputError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        model_dir = resolve(resolve_model_arg(args.model))
        from kimi_mlx.placement.wired import allow_paging, model_plan, wire

        # windows of seq_len + 1 tokens, batch_size of them per forward pass
        kv = kv_quant(args)  # the caches planned in their `--kv-bits` format
        wire(lambda: model_plan(model_dir, "kimi-mlx eval", sequences=args.batch_size,
                                context=args.seq_len + 1, kv_bits=kv[0], kv_group_size=kv[1]),
             allow_paging(args.allow_paging))
        tokenizer = KimiTokenizer.from_pretrained(model_dir)
        if args.per_text:
            texts = read_texts(args.data)
            model, _, _ = load_model(model_dir, verbose=False,
                                     progress=byte_bar(f"loading {model_dir.name}", not args.quiet))
            apply_kv_quant(model, args)
            for i, text in enumerate(texts):
                ids = tokenizer.encode(text)
                if len(ids) < 2:
                    row = {"index": i, "tokens": 0, "logprob": 0.0, "perplexity": None}
                else:
                    r = perplexity(model, ids, args.seq_len, args.batch_size)
                    row = {"index": i, "tokens": r.tokens, "logprob": -r.nll,
                           "perplexity": r.perplexity}
                print(json.dumps(row), flush=True)
            return 0
        ids = read_tokens(tokenizer, args.data, args.max_tokens)
        if len(ids) < 2:
            raise InputError(f"{args.data}: fewer than 2 tokens, nothing to predict")
        model, _, _ = load_model(model_dir, verbose=False,
                                 progress=byte_bar(f"loading {model_dir.name}", not args.quiet))
        apply_kv_quant(model, args)
    except (InputError, FileNotFoundError, ValueError) as e:
        print(f"kimi-mlx eval: error: {e}", file=sys.stderr)
        return 2
    context = model.args.max_position_embeddings
    if args.seq_len + 1 > context:
        print(f"note: windows of {args.seq_len + 1} tokens run past the model's context of "
              f"{context} (max_position_embeddings): figures beyond it are out of spec",
              file=sys.stderr)
    print(f"model: {model_dir}")
    print(f"data: {args.data} ({len(ids)} tokens, windows of {args.seq_len})", flush=True)
    result = perplexity(model, ids, args.seq_len, args.batch_size, progress=not args.quiet)
    print(f"perplexity: {result.perplexity:.4f}")
    print(f"tokens: {result.tokens}")
    print(f"tokens/s: {result.tokens_per_second:.1f}")
    return 0


def run_compare(args) -> int:
    """`--compare FULL BUILD DATA...`: print the per-domain table (exit 2 on bad input)."""
    from pathlib import Path

    from kimi_mlx.checkpoint.hub import resolve
    from kimi_mlx.prune.calib import CalibError, load_calibration
    from kimi_mlx.prune.compare import compare
    from kimi_mlx.text.tokenizer import KimiTokenizer

    try:
        if not args.files:
            raise ValueError("--compare FULL BUILD needs DATA files to measure on")
        if args.seq_len < 1:
            raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        full, build = (resolve(m) for m in args.compare)
        for m in (full, build):
            if not (Path(m) / "config.json").is_file():
                raise FileNotFoundError(f"{m}: no config.json (not a checkpoint folder)")
        data = load_calibration(args.files, lambda: KimiTokenizer.from_pretrained(full),
                                seq_len=args.seq_len + 1, max_tokens=None)
        by_domain = {}
        for d, ids in zip(data.domains, data.sequences):
            have = sum(len(s) - 1 for s in by_domain.get(d, []))
            if args.max_tokens is not None and have >= args.max_tokens:
                continue
            if args.max_tokens is not None:
                ids = ids[: args.max_tokens - have + 1]
            by_domain.setdefault(d, []).append(ids)
        table = compare(full, build, by_domain,
                        log=None if args.quiet else lambda s: print(s, file=sys.stderr))
    except (CalibError, FileNotFoundError, ValueError) as e:
        print(f"kimi-mlx eval: error: {e}", file=sys.stderr)
        return 2
    print(f"full: {full}")
    print(f"build: {build}")
    print()
    print(table.table())
    if args.json:
        Path(args.json).write_text(json.dumps(table.to_dict(), indent=1) + "\n")
    return 0
