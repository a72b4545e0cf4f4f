"""Recorded Macs for the doctor tests: host facts built from the command outputs under
tests/data/macos/doctor/ (each file says where its output comes from), run through
`hostfacts.gather` with a runner that answers from those files, as on a Mac."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Dict, Optional

from kimi_mlx.cluster.net import hostfacts as hf

DATA = Path(__file__).parent / "data" / "macos" / "doctor"
GiB = 2**30


def recorded(name: str) -> str:
    """A fixture's command output: the leading '# ' comment lines (its source) dropped;
    JSON fixtures as they are (their "_source" key is ignored by the parsers)."""
    text = (DATA / name).read_text()
    if name.endswith(".json"):
        return text
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("# "):
        lines.pop(0)
    return "".join(lines)


MISSING = object()  # the program is not installed
IFCONFIG_NO_BRIDGE = subprocess.CalledProcessError(
    1, ["ifconfig", "bridge0"], "", "ifconfig: interface bridge0 does not exist")


def runner(files: Dict[str, object]):
    """run(cmd) answering `hostfacts.COMMANDS` keys from `files` ({key: fixture name,
    MISSING, or an exception to raise}); ibv_devinfo for `jaccl.local_report` too."""
    by_cmd = {tuple(cmd): key for key, cmd in hf.COMMANDS.items()}
    by_cmd[("ibv_devinfo",)] = "ibv_devinfo"

    def run(cmd):
        key = by_cmd.get(tuple(cmd))
        what = files.get(key, MISSING)
        if what is MISSING:
            raise FileNotFoundError(cmd[0])
        if isinstance(what, Exception):
            raise what
        return recorded(what)
    return run


GOOD_MAC = {
    "sw_vers": "sw_vers_26.2.txt", "memsize": "sysctl_hw_memsize_512g.txt",
    "cpu_brand": "sysctl_cpu_brand_m3_ultra.txt",
    "wired_limit": "sysctl_iogpu_wired_limit_mb_507904.txt",
    "rdma_ctl": "rdma_ctl_enabled.txt", "ibv_devices": "ibv_devices_tb5.txt",
    "ibv_devinfo": "ibv_devinfo_tb5.txt", "thunderbolt": "system_profiler_tb5_pair_a.json",
    "hardware_ports": "networksetup_hardware_ports.txt", "bridge": "ifconfig_bridge0_active.txt",
}


def mac_facts(disk: Optional[dict] = None, **changes) -> dict:
    """Host facts of a recorded Mac: GOOD_MAC with `changes` ({key: fixture | MISSING |
    exception}); `disk`: the "disk" entry ({label: {"path", "exists", "free", "total"}})."""
    files = dict(GOOD_MAC, **changes)
    facts = hf.gather(runner(files), platform="darwin")
    facts["chip"] = hf.parse_chip(facts["outputs"].get("cpu_brand"))
    facts["disk"] = disk or {}
    return facts


def disk(path: str, free_gb: float, total_gb: float = 2000, exists: bool = True) -> dict:
    """A `hostfacts.disk_facts` entry (sizes in GB)."""
    return {"path": path, "exists": exists, "free": int(free_gb * 10**9),
            "total": int(total_gb * 10**9)}


def node_report(name: str, **changes):
    """`jaccl.NodeReport` of a recorded Mac (its RDMA devices and cabled ports), taken by
    `jaccl.local_report` from the recorded commands."""
    from kimi_mlx.cluster.net.jaccl import local_report

    return local_report(name, runner(dict(GOOD_MAC, **changes)), jaccl=True, mlx_version="0.32.4")


def node(name: str, clock_offset: float = 0.0, version: str = "0.1.0", mlx: str = "0.32.4",
         protocol: int = 7, usable: int = 496 * GiB, **changes):
    """`doctor.NodeFacts` of a recorded Mac answering Health: its host facts, RDMA report,
    and a clock `clock_offset` seconds off ours (a call of 10 ms)."""
    from kimi_mlx.cluster.doctor import NodeFacts

    facts = mac_facts({"models folder": disk("/Users/me/models", 900)}, **changes)
    facts["time"] = 1_000_000.005 + clock_offset
    return NodeFacts(name, f"{name}.local:52415", version, mlx, protocol,
                     json.loads(json.dumps(facts)), node_report(name, **changes),
                     1_000_000.0, 1_000_000.010, 512 * GiB, usable, 819 * 10**9, "m3-ultra")
