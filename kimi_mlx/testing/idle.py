"""(tests, measurement) What idle processes cost: CPU seconds while no command comes, and
the latency of the first command after the idle time.

The tensor group (`--what tensor`, default) is the server's on loopback, from its real
processes: rank 0 is the server's rank 0 child (`cluster.tensor.relay.Rank0Process`,
driven from this process as the server drives it) and rank 1 a node's rank process
(`python -m kimi_mlx.cluster.tensor.rank`, started by `cluster.node.rank.RankProcess`),
both on MLX's ring backend over 127.0.0.1. `python -m kimi_mlx.testing.idle --idle 60`
prints one JSON line: CPU seconds of each process over the last `--window` s of `--idle`
s idle (Linux /proc: utime + stime of the process and its descendants), then the first
command's latency and the median of `--repeats` back-to-back ones (`--cycles` times). A
command here is BEGIN then END through rank 0's child: the END's answer comes once rank
1 ran the BEGIN and met the END's broadcast, so it times a wake of every rank.
KIMI_MLX_TENSOR_PARK_AFTER=inf gives ranks that wait in `all_sum` (no parking) for a
before/after figure.

`--compare` (the first command after a long idle against a group that never parks, in
one run): `--rounds` times, a parked group (the default `relay.PARK_AFTER`) and then a
group whose rank 0 never parks (KIMI_MLX_TENSOR_PARK_AFTER=inf, today's idle before the
doorbell), each timed after `--cycles` idle times of `--idle` s; `--command token`
(default there) times one decode step (BEGIN, a one-token FORWARD with its logits back,
END: the first token of a request), `--command wake` the bare BEGIN / END. Prints one
JSON line with every figure, the medians of the first commands and their signed
difference (parked minus never-parked, ms: negative when the parked group was faster,
which meets "within 1 ms of today's latency" as well), and one summary line on stderr. A
group that never parks spins two cores while it waits, so the groups run one after the
other, never together.

What parking itself adds, apart from end-to-end noise: every parked group runs with
KIMI_MLX_WAKE_LOG (`cluster.tensor.wire`), so each rank other than 0 notes, for every
ring of rank 0's doorbell, when its blocking `recv` returned and when it re-entered the
collective, against rank 0's own stamp of the ring (one monotonic clock: one machine).
`wake_us` reports those delays in microseconds (all wakes of the run: median and max, and
each); on a loaded machine the end-to-end first-command samples vary by tens of ms, the
wake delay is the part the doorbell adds.

`--what stage`: one `cluster serve` stage idle, before and after a head loaded it;
`--what server`: the one-process `kimi-mlx server` idle; `--what cluster`: `cluster
server --parallel tensor` with one node, as process trees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PARK_ENV = "KIMI_MLX_TENSOR_PARK_AFTER"  # read by rank 0's child (`cluster.tensor.relay`)


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and every live descendant
    (Linux /proc; RuntimeError elsewhere or when `pid` is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: Dict[int, List[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stats[int(d)] = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
    if pid not in stats:
        raise RuntimeError(f"process {pid} is not running (or this is not Linux)")
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [c for c, s in stats.items() if int(s[1]) == p and c not in tree]
    # after the ")" the fields are numbered from 3 (state): utime is field 14, stime 15
    return sum(int(stats[p][11]) + int(stats[p][12]) for p in tree) / tick


class IdleGroup:
    """A 2-rank tensor group on loopback (module doc) over checkpoint `ckpt`; `pids`:
    {"rank 0": the child's pid, "rank 1": the node rank's pid}; `rank0` the
    `Rank0Process`, `node_rank` rank 1's `node.rank.RankProcess` (started as a node starts
    it). Use as a context manager: both processes are ended on exit (`stop`)."""

    def __init__(self, ckpt: Path, timeout: float = 180.0, park_after: Optional[str] = None):
        """`park_after`: KIMI_MLX_TENSOR_PARK_AFTER for rank 0's child ("inf": never
        parks; "": the default); None: this process's environment as it is."""
        from kimi_mlx.cluster.tensor.group import hosts_json
        from kimi_mlx.cluster.tensor.relay import Rank0Process
        from kimi_mlx.testing.ports import free_ports

        from kimi_mlx.cluster.node.rank import RankProcess

        ports = free_ports(2)
        hosts = hosts_json([("127.0.0.1", p) for p in ports])
        self.node_rank = RankProcess(ckpt, 1, 2, "ring", hosts, "idle-test", cache_bytes=0)
        self.rank1 = self.node_rank.proc
        self.rank0 = None
        saved = os.environ.get(PARK_ENV)
        try:
            if park_after is not None:  # rank 0's child reads it at import (a new process)
                os.environ.pop(PARK_ENV, None)
                if park_after:
                    os.environ[PARK_ENV] = park_after
            try:
                self.rank0 = Rank0Process(ckpt, "ring", {"MLX_RANK": "0"}, hosts=hosts,
                                          timeout=timeout)
            finally:
                os.environ.pop(PARK_ENV, None)
                if saved is not None:
                    os.environ[PARK_ENV] = saved
            self.rank0.wait_ready(timeout, cancelled=lambda: self.rank1.poll() is not None)
        except BaseException:
            self.stop()
            raise
        self.pids = {"rank 0": self.rank0.proc.pid, "rank 1": self.rank1.pid}

    def command(self) -> float:
        """Seconds for BEGIN then END through the group (module doc)."""
        from kimi_mlx.cluster.tensor.step import OP_BEGIN, OP_END

        t0 = time.perf_counter()
        self.rank0.relay_command(OP_BEGIN)
        self.rank0.relay_command(OP_END)
        return time.perf_counter() - t0

    def token(self, token_id: int = 1) -> float:
        """Seconds for one decode step through the group: BEGIN, a one-token FORWARD with
        the logits back to rank 0's caller, END (the first token of a request)."""
        t0 = time.perf_counter()
        self.forward([token_id])
        return time.perf_counter() - t0

    def forward(self, ids: Sequence[int]):
        """Rank 0's logits [1, T, vocab] for `ids` through the group (one request)."""
        from kimi_mlx.cluster.tensor.step import LOGITS, OP_BEGIN, OP_END, OP_FORWARD

        self.rank0.relay_command(OP_BEGIN)
        self.rank0.relay_command(OP_FORWARD, list(ids), -1, LOGITS)
        out = self.rank0.last
        self.rank0.relay_command(OP_END)
        return out

    def cpu(self, window: float) -> Dict[str, float]:
        """CPU seconds of each process (with its descendants) over the next `window` s."""
        before = {k: cpu_seconds(p) for k, p in self.pids.items()}
        time.sleep(window)
        return {k: cpu_seconds(p) - before[k] for k, p in self.pids.items()}

    def stop(self, timeout: float = 20.0) -> Dict[str, Optional[int]]:
        """EXIT the group (both processes exit 0), then stop what still runs as the
        server and the node do (`kill`: SIGTERM first); returns exit statuses. Safe to
        repeat."""
        if self.rank0 is not None and self.rank0.proc.returncode is None:
            self.rank0.finish(timeout)
        try:
            self.rank1.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.node_rank.kill("the idle test ended")
        return {"rank 0": None if self.rank0 is None else self.rank0.proc.returncode,
                "rank 1": self.rank1.returncode}

    def __enter__(self) -> "IdleGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wake_delays(path: Path) -> List[dict]:
    """The wakes noted in a KIMI_MLX_WAKE_LOG file (`cluster.tensor.wire`): one dict per
    rank woken per ring, {"ring", "rank", "recv_us": rank 0's ring to the rank's `recv`
    returning, "entered_us": to its re-entry into the collective}, microseconds, in ring
    order. Rings no rank noted (the group stopped first) are left out."""
    rings, wakes = {}, []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        r = json.loads(line)
        if "rang_ns" in r:
            rings[r["ring"]] = r["rang_ns"]
        else:
            wakes.append(r)
    out = []
    for w in wakes:
        rang = rings.get(w["ring"])
        if rang is not None:
            out.append({"ring": w["ring"], "rank": w["rank"],
                        "recv_us": (w["woke_ns"] - rang) / 1e3,
                        "entered_us": (w["entered_ns"] - rang) / 1e3})
    return sorted(out, key=lambda w: (w["ring"], w["rank"]))


def _wake_summary(wakes: List[dict]) -> dict:
    """{"n", "median_us", "max_us" (of the re-entry delay), "median_recv_us", "max_recv_us",
    "entered_us": each}, microseconds; {"n": 0} without wakes."""
    if not wakes:
        return {"n": 0}
    entered = [w["entered_us"] for w in wakes]
    recv = [w["recv_us"] for w in wakes]
    return {"n": len(wakes), "median_us": statistics.median(entered), "max_us": max(entered),
            "median_recv_us": statistics.median(recv), "max_recv_us": max(recv),
            "entered_us": entered}


def measure(ckpt: Path, idle: float, window: float, repeats: int,
            cycles: int = 1, park_after: Optional[str] = None, command: str = "wake") -> dict:
    """{"cpu_s": {process: CPU s over the last `window` s of the first idle time},
    "window_s", "idle_s", "first_ms": [the first command after each of `cycles` idle
    times of `idle` s], "warm_ms": median of `repeats` back-to-back commands after each,
    "wake_us": the doorbell's wake delays of the run (`_wake_summary` of `wake_delays`;
    {"n": 0} for a group that never parks), "exit": exit statuses}. `command`: "wake"
    (BEGIN / END, `IdleGroup.command`) or "token" (one decode step, `IdleGroup.token`);
    `park_after`: as `IdleGroup`'s."""
    from kimi_mlx.cluster.tensor.wire import WAKE_LOG_ENV

    window = min(window, idle)
    with tempfile.TemporaryDirectory(prefix="kimi-mlx-wakes-") as tmp:
        notes = Path(tmp) / "wakes.jsonl"
        saved = os.environ.get(WAKE_LOG_ENV)
        os.environ[WAKE_LOG_ENV] = str(notes)  # both rank processes inherit it
        try:
            g = IdleGroup(ckpt, park_after=park_after)
        finally:
            os.environ.pop(WAKE_LOG_ENV, None)
            if saved is not None:
                os.environ[WAKE_LOG_ENV] = saved
        with g:
            run = g.token if command == "token" else g.command
            run()  # the first command ever (lazy set-up on both sides) is not the figure
            run()
            cpu, first, warm = None, [], []
            for _ in range(cycles):
                time.sleep(max(0.0, idle - window))
                c = g.cpu(window)
                cpu = cpu or c
                first.append(run() * 1e3)
                warm.append(statistics.median(run() for _ in range(repeats)) * 1e3)
            time.sleep(1.0)  # parked again: the last wake's notes are written (wire doc)
            codes = g.stop()
        wakes = _wake_summary(wake_delays(notes))
    return {"cpu_s": cpu, "window_s": window, "idle_s": idle, "first_ms": first,
            "warm_ms": warm, "wake_us": wakes, "exit": codes}


def compare(ckpt: Path, idle: float, window: float, repeats: int, cycles: int = 3,
            rounds: int = 1, command: str = "token") -> dict:
    """The first command after `idle` s of a parked group against a group that never
    parks (module doc, `--compare`). Returns {"parked": {...}, "never_parked": {...}}
    (each: "first_ms" [rounds x cycles], "warm_ms", "cpu_s" per round, "wake_us": every
    wake's re-entry delay, µs) with "median_first_ms" of each, "difference_ms" (parked
    minus never-parked, signed: negative when parked was faster), "within_1ms"
    (difference <= 1 ms: parking adds at most 1 ms; being faster meets it too), "wake"
    (the parked groups' wake delays: `_wake_summary`), the load average before and
    after, plus the settings."""
    kinds = {"parked": "", "never_parked": "inf"}
    out = {k: {"first_ms": [], "warm_ms": [], "cpu_s": [], "wake_us": []} for k in kinds}
    load_before = os.getloadavg()
    for _ in range(rounds):
        for kind, park in kinds.items():
            m = measure(ckpt, idle, window, repeats, cycles, park_after=park, command=command)
            out[kind]["first_ms"] += m["first_ms"]
            out[kind]["warm_ms"] += m["warm_ms"]
            out[kind]["cpu_s"].append(m["cpu_s"])
            out[kind]["wake_us"] += m["wake_us"].get("entered_us", [])
    med = {k: statistics.median(v["first_ms"]) for k, v in out.items()}
    diff = med["parked"] - med["never_parked"]
    parked = out["parked"]["wake_us"]
    wake = ({"n": len(parked), "median_us": statistics.median(parked), "max_us": max(parked)}
            if parked else {"n": 0})
    return dict(out, command=command, idle_s=idle, cycles=cycles, rounds=rounds,
                median_first_ms=med, median_warm_ms={k: statistics.median(v["warm_ms"])
                                                     for k, v in out.items()},
                difference_ms=diff, within_1ms=within_1ms(diff), wake=wake,
                load_average=[list(load_before), list(os.getloadavg())])


def stage_cpu(ckpt: Path, workdir: Path, window: float, settle: float = 2.0) -> dict:
    """{"unloaded": CPU s of an idle `cluster serve` stage over `window` s, "loaded": the
    same after a head loaded its layers (a pipeline of this one stage, no request)}."""
    from kimi_mlx.testing.cluster import LocalCluster

    c = LocalCluster(Path(workdir), 1, prefix="idlestage", ckpt=ckpt)
    try:
        pid = c.procs[0].proc.pid
        time.sleep(settle)
        out = {"unloaded": _window(pid, window)}
        t, _ = c.load_transport()
        try:
            time.sleep(settle)
            out["loaded"] = _window(pid, window)
        finally:
            t.shutdown()
    finally:
        c.stop()
    return out


def server_cpu(ckpt: Path, workdir: Path, window: float, timeout: float = 180.0) -> float:
    """CPU s of an idle one-process `kimi-mlx server` (model loaded, no request) over
    `window` s."""
    from kimi_mlx.cluster.net.lifetime import child_env, stop_process
    from kimi_mlx.testing.health import wait_healthy
    from kimi_mlx.testing.ports import free_ports

    port = free_ports(1)[0]
    path = Path(workdir) / "server.log"
    log = open(path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kimi_mlx.commands.main", "server", "--model",
                             str(ckpt), "--port", str(port)], env=child_env(),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout, proc, output=path)
        time.sleep(2.0)
        return _window(proc.pid, window)
    finally:
        stop_process(proc, what="the idle server")
        log.close()


def cluster_cpu(ckpt: Path, workdir: Path, window: float, settle: float = 20.0,
                timeout: float = 240.0) -> dict:
    """CPU s over `window` s of an idle `kimi-mlx cluster server --parallel tensor` on
    loopback with one `cluster serve` node, as process trees: {"node": the node and its
    rank, "server": the server, its rank 0 child and the spare}, measured `settle` s after
    the server is ready (the spare rank 0 process imports meanwhile: 1-3 s of CPU)."""
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.ports import free_ports

    grpc_port, _ = free_ports(2, consecutive=True)  # the node's rank listens on port + 1
    c = LocalCluster(Path(workdir), 1, prefix="idlenode", ckpt=ckpt, ports=[grpc_port])
    try:
        srv = ServerProc(c, free_ports(1)[0], "--parallel", "tensor", timeout=timeout)
        try:
            time.sleep(settle)
            pids = {"node": c.procs[0].proc.pid, "server": srv.proc.pid}
            before = {k: cpu_seconds(v) for k, v in pids.items()}
            time.sleep(window)
            return {k: cpu_seconds(v) - before[k] for k, v in pids.items()}
        finally:
            srv.stop()
    finally:
        c.stop()


def _window(pid: int, window: float) -> float:
    before = cpu_seconds(pid)
    time.sleep(window)
    return cpu_seconds(pid) - before


def within_1ms(difference_ms: float) -> bool:
    """Whether the first command after an idle time "starts within 1 ms of today's
    latency": parked minus never-parked at most +1 ms (a parked group that was faster
    meets it: the bound is on what parking adds)."""
    return difference_ms <= 1.0


def summary_line(out: dict) -> str:
    """One line for `compare`'s result: the wake delay, then the first-command medians
    and their signed difference judged against "within 1 ms" (faster passes)."""
    diff, w = out["difference_ms"], out["wake"]
    wake = (f"doorbell wake (ring to back in the collective) median {w['median_us']:.0f} us, "
            f"max {w['max_us']:.0f} us over {w['n']} wakes; " if w.get("n") else
            "no doorbell wake noted; ")
    verdict = ("parking added at most 1 ms" if out["within_1ms"]
               else "parking added MORE than 1 ms")
    load = out.get("load_average")
    return (wake + f"first {out['command']} after {out['idle_s']:g} s idle, median of "
            f"{len(out['parked']['first_ms'])}: parked {out['median_first_ms']['parked']:.2f} ms, "
            f"never parked {out['median_first_ms']['never_parked']:.2f} ms, parked minus never "
            f"parked {diff:+.2f} ms ({'parked faster' if diff < 0 else 'parked slower'}; "
            f"{verdict}); back-to-back medians {out['median_warm_ms']['parked']:.2f} / "
            f"{out['median_warm_ms']['never_parked']:.2f} ms"
            + (f"; load average {load[0][0]:.1f} before, {load[1][0]:.1f} after" if load else ""))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the reference one)")
    p.add_argument("--idle", type=float, default=60.0, help="seconds idle before the command")
    p.add_argument("--window", type=float, default=10.0, help="seconds of CPU measured")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--cycles", type=int, default=None,
                   help="idle times per group, each then timed (default 1; 5 with --compare)")
    p.add_argument("--compare", action="store_true",
                   help="tensor: the first command after --idle s of a parked group against "
                        "a group that never parks (KIMI_MLX_TENSOR_PARK_AFTER=inf), medians "
                        "over --rounds x --cycles")
    p.add_argument("--rounds", type=int, default=1,
                   help="--compare: parked then never-parked groups, this many times")
    p.add_argument("--command", default=None, choices=("wake", "token"),
                   help="what is timed: wake (BEGIN/END) or token (one decode step); "
                        "default token with --compare, else wake")
    p.add_argument("--what", default="tensor", choices=("tensor", "stage", "server", "cluster"),
                   help="tensor: the 2-rank group; stage: one `cluster serve` stage idle "
                        "before and after loading; server: the one-process server idle; "
                        "cluster: `cluster server --parallel tensor` and its node, idle")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kimi-mlx-idle-") as tmp:
        from kimi_mlx.testing.cluster import reference_checkpoint

        ckpt = Path(a.model) if a.model else reference_checkpoint(Path(tmp))
        if a.what == "stage":
            out = {"stage_cpu_s": stage_cpu(ckpt, Path(tmp), a.window), "window_s": a.window}
        elif a.what == "cluster":
            out = {"cluster_cpu_s": cluster_cpu(ckpt, Path(tmp), a.window), "window_s": a.window}
        elif a.what == "server":
            out = {"server_cpu_s": server_cpu(ckpt, Path(tmp), a.window), "window_s": a.window}
        elif a.compare:
            out = compare(ckpt, a.idle, a.window, a.repeats, a.cycles or 5, a.rounds,
                          a.command or "token")
            print(summary_line(out), file=sys.stderr, flush=True)
        else:
            out = measure(ckpt, a.idle, a.window, a.repeats, a.cycles or 1,
                          command=a.command or "wake")
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
