"""`kimi-mlx` command line: one subcommand per module, each with `add_arguments` and `run`.

To add a command, add a line to COMMANDS; the module is imported only when the command
(or `--help`) needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (name, module, one-line help)
COMMANDS = [
    ("generate", "kimi_mlx.commands.generate", "one-shot generation, streamed (like mlx_lm.generate)"),
    ("chat", "kimi_mlx.commands.chat", "multi-turn chat REPL that keeps reasoning between turns"),
    ("eval", "kimi_mlx.commands.eval", "perplexity and tokens/s of a checkpoint on a text file"),
    ("plan", "kimi_mlx.commands.plan", "which Macs hold which layers of a checkpoint"),
    ("server", "kimi_mlx.server.cli", "OpenAI- and Anthropic-compatible HTTP API server"),
    ("cluster", "kimi_mlx.cluster.cli", "zeroconf discovery, stage service and launcher"),
    ("prune", "kimi_mlx.prune.cli", "REAP expert pruning to a single-Mac checkpoint"),
    ("convert", "kimi_mlx.prune.convert_cli", "quantize the BF16 trunk (MLX affine, as mlx_lm.convert)"),
    ("doctor", "kimi_mlx.commands.doctor", "check this Mac for kimi-mlx: versions, Metal, wired limit, RDMA, speed"),
    ("bench", "kimi_mlx.commands.bench", "benchmarks (kernels, model vs mlx-lm)"),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-mlx",
        description="Run Moonshot's Kimi K3.1 Pro on Apple Silicon with MLX: one Mac, "
        "a cluster of Macs, or a REAP-pruned build.",
    )
    parser.add_argument("--version", "-V", action="store_true",
                        help="print the versions of kimi-mlx, MLX and mlx-lm and the BLAS in use")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # command not built yet
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def version_text() -> str:
    """`kimi-mlx --version`: ours, MLX's and mlx-lm's versions, and the BLAS in use."""
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    from kimi_mlx.commands.blas import blas_in_use

    def v(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return (f"kimi-mlx {v('kimi-mlx')} (mlx {mx.__version__}, mlx-lm {v('mlx-lm')}, "
            f"{mx.default_device().type.name}, BLAS: {blas_in_use()})")


def main(argv=None) -> int:
    if argv is None:  # started as a program (not called from Python): full BLAS speed
        from kimi_mlx.commands.blas import ensure_fast_blas

        ensure_fast_blas()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        print(version_text())
        return 0
    command = argv[0] if argv and not argv[0].startswith("-") else None
    parser = build_parser(only=command)
    args, extra = parser.parse_known_args(argv)
    if extra:  # say it with the subcommand's usage, not the top-level one
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2 if command else 0
    try:
        return args._run(args) or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kimi-mlx plan ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
