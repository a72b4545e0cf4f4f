"""JACCL set-up from node reports (`kimi_mlx.cluster.jaccl`), on recorded-format command
output and fake reports: no RDMA hardware here, so no real jaccl group is formed.

The expected device matrices are written out by hand from the cabling each test
describes (and, for the 4-Mac mesh, MLX's own documented example in
docs/src/usage/distributed.rst), not computed by the code under test."""

import json
import os
import subprocess

import pytest

from kimi_mlx.cluster.net import jaccl
from kimi_mlx.cluster.net.jaccl import JacclError, NodeReport, Port

IBV_DEVICES = """    device          \t   node GUID
    ------          \t----------------
    rdma_en2        \t8096a9d9edbaac05
    rdma_en3        \t8196a9d9edbaac05
    rdma_en5        \t8396a9d9edbaac05
"""

IBV_DEVINFO = """hca_id:\trdma_en2
\ttransport:\t\t\tInfiniBand (0)
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tmax_mtu:\t\t4096 (5)

hca_id:\trdma_en3
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)

hca_id:\trdma_en5
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
"""

HARDWARE_PORTS = """
Hardware Port: Ethernet
Device: en0
Ethernet Address: 00:00:00:00:00:01

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: 36:00:00:00:00:01

Hardware Port: Thunderbolt 2
Device: en3
Ethernet Address: 36:00:00:00:00:02

Hardware Port: Thunderbolt 3
Device: en5
Ethernet Address: 36:00:00:00:00:03

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: 36:00:00:00:00:00
"""


def profile(ports):
    """system_profiler SPThunderboltDataType -json for receptacles {tag: (own uuid,
    peer uuid or None)}, shaped as macOS writes it (a bus entry per receptacle)."""
    entries = [{"_name": "thunderbolt_bus", "device_name_key": "Mac Studio",
                "domain_uuid_key": uuid, "receptacle_1_tag": {"receptacle_id_key": str(tag)},
                "_items": ([{"_name": "Mac Studio", "domain_uuid_key": peer, "mode_key": "TB5"}]
                           if peer else [])}
               for tag, (uuid, peer) in ports.items()]
    entries.append({"_name": "thunderbolt_bus", "receptacle_1_tag": {"receptacle_id_key": "9"}})
    return json.dumps({"SPThunderboltDataType": entries})


def runner(outputs):
    def run(cmd):
        out = outputs.get(cmd[0])
        if out is None:
            raise FileNotFoundError(cmd[0])
        if isinstance(out, Exception):
            raise out
        return out
    return run


def test_parsers_on_recorded_output():
    assert jaccl.parse_ibv_devices(IBV_DEVICES) == ["rdma_en2", "rdma_en3", "rdma_en5"]
    assert jaccl.parse_ibv_devinfo(IBV_DEVINFO) == {
        "rdma_en2": "PORT_ACTIVE", "rdma_en3": "PORT_ACTIVE", "rdma_en5": "PORT_DOWN"}
    hw = jaccl.parse_hardware_ports(HARDWARE_PORTS)
    assert hw["Thunderbolt 2"] == "en3" and hw["Thunderbolt Bridge"] == "bridge0"
    ports = jaccl.parse_thunderbolt(profile({1: ("A1", "B1"), 2: ("A2", None)}), hw)
    assert ports == [Port("en2", "A1", "B1"), Port("en3", "A2", None)]
    with pytest.raises(JacclError, match="SPThunderboltDataType"):
        jaccl.parse_thunderbolt("not json", hw)


def test_local_report_from_injected_commands():
    r = jaccl.local_report("node mac-1", runner({
        "ibv_devices": IBV_DEVICES, "ibv_devinfo": IBV_DEVINFO, "networksetup": HARDWARE_PORTS,
        "system_profiler": profile({1: ("A1", "B1"), 3: ("A3", "C1")})}),
        jaccl=True, mlx_version="0.32.4")
    assert r.problem == ""
    assert r.rdma_devices == ["rdma_en2", "rdma_en3", "rdma_en5"] and r.inactive == ["rdma_en5"]
    assert [p.iface for p in r.ports] == ["en2", "en5"]
    assert NodeReport.from_json(r.to_json()) == r
    # Linux / RDMA tools absent: a report that says so, no exception
    linux = jaccl.local_report("node box", runner({}), jaccl=False, mlx_version="0.32.4")
    assert linux.problem == "ibv_devices: not found" and linux.rdma_devices == []
    failing = jaccl.local_report("node x", runner({
        "ibv_devices": subprocess.CalledProcessError(1, "ibv_devices")}), True, "0.32.4")
    assert "ibv_devices" in failing.problem


def mesh_reports(n, cabled=None):
    """n Macs; node i's port to node j is interface en(10*i + j) with UUID "u<i>-<j>";
    `cabled`: the pairs with a cable (default all)."""
    pairs = cabled if cabled is not None else {(i, j) for i in range(n) for j in range(i + 1, n)}
    reports = []
    for i in range(n):
        ports, devs = [], []
        for j in range(n):
            if i == j:
                continue
            on = (min(i, j), max(i, j)) in pairs
            ports.append(Port(f"en{10 * i + j}", f"u{i}-{j}", f"u{j}-{i}" if on else None))
            devs.append(f"rdma_en{10 * i + j}")
        reports.append(NodeReport(f"node mac-{i}", ports, devs, [], True, "0.32.4"))
    return reports


def test_full_mesh_gives_mlx_s_matrix_and_auto_picks_jaccl():
    reports = mesh_reports(3)
    want = [[None, "rdma_en1", "rdma_en2"],
            ["rdma_en10", None, "rdma_en12"],
            ["rdma_en20", "rdma_en21", None]]
    assert jaccl.device_matrix(reports) == want
    backend, matrix, _ = jaccl.choose(reports)
    assert (backend, matrix) == ("jaccl", want)
    assert jaccl.choose(reports, "ring")[:2] == ("ring", None)


def test_mlx_docs_four_mac_mesh():
    """MLX's documented 4-Mac mesh (usage/distributed.rst): the same matrix back."""
    doc = [[None, "rdma_en5", "rdma_en4", "rdma_en3"],
           ["rdma_en5", None, "rdma_en3", "rdma_en4"],
           ["rdma_en4", "rdma_en3", None, "rdma_en5"],
           ["rdma_en3", "rdma_en4", "rdma_en5", None]]
    reports = []
    for i, row in enumerate(doc):
        ports = [Port(dev[5:], f"m{i}-{dev}", f"m{j}-{doc[j][i]}")
                 for j, dev in enumerate(row) if dev]
        reports.append(NodeReport(f"node m3-ultra-{i + 1}", ports, [d for d in row if d], [],
                                  True, "0.32.4"))
    assert jaccl.device_matrix(reports) == doc


@pytest.mark.parametrize("case,names,why", [
    ("missing pair", ["node mac-0 and node mac-2"], "no Thunderbolt cable"),
    ("rdma off", ["node mac-1"], "rdma_ctl enable"),
    ("no jaccl", ["node mac-2"], "has no jaccl backend"),
    ("version", ["node mac-1"], "MLX 0.31.0"),
    ("inactive", ["node mac-0"], "rdma_en1 (cabled to node mac-1) is not active"),
    ("no tools", ["node mac-2"], "ibv_devices: not found"),
])
def test_a_node_that_cannot_join_is_refused_by_name_and_auto_falls_back_to_ring(case, names, why):
    reports = mesh_reports(3, cabled={(0, 1), (1, 2)} if case == "missing pair" else None)
    if case == "rdma off":
        reports[1].rdma_devices = []
    elif case == "no jaccl":
        reports[2].jaccl = False
    elif case == "version":
        reports[1].mlx_version = "0.31.0"
    elif case == "inactive":
        reports[0].inactive = ["rdma_en1"]
    elif case == "no tools":
        reports[2].problem = "ibv_devices: not found"
        reports[2].rdma_devices = []
    with pytest.raises(JacclError) as e:
        jaccl.choose(reports, "jaccl")
    for name in names:
        assert name in str(e.value)
    assert why in str(e.value)
    backend, matrix, reason = jaccl.choose(reports)
    assert (backend, matrix) == ("ring", None) and why in reason


def test_a_cabled_port_without_its_rdma_device_is_named():
    reports = mesh_reports(2)
    reports[1].rdma_devices = ["rdma_en99"]
    with pytest.raises(JacclError, match=r"node mac-1: en10 is cabled to node mac-0 but has no "
                                         r"RDMA device rdma_en10"):
        jaccl.device_matrix(reports)


def test_rank_env_writes_the_device_file_mlx_reads(tmp_path):
    matrix = jaccl.device_matrix(mesh_reports(2))
    payload = jaccl.hosts_payload(matrix, "192.168.1.1:52000")
    env, path = jaccl.rank_env(payload, 1, str(tmp_path))
    assert env["MLX_RANK"] == "1" and env["MLX_JACCL_COORDINATOR"] == "192.168.1.1:52000"
    assert env["MLX_IBV_DEVICES"] == path
    with open(path) as f:
        assert json.load(f) == [[None, "rdma_en1"], ["rdma_en10", None]]
    os.unlink(path)
    with pytest.raises(JacclError, match="not square"):
        jaccl.rank_env(jaccl.hosts_payload([[None]], "h:1"), 1)
    with pytest.raises(JacclError, match="coordinator"):
        jaccl.rank_env(json.dumps({"devices": matrix}), 0)


def test_choose_backend_takes_the_reports():
    """The launcher's choice (`cluster.tensor.choose_backend`): auto is jaccl only with a
    full RDMA mesh and jaccl in every MLX; a forced jaccl names the node that cannot join."""
    from kimi_mlx.cluster.tensor.group import TensorSetupError, choose_backend

    both = {"this head": ["ring", "jaccl"], "node mac-1": ["ring", "jaccl"]}
    reports = mesh_reports(2)
    assert choose_backend(both, None, reports) == "jaccl"
    assert choose_backend(both, "auto", reports) == "jaccl"
    assert choose_backend(both, "ring", reports) == "ring"
    assert choose_backend({**both, "node mac-1": ["ring"]}, None, reports) == "ring"
    reports[1].rdma_devices = []
    assert choose_backend(both, None, reports) == "ring"
    with pytest.raises(TensorSetupError, match=r"node mac-1: no RDMA devices"):
        choose_backend(both, "jaccl", reports)


def test_rank_process_gets_jaccl_s_environment(tmp_path, monkeypatch):
    """A node's rank for a jaccl group starts with MLX_RANK, MLX_JACCL_COORDINATOR and
    MLX_IBV_DEVICES (the device file removed when the rank is killed)."""
    from kimi_mlx.cluster.node import rank as tensor

    seen = {}

    class FakePopen:
        def __init__(self, cmd, env, stdin):
            seen.update(cmd=cmd, env=env)
            with open(env["MLX_IBV_DEVICES"]) as f:
                seen["devices"] = json.load(f)
            self.pid = 1

        def poll(self):
            return 0

        def wait(self, *a):
            return 0

    monkeypatch.setattr(tensor.subprocess, "Popen", FakePopen)
    payload = jaccl.hosts_payload(jaccl.device_matrix(mesh_reports(2)), "10.0.0.1:5000")
    rank = tensor.RankProcess(tmp_path, 1, 2, "jaccl", payload, "mac-1")
    assert seen["env"]["MLX_RANK"] == "1"
    assert seen["env"]["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5000"
    assert seen["devices"] == [[None, "rdma_en1"], ["rdma_en10", None]]
    assert "--backend" in seen["cmd"] and "jaccl" in seen["cmd"]
    rank.kill()
    assert not os.path.exists(seen["env"]["MLX_IBV_DEVICES"])
