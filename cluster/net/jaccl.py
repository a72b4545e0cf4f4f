"""MLX's `jaccl` backend (RDMA over Thunderbolt 5, macOS 26.2+) set up from our own node
reports, without ssh or a hand-written host file.

What MLX's jaccl backend reads (MLX `mlx/distributed/jaccl/lib/jaccl/jaccl.cpp`
`Config::from_env`, and `mlx.launch --backend jaccl` in
`python/mlx/_distributed_utils/launch.py`; docs `usage/distributed.rst`, "Getting
Started with JACCL" and "Distributed Without mlx.launch"):

- `MLX_RANK` (or `JACCL_RANK`): this process's rank;
- `MLX_JACCL_COORDINATOR` (or `JACCL_COORDINATOR`): "ip:port" that rank 0 listens on
  and every other rank connects to, to exchange the RDMA connection data (a TCP side
  channel; `mlx.launch` uses rank 0's first IP and `--starting-port`);
- `MLX_IBV_DEVICES` (or `JACCL_IBV_DEVICES`): the path of a JSON file holding the
  N x N device matrix: row i, column j is the ibverbs device name on rank i's Mac
  that is cabled to rank j's Mac (a string, or a list of names for several cables),
  null on the diagonal. A full mesh (every pair cabled) is required, unless
  `MLX_JACCL_RING` is set (then only ring neighbours; not used here).

How the matrix is found (as `mlx.distributed_config` does over ssh, here from each
node's own report): `system_profiler SPThunderboltDataType -json` lists each
Thunderbolt receptacle with this Mac's domain UUID on it (`domain_uuid_key`), its
receptacle tag, and the domain UUID of the Mac at the other end of the cable;
`networksetup -listallhardwareports` maps "Thunderbolt <tag>" to the network interface
(`en3`), whose RDMA device is `rdma_en3`; `ibv_devices` lists the RDMA devices that
exist (none until `rdma_ctl enable` has been run in macOS Recovery), and
`ibv_devinfo` says whether each device's port is active. Pairing peer UUIDs across
the reports gives, for every pair of nodes, the device on each side.

Nothing here could be run against real RDMA hardware (Linux CI, no Thunderbolt): the
parsers are tested on recorded command output and the matrix on fake reports.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple


class JacclError(RuntimeError):
    """A jaccl group that cannot be formed; the message names the node(s) and why."""


@dataclass(frozen=True)
class Port:
    """One Thunderbolt receptacle: its network interface ("en3"), this Mac's domain UUID
    on it, and the domain UUID at the other end of its cable (None: nothing plugged in
    or not a Mac)."""

    iface: str
    uuid: str
    peer_uuid: Optional[str]


@dataclass
class NodeReport:
    """What a node tells the head about its RDMA (JSON on the wire: `to_json`).

    name: how errors name the node ("node mac-2"); ports: its Thunderbolt ports;
    rdma_devices: `ibv_devices` names; inactive: devices whose port `ibv_devinfo` does
    not show PORT_ACTIVE; jaccl: whether its MLX has the jaccl backend; mlx_version;
    problem: why the report could not be taken ("ibv_devices: not found"), or "".
    """

    name: str
    ports: List[Port] = field(default_factory=list)
    rdma_devices: List[str] = field(default_factory=list)
    inactive: List[str] = field(default_factory=list)
    jaccl: bool = False
    mlx_version: str = ""
    problem: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, name: Optional[str] = None) -> "NodeReport":
        """Parse a report; raises JacclError naming `name` for a malformed one."""
        try:
            d = json.loads(text)
            ports = [Port(str(p["iface"]), str(p["uuid"]),
                          None if p.get("peer_uuid") is None else str(p["peer_uuid"]))
                     for p in d.get("ports", [])]
            return cls(name or str(d["name"]), ports, [str(x) for x in d.get("rdma_devices", [])],
                       [str(x) for x in d.get("inactive", [])], bool(d.get("jaccl")),
                       str(d.get("mlx_version", "")), str(d.get("problem", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise JacclError(f"{name or 'a node'}: malformed RDMA report ({e})") from None


# ----------------------------------------------------------------- command output parsers


def parse_ibv_devices(text: str) -> List[str]:
    """RDMA device names from `ibv_devices` output (a "device / node GUID" table)."""
    return [w for line in text.splitlines() for w in line.split()[:1] if w.startswith("rdma_")]


def parse_ibv_devinfo(text: str) -> Dict[str, str]:
    """{device: port state} from `ibv_devinfo` output ("hca_id: rdma_en3" blocks, each
    with "state: PORT_ACTIVE (4)" lines; the first port's state per device)."""
    states: Dict[str, str] = {}
    dev = None
    for line in text.splitlines():
        m = re.match(r"\s*hca_id:\s*(\S+)", line)
        if m:
            dev = m.group(1)
            continue
        m = re.match(r"\s*state:\s*(\S+)", line)
        if m and dev is not None and dev not in states:
            states[dev] = m.group(1)
    return states


def parse_hardware_ports(text: str) -> Dict[str, str]:
    """{"Thunderbolt 1": "en2", ...} from `networksetup -listallhardwareports`."""
    ports: Dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and name is not None:
            ports[name] = line.split(":", 1)[1].strip()
            name = None
    return ports


def parse_thunderbolt(profile: str, hardware_ports: Dict[str, str]) -> List[Port]:
    """This Mac's Thunderbolt ports from `system_profiler SPThunderboltDataType -json`
    and `parse_hardware_ports`: entries with a `domain_uuid_key` are this Mac's
    receptacles; the first item under one with its own `domain_uuid_key` is the Mac at
    the other end. A receptacle with no network interface is skipped. Raises
    JacclError for output that is not that JSON."""
    try:
        entries = json.loads(profile)["SPThunderboltDataType"]
    except (ValueError, KeyError, TypeError) as e:
        raise JacclError(f"system_profiler SPThunderboltDataType: unexpected output ({e})") from None
    ports = []
    for t in entries:
        uuid = t.get("domain_uuid_key")
        tag = (t.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        if uuid is None or tag is None:
            continue
        iface = hardware_ports.get(f"Thunderbolt {tag}")
        if iface is None:
            continue
        peers = [i["domain_uuid_key"] for i in t.get("_items", []) if "domain_uuid_key" in i]
        ports.append(Port(iface, uuid, peers[0] if peers else None))
    return sorted(ports, key=lambda p: p.iface)


Runner = Callable[[Sequence[str]], str]


def _run(cmd: Sequence[str]) -> str:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20,
                          check=True).stdout


def local_report(name: str, run: Runner = _run, jaccl: Optional[bool] = None,
                 mlx_version: Optional[str] = None) -> NodeReport:
    """This machine's report. `run(cmd) -> stdout` (injected in tests) runs
    `ibv_devices`, `ibv_devinfo`, `networksetup -listallhardwareports` and
    `system_profiler SPThunderboltDataType -json`; a command that is missing or fails
    leaves `problem` saying which (on Linux: "ibv_devices: not found"), never raises."""
    if jaccl is None or mlx_version is None:
        import mlx.core as mx

        jaccl = mx.distributed.is_available(backend="jaccl") if jaccl is None else jaccl
        mlx_version = mx.__version__ if mlx_version is None else mlx_version
    report = NodeReport(name, jaccl=jaccl, mlx_version=mlx_version)
    steps = [("ibv_devices", ["ibv_devices"]), ("ibv_devinfo", ["ibv_devinfo"]),
             ("networksetup", ["networksetup", "-listallhardwareports"]),
             ("system_profiler", ["system_profiler", "SPThunderboltDataType", "-json"])]
    out: Dict[str, str] = {}
    for key, cmd in steps:
        try:
            out[key] = run(cmd)
        except FileNotFoundError:
            report.problem = f"{cmd[0]}: not found"
            return report
        except (OSError, subprocess.SubprocessError) as e:
            report.problem = f"{' '.join(cmd)}: {e}"
            return report
    report.rdma_devices = parse_ibv_devices(out["ibv_devices"])
    states = parse_ibv_devinfo(out["ibv_devinfo"])
    report.inactive = sorted(d for d in report.rdma_devices
                             if states.get(d, "PORT_ACTIVE") != "PORT_ACTIVE")
    try:
        report.ports = parse_thunderbolt(out["system_profiler"],
                                         parse_hardware_ports(out["networksetup"]))
    except JacclError as e:
        report.problem = str(e)
    return report


@functools.lru_cache(maxsize=8)
def local_report_json(name: str) -> str:
    """`local_report(name).to_json()`, taken once per process (system_profiler takes
    about a second; cabling changes need a restart of `cluster serve`)."""
    return local_report(name).to_json()


# ------------------------------------------------------------------------- the head's side


def device_matrix(reports: Sequence[NodeReport], mlx_version: Optional[str] = None
                  ) -> List[List[Optional[str]]]:
    """MLX_IBV_DEVICES' matrix for ranks in `reports`' order: [i][j] the RDMA device on
    node i cabled to node j, None on the diagonal.

    Raises JacclError naming every node that cannot join and why: no jaccl in its MLX,
    an MLX version other than `mlx_version` (default: the first report's), a report
    problem, no RDMA devices (RDMA off: `rdma_ctl enable` in Recovery), a pair with no
    Thunderbolt cable between them, or a cabled port whose RDMA device is missing or
    not active.
    """
    if len(reports) < 2:
        raise JacclError("a jaccl group needs at least 2 Macs")
    want = mlx_version or reports[0].mlx_version
    problems: List[str] = []
    for r in reports:
        if not r.jaccl:
            problems.append(f"{r.name}: its MLX ({r.mlx_version or '?'}) has no jaccl backend "
                            "(macOS 26.2+ and an MLX built with it)")
        if r.mlx_version != want:
            problems.append(f"{r.name}: MLX {r.mlx_version or '?'}, the head has {want} "
                            "(one group needs the same MLX)")
        if r.problem:
            problems.append(f"{r.name}: cannot read its RDMA set-up ({r.problem})")
        elif not r.rdma_devices:
            problems.append(f"{r.name}: no RDMA devices (ibv_devices lists none: run "
                            "`rdma_ctl enable` in macOS Recovery, then reboot)")
    owner = {p.uuid: i for i, r in enumerate(reports) for p in r.ports}
    n = len(reports)
    matrix: List[List[Optional[str]]] = [[None] * n for _ in range(n)]
    for i, r in enumerate(reports):
        for p in r.ports:
            j = owner.get(p.peer_uuid) if p.peer_uuid else None
            if j is None or j == i or matrix[i][j] is not None:
                continue  # not cabled to a group member, or a second cable (one is used)
            dev = f"rdma_{p.iface}"
            if r.rdma_devices and dev not in r.rdma_devices:
                problems.append(f"{r.name}: {p.iface} is cabled to {reports[j].name} but has no "
                                f"RDMA device {dev} (ibv_devices: {', '.join(r.rdma_devices)})")
            elif dev in r.inactive:
                problems.append(f"{r.name}: {dev} (cabled to {reports[j].name}) is not active")
            matrix[i][j] = dev
    for i in range(n):
        for j in range(i + 1, n):
            if matrix[i][j] is None or matrix[j][i] is None:
                problems.append(f"{reports[i].name} and {reports[j].name}: no Thunderbolt cable "
                                "between them (jaccl needs every pair of Macs cabled)")
    if problems:
        raise JacclError("cannot form a jaccl group: " + "; ".join(dict.fromkeys(problems)))
    return matrix


def choose(reports: Sequence[NodeReport], forced: Optional[str] = None,
           mlx_version: Optional[str] = None) -> Tuple[str, Optional[List[List[Optional[str]]]], str]:
    """(backend, device matrix or None, why) for `--backend auto|ring|jaccl`.

    "auto": jaccl when `device_matrix` succeeds (every pair cabled, RDMA on, jaccl in
    every MLX), else ring with the reason; "jaccl": the matrix or JacclError naming the
    nodes; "ring": ring.
    """
    if forced == "ring":
        return "ring", None, "--backend ring"
    try:
        matrix = device_matrix(reports, mlx_version)
    except JacclError as e:
        if forced == "jaccl":
            raise
        return "ring", None, str(e)
    return "jaccl", matrix, "every pair of Macs is cabled with RDMA on"


def hosts_payload(matrix: List[List[Optional[str]]], coordinator: str) -> str:
    """What a rank request carries for jaccl (instead of the ring's host list): JSON
    {"devices": matrix, "coordinator": "ip:port"}."""
    return json.dumps({"devices": matrix, "coordinator": coordinator})


def rank_env(payload: str, rank: int, workdir: Optional[str] = None) -> Tuple[Dict[str, str], str]:
    """(environment for rank `rank`, path of the device file written for it) from a
    `hosts_payload`: MLX_RANK, MLX_JACCL_COORDINATOR, MLX_IBV_DEVICES. The caller
    removes the file once the group is formed. Raises JacclError for a payload that
    is not one (names what is missing)."""
    try:
        d = json.loads(payload)
        matrix, coordinator = d["devices"], str(d["coordinator"])
    except (ValueError, KeyError, TypeError) as e:
        raise JacclError(f"jaccl host payload: {e}") from None
    if not (isinstance(matrix, list) and 0 <= rank < len(matrix)
            and all(isinstance(row, list) and len(row) == len(matrix) for row in matrix)):
        raise JacclError(f"jaccl host payload: rank {rank} and a device matrix that is not "
                         "square N x N with N > rank")
    fd, path = tempfile.mkstemp(prefix="kimi-mlx-ibv-", suffix=".json", dir=workdir)
    with os.fdopen(fd, "w") as f:
        json.dump(matrix, f)
    return {"MLX_RANK": str(rank), "MLX_JACCL_COORDINATOR": coordinator,
            "MLX_IBV_DEVICES": path}, path
