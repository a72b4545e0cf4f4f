"""`kimi-mlx convert`: quantize a checkpoint's BF16 trunk (MLX affine, as mlx_lm.convert).

    kimi-mlx convert --model SRC --out DST --q-bits 4 [--q-group-size 64] [--expert-bits 3]

Streamed tensor by tensor (memory: one tensor), written atomically; the source is only
read. Routed experts stay MXFP4, byte-copied, unless --expert-bits requantizes them.
Exit status: 0 done, 2 bad input (the message says which file / flag and why).
"""

from __future__ import annotations

import argparse
import sys

from kimi_mlx.prune.cli import _source, add_quant_arguments, quant_spec
from kimi_mlx.prune.writer import PruneError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="source checkpoint: folder in the official layout (BF16 trunk), or a "
                        "Hugging Face id")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --force)")
    add_quant_arguments(p)
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from kimi_mlx.prune.pipeline import convert

    try:
        quant = quant_spec(args)
        if not quant.active:
            raise PruneError("give --q-bits (trunk) and/or --expert-bits (routed experts)")
        src = _source(args.model)
        plan = convert(src, args.out, quant, force=args.force, progress=not args.quiet)
    except PruneError as e:
        print(f"kimi-mlx convert: error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.model} -> {args.out}: {plan.bytes_out / 1e9:.3f} GB of tensors "
          f"(source {plan.bytes_in / 1e9:.3f} GB); " + " ".join(quant.describe(markdown=False)[:1]))
    return 0
