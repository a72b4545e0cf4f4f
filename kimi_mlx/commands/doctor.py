"""`kimi-mlx doctor`: check this Mac for running kimi-mlx (macOS, versions, Metal and the
kernel device checks, the wired limit against the plan for --model, free disk, RDMA,
Thunderbolt cabling and bridge, memory bandwidth and decode tokens/s measured against
the planner). One line per check, OK / WARN / FAIL / SKIP with the fix; `--json` for
tools; exit status 1 when a check FAILs. The checks live in `kimi_mlx.cluster.doctor` and
the gathering in `kimi_mlx.cluster.doctor_run` (shared with `kimi-mlx cluster doctor`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kimi_mlx.cluster.doctor_run import add_doctor_arguments

    add_doctor_arguments(p)
    from kimi_mlx.server.serving import DEFAULT_DISK_BYTES

    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="the disk prompt cache folder to check free space for")
    p.add_argument("--prompt-cache-disk-bytes", default=str(DEFAULT_DISK_BYTES), metavar="N",
                   help="the disk prompt cache size it must hold (default 32 GiB)")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the bandwidth and decode measurements (a few seconds)")
    p.add_argument("--decode-tokens", type=int, default=32,
                   help="tokens generated to time decode with --model (default 32)")
    p.add_argument("--facts", type=Path, default=None, metavar="FILE",
                   help="check recorded facts (JSON written by --save-facts, e.g. on another "
                        "Mac) instead of this machine")
    p.add_argument("--save-facts", type=Path, default=None, metavar="FILE",
                   help="also write this machine's facts and measurements as JSON")


def run(args) -> int:
    from kimi_mlx.cluster.doctor import exit_status, render
    from kimi_mlx.cluster.doctor_run import DoctorSettings, local_checks, local_facts
    from kimi_mlx.placement.planner import parse_bytes

    try:
        cache_bytes = parse_bytes(str(args.prompt_cache_disk_bytes), default_unit="B")
    except ValueError as e:
        print(f"kimi-mlx doctor: error: --prompt-cache-disk-bytes: {e}", file=sys.stderr)
        return 2
    s = DoctorSettings(model=args.model, context=args.context,
                       prompt_cache_dir=args.prompt_cache_dir, prompt_cache_bytes=cache_bytes,
                       backend=args.backend, measure=not args.no_measure,
                       decode_tokens=args.decode_tokens)
    facts = None
    if args.facts is not None:
        try:
            facts = json.loads(args.facts.read_text())
        except (OSError, ValueError) as e:
            print(f"kimi-mlx doctor: error: --facts {args.facts}: {e}", file=sys.stderr)
            return 2
    elif args.save_facts is not None:
        facts = local_facts(s)
    checks = local_checks(s, facts, record=args.save_facts is not None)
    if args.save_facts is not None:
        args.save_facts.write_text(json.dumps(facts, indent=1))
    print(render(checks, args.json))
    return exit_status(checks)
