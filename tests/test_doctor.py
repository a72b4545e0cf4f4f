"""`kimi-mlx doctor` / `kimi-mlx cluster doctor` checks on recorded macOS command outputs
(tests/data/macos/doctor/, each file citing its public source): every check on a pass
and on each of its failures. Expected values are read off the fixtures and worked out
by hand here (GiB arithmetic, macOS's 3/4-of-RAM default), not computed by the code
under test."""

import json
import socket
import subprocess
import sys

import pytest

from doctor_cases import (GOOD_MAC, IFCONFIG_NO_BRIDGE, MISSING, GiB, disk, mac_facts, node,
                          node_report, recorded, runner)
from kimi_mlx.cluster import doctor as d
from kimi_mlx.cluster.doctor_run import DoctorSettings, cross_checks as d_cross, local_checks, nodes_checks
from kimi_mlx.cluster.net import hostfacts as hf

from pathlib import Path

REPO_MICRO = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro"
MICRO = str(REPO_MICRO)
RAM_MB = 512 * 1024  # hw.memsize 549755813888 = 512 GiB


def status(checks, name, node=""):
    found = [c for c in checks if c.name == name and c.node == node]
    assert len(found) == 1, (name, node, [c.line() for c in checks])
    return found[0]


# ---------------------------------------------------------------------------- parsers


def test_parsers_read_the_recorded_outputs():
    assert hf.parse_sw_vers(recorded("sw_vers_26.2.txt")) == {
        "ProductName": "macOS", "ProductVersion": "26.2", "BuildVersion": "25C56"}
    assert hf.parse_sysctl_int(recorded("sysctl_hw_memsize_512g.txt")) == 512 * GiB
    assert hf.parse_sysctl_int("549755813888\n") == 512 * GiB  # sysctl -n
    assert hf.parse_chip(recorded("sysctl_cpu_brand_m3_ultra.txt")) == "m3-ultra"
    assert hf.parse_rdma_ctl(recorded("rdma_ctl_enabled.txt")) == "enabled"
    assert hf.parse_rdma_ctl(recorded("rdma_ctl_disabled.txt")) == "disabled"
    b = hf.parse_ifconfig(recorded("ifconfig_bridge0_active.txt"))
    assert b == {"inet": [("169.254.61.20", 16)], "members": ["en2", "en3"], "status": "active"}
    assert hf.parse_ifconfig(recorded("ifconfig_bridge0_noaddr.txt"))["inet"] == []
    assert hf.max_gbps(hf.thunderbolt_speeds(recorded("system_profiler_tb4.json"))) == 40
    assert hf.max_gbps(hf.thunderbolt_speeds(recorded("system_profiler_tb5_pair_a.json"))) == 120


def test_wired_limit_mb_reads_sysctl_or_says_none():
    assert hf.wired_limit_mb(runner({"wired_limit": "sysctl_iogpu_wired_limit_mb_507904.txt"})) == 507904
    assert hf.wired_limit_mb(runner({"wired_limit": "sysctl_iogpu_wired_limit_mb_0.txt"})) == 0
    assert hf.wired_limit_mb(runner({})) is None  # Linux: no such sysctl program / key
    err = subprocess.CalledProcessError(1, ["sysctl"], "", "sysctl: unknown oid 'iogpu.wired_limit_mb'")
    assert hf.wired_limit_mb(runner({"wired_limit": err})) is None


def test_gather_on_linux_names_every_command_it_could_not_run(tmp_path):
    facts = hf.gather(runner({}), {"models folder": tmp_path / "not-yet"}, platform="linux")
    assert facts["outputs"] == {}
    assert set(facts["errors"]) == set(hf.COMMANDS)
    assert facts["errors"]["rdma_ctl"] == "rdma_ctl: not found"
    m = facts["disk"]["models folder"]
    assert m["exists"] is False and m["free"] > 0  # sized from its nearest parent


# ---------------------------------------------------------------------- one-Mac checks


def test_macos_version():
    assert d.check_macos(mac_facts()).status == d.OK
    assert "26.2 (25C56)" in d.check_macos(mac_facts()).message
    old = mac_facts()
    old["outputs"]["sw_vers"] = recorded("sw_vers_26.2.txt").replace("26.2", "13.4")
    c = d.check_macos(old)
    assert c.status == d.FAIL and "13.5" in c.message and c.fix
    assert d.check_macos(mac_facts(sw_vers=MISSING)).status == d.WARN
    assert d.check_macos({"platform": "linux", "outputs": {}, "errors": {}}).status == d.SKIP


def test_wired_limit_against_the_plan_and_the_ram():
    set_ = mac_facts()  # 507904 MB wired of 512 GiB
    c = d.check_wired(set_, 400 * GiB)
    assert c.status == d.OK and "507904" in c.message
    assert d.check_wired(set_, None).status == d.OK  # no --model: limit only
    unset = mac_facts(wired_limit="sysctl_iogpu_wired_limit_mb_0.txt")
    # macOS's default above 36 GiB is 3/4 of RAM: 384 GiB = 393216 MB
    assert d.check_wired(unset, 380 * GiB).status == d.OK
    c = d.check_wired(unset, 450 * GiB + 1)
    assert c.status == d.FAIL and "393216" in c.message
    assert c.fix.startswith("sudo sysctl iogpu.wired_limit_mb=461824")  # 451 GiB, whole GiB up
    c = d.check_wired(unset, 510 * GiB)  # more than 512 GiB - 8 GiB for macOS
    assert c.status == d.FAIL and "more Macs" in c.fix
    above = mac_facts()
    above["outputs"]["wired_limit"] = "iogpu.wired_limit_mb: 600000\n"
    c = d.check_wired(above, None)
    assert c.status == d.FAIL and c.fix == f"sudo sysctl iogpu.wired_limit_mb={RAM_MB - 8192}"
    tight = mac_facts()
    tight["outputs"]["wired_limit"] = f"iogpu.wired_limit_mb: {RAM_MB - 4096}\n"
    assert d.check_wired(tight, None).status == d.WARN
    assert d.check_wired(mac_facts(wired_limit=MISSING), None).status == d.WARN
    assert d.check_wired({"platform": "linux", "outputs": {}, "errors": {}}, 1).status == d.SKIP


def test_disk():
    assert d.check_disk("checkpoint", disk("/m", 500)).status == d.OK
    assert d.check_disk("checkpoint", disk("/m", 5)).status == d.WARN
    c = d.check_disk("prompt cache", disk("/c", 20), need_bytes=32 * GiB)
    assert c.status == d.FAIL and "34.4 GB" in c.message  # 32 GiB
    assert d.check_disk("prompt cache", disk("/c", 40), need_bytes=32 * GiB).status == d.OK
    assert d.check_disk("x", {"path": "/x", "exists": False, "error": "Permission denied"}).status == d.FAIL
    assert d.check_disk("x", None).status == d.SKIP


def test_rdma_enabled_disabled_and_thunderbolt4_without_devices():
    c = d.check_rdma(mac_facts())
    assert c.status == d.OK and "rdma_en2, rdma_en3, rdma_en4" in c.message
    off = mac_facts(rdma_ctl="rdma_ctl_disabled.txt", ibv_devices="ibv_devices_none.txt")
    assert d.check_rdma(off).status == d.WARN
    c = d.check_rdma(off, need=True)
    assert c.status == d.FAIL and "rdma_ctl enable" in c.fix and "Recovery" in c.fix
    tb4 = mac_facts(ibv_devices="ibv_devices_none.txt", thunderbolt="system_profiler_tb4.json")
    c = d.check_rdma(tb4)
    assert c.status == d.WARN and "Thunderbolt 4" in c.message and "--backend ring" in c.fix
    assert "Recovery" not in c.fix  # nothing to enable: the hardware cannot
    tb5_empty = mac_facts(ibv_devices="ibv_devices_none.txt")
    c = d.check_rdma(tb5_empty, need=True)
    assert c.status == d.FAIL and "Thunderbolt 4" not in c.message
    c = d.check_rdma(mac_facts(rdma_ctl=MISSING), need=True)
    assert c.status == d.FAIL and "26.2" in c.message


def test_odd_outputs_warn_instead_of_raising():
    odd = mac_facts()
    odd["outputs"]["rdma_ctl"] = "rdma_ctl: unknown state\n"
    c = d.check_rdma(odd)
    assert c.status == d.WARN and "unknown state" in c.message
    odd["outputs"]["thunderbolt"] = "not json"
    assert d.check_thunderbolt(odd).status == d.WARN
    assert d.check_wired(mac_facts(memsize=MISSING), 1).status == d.WARN


def test_thunderbolt_ports_cabled():
    c = d.check_thunderbolt(mac_facts())
    assert c.status == d.OK and c.message == "en4 -> Mac 88F10ACA"  # receptacle 3 = en4
    none = mac_facts(thunderbolt="system_profiler_tb5_uncabled_a.json")
    assert d.check_thunderbolt(none).status == d.WARN
    assert d.check_thunderbolt(none, need=True).status == d.FAIL


def test_bridge0_address():
    c = d.check_bridge(mac_facts())
    assert c.status == d.OK and c.message.startswith("169.254.61.20/16 (en2,en3")
    c = d.check_bridge(mac_facts(bridge="ifconfig_bridge0_noaddr.txt"))
    assert c.status == d.WARN and "no IPv4" in c.message
    c = d.check_bridge(mac_facts(bridge=IFCONFIG_NO_BRIDGE))
    assert c.status == d.WARN and "does not exist" in c.message


def test_metal_and_kernel_checks():
    assert d.check_metal(False, "darwin", {}, "auto")[0].status == d.FAIL
    assert d.check_metal(False, "linux", {}, "auto")[0].status == d.SKIP
    ok = d.check_metal(True, "darwin", {"kda_decode": "ok", "kda_prefill": "ok"}, "auto")
    assert [c.status for c in ok] == [d.OK, d.OK]
    bad = d.check_metal(True, "darwin", {"kda_decode": "ok", "dsa_index_topk": "mismatch 0.3"}, "auto")
    assert [(c.name, c.status) for c in bad] == [
        ("metal", d.OK), ("kernel dsa_index_topk", d.WARN), ("kernels", d.OK)]
    assert "mismatch 0.3" in bad[1].message
    assert d.check_metal(True, "darwin", {}, "auto")[1].status == d.WARN  # nothing checked
    assert d.check_metal(True, "darwin", {}, "reference")[1].status == d.OK


def test_bandwidth_and_decode_against_the_planner():
    c = d.check_bandwidth(700e9, 819 * 10**9, "m3-ultra")
    assert c.status == d.OK and "85%" in c.message  # 700 / 819
    assert d.check_bandwidth(300e9, 819 * 10**9, "m3-ultra").status == d.WARN
    assert d.check_bandwidth(5e9, 0, "").status == d.WARN
    assert d.check_bandwidth(5e9, 0, "").fix.endswith("--bandwidth-gbs 5` on this machine")
    assert d.check_decode(20.0, 25.0).status == d.OK
    c = d.check_decode(5.0, 25.0)
    assert c.status == d.WARN and "20%" in c.message
    assert d.check_decode(None, None, why_not="no --model").status == d.SKIP


def test_copy_bandwidth_measures_something_plausible():
    bw = d.copy_bandwidth(size_mb=16, repeats=2)
    assert 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s


# ------------------------------------------------------------------ cluster-wide checks


def test_port_reachable_and_refused():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        assert d.check_port(f"127.0.0.1:{port}", "127.0.0.1", port).status == d.OK
    finally:
        srv.close()
    c = d.check_port(f"127.0.0.1:{port}", "127.0.0.1", port)  # nothing listens now
    assert c.status == d.FAIL and "cluster serve" in c.fix


def test_clock_skew():
    assert d.check_clock(100.3, 100.0, 100.2).status == d.OK
    c = d.check_clock(105.1, 100.0, 100.2)
    assert c.status == d.WARN and "+5.000 s" in c.message
    assert d.check_clock(500.1, 100.0, 100.2).status == d.FAIL  # 400 s > auth's 300 s
    assert d.check_clock(None, 0, 0).status == d.SKIP


def test_zeroconf_visibility():
    assert d.check_zeroconf("a:1", ["a:1", "b:2"], 3).status == d.OK
    c = d.check_zeroconf("c:3", ["a:1"], 3)
    assert c.status == d.WARN and "a:1" in c.message


def test_cabling_every_pair():
    a = node_report("mac-a")
    b = node_report("mac-b", thunderbolt="system_profiler_tb5_pair_b.json")
    assert d.check_cabling([a, b]).status == d.OK
    lone_a = node_report("mac-a", thunderbolt="system_profiler_tb5_uncabled_a.json")
    lone = node_report("mac-b", thunderbolt="system_profiler_tb5_uncabled_b.json")
    c = d.check_cabling([lone_a, lone])
    assert c.status == d.WARN and "between mac-a and mac-b" in c.message
    assert d.check_cabling([lone_a, lone], need=True).status == d.FAIL
    assert d.check_cabling([a]).status == d.SKIP


def test_mlx_and_macos_differ_fail_only_where_jaccl_would_run():
    a, b = node("mac-a"), node("mac-b", mlx="0.31.2", sw_vers="sw_vers_26.5.1.txt")
    head = {"kimi-mlx": "0.1.0", "MLX": "0.32.4", "stage protocol": "7"}
    ring = {c.name: c.status for c in d_cross(head, [a, b], "ring")}
    assert ring["MLX version"] == d.WARN and ring["macOS versions"] == d.WARN
    auto = {c.name: c.status for c in d_cross(head, [a, b], "auto")}  # RDMA on both: jaccl
    assert auto["MLX version"] == d.FAIL and auto["macOS versions"] == d.FAIL
    newer = {c.name: c.status for c in d_cross(head, [node("mac-a", protocol=8)], "ring")}
    assert newer["stage protocol"] == d.FAIL


def test_secret_missing_is_a_fail(tmp_path):
    from kimi_mlx.cluster.doctor_run import cluster_checks

    checks = cluster_checks(DoctorSettings(), "127.0.0.1:9", tmp_path / "none.key", browse_s=0.3,
                            interface="127.0.0.1")
    assert status(checks, "secret").status == d.FAIL


def test_bridge_subnets_shared():
    active = hf.parse_ifconfig(recorded("ifconfig_bridge0_active.txt"))["inet"]  # 169.254.61.20/16
    c = d.check_bridge_subnets({"mac-a": active, "mac-b": [("169.254.7.9", 16)]})
    assert c.status == d.OK and "169.254.0.0/16" in c.message
    c = d.check_bridge_subnets({"mac-a": active, "mac-b": [("10.10.0.2", 24)]})
    assert c.status == d.WARN and "mac-b: 10.10.0.0/24" in c.message
    assert d.check_bridge_subnets({"mac-a": active, "mac-b": []}).status == d.SKIP


def test_versions_equal_across_nodes():
    c = d.check_same("v", {"this head": "1", "a": "1"}, "kimi-mlx", "fix")
    assert c.status == d.OK
    c = d.check_same("v", {"this head": "1", "a": "1", "b": "2"}, "kimi-mlx", "fix")
    assert c.status == d.FAIL and c.message == "kimi-mlx differs (1: this head, a; 2: b)"


# --------------------------------------------------------------- recorded whole reports


def test_local_all_ok_on_the_recorded_mac():
    facts = mac_facts({"checkpoint": disk("/Users/me/models/micro", 900)})
    checks = local_checks(DoctorSettings(model=MICRO, measure=False), facts)
    assert not [c for c in checks if c.status in (d.WARN, d.FAIL)], d.render(checks)
    assert d.exit_status(checks) == 0


def test_local_three_failures_on_the_recorded_mac():
    facts = mac_facts({}, rdma_ctl="rdma_ctl_disabled.txt", ibv_devices="ibv_devices_none.txt",
                      wired_limit="sysctl_iogpu_wired_limit_mb_0.txt")
    s = DoctorSettings(model="moonshotai/Kimi-K3.1-Pro", backend="jaccl", measure=False)
    checks = local_checks(s, facts)
    failed = sorted(c.name for c in checks if c.status == d.FAIL)
    assert failed == ["disk checkpoint", "rdma", "wired-limit"], d.render(checks)
    assert d.exit_status(checks) == 1
    js = json.loads(d.render(checks, as_json=True))
    assert js["ok"] is False and js["summary"]["FAIL"] == 3


def test_cluster_all_ok_on_two_recorded_macs():
    a = node("mac-a")
    b = node("mac-b", thunderbolt="system_profiler_tb5_pair_b.json")
    checks = nodes_checks(DoctorSettings(model=MICRO), [a, b])
    assert not [c for c in checks if c.status in (d.WARN, d.FAIL)], d.render(checks)


def test_cluster_three_failures_on_two_recorded_macs():
    a = node("mac-a", thunderbolt="system_profiler_tb5_uncabled_a.json")
    b = node("mac-b", clock_offset=400.0, sw_vers="sw_vers_26.5.1.txt",
             thunderbolt="system_profiler_tb5_uncabled_b.json")
    checks = nodes_checks(DoctorSettings(model=MICRO, backend="jaccl"), [a, b])
    failed = [(c.node, c.name) for c in checks if c.status == d.FAIL]
    assert failed == [("mac-b", "clock"), ("", "macOS versions"), ("", "cabling")], d.render(checks)
    assert "26.2: mac-a; 26.5.1: mac-b" in status(checks, "macOS versions").message


def test_cluster_wired_limit_against_each_nodes_stage():
    """K3.1 over four 512 GB Macs: each stage needs more than macOS's default 384 GiB
    (as `kimi-mlx plan --macs 4x512GB` says), so a node with the limit unset FAILs with
    the sysctl to run and one with 507904 MB passes."""
    nodes = [node(f"mac-{i}") for i in range(3)]
    nodes.append(node("mac-3", wired_limit="sysctl_iogpu_wired_limit_mb_0.txt"))
    checks = nodes_checks(DoctorSettings(model="moonshotai/Kimi-K3.1-Pro", backend="ring"), nodes)
    assert status(checks, "wired-limit", "mac-0").status == d.OK
    c = status(checks, "wired-limit", "mac-3")
    assert c.status == d.FAIL and c.fix.startswith("sudo sysctl iogpu.wired_limit_mb=")


def test_older_node_without_host_facts_is_skipped_not_failed():
    n = node("mac-a")
    n.facts = None
    checks = nodes_checks(DoctorSettings(), [n])
    assert status(checks, "host facts", "mac-a").status == d.SKIP


# ----------------------------------------------------------------------------- commands


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_doctor_on_this_linux_machine_says_what_it_cannot_check():
    r = _cli("doctor", "--no-measure", "--json")
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    by = {c["name"]: c["status"] for c in js["checks"]}
    if sys.platform != "darwin":
        for name in ("macos", "wired-limit", "rdma", "thunderbolt", "bridge0"):
            assert by[name] == "SKIP", js
    assert js["summary"]["FAIL"] == 0


def test_doctor_replays_recorded_facts_and_exits_1_on_a_fail(tmp_path):
    facts = mac_facts({}, rdma_ctl="rdma_ctl_disabled.txt", ibv_devices="ibv_devices_none.txt")
    f = tmp_path / "facts.json"
    f.write_text(json.dumps(facts))
    r = _cli("doctor", "--facts", str(f), "--backend", "jaccl")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL  rdma: rdma_ctl status: disabled" in r.stdout
    r = _cli("doctor", "--facts", str(f))
    assert r.returncode == 0, r.stdout + r.stderr  # WARN only without --backend jaccl


def test_cluster_doctor_with_a_node_that_is_down(tmp_path):
    from kimi_mlx.cluster.net.auth import init_secret
    from kimi_mlx.testing.ports import free_ports

    secret = init_secret(tmp_path / "cluster.key")
    port = free_ports(1)[0]
    r = _cli("cluster", "doctor", "--nodes", f"127.0.0.1:{port}", "--secret-file", str(secret),
             "--discover-timeout", "0.5")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAIL  [127.0.0.1:{port}] port:" in r.stdout


def test_cluster_doctor_on_two_loopback_nodes(tmp_path):
    """Two real `cluster serve` processes on loopback, one advertising over zeroconf: the
    doctor reaches both, reads their host facts from Health (clock, models folder) and
    finds versions equal; the node without an advertisement is the only WARN."""
    from kimi_mlx.testing.cluster import LocalCluster

    c = LocalCluster(tmp_path, n=2, prefix="dr", ckpt=REPO_MICRO,
                     extras=[[], ["--no-advertise"]], advertise=True)
    from kimi_mlx.cluster.net.auth import init_secret

    other = init_secret(tmp_path / "other.key")
    try:
        nodes = ",".join(p.address for p in c.procs)
        r = _cli("cluster", "doctor", "--nodes", nodes, "--secret-file", str(c.secret_file),
                 "--interface", "127.0.0.1", "--discover-timeout", "1.5", "--json", timeout=240)
        wrong = _cli("cluster", "doctor", "--nodes", nodes, "--secret-file", str(other),
                     "--interface", "127.0.0.1", "--discover-timeout", "0.5", timeout=240)
    finally:
        c.stop()
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    fails = [l for l in wrong.stdout.splitlines() if l.startswith("FAIL")]
    assert len(fails) == 2 and all("another cluster secret" in l for l in fails), wrong.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    js = json.loads(r.stdout)
    by = {(x["node"], x["name"]): x for x in js["checks"]}
    for n in ("dr0", "dr1"):
        assert by[(n, "port")]["status"] == "OK"
        assert by[(n, "health")]["status"] == "OK"
        assert by[(n, "clock")]["status"] == "OK"  # same machine, same clock
        assert by[(n, "disk models folder")]["status"] == "OK"
        assert by[(n, "disk models folder")]["message"].startswith(str(tmp_path / "models"))
    for name in ("stage protocol", "kimi-mlx version", "MLX version"):
        assert by[("", name)]["status"] == "OK"
    assert by[("dr0", "zeroconf")]["status"] == "OK"
    assert by[("dr1", "zeroconf")]["status"] == "WARN"
    assert js["summary"]["FAIL"] == 0


def test_node_host_facts_never_hold_a_health_reply_up(monkeypatch):
    """A node's facts are gathered in the background: while the commands run, Health says
    "pending" after a bounded wait; then the facts, each with the clock of that moment."""
    import threading
    import time

    release = threading.Event()

    def slow_gather(paths=None, **_):
        release.wait(10)
        return {"platform": "darwin", "outputs": {"sw_vers": "x"}, "errors": {}, "disk": {},
                "time": 0.0}

    monkeypatch.setattr(hf, "gather", slow_gather)
    paths = {"models folder": None, "test": "pending-case"}
    t = time.monotonic()
    first = json.loads(hf.cached_facts_json(paths, wait_s=0.2))
    assert time.monotonic() - t < 2.0 and first["pending"] is True
    release.set()
    deadline = time.monotonic() + 10
    while True:
        got = json.loads(hf.cached_facts_json(paths, wait_s=0.2))
        if not got.get("pending") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got["outputs"] == {"sw_vers": "x"} and abs(got["time"] - time.time()) < 5
