"""Zeroconf discovery: each `kimi-mlx cluster serve` advertises `_kimi-mlx._tcp.local.`.

TXT record keys (all strings; sizes in bytes):

| key | value |
|---|---|
| id | node id (unique in the cluster; default: the host name) |
| proto | stage protocol version (`wire.PROTOCOL_VERSION`) |
| ver, mlx, py | kimi-mlx, MLX and Python versions |
| mem, usable | total RAM and the memory the stage may use (macOS: `hw.memsize` and `iogpu.wired_limit_mb`, else the planner's rule; Linux: /proc/meminfo) |
| wired_mb | macOS `iogpu.wired_limit_mb` (0 = macOS default) |
| chip, bw | chip (`m3-ultra`) and its memory bandwidth in bytes/s, where known |
| key | id of the cluster secret in use (`auth.key_id`), so a head can name a node with another secret |
| tls | "1" when the service wants TLS |
| fp0, fp1, ... | fingerprints of the checkpoints in its models folder |

What is advertised is a claim: the launcher confirms every node with an authenticated
`Health` call before using it, so stale records (ghost peers) and foreign services are
reported and skipped, never planned on.
"""

from __future__ import annotations

import logging
import platform
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

SERVICE_TYPE = "_kimi-mlx._tcp.local."
DEFAULT_PORT = 52415
MAX_FINGERPRINTS = 32
# Used for planning when a node's chip is unknown (Linux hosts, unknown Macs).
UNKNOWN_BANDWIDTH = 100 * 10**9

log = logging.getLogger(__name__)


@dataclass
class NodeInfo:
    """A node as advertised (or as reported by its Health call).

    Attributes:
        node_id: unique name. host/port: where its stage service listens.
        protocol: stage protocol version. version/mlx_version: package versions.
        total_memory/usable_memory: bytes. chip: e.g. "m3-ultra" ("" unknown).
        bandwidth: bytes/s (0 unknown). fingerprints: checkpoints it holds.
        key_id: id of its cluster secret. tls: wants TLS.
    """

    node_id: str
    host: str
    port: int
    protocol: int = 0
    version: str = ""
    mlx_version: str = ""
    total_memory: int = 0
    usable_memory: int = 0
    chip: str = ""
    bandwidth: int = 0
    fingerprints: List[str] = field(default_factory=list)
    key_id: str = ""
    tls: bool = False
    wired_mb: int = 0

    @property
    def address(self) -> str:
        """'host:port' (IPv6 hosts in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def planner_node(self):
        """The planner's `Node` for this machine (unknown bandwidth -> UNKNOWN_BANDWIDTH)."""
        from kimi_mlx.placement.planner import Node

        return Node(self.node_id, int(self.usable_memory), int(self.bandwidth or UNKNOWN_BANDWIDTH),
                    int(self.total_memory) or None, self.chip or None)


# -- this machine ---------------------------------------------------------------------

def _sysctl(name: str) -> Optional[str]:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def local_memory() -> Tuple[int, int, int]:
    """(total bytes, usable bytes, wired_limit_mb) of this machine.

    macOS: `hw.memsize` and `iogpu.wired_limit_mb` (usable per `planner.usable_bytes_for_ram`:
    the wired limit when set, else the limit kimi-mlx asks a dedicated node to set).
    Linux: MemTotal from /proc/meminfo, usable by the same rule. 0s when unknown.
    """
    from kimi_mlx.placement.planner import usable_bytes_for_ram

    total, wired = 0, 0
    if platform.system() == "Darwin":
        total = int(_sysctl("hw.memsize") or 0)
        wired = int(_sysctl("iogpu.wired_limit_mb") or 0)
    else:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        total = int(line.split()[1]) * 1024
        except OSError:
            pass
    usable = usable_bytes_for_ram(total, wired or None) if total else 0
    return total, usable, wired


def local_chip() -> Tuple[str, int]:
    """(chip, bandwidth bytes/s) for Apple Silicon ('m3-ultra', ...); ('', 0) elsewhere."""
    from kimi_mlx.placement.planner import MAC_BANDWIDTH

    if platform.system() != "Darwin":
        return "", 0
    brand = _sysctl("machdep.cpu.brand_string") or ""
    m = re.search(r"Apple (M\d)(?: (Pro|Max|Ultra))?", brand)
    if not m:
        return "", 0
    chip = m.group(1).lower() + (f"-{m.group(2).lower()}" if m.group(2) else "")
    return chip, MAC_BANDWIDTH.get(chip, 0)


def _adapters():
    import ifaddr

    return ifaddr.get_adapters()


def interface_addresses(interface: Optional[str]) -> List[str]:
    """IPv4 addresses to advertise and listen on.

    Args:
        interface: an interface name (`bridge0`, `en0`, `eth0`) or an IPv4 address. None:
            on macOS the Thunderbolt bridge (`bridge0`) when it has an address, else every
            non-loopback IPv4 address.
    Raises:
        ValueError: the interface does not exist or has no IPv4 address.
    """
    adapters = _adapters()
    if interface:
        if re.match(r"^\d+\.\d+\.\d+\.\d+$", interface):
            return [interface]
        for a in adapters:
            if a.nice_name == interface or a.name == interface:
                ips = [ip.ip for ip in a.ips if isinstance(ip.ip, str)]
                if not ips:
                    raise ValueError(f"interface {interface} has no IPv4 address")
                return ips
        names = ", ".join(sorted({a.nice_name for a in adapters}))
        raise ValueError(f"no interface {interface!r} (have: {names})")
    if platform.system() == "Darwin":
        for a in adapters:
            if a.nice_name == "bridge0":
                ips = [ip.ip for ip in a.ips if isinstance(ip.ip, str)]
                if ips:
                    return ips
    ips = [ip.ip for a in adapters for ip in a.ips
           if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]
    return ips or ["127.0.0.1"]


# -- TXT records ----------------------------------------------------------------------

def to_properties(info: NodeInfo) -> Dict[str, str]:
    """TXT properties for a node (see the module doc)."""
    from kimi_mlx.cluster.net.wire import python_version

    props = {
        "id": info.node_id, "proto": str(info.protocol), "ver": info.version,
        "mlx": info.mlx_version, "py": python_version(), "mem": str(info.total_memory),
        "usable": str(info.usable_memory), "wired_mb": str(info.wired_mb), "chip": info.chip,
        "bw": str(info.bandwidth), "key": info.key_id, "tls": "1" if info.tls else "0",
    }
    for i, fp in enumerate(info.fingerprints[:MAX_FINGERPRINTS]):
        props[f"fp{i}"] = fp
    return props


def from_properties(props: Dict[bytes, Optional[bytes]], host: str, port: int) -> NodeInfo:
    """NodeInfo from TXT properties; missing or malformed numbers read as 0."""
    p = {k.decode(errors="replace"): (v or b"").decode(errors="replace") for k, v in props.items()}

    def num(key):
        try:
            return int(p.get(key, "0") or 0)
        except ValueError:
            return 0

    fps = [p[k] for k in sorted((k for k in p if re.match(r"^fp\d+$", k)), key=lambda k: int(k[2:]))]
    return NodeInfo(
        node_id=p.get("id", ""), host=host, port=port, protocol=num("proto"),
        version=p.get("ver", ""), mlx_version=p.get("mlx", ""), total_memory=num("mem"),
        usable_memory=num("usable"), chip=p.get("chip", ""), bandwidth=num("bw"),
        fingerprints=fps, key_id=p.get("key", ""), tls=p.get("tls") == "1", wired_mb=num("wired_mb"),
    )


def _label(node_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", node_id)[:63] or "node"


class Advertiser:
    """Registers one node's service record on the given addresses until `close()`.

    `close()` sends the mDNS goodbye, so browsers drop the node at once; a node that dies
    without it is dropped when its record expires (TTL `ttl` seconds) or, sooner, by the
    launcher's Health check.
    """

    def __init__(self, info: NodeInfo, addresses: List[str], ttl: int = 120):
        from zeroconf import IPVersion, ServiceInfo, Zeroconf

        self.zc = Zeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
        self.info = ServiceInfo(
            SERVICE_TYPE, f"{_label(info.node_id)}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addresses], port=info.port,
            properties=to_properties(info), server=f"{_label(info.node_id)}.local.",
            host_ttl=ttl, other_ttl=ttl,
        )
        # allow_name_change=False: two live nodes with one id is a configuration error.
        self.zc.register_service(self.info, allow_name_change=False)

    def update(self, info: NodeInfo) -> None:
        """Re-advertise with new properties (e.g. after a rescan of the models folder)."""
        self.info.properties = to_properties(info)
        self.zc.update_service(self.info)

    def close(self) -> None:
        """Unregister (mDNS goodbye) and stop the responder."""
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


# Measured on loopback with two advertised stages (python-zeroconf 0.154, 6 browses each):
# - the standard browser's first query asks for unicast answers (QU), which responders
#   send to port 5353, where another process sharing that port may take them: nodes seen
#   only after its second query, 1.0-1.2 s in (so `ls --timeout 1` found nothing);
# - a multicast (QM) first query: answered 0.1-0.27 s in, but every other browse heard
#   nothing (a responder multicasts a record at most once a second, RFC 6762 s. 6);
# - a query from our own ephemeral port (legacy unicast, RFC 6762 s. 6.7): answered
#   straight to that port 0.08-0.13 s in, every time.
# `browse` runs the last and a QM multicast browser side by side (the latter for networks
# that drop unicast UDP).
MIN_BROWSE_S = 0.3  # first query goes out after a random 20-120 ms, answers after up to 120 ms more


def browse(timeout: float = 3.0, interfaces: Optional[List[str]] = None) -> List[NodeInfo]:
    """Nodes that answer on mDNS within `timeout` seconds, sorted by node id.

    Browses twice at once: with a query from an ephemeral port (answered by unicast, at
    once) and with an ordinary multicast browser (see the note above `MIN_BROWSE_S`).

    Args:
        timeout: seconds to collect answers (at least MIN_BROWSE_S).
        interfaces: IPv4 addresses to browse on (see `interface_addresses`); None: all.
    Raises:
        ValueError: `timeout` below MIN_BROWSE_S (the message says why).
        OSError: neither browser could open its sockets.
    """
    from zeroconf import DNSQuestionType, IPVersion, ServiceBrowser, ServiceListener, Zeroconf

    if timeout < MIN_BROWSE_S:
        raise ValueError(f"a browse of {timeout:g} s is too short to hear any node: mDNS "
                         "queries go out after a random 20-120 ms and answers may take "
                         f"120 ms more (RFC 6762); use at least {MIN_BROWSE_S:g} s")
    names: List[Tuple[object, str]] = []
    lock = threading.Lock()

    class _Listener(ServiceListener):
        def add_service(self, zc, type_, name):
            with lock:
                names.append((zc, name))

        update_service = add_service

        def remove_service(self, zc, type_, name):
            pass

    zcs, browsers, errors = [], [], []
    for unicast in (True, False):
        try:
            zc = (Zeroconf(interfaces=interfaces, unicast=unicast) if interfaces
                  else Zeroconf(ip_version=IPVersion.V4Only, unicast=unicast))
        except OSError as e:
            errors.append(e)
            continue
        zcs.append(zc)
        # The unicast one keeps zeroconf's first question (QU): asked as QM it is held
        # back like any multicast answer (measured: every other browse heard nothing).
        browsers.append(ServiceBrowser(zc, SERVICE_TYPE, listener=_Listener(),
                                       question_type=None if unicast else DNSQuestionType.QM))
    if not zcs:
        raise errors[0]
    try:
        time.sleep(timeout)
        found: Dict[str, NodeInfo] = {}
        with lock:
            seen = list(dict.fromkeys(names))
        for zc, name in seen:
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=1000)
            if info is None or not info.addresses:
                continue
            addrs = info.parsed_addresses(IPVersion.V4Only)
            if interfaces:
                preferred = [a for a in addrs if _same_net(a, interfaces)]
                addrs = preferred or addrs
            if not addrs:
                continue
            node = from_properties(info.properties, addrs[0], info.port)
            if node.node_id:
                found.setdefault(node.node_id, node)
        return sorted(found.values(), key=lambda n: n.node_id)
    finally:
        for b in browsers:
            b.cancel()
        for zc in zcs:
            zc.close()


def _same_net(addr: str, interfaces: List[str]) -> bool:
    """Same /24 as one of our interface addresses (prefers the Thunderbolt-bridge address
    when a node advertises several)."""
    return any(addr.rsplit(".", 1)[0] == i.rsplit(".", 1)[0] for i in interfaces)
