"""The checks of `kimi-mlx doctor` (this Mac) and `kimi-mlx cluster doctor` (the nodes found
or listed): one line per check, OK / WARN / FAIL / SKIP, each not-OK line with the fix.

Every check is a small function of facts (command output recorded by
`net.hostfacts.gather`, a node's `HealthReply`, a measurement) returning `Check`s, so the
suite runs them on recorded macOS outputs (tests/data/macos/doctor/).
`cluster.doctor_run` gathers the facts and calls them. FAIL: what was asked for cannot
work as set up (the exit status is then 1); WARN: it works, slower or with less than the
plan expects; SKIP: the check cannot be made here (e.g. macOS tools on Linux).
"""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kimi_mlx.cluster.net import hostfacts as hf

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
GB = 10**9
GiB = 2**30
MiB = 2**20

MIN_MACOS = (13, 5)  # MLX's wheels: macOS 13.5 or later
JACCL_MACOS = (26, 2)  # RDMA over Thunderbolt 5 (MLX docs, usage/distributed.rst)
MACOS_RESERVE = 8 * GiB  # a wired limit leaving less than this to macOS: WARN
LOW_DISK = 10 * GB  # less free than this on the checkpoint's volume: WARN
SKEW_WARN_S = 2.0
BANDWIDTH_WARN = 0.5  # measured copy GB/s under this fraction of the planner's constant
DECODE_WARN = 0.5  # measured decode tok/s under this fraction of the plan's prediction
RECOVERY_FIX = ("boot into macOS Recovery (hold the power button), open Terminal, run "
                "`rdma_ctl enable`, reboot")


@dataclass
class Check:
    """One line of the report. status: OK / WARN / FAIL / SKIP; name: the check
    ("wired-limit"); node: which machine ("" for this one); message: what was found;
    fix: what to do (for WARN / FAIL)."""

    name: str
    status: str
    message: str
    fix: str = ""
    node: str = ""

    def line(self) -> str:
        where = f"[{self.node}] " if self.node else ""
        fix = f" -- fix: {self.fix}" if self.fix and self.status in (WARN, FAIL) else ""
        return f"{self.status:<4}  {where}{self.name}: {self.message}{fix}"


def render(checks: Sequence[Check], as_json: bool = False) -> str:
    """The report: one line per check and a summary line, or JSON {"checks": [...],
    "summary": {status: count}, "ok": no FAIL}."""
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL, SKIP)}
    if as_json:
        return json.dumps({"checks": [asdict(c) for c in checks], "summary": counts,
                           "ok": counts[FAIL] == 0}, indent=2)
    lines = [c.line() for c in checks]
    lines.append(f"{counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL, "
                 f"{counts[SKIP]} SKIP")
    return "\n".join(lines)


def exit_status(checks: Sequence[Check]) -> int:
    """1 when any check FAILs, else 0."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def _is_mac(facts: dict) -> bool:
    return facts.get("platform") == "darwin"


def _skip_not_mac(name: str, facts: dict, what: str) -> Optional[Check]:
    if _is_mac(facts):
        return None
    return Check(name, SKIP, f"not macOS ({facts.get('platform')}): {what} cannot be checked here")


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


# ------------------------------------------------------------------------ one machine


def check_macos(facts: dict) -> Check:
    """macOS version from `sw_vers`: FAIL below 13.5 (MLX), OK otherwise (noting that
    RDMA / jaccl needs 26.2+)."""
    skip = _skip_not_mac("macos", facts, "the macOS version")
    if skip:
        return skip
    v = hf.parse_sw_vers(facts["outputs"].get("sw_vers"))
    version = v.get("ProductVersion", "")
    if not version:
        return Check("macos", WARN, f"cannot read sw_vers ({facts['errors'].get('sw_vers', 'no version')})")
    label = f"macOS {version} ({v.get('BuildVersion', '?')})"
    t = hf.version_tuple(version)
    if t < MIN_MACOS:
        return Check("macos", FAIL, f"{label}: MLX needs macOS 13.5 or later",
                     "update macOS (System Settings > General > Software Update)")
    note = "" if t >= JACCL_MACOS else "; RDMA over Thunderbolt (jaccl) needs macOS 26.2+"
    return Check("macos", OK, label + note)


def check_versions(versions: Dict[str, str]) -> Check:
    """This install's versions (kimi-mlx, MLX, stage protocol), as one OK line."""
    return Check("versions", OK, ", ".join(f"{k} {v}" for k, v in versions.items()))


def check_metal(available: bool, platform: str, status: Dict[str, str], setting: str) -> List[Check]:
    """Metal and the kernel device checks (`metal.dispatch.check_kernels` run first):
    no Metal on a Mac FAILs; a kernel that failed its check WARNs (its reference op is
    used, slower) with the error."""
    if not available:
        if platform == "darwin":
            return [Check("metal", FAIL, "MLX sees no Metal GPU on this Mac",
                          "install the arm64 Python and MLX (`python -c 'import platform; "
                          "print(platform.machine())'` must say arm64)")]
        return [Check("metal", SKIP, f"no Metal here ({platform}): MLX runs on the CPU and "
                                     "our kernels use their reference ops")]
    out = [Check("metal", OK, "MLX sees a Metal GPU")]
    if setting != "auto":
        out.append(Check("kernels", OK, f"KIMI_MLX_KERNELS={setting}: device checks not run"))
        return out
    bad = {k: v for k, v in status.items() if v != "ok"}
    if not status:
        out.append(Check("kernels", WARN, "no kernel check ran"))
    elif bad:
        for k, err in sorted(bad.items()):
            out.append(Check(f"kernel {k}", WARN, f"failed its device check, its reference op "
                             f"is used (slower): {err}",
                             "report this line with `kimi-mlx --version` and `sw_vers`; "
                             "KIMI_MLX_KERNELS=reference silences it"))
    if status and len(bad) < len(status):
        out.append(Check("kernels", OK, "passed their device checks: "
                         + ", ".join(sorted(k for k in status if k not in bad))))
    return out


def effective_wired_bytes(memsize: int, wired_mb: Optional[int]) -> int:
    """GPU memory macOS lets MLX wire: `iogpu.wired_limit_mb` when set (non-zero), else
    macOS's default (`planner.macos_default_wired_bytes`)."""
    from kimi_mlx.placement.planner import macos_default_wired_bytes

    return wired_mb * MiB if wired_mb else macos_default_wired_bytes(memsize)


def check_wired(facts: dict, need_bytes: Optional[int], what: str = "") -> Check:
    """`iogpu.wired_limit_mb` against `need_bytes` (this node's planned weights + caches +
    headroom; None: no --model, skipped) and against `hw.memsize`.

    FAIL: the limit (or macOS's default when unset) is below the plan (fix: the sysctl
    with N for this node), or above the RAM. WARN: it leaves macOS under 8 GiB."""
    skip = _skip_not_mac("wired-limit", facts, "iogpu.wired_limit_mb")
    if skip:
        return skip
    memsize = hf.parse_sysctl_int(facts["outputs"].get("memsize"))
    wired = hf.parse_sysctl_int(facts["outputs"].get("wired_limit"))
    if not memsize:
        return Check("wired-limit", WARN, f"cannot read hw.memsize ({facts['errors'].get('memsize', '?')})")
    if wired is None:
        return Check("wired-limit", WARN, "cannot read iogpu.wired_limit_mb "
                     f"({facts['errors'].get('wired_limit', '?')})", "update macOS (14+ has it)")
    ram_mb = memsize // MiB
    limit = effective_wired_bytes(memsize, wired)
    said = (f"iogpu.wired_limit_mb={wired}" if wired else
            f"iogpu.wired_limit_mb unset (macOS default {limit // MiB} MB)")
    said += f", RAM {ram_mb} MB"
    if wired and wired > ram_mb:
        return Check("wired-limit", FAIL, f"{said}: the limit is above the RAM",
                     f"sudo sysctl iogpu.wired_limit_mb={max(ram_mb - MACOS_RESERVE // MiB, 0)}")
    if need_bytes is not None and need_bytes > limit:
        n = math.ceil(need_bytes / MiB / 1024) * 1024  # whole GiB, in MB
        if n > ram_mb - MACOS_RESERVE // MiB:
            return Check("wired-limit", FAIL, f"{said}; {what}needs {need_bytes // MiB} MB, "
                         "more than this Mac can wire and keep 8 GiB for macOS",
                         "spread the model over more Macs (`kimi-mlx plan`) or prune it")
        return Check("wired-limit", FAIL, f"{said}; {what}needs {need_bytes // MiB} MB: "
                     "weights would be paged and decode would crawl",
                     f"sudo sysctl iogpu.wired_limit_mb={n} (it resets at reboot: run it "
                     "again after one)")
    if wired and ram_mb - wired < MACOS_RESERVE // MiB:
        return Check("wired-limit", WARN, f"{said}: leaves macOS {ram_mb - wired} MB",
                     f"sudo sysctl iogpu.wired_limit_mb={ram_mb - MACOS_RESERVE // MiB}")
    if need_bytes is None:
        return Check("wired-limit", OK, f"{said}; plan not checked (no --model)")
    return Check("wired-limit", OK, f"{said}; {what}needs {need_bytes // MiB} MB (weights, "
                 "caches and the planner's headroom)")


def check_disk(label: str, d: Optional[dict], need_bytes: int = 0) -> Check:
    """Free disk on the volume of `d` (`hostfacts.disk_facts` entry): FAIL when under
    `need_bytes` (e.g. --prompt-cache-disk-bytes) or the path is a missing checkpoint,
    WARN under 10 GB."""
    name = f"disk {label}"
    if d is None:
        return Check(name, SKIP, "not given")
    if "error" in d:
        return Check(name, FAIL, f"{d['path']}: {d['error']}", "check the path and its permissions")
    free = d["free"]
    where = f"{d['path']}: {_gb(free)} free of {_gb(d['total'])}"
    if need_bytes and free < need_bytes:
        return Check(name, FAIL, f"{where}, needs {_gb(need_bytes)}",
                     f"free {_gb(need_bytes - free)} there, or give a smaller size or "
                     "another folder")
    if free < LOW_DISK:
        return Check(name, WARN, f"{where}", "free some space (logs, caches and snapshots "
                     "need room)")
    return Check(name, OK, where + (f", needs {_gb(need_bytes)}" if need_bytes else ""))


def check_rdma(facts: dict, need: bool = False) -> Check:
    """RDMA from `rdma_ctl status` and `ibv_devices` (and the Thunderbolt speed from
    system_profiler for the "enabled but no devices" case). Problems WARN (tensor
    groups use the TCP ring instead) or, with `need` (--backend jaccl), FAIL."""
    skip = _skip_not_mac("rdma", facts, "rdma_ctl / ibv_devices")
    if skip:
        return skip
    bad = FAIL if need else WARN
    out, errs = facts["outputs"], facts["errors"]
    if "rdma_ctl" not in out:
        return Check("rdma", bad, f"cannot run rdma_ctl ({errs.get('rdma_ctl')}): RDMA over "
                     "Thunderbolt needs macOS 26.2+", "update macOS to 26.2 or later")
    state = hf.parse_rdma_ctl(out["rdma_ctl"])
    from kimi_mlx.cluster.net.jaccl import parse_ibv_devices

    devices = parse_ibv_devices(out.get("ibv_devices", ""))
    if state == "disabled":
        return Check("rdma", bad, "rdma_ctl status: disabled (jaccl cannot run; tensor "
                     "groups use the TCP ring)", RECOVERY_FIX)
    if state != "enabled":
        return Check("rdma", bad, f"rdma_ctl status says {out['rdma_ctl'].strip()!r}", RECOVERY_FIX)
    if devices:
        return Check("rdma", OK, f"enabled, verbs devices: {', '.join(devices)}")
    speed = hf.max_gbps(hf.thunderbolt_speeds(out.get("thunderbolt")))
    if speed is not None and speed <= 40:
        return Check("rdma", bad, f"enabled but ibv_devices lists no device: this Mac's "
                     f"Thunderbolt ports are Thunderbolt 4 (up to {speed} Gb/s) and RDMA needs "
                     "Thunderbolt 5; nothing to fix here", "use --backend ring (the TCP ring "
                     "over the Thunderbolt bridge), or Macs with Thunderbolt 5")
    return Check("rdma", bad, "enabled but ibv_devices lists no device (ibverbs cannot "
                 "see RDMA)", "shut down fully and start again; if it stays empty run "
                 "`rdma_ctl enable` in Recovery again")


def check_thunderbolt(facts: dict, need: bool = False) -> Check:
    """Which Thunderbolt ports are cabled to another Mac (system_profiler +
    networksetup): none WARNs (FAIL with `need`)."""
    skip = _skip_not_mac("thunderbolt", facts, "Thunderbolt cabling")
    if skip:
        return skip
    from kimi_mlx.cluster.net.jaccl import JacclError, parse_hardware_ports, parse_thunderbolt

    out = facts["outputs"]
    try:
        ports = parse_thunderbolt(out.get("thunderbolt", ""),
                                  parse_hardware_ports(out.get("hardware_ports", "")))
    except JacclError as e:
        return Check("thunderbolt", WARN, str(e))
    cabled = [p for p in ports if p.peer_uuid]
    if not cabled:
        return Check("thunderbolt", FAIL if need else WARN,
                     f"no Thunderbolt port is cabled to another Mac ({len(ports)} ports)",
                     "cable every pair of Macs with Thunderbolt 5 for jaccl")
    return Check("thunderbolt", OK, ", ".join(f"{p.iface} -> Mac {p.peer_uuid[:8]}" for p in cabled))


def check_bridge(facts: dict) -> Check:
    """The Thunderbolt bridge (`ifconfig bridge0`): its IPv4 addresses and members.
    Missing or without an address WARNs (nodes then talk over Ethernet / Wi-Fi)."""
    skip = _skip_not_mac("bridge0", facts, "the Thunderbolt bridge")
    if skip:
        return skip
    text = facts["outputs"].get("bridge")
    if text is None:
        return Check("bridge0", WARN, f"no Thunderbolt bridge ({facts['errors'].get('bridge')})",
                     "fine over Ethernet; for Thunderbolt enable the Thunderbolt Bridge "
                     "service in System Settings > Network")
    b = hf.parse_ifconfig(text)
    members = ",".join(b["members"]) or "no members"
    if not b["inet"]:
        return Check("bridge0", WARN, f"no IPv4 address ({members}, status {b['status'] or '?'})",
                     "System Settings > Network > Thunderbolt Bridge > Details > TCP/IP: "
                     "give it an address (e.g. 10.10.0.N/24), or serve with --interface")
    addrs = ", ".join(f"{a}/{bits}" for a, bits in b["inet"])
    return Check("bridge0", OK, f"{addrs} ({members}, status {b['status'] or '?'})")


def copy_bandwidth(size_mb: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s of an MLX copy of a `size_mb` MB float32 array on the
    default device: the best of `repeats` timed `x + 0` (reads and writes the array once:
    2 x size bytes moved)."""
    import mlx.core as mx

    n = size_mb * 10**6 // 4
    x = mx.ones((n,), dtype=mx.float32)
    mx.eval(x)
    best = math.inf
    for _ in range(repeats + 1):  # the first builds the kernel
        t = time.perf_counter()
        y = x + 0
        mx.eval(y)
        best = min(best, time.perf_counter() - t)
        del y
    return 2 * n * 4 / best


def check_bandwidth(measured: float, constant: Optional[int], chip: str) -> Check:
    """Measured copy bandwidth against the planner's constant for this chip
    (`planner.MAC_BANDWIDTH`); under half WARNs. No constant (not a known Mac): WARN
    with what the planner assumes instead."""
    from kimi_mlx.cluster.net.discovery import UNKNOWN_BANDWIDTH

    got = f"measured {measured / GB:.1f} GB/s (256 MB copy)"
    if not constant:
        return Check("bandwidth", WARN, f"{got}; no planner constant for this machine "
                     f"({chip or 'not a known Apple chip'}): the planner assumes "
                     f"{UNKNOWN_BANDWIDTH / GB:.0f} GB/s", "plan with `cluster serve "
                     f"--bandwidth-gbs {measured / GB:.0f}` on this machine")
    ratio = measured / constant
    line = f"{got}, {ratio:.0%} of the planner's {constant / GB:.0f} GB/s for {chip}"
    if ratio < BANDWIDTH_WARN:
        return Check("bandwidth", WARN, line, "close other GPU work (Activity Monitor > GPU); "
                     "check Low Power Mode is off")
    return Check("bandwidth", OK, line)


def check_decode(measured: Optional[float], predicted: Optional[float], basis: str = "",
                 why_not: str = "") -> Check:
    """Measured decode tokens/s on --model against the planner's prediction for it on
    this machine (`Plan.tokens_per_s`): under half WARNs (the plan is optimistic for
    this machine)."""
    if measured is None:
        return Check("decode", SKIP, why_not or "no --model")
    line = f"measured {measured:.1f} tok/s"
    if not predicted:
        return Check("decode", OK, line + " (no prediction)")
    ratio = measured / predicted
    line += f", {ratio:.0%} of the plan's {predicted:.1f} tok/s{basis}"
    if ratio < DECODE_WARN:
        return Check("decode", WARN, line, "check the wired limit and the bandwidth lines "
                     "above; plans for this machine are that much too optimistic")
    return Check("decode", OK, line)


# -------------------------------------------------------------------------- the cluster


@dataclass
class NodeFacts:
    """What the cluster doctor knows of one node: name and address, its Health reply
    fields (versions), its host facts (`hostfacts.gather`'s dict; None from an older
    node), its RDMA report (`jaccl.NodeReport` or None), and the clock reading (local time before / after the call,
    node time)."""

    name: str
    address: str
    version: str = ""
    mlx_version: str = ""
    protocol: int = 0
    facts: Optional[dict] = None
    rdma: object = None  # jaccl.NodeReport
    sent: float = 0.0
    received: float = 0.0
    memory: int = 0
    usable: int = 0
    bandwidth: int = 0
    chip: str = ""


def check_same(name: str, values: Dict[str, str], what: str, fix: str,
               status_if_differ: str = FAIL) -> Check:
    """One value per node ({node: value}); FAIL (or `status_if_differ`) naming which
    nodes differ."""
    distinct = sorted(set(values.values()))
    if len(distinct) <= 1:
        return Check(name, OK, f"{what} {distinct[0] if distinct else '?'} on every node")
    by = "; ".join(f"{v}: {', '.join(n for n in values if values[n] == v)}" for v in distinct)
    return Check(name, status_if_differ, f"{what} differs ({by})", fix)


def check_port(address: str, host: str, port: int,
               connect: Callable[[Tuple[str, int], float], object] = socket.create_connection,
               timeout: float = 1.0) -> Check:
    """A TCP connect to the node's stage port within `timeout` seconds."""
    try:
        s = connect((host, port), timeout)
        close = getattr(s, "close", None)
        if close:
            close()
        return Check("port", OK, f"{address} accepts TCP connections")
    except OSError as e:
        return Check("port", FAIL, f"{address}: {e.strerror or e}",
                     "start `kimi-mlx cluster serve` there, and allow it through the macOS "
                     "firewall (System Settings > Network > Firewall)")


def check_clock(node_time: Optional[float], sent: float, received: float) -> Check:
    """The node's clock (its host facts' "time") against ours at the middle of the call;
    the uncertainty is half the round trip. Over 2 s WARNs; at the auth limit
    (`auth.MAX_SKEW_S`) calls are refused: FAIL."""
    from kimi_mlx.cluster.net.auth import MAX_SKEW_S

    if node_time is None:
        return Check("clock", SKIP, "the node does not send its clock (older kimi-mlx)")
    skew = node_time - (sent + received) / 2
    line = f"off by {skew:+.3f} s (+- {(received - sent) / 2:.3f} s)"
    fix = "turn on System Settings > General > Date & Time > Set time automatically on every Mac"
    if abs(skew) >= MAX_SKEW_S:
        return Check("clock", FAIL, f"{line}: calls are refused past {MAX_SKEW_S} s", fix)
    if abs(skew) > SKEW_WARN_S:
        return Check("clock", WARN, line, fix)
    return Check("clock", OK, line)


def check_zeroconf(address: str, advertised: Sequence[str], browsed_s: float) -> Check:
    """Whether the node's address answered a zeroconf browse of `browsed_s` seconds
    (`discovery.browse`); missing WARNs (`--nodes auto` and `cluster ls` miss it)."""
    if address in advertised:
        return Check("zeroconf", OK, f"advertised ({browsed_s:g} s browse)")
    return Check("zeroconf", WARN, f"not seen in a {browsed_s:g} s browse "
                 f"(seen: {', '.join(advertised) or 'none'})",
                 "serve without --no-advertise, on the same network (or keep listing it "
                 "in --nodes); multicast may be blocked by the network")


def check_cabling(reports: Sequence, need: bool = False) -> Check:
    """Every pair of nodes linked by a Thunderbolt cable (jaccl needs a full mesh), from
    each node's RDMA report (`jaccl.NodeReport`: its ports and the peer UUID on each)."""
    if len(reports) < 2:
        return Check("cabling", SKIP, "fewer than 2 nodes")
    owner = {p.uuid: i for i, r in enumerate(reports) for p in r.ports}
    linked = set()
    for i, r in enumerate(reports):
        for p in r.ports:
            j = owner.get(p.peer_uuid) if p.peer_uuid else None
            if j is not None and j != i:
                linked.add((min(i, j), max(i, j)))
    missing = [(reports[i].name, reports[j].name) for i in range(len(reports))
               for j in range(i + 1, len(reports)) if (i, j) not in linked]
    if missing:
        return Check("cabling", FAIL if need else WARN,
                     "no Thunderbolt cable between " + "; ".join(f"{a} and {b}" for a, b in missing)
                     + " (jaccl needs every pair cabled; tensor groups use the TCP ring)",
                     "cable each pair listed with Thunderbolt 5")
    return Check("cabling", OK, f"every pair of the {len(reports)} nodes is cabled")


def check_bridge_subnets(bridges: Dict[str, List[Tuple[str, int]]]) -> Check:
    """The nodes' bridge0 IPv4 networks ({node: [(address, prefix bits)]}, from
    `hostfacts.parse_ifconfig`): nodes whose bridge shares no network with the first
    node's cannot talk over Thunderbolt (WARN: traffic goes over Ethernet / Wi-Fi)."""
    import ipaddress

    nets = {n: {ipaddress.ip_interface(f"{a}/{b}").network for a, b in v}
            for n, v in bridges.items() if v}
    if len(nets) < 2:
        return Check("bridge subnets", SKIP, "fewer than 2 nodes with a bridge0 address")
    first, *rest = list(nets)
    apart = [n for n in rest if not nets[n] & nets[first]]
    if apart:
        shown = "; ".join(f"{n}: {', '.join(map(str, sorted(nets[n], key=str)))}" for n in [first] + apart)
        return Check("bridge subnets", WARN, f"bridge0 of {', '.join(apart)} shares no network "
                     f"with {first}'s ({shown})", "give every Mac's Thunderbolt Bridge an "
                     "address in one subnet (or leave them all self-assigned 169.254.x.x)")
    common = set.intersection(*nets.values())
    return Check("bridge subnets", OK, "every node's bridge0 is on "
                 + (", ".join(map(str, sorted(common, key=str))) or "a network shared with the first"))


def node_plan_needs(nodes: Sequence[NodeFacts], model_dir: Optional[str], context: Optional[int]
                    ) -> Tuple[Dict[str, int], str]:
    """({node: bytes its pipeline stage needs (weights + caches + headroom)}, note) for
    `model_dir` planned over `nodes` by `placement.planner.StagePlanner` ({} and the
    reason when there is no model or it does not fit)."""
    if not model_dir:
        return {}, "no --model: plans not checked"
    from kimi_mlx.placement.layer_bytes import model_bytes
    from kimi_mlx.placement.planner import Node, PlanError, StagePlanner, planned_context

    try:
        model = model_bytes(model_dir)
        ctx = planned_context(context, model.max_position_embeddings)
        from kimi_mlx.cluster.net.discovery import UNKNOWN_BANDWIDTH

        pn = [Node(n.name, n.usable, n.bandwidth or UNKNOWN_BANDWIDTH, n.memory or None, n.chip or None)
              for n in nodes]
        plan = StagePlanner().plan(model, pn, ctx)
    except (PlanError, ValueError, FileNotFoundError) as e:
        return {}, f"no plan: {str(e).splitlines()[0]}"
    return ({s.node.name: s.total_bytes + s.headroom_bytes for s in plan.stages if s.used},
            f"{Path(model_dir).name} at {ctx} tokens")
