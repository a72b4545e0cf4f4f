"""What `kimi-mlx doctor` needs to know about one machine, read from macOS's own tools
(`sw_vers`, `sysctl`, `rdma_ctl`, `ibv_devices`, `system_profiler`, `networksetup`,
`ifconfig`) and the disk, as raw command output in a JSON-able dict ("host facts").

The node daemon sends its facts in `HealthReply.host_facts` so `kimi-mlx cluster doctor`
can check a node it cannot log in to; `kimi-mlx doctor` gathers them for this machine.
Every reader takes a `run(cmd) -> stdout` callable (raises FileNotFoundError for a
missing program, `subprocess.CalledProcessError` / OSError for a failing one) so tests
feed recorded outputs (tests/data/macos/doctor/). Parsing is separate (`parse_*`), and
never raises on odd text: a value it cannot read is None.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

Runner = Callable[[Sequence[str]], str]

# key in facts["outputs"] -> the command whose stdout it holds
COMMANDS: Dict[str, List[str]] = {
    "sw_vers": ["sw_vers"],
    "memsize": ["sysctl", "hw.memsize"],
    "cpu_brand": ["sysctl", "machdep.cpu.brand_string"],
    "wired_limit": ["sysctl", "iogpu.wired_limit_mb"],
    "rdma_ctl": ["rdma_ctl", "status"],
    "ibv_devices": ["ibv_devices"],
    "thunderbolt": ["system_profiler", "SPThunderboltDataType", "-json"],
    "hardware_ports": ["networksetup", "-listallhardwareports"],
    "bridge": ["ifconfig", "bridge0"],
}


def run_command(cmd: Sequence[str]) -> str:
    """stdout of `cmd` (10 s limit). Raises FileNotFoundError (no such program),
    subprocess.CalledProcessError (non-zero exit, stderr kept) or TimeoutExpired."""
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=10,
                          check=True).stdout


def _one(run: Runner, cmd: Sequence[str]):
    """(stdout, None) or (None, why) for one command."""
    try:
        return run(cmd), None
    except FileNotFoundError:
        return None, f"{cmd[0]}: not found"
    except subprocess.CalledProcessError as e:
        err = (e.stderr or e.stdout or "").strip().splitlines()
        return None, f"{' '.join(cmd)}: exit {e.returncode}" + (f": {err[-1]}" if err else "")
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{' '.join(cmd)}: {e}"


def disk_facts(paths: Dict[str, Optional[Path]]) -> Dict[str, dict]:
    """{label: {"path", "exists", "free", "total"}} for each path (bytes; the volume of
    its nearest existing parent, so a folder not yet made is still sized)."""
    out: Dict[str, dict] = {}
    for label, path in paths.items():
        if path is None:
            continue
        p = Path(path).expanduser()
        probe = p
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            usage = shutil.disk_usage(probe)
            out[label] = {"path": str(p), "exists": p.exists(), "free": usage.free,
                          "total": usage.total}
        except OSError as e:
            out[label] = {"path": str(p), "exists": p.exists(), "error": str(e)}
    return out


def gather(run: Runner = run_command, paths: Optional[Dict[str, Optional[Path]]] = None,
           platform: Optional[str] = None) -> dict:
    """This machine's facts: {"platform", "outputs": {key: stdout}, "errors": {key: why},
    "disk": disk_facts(paths), "time": unix seconds}. Commands of `COMMANDS` that fail
    are in "errors" (on Linux: "sw_vers: not found" ...); nothing raises."""
    outputs, errors = {}, {}
    for key, cmd in COMMANDS.items():
        out, why = _one(run, cmd)
        if why is None:
            outputs[key] = out
        else:
            errors[key] = why
    return {"platform": platform or sys.platform, "outputs": outputs, "errors": errors,
            "disk": disk_facts(paths or {}), "time": time.time()}


# ------------------------------------------------------------------------------ parsers


def parse_sw_vers(text: Optional[str]) -> Dict[str, str]:
    """{"ProductName": "macOS", "ProductVersion": "26.2", "BuildVersion": "25C56"} from
    `sw_vers` ("Key:<tabs>value" lines); {} for None."""
    out = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def version_tuple(version: str) -> tuple:
    """'26.2.1' -> (26, 2, 1); non-numeric parts end it ('' -> ())."""
    parts = []
    for p in version.split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def parse_sysctl_int(text: Optional[str]) -> Optional[int]:
    """The integer of `sysctl NAME` ("hw.memsize: 549755813888") or `sysctl -n NAME`
    output; None when there is none."""
    if not text:
        return None
    m = re.search(r"(?:^|:)\s*(-?\d+)\s*$", text.strip())
    return int(m.group(1)) if m else None


def wired_limit_mb(run: Runner = run_command) -> Optional[int]:
    """macOS `sysctl iogpu.wired_limit_mb` (0: unset, macOS's default applies); None where
    it cannot be read (not macOS, or an older macOS without it)."""
    out, _ = _one(run, COMMANDS["wired_limit"])
    return parse_sysctl_int(out)


def parse_chip(text: Optional[str]) -> str:
    """'m3-ultra' from `sysctl machdep.cpu.brand_string` ("... Apple M3 Ultra"); '' when
    it names no Apple chip (the names `placement.planner.MAC_BANDWIDTH` uses)."""
    m = re.search(r"Apple (M\d)(?: (Pro|Max|Ultra))?", text or "")
    if not m:
        return ""
    return m.group(1).lower() + (f"-{m.group(2).lower()}" if m.group(2) else "")


def parse_rdma_ctl(text: Optional[str]) -> Optional[str]:
    """"enabled" / "disabled" from `rdma_ctl status`; None when it says neither."""
    words = (text or "").strip().lower().split()
    for w in words:
        if w in ("enabled", "disabled"):
            return w
    return None


def parse_ifconfig(text: Optional[str]) -> dict:
    """{"inet": [(address, prefix bits)], "members": [en1, ...], "status": "active" |
    "inactive" | ""} from `ifconfig IFACE` (macOS: netmask in hex)."""
    inet, members, status = [], [], ""
    for line in (text or "").splitlines():
        s = line.strip()
        m = re.match(r"inet (\d+\.\d+\.\d+\.\d+) netmask (0x[0-9a-fA-F]+|\d+\.\d+\.\d+\.\d+)", s)
        if m:
            mask = m.group(2)
            bits = (bin(int(mask, 16)).count("1") if mask.startswith("0x")
                    else sum(bin(int(o)).count("1") for o in mask.split(".")))
            inet.append((m.group(1), bits))
        m = re.match(r"member: (\S+)", s)
        if m:
            members.append(m.group(1))
        m = re.match(r"status: (\S+)", s)
        if m:
            status = m.group(1)
    return {"inet": inet, "members": members, "status": status}


def thunderbolt_speeds(profile: Optional[str]) -> List[str]:
    """The `current_speed_key` of every receptacle in `system_profiler
    SPThunderboltDataType -json` ("Up to 40 Gb/s" on Thunderbolt 4, "Up to 120 Gb/s" /
    "Up to 80 Gb/s" on Thunderbolt 5); [] when unreadable."""
    import json

    try:
        entries = json.loads(profile or "")["SPThunderboltDataType"]
    except (ValueError, KeyError, TypeError):
        return []
    return [str((t.get("receptacle_1_tag") or {}).get("current_speed_key", ""))
            for t in entries if isinstance(t, dict) and t.get("receptacle_1_tag")]


def max_gbps(speeds: Sequence[str]) -> Optional[int]:
    """The fastest "N Gb/s" in `speeds`, or None."""
    found = [int(m.group(1)) for s in speeds for m in [re.search(r"(\d+)\s*Gb/s", s)] if m]
    return max(found) if found else None


_LOCK = threading.Lock()
_CACHE: Dict[str, dict] = {}  # paths key -> {"at": gathered, "facts": dict | None, "thread"}


def _refresh(key: str, paths: Dict[str, Optional[Path]]) -> None:
    facts = gather(paths=paths)
    with _LOCK:
        _CACHE[key].update(at=time.time(), facts=facts)


def cached_facts_json(paths: Dict[str, Optional[Path]], ttl_s: float = 30.0,
                      wait_s: float = 1.0) -> str:
    """`gather(paths=paths)` as JSON for a node's Health reply, without holding the reply up:
    the commands run in a background thread, again once the last reading is `ttl_s`
    seconds old; the first call waits up to `wait_s` for them, and when they are not done
    yet answers {"pending": true} (the doctor asks again). "time" is always this moment's
    clock (for clock skew)."""
    import json

    key = repr(sorted((k, str(v)) for k, v in paths.items()))
    with _LOCK:
        st = _CACHE.setdefault(key, {"at": 0.0, "facts": None, "thread": None})
        if time.time() - st["at"] > ttl_s and not (st["thread"] and st["thread"].is_alive()):
            st["thread"] = threading.Thread(target=_refresh, args=(key, paths), daemon=True,
                                            name="kimi-mlx-hostfacts")
            st["thread"].start()
        thread, facts = st["thread"], st["facts"]
    if facts is None and thread is not None:
        thread.join(wait_s)
        with _LOCK:
            facts = st["facts"]
    if facts is None:
        return json.dumps({"platform": sys.platform, "pending": True, "time": time.time()})
    return json.dumps(dict(facts, time=time.time()))
