"""The macOS side of every platform branch in the product, run here with the platform faked.

`REGISTRY` maps each function of the product that branches on the platform (sys.platform,
platform.system(), /proc, memfd, sysctl, ps, "darwin") to the test below that runs its
macOS side; `test_every_platform_branch_has_a_test` finds the branches by reading the
source (AST) and fails for one that is not in the registry, so a new branch needs a test.
Command outputs are recorded macOS outputs (tests/data/macos/commands.json).
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
MACOS = json.loads((Path(__file__).parent / "data" / "macos" / "commands.json").read_text())
GiB = 2**30

# file:function (qualified) -> the test that runs its macOS side: a test of this module, or
# "tests/<file>.py::test_name" for one that lives beside its subsystem's other tests
REGISTRY = {
    "kimi_mlx/bench/models.py:rss_bytes": "test_rss_through_ps_without_proc",
    "kimi_mlx/commands/blas.py:preload_env": "test_blas_preload_is_linux_only",
    "kimi_mlx/commands/blas.py:blas_in_use": "test_blas_in_use_says_accelerate_on_macos",
    "kimi_mlx/placement/wired.py:wire": "test_wired_limit_on_macos_and_not_elsewhere",
    "cluster/net/discovery.py:_sysctl": "test_local_memory_from_sysctl",
    "cluster/net/discovery.py:local_memory": "test_local_memory_from_sysctl",
    "cluster/net/discovery.py:local_chip": "test_local_chip_from_sysctl",
    "cluster/net/discovery.py:interface_addresses": "test_interface_prefers_thunderbolt_bridge_on_macos",
    "cluster/net/ranks.py:process_stopped": "test_process_stopped_through_ps",
    "cluster/node/daemon.py:listen_addresses": "test_stage_listens_on_advertised_addresses_on_macos",
    "cluster/node/rank.py:_peak_rss": "test_no_proc_on_macos",
    "cluster/node/rank.py:_mem_available": "test_no_proc_on_macos",
    "cluster/node/loading.py:rchar": "test_no_proc_on_macos",
    "cluster/bench/grpc_floor.py:_proc_cpu": "test_no_proc_on_macos",
    "cluster/bench/hop.py:_cpu_seconds": "test_no_proc_on_macos",
    "cluster/tensor/relay.py:_anonymous_file": "test_host_list_in_a_removed_temp_file_without_memfd",
    "cluster/tensor/relay.py:_pdeathsig": "test_rank0_polls_its_parent_without_pdeathsig",
    "kimi_mlx/bench/ranged.py:drop_cache": "test_cold_read_bench_without_posix_fadvise",
    "kimi_mlx/generation/background.py:lower_thread_priority":
        "test_admission_threads_keep_their_priority_on_macos",
    "kimi_mlx/checkpoint/ranged.py:SliceReader._copy_mapped": "test_ranged_read_without_madvise",
    "cluster/net/hostfacts.py:<module>": "test_host_facts_gather_every_recorded_macos_command",
    "cluster/net/hostfacts.py:gather": "test_host_facts_gather_every_recorded_macos_command",
    "cluster/net/hostfacts.py:cached_facts_json": "test_pending_host_facts_name_the_platform",
    "cluster/doctor.py:_is_mac": "tests/test_doctor.py::test_local_all_ok_on_the_recorded_mac",
    "cluster/doctor.py:check_metal": "tests/test_doctor.py::test_metal_and_kernel_checks",
    "cluster/doctor_run.py:cross_checks":
        "tests/test_doctor.py::test_mlx_and_macos_differ_fail_only_where_jaccl_would_run",
}

# os / mmap names that macOS lacks or treats differently (a feature check is a branch too)
LINUX_ONLY = ("memfd_create", "posix_fadvise", "POSIX_FADV_DONTNEED", "MADV_DONTNEED")

# the product: what is installed as kimi_mlx (test support in kimi_mlx/testing is not)
PRODUCT_DIRS = ["kimi_mlx", "cluster", "metal", "prune"]
EXCLUDE = ("kimi_mlx/testing/",)


# -- finding the branches ------------------------------------------------------------------

def _platform_marks(node: ast.AST) -> bool:
    """Whether `node` is a platform test or a platform-only resource: sys.platform,
    platform.system(), a `LINUX_ONLY` name, a "/proc..." path, a `ps` / `sysctl` command
    line, or a "darwin" literal."""
    if isinstance(node, ast.Attribute):
        if node.attr == "platform" and isinstance(node.value, ast.Name) and node.value.id == "sys":
            return True
        if node.attr in LINUX_ONLY:
            return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "system" and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == "platform":
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        v = node.value
        if v.startswith("/proc") or v in ("darwin", "Darwin") or v in LINUX_ONLY:
            return True
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
            and str(node.values[0].value).startswith("/proc"):
        return True
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts and isinstance(node.elts[0], ast.Constant) \
            and node.elts[0].value in ("ps", "sysctl"):
        return True
    return False


def _walk_own(fn: ast.AST):
    """Nodes of a function body, not descending into nested functions / classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield n
        stack.extend(ast.iter_child_nodes(n))


def platform_branches(root: Path = ROOT):
    """{"file:qualified.function"} of every function with a platform mark ("file:<module>"
    for one at module level)."""
    found = set()
    for d in PRODUCT_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(EXCLUDE):
                continue
            tree = ast.parse(path.read_text(), rel)

            def visit(node, prefix):
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        name = f"{prefix}{child.name}"
                        if any(_platform_marks(n) for n in _walk_own(child)):
                            found.add(f"{rel}:{name}")
                        visit(child, f"{name}.")
                    elif isinstance(child, ast.ClassDef):
                        visit(child, f"{prefix}{child.name}.")

            visit(tree, "")
            top = [n for n in _walk_own(tree)]
            if any(_platform_marks(n) for n in top):
                found.add(f"{rel}:<module>")
    return found


def test_every_platform_branch_has_a_test():
    found = platform_branches()
    missing = sorted(found - set(REGISTRY))
    assert not missing, ("platform branches with no macOS test (add one to "
                         f"tests/test_macos_branches.py and to REGISTRY): {missing}")
    stale = sorted(set(REGISTRY) - found)
    assert not stale, f"REGISTRY names branches that are gone: {stale}"
    names = {n for n in globals() if n.startswith("test_")}
    local = {v for v in REGISTRY.values() if "::" not in v}
    assert local <= names, local - names
    for ref in {v for v in REGISTRY.values() if "::" in v}:
        file, test = ref.split("::")
        tree = ast.parse((ROOT / file).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert test in defined, f"REGISTRY names {ref}, which does not exist"


def test_the_scanner_finds_a_new_branch(tmp_path):
    pkg = tmp_path / "cluster"
    pkg.mkdir()
    (pkg / "x.py").write_text(textwrap.dedent("""
        import sys, platform
        def plain():
            return 1
        class C:
            def m(self):
                if sys.platform == "darwin":
                    return 2
        def proc(pid):
            return open(f"/proc/{pid}/status")
        def mac():
            return platform.system()
    """))
    for d in ("kimi_mlx", "metal", "prune"):
        (tmp_path / d).mkdir()
    assert platform_branches(tmp_path) == {"cluster/x.py:C.m", "cluster/x.py:proc", "cluster/x.py:mac"}


# -- recorded macOS command outputs ----------------------------------------------------------

def _recorded(*keys):
    """A subprocess.run replacement answering each recorded argv (PID ignored) with its
    macOS output; any other command fails the test."""
    table = {}
    for k in keys:
        e = MACOS[k]
        table[tuple(a for a in e["argv"] if a != "PID")] = e
    calls = []

    def run(argv, **kw):
        calls.append(list(argv))
        key = tuple(a for a in argv if not str(a).isdigit())
        assert key in table, f"unrecorded command {argv}"
        e = table[key]
        return subprocess.CompletedProcess(argv, e["returncode"], e["stdout"], e["stderr"])

    run.calls = calls
    return run


@pytest.fixture
def darwin(monkeypatch):
    """sys.platform and platform.system() as on a Mac, for this test only."""
    import platform

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(platform, "system", lambda: "Darwin")


@pytest.mark.parametrize("wired_key,want_usable", [
    ("iogpu.wired_limit_mb set", 507904 * 2**20),
    ("iogpu.wired_limit_mb unset", 512 * GiB - 16 * GiB),    # RAM - 16 GiB above 64 GiB
    ("iogpu.wired_limit_mb unknown", 512 * GiB - 16 * GiB),
])
def test_local_memory_from_sysctl(darwin, monkeypatch, wired_key, want_usable):
    from kimi_mlx.cluster.net import discovery

    run = _recorded("hw.memsize 512GB", wired_key)
    monkeypatch.setattr(discovery.subprocess, "run", run)

    def no_proc(*a, **k):
        raise AssertionError("macOS has no /proc/meminfo")

    monkeypatch.setattr(discovery, "open", no_proc, raising=False)
    total, usable, wired = discovery.local_memory()
    assert total == 549755813888
    assert usable == want_usable
    assert wired == (507904 if wired_key.endswith("set") and "unset" not in wired_key else 0)
    assert ["sysctl", "-n", "hw.memsize"] in run.calls


def test_local_memory_64gb_mac(darwin, monkeypatch):
    from kimi_mlx.cluster.net import discovery

    monkeypatch.setattr(discovery.subprocess, "run",
                        _recorded("hw.memsize 64GB", "iogpu.wired_limit_mb unset"))
    total, usable, wired = discovery.local_memory()
    assert (total, usable, wired) == (64 * GiB, 48 * GiB, 0)  # 3/4 of RAM up to 64 GiB


@pytest.mark.parametrize("key,chip,gbs", [("brand M3 Ultra", "m3-ultra", 819), ("brand M4", "m4", 120)])
def test_local_chip_from_sysctl(darwin, monkeypatch, key, chip, gbs):
    from kimi_mlx.cluster.net import discovery

    monkeypatch.setattr(discovery.subprocess, "run", _recorded(key))
    assert discovery.local_chip() == (chip, gbs * 10**9)


def test_interface_prefers_thunderbolt_bridge_on_macos(darwin, monkeypatch):
    from kimi_mlx.cluster.net import discovery

    ad = lambda name, *ips: SimpleNamespace(name=name, nice_name=name,
                                            ips=[SimpleNamespace(ip=i) for i in ips])
    adapters = [ad("lo0", "127.0.0.1"), ad("en0", "192.168.1.20"), ad("bridge0", "10.0.0.2")]
    monkeypatch.setattr(discovery, "_adapters", lambda: adapters)
    assert discovery.interface_addresses(None) == ["10.0.0.2"]
    adapters[2] = ad("bridge0")  # a bridge with no address: every non-loopback address
    assert discovery.interface_addresses(None) == ["192.168.1.20"]


def test_stage_listens_on_advertised_addresses_on_macos():
    from kimi_mlx.cluster.node.daemon import listen_addresses

    assert listen_addresses(["10.0.0.2"], None, platform="darwin") == ["10.0.0.2"]
    assert listen_addresses(["10.0.0.2"], None, platform="linux") == ["0.0.0.0"]
    assert listen_addresses(["10.0.0.2"], "bridge0", platform="linux") == ["10.0.0.2"]


@pytest.mark.parametrize("key,stopped", [("ps stopped", True), ("ps sleeping", False),
                                         ("ps running foreground", False), ("ps gone", False)])
def test_process_stopped_through_ps(darwin, monkeypatch, key, stopped):
    from kimi_mlx.cluster.net import ranks

    run = _recorded(key)
    monkeypatch.setattr(ranks.subprocess, "run", run)
    assert ranks.process_stopped(4242) is stopped
    assert run.calls == [["ps", "-o", "stat=", "-p", "4242"]]


def test_process_stopped_through_real_ps_on_a_stopped_child(darwin):
    """The same `ps -o stat= -p PID` run for real (procps takes the BSD flags)."""
    from kimi_mlx.cluster.net import ranks

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ranks.process_stopped(child.pid) is False
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not ranks.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ranks.process_stopped(child.pid) is True
    finally:
        child.kill()
        child.wait(10)


def test_no_proc_on_macos(monkeypatch):
    """macOS has no /proc: each reader gives its documented 'unknown'."""
    from kimi_mlx.cluster.bench import grpc_floor, hop
    from kimi_mlx.cluster.node import loading, rank

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return open(path, *a, **k)

    for mod in (rank, loading, grpc_floor, hop):
        monkeypatch.setattr(mod, "open", no_proc, raising=False)
    assert rank._peak_rss(os.getpid()) == 0
    assert rank._mem_available() == "? MiB"
    assert loading.rchar() == -1
    assert grpc_floor._proc_cpu(os.getpid()) == 0.0
    t0 = time.process_time()
    assert hop._cpu_seconds([os.getpid()]) - t0 < 1.0  # only this process's own time


def test_rss_through_ps_without_proc(monkeypatch):
    """macOS has no /proc: the model bench reads this process's RSS from `ps -o rss=` (KiB),
    which agrees with Linux's /proc/self/statm (resident pages x page size) read here."""
    from kimi_mlx.bench import models

    with open("/proc/self/statm") as f:
        want = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return open(path, *a, **k)

    monkeypatch.setattr(models, "open", no_proc, raising=False)
    got = models.rss_bytes()
    assert abs(got - want) < 0.1 * want, (got, want)


def test_blas_preload_is_linux_only(monkeypatch):
    from kimi_mlx.commands import blas

    monkeypatch.setattr(blas, "openblas_path", lambda: "/usr/lib/x/libblas.so.3")
    assert blas.preload_env({}, platform="darwin") is None
    assert blas.preload_env({}, platform="linux")["LD_PRELOAD"] == "/usr/lib/x/libblas.so.3"


def test_blas_in_use_says_accelerate_on_macos(darwin, monkeypatch):
    from kimi_mlx.commands import blas

    monkeypatch.setattr(blas, "open", lambda *a, **k: pytest.fail("no /proc on macOS"),
                        raising=False)
    assert blas.blas_in_use() == "Accelerate"


def test_wired_limit_on_macos_and_not_elsewhere(monkeypatch, tmp_path):
    """`wire`'s Metal branch with the fake device; the no-Metal branch with the real MLX here."""
    import mlx.core as mx

    from kimi_mlx.placement import wired
    from kimi_mlx.testing import fake_metal

    info = json.loads((Path(__file__).parent / "data" / "macos" / "device_info_64gb.json").read_text())
    monkeypatch.setattr(wired, "mx", mx)
    monkeypatch.setattr(wired, "_saved", None)
    plan = wired.WiredPlan("test", 10 * GiB, GiB)
    if not mx.metal.is_available():
        assert wired.wire(plan) is None
    fake_metal.install(info, str(tmp_path / "rec.jsonl"))
    assert wired.wire(plan) == 11 * GiB
    wired.restore()
    assert [r["limit"] for r in fake_metal.records(tmp_path / "rec.jsonl")] == [11 * GiB, 0]


def test_host_list_in_a_removed_temp_file_without_memfd(monkeypatch, tmp_path):
    from kimi_mlx.cluster.tensor import relay

    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"]]).encode()
    fd = relay._anonymous_file(data)
    try:
        assert os.read(fd, 1 << 16) == data  # readable from offset 0
        assert list(tmp_path.iterdir()) == []  # no path names it
        with open(f"/dev/fd/{fd}", "rb") as f:  # as MLX reads MLX_HOSTFILE=/dev/fd/N
            assert f.read() == data
    finally:
        os.close(fd)


def test_rank0_polls_its_parent_without_pdeathsig(tmp_path):
    """On macOS (faked in the grandchild) no prctl is made; the parent poll ends rank 0's
    process within a second or so of its parent's death, and removes its host file."""
    hostfile = tmp_path / "kimi-mlx-hosts-test.json"
    hostfile.write_text("[]")
    marker = tmp_path / "prctl-called"
    grandchild = textwrap.dedent(f"""
        import ctypes, os, sys, time
        sys.platform = "darwin"
        class NoPrctl:
            def __init__(self, *a, **k):
                open({str(marker)!r}, "w").close()
        ctypes.CDLL = NoPrctl
        os.environ["MLX_HOSTFILE"] = {str(hostfile)!r}
        from kimi_mlx.cluster.tensor.relay import _die_with_parent
        _die_with_parent(os.getppid())
        print("watching", flush=True)
        time.sleep(60)
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", {grandchild!r}], stdout=subprocess.PIPE)
        print(p.pid, flush=True)
        assert p.stdout.readline().strip() == b"watching"
        print("ready", flush=True)
        time.sleep(60)
    """)
    par = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    gpid = None
    try:
        gpid = int(par.stdout.readline())
        assert par.stdout.readline().strip() == "ready"
        par.kill()
        par.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(gpid, 0)
            except ProcessLookupError:
                break
            if _zombie(gpid):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("rank 0's process outlived its parent by 15 s")
        assert not marker.exists()  # no PR_SET_PDEATHSIG on macOS
        assert not hostfile.exists()
        gpid = None
    finally:
        if par.poll() is None:
            par.kill()
            par.wait(10)
        if gpid is not None:
            try:
                os.kill(gpid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_admission_threads_keep_their_priority_on_macos(monkeypatch):
    """macOS has no per-thread nice value (setpriority on a thread id would renice the
    whole server or fail): nothing is changed there; on Linux the calling thread alone
    goes down by the step, read back from the kernel."""
    import threading

    from kimi_mlx.generation import background

    got = {}

    def in_thread():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        got["changed"] = background.lower_thread_priority(3)
        got["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    if sys.platform.startswith("linux"):
        t = threading.Thread(target=in_thread)
        t.start()
        t.join()
        assert got == {"changed": True, "delta": min(3, 19 - os.getpriority(os.PRIO_PROCESS, 0))}
        assert os.getpriority(os.PRIO_PROCESS, 0) == os.getpriority(os.PRIO_PROCESS, os.getpid())
    calls = []
    monkeypatch.setattr(background.sys, "platform", "darwin")
    monkeypatch.setattr(background.os, "setpriority", lambda *a: calls.append(a))
    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert got == {"changed": False, "delta": 0} and calls == []


def test_cold_read_bench_without_posix_fadvise(monkeypatch, tmp_path):
    from kimi_mlx.bench import ranged

    f = tmp_path / "x.bin"
    f.write_bytes(b"\0" * 4096)
    if hasattr(os, "posix_fadvise"):
        assert ranged.drop_cache(f) is True
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    assert ranged.drop_cache(f) is False  # macOS: no crash, the bench says so


def test_ranged_read_without_madvise(monkeypatch):
    """Slices read through the mmap path are the same whether the pages can be dropped
    with MADV_DONTNEED or not."""
    import mmap

    import numpy as np

    from kimi_mlx.checkpoint.ranged import load_sharded
    from kimi_mlx.generation.generate import default_model

    micro = default_model()
    if micro is None:
        pytest.skip("needs the shipped micro checkpoint")

    class G:
        def size(self):
            return 2

        def rank(self):
            return 1

    def flat(model):
        from mlx.utils import tree_flatten

        import mlx.core as mx

        return {k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v)
                for k, v in tree_flatten(model.parameters())}

    with_madv, stats = load_sharded(micro, G())
    assert stats["mapped"] > 0  # the mmap path ran
    monkeypatch.delattr(mmap, "MADV_DONTNEED", raising=False)
    without, stats2 = load_sharded(micro, G())
    assert stats2["mapped"] == stats["mapped"]
    a, b = flat(with_madv), flat(without)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# -- the doctor's host facts ---------------------------------------------------------------

DOCTOR = Path(__file__).parent / "data" / "macos" / "doctor"


def test_host_facts_gather_every_recorded_macos_command(tmp_path):
    """On a Mac every command of `hostfacts.COMMANDS` answers; gather keeps each recorded
    stdout under its key and reports the platform it ran on."""
    from kimi_mlx.cluster.net import hostfacts as hf

    recorded = {
        ("sw_vers",): "sw_vers_26.2.txt",
        ("sysctl", "hw.memsize"): "sysctl_hw_memsize_512g.txt",
        ("sysctl", "machdep.cpu.brand_string"): "sysctl_cpu_brand_m3_ultra.txt",
        ("sysctl", "iogpu.wired_limit_mb"): "sysctl_iogpu_wired_limit_mb_507904.txt",
        ("rdma_ctl", "status"): "rdma_ctl_enabled.txt",
        ("ibv_devices",): "ibv_devices_tb5.txt",
        ("system_profiler", "SPThunderboltDataType", "-json"): "system_profiler_tb5_pair_a.json",
        ("networksetup", "-listallhardwareports"): "networksetup_hardware_ports.txt",
        ("ifconfig", "bridge0"): "ifconfig_bridge0_active.txt",
    }
    calls = []

    def run(cmd):
        calls.append(tuple(cmd))
        return (DOCTOR / recorded[tuple(cmd)]).read_text()

    facts = hf.gather(run, {"models": tmp_path}, platform="darwin")
    assert facts["platform"] == "darwin" and facts["errors"] == {}
    assert set(calls) == set(recorded) == {tuple(c) for c in hf.COMMANDS.values()}
    for key, cmd in hf.COMMANDS.items():
        assert facts["outputs"][key] == (DOCTOR / recorded[tuple(cmd)]).read_text()
    assert hf.wired_limit_mb(run) == 507904
    assert facts["disk"]["models"]["exists"] is True


def test_pending_host_facts_name_the_platform(monkeypatch):
    """A Health reply asked before the background gather finishes says {"pending": true}
    with the node's platform (darwin on a Mac) and its clock."""
    import threading

    from kimi_mlx.cluster.net import hostfacts as hf

    release = threading.Event()
    monkeypatch.setattr(hf.sys, "platform", "darwin")
    monkeypatch.setattr(hf, "gather", lambda paths=None, **kw: (release.wait(5), {"platform": "darwin"})[1])
    before = time.time()
    try:
        reply = json.loads(hf.cached_facts_json({"x": Path("/nonexistent-doctor-probe")}, wait_s=0.05))
    finally:
        release.set()
    assert reply["pending"] is True and reply["platform"] == "darwin"
    assert before <= reply["time"] <= time.time()
