"""The runners of `kimi-mlx doctor` and `kimi-mlx cluster doctor`: gather the facts (this
machine's commands and measurements, or each node's Health reply) and call the checks of
`cluster.doctor`. `local_checks` / `nodes_checks` also take recorded facts (tests,
`kimi-mlx doctor --facts`)."""

from __future__ import annotations

import argparse
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from kimi_mlx.cluster.doctor import (
    FAIL, GB, OK, SKIP, Check, NodeFacts, _is_mac, check_bandwidth, check_bridge,
    check_bridge_subnets, check_cabling,
    check_clock, check_decode, check_disk, check_macos, check_metal, check_port, check_rdma,
    check_same, check_thunderbolt, check_versions, check_wired, check_zeroconf, copy_bandwidth,
    effective_wired_bytes, node_plan_needs, WARN,
)
from kimi_mlx.cluster.net import hostfacts as hf


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `kimi-mlx doctor` and `kimi-mlx cluster doctor`."""
    p.add_argument("--model", default=None,
                   help="checkpoint folder (or hub id, for the plan only) to check the wired "
                        "limit against its plan, free disk and (kimi-mlx doctor) decode "
                        "tok/s for (default: those checks are skipped)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence to plan caches for (default as `kimi-mlx plan`)")
    p.add_argument("--backend", default="auto", choices=["auto", "ring", "jaccl"],
                   help="the tensor-parallel backend you mean to use: with jaccl, RDMA and "
                        "cabling problems FAIL instead of WARN (default auto)")
    p.add_argument("--json", action="store_true", help="print JSON (checks, summary, ok)")



@dataclass
class DoctorSettings:
    """`kimi-mlx doctor` / `kimi-mlx cluster doctor` flags. model: checkpoint folder (None:
    plan, disk and decode checks skipped). context: tokens to plan caches for (None: the
    planner's default). prompt_cache_dir / prompt_cache_bytes: the disk cache to size.
    backend: "auto" | "ring" | "jaccl" (jaccl: RDMA problems FAIL). measure: run the
    bandwidth and decode measurements. decode_tokens: tokens generated to time decode."""

    model: Optional[str] = None
    context: Optional[int] = None
    prompt_cache_dir: Optional[str] = None
    prompt_cache_bytes: int = 0
    backend: str = "auto"
    measure: bool = True
    decode_tokens: int = 32


def _versions() -> Dict[str, str]:
    from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION, package_versions

    ours, mlx_version = package_versions()
    return {"kimi-mlx": ours, "MLX": mlx_version, "stage protocol": str(PROTOCOL_VERSION)}


def local_facts(s: DoctorSettings, run: hf.Runner = hf.run_command) -> dict:
    """This machine's host facts (`hostfacts.gather`) with the disks of --model and
    --prompt-cache-dir, and "chip" (from machdep.cpu.brand_string)."""
    paths = {"checkpoint": Path(s.model) if s.model and Path(s.model).expanduser().exists() else None,
             "prompt cache": Path(s.prompt_cache_dir) if s.prompt_cache_dir else None}
    facts = hf.gather(run, paths)
    facts["chip"] = hf.parse_chip(facts["outputs"].get("cpu_brand"))
    return facts


def _metal_facts() -> dict:
    """{"available", "status", "setting"}: Metal, and the kernel device checks run now
    (`metal.dispatch.check_kernels`; nothing runs off Metal or with KIMI_MLX_KERNELS set)."""
    import mlx.core as mx

    from kimi_mlx.metal import dispatch

    available = bool(mx.metal.is_available())
    setting = dispatch.kernels_setting()
    status = {}
    if available:
        import kimi_mlx.metal.dsa  # noqa: F401  (registers the DSA / MLA kernel checks)
        import kimi_mlx.metal.kda  # noqa: F401  (registers the KDA kernel checks)

        status = dispatch.check_kernels()
    return {"available": available, "status": status, "setting": setting}


def _memory(facts: dict) -> Tuple[int, Optional[int]]:
    """(RAM bytes, wired_limit_mb or None) from the facts; off macOS from /proc/meminfo."""
    if _is_mac(facts):
        return (hf.parse_sysctl_int(facts["outputs"].get("memsize")) or 0,
                hf.parse_sysctl_int(facts["outputs"].get("wired_limit")))
    from kimi_mlx.cluster.net.discovery import local_memory

    return local_memory()[0], None


def local_plan(s: DoctorSettings, facts: dict, bandwidth: int):
    """(plan of --model on this machine alone or None, PlanError or None, note)."""
    from kimi_mlx.placement.layer_bytes import model_bytes
    from kimi_mlx.placement.planner import Node, PlanError, StagePlanner, planned_context, usable_bytes_for_ram

    memsize, wired = _memory(facts)
    model = model_bytes(s.model)
    ctx = planned_context(s.context, model.max_position_embeddings)
    usable = (effective_wired_bytes(memsize, wired) if wired is not None and _is_mac(facts)
              else usable_bytes_for_ram(memsize))
    try:
        return StagePlanner().plan(model, [Node("this Mac", usable, bandwidth, memsize)], ctx), None, ctx
    except PlanError as e:
        return None, e, ctx


def measure_decode(model_dir: str, tokens: int) -> float:
    """Decode tokens/s of `model_dir` here: `tokens` greedy tokens after a short prompt
    with mlx-lm's `stream_generate` (our model and tokenizer, `checkpoint.loader`)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from kimi_mlx.checkpoint.loader import load_for_generation

    model, wrapper, _, _ = load_for_generation(model_dir)
    prompt = wrapper.encode("The quick brown fox jumps over the lazy dog. " * 2)
    last = None
    for last in stream_generate(model, wrapper, prompt, max_tokens=tokens,
                                sampler=make_sampler(0.0)):
        pass
    if last is None or not last.generation_tps:
        raise RuntimeError("generated nothing")
    return float(last.generation_tps)


def local_checks(s: DoctorSettings, facts: Optional[dict] = None, run: hf.Runner = hf.run_command,
                 record: bool = False) -> List[Check]:
    """Every check of this machine. `facts`: recorded facts (a `local_facts` dict, with
    optional "versions", "metal", "bandwidth" (bytes/s) and "decode" (tok/s) recorded
    too) checked instead of this machine; with `record`, `facts` are this machine's and
    the measurements are made here and added to them (`--save-facts`)."""
    from kimi_mlx.placement.planner import MAC_BANDWIDTH

    replay = facts is not None and not record
    facts = facts if facts is not None else local_facts(s, run)
    need_rdma = s.backend == "jaccl"
    if not replay:
        facts["versions"] = _versions()
    checks = [check_macos(facts), check_versions(facts.get("versions") or _versions())]
    if not replay:
        facts["metal"] = _metal_facts()
    metal = facts.get("metal")
    if metal:
        checks += check_metal(metal["available"], facts.get("platform", ""), metal["status"],
                              metal["setting"])
    else:
        checks.append(Check("metal", SKIP, "not recorded"))
    chip = facts.get("chip", "")
    constant = MAC_BANDWIDTH.get(chip, 0)
    bandwidth = facts.get("bandwidth")
    if bandwidth is None and s.measure and not replay:
        bandwidth = facts["bandwidth"] = copy_bandwidth()
    plan = error = ctx = None
    if s.model:
        try:
            plan, error, ctx = local_plan(s, facts, constant or int(bandwidth or 100 * GB))
        except (ValueError, FileNotFoundError, OSError) as e:
            checks.append(Check("model", FAIL, f"{s.model}: {e}", "give a checkpoint folder"))
    need = None
    if plan is not None:
        st = plan.used_stages[0]
        need = st.total_bytes + st.headroom_bytes
    elif error is not None:
        need = getattr(error, "need_bytes", None)
    what = f"{Path(s.model).name} at {ctx} tokens " if s.model and ctx else ""
    checks.append(check_wired(facts, need, what))
    disk = facts.get("disk", {})
    if s.model:
        d = disk.get("checkpoint")
        checks.append(check_disk("checkpoint", d) if d else
                      Check("disk checkpoint", FAIL, f"{s.model} is not a folder here",
                            "download it first (`huggingface-cli download ...`) and give its folder"))
    else:
        checks.append(Check("disk checkpoint", SKIP, "no --model"))
    if s.prompt_cache_dir:
        checks.append(check_disk("prompt cache", disk.get("prompt cache"), s.prompt_cache_bytes))
    else:
        checks.append(Check("disk prompt cache", SKIP, "no --prompt-cache-dir"))
    checks += [check_rdma(facts, need_rdma), check_thunderbolt(facts, need_rdma), check_bridge(facts)]
    if bandwidth is not None:
        checks.append(check_bandwidth(float(bandwidth), constant, chip))
    else:
        checks.append(Check("bandwidth", SKIP, "not recorded" if replay else
                            "not measured (--no-measure)"))
    decode = facts.get("decode")
    local = bool(s.model) and Path(s.model).expanduser().is_dir()
    why = ""
    if decode is None:
        if not s.model:
            why = "no --model"
        elif plan is None:
            why = "the model does not fit this machine"
        elif not local:
            why = f"{s.model} is not a folder here"
        elif replay:
            why = "not recorded"
        elif not s.measure:
            why = "not measured (--no-measure)"
        else:
            try:
                decode = facts["decode"] = measure_decode(s.model, s.decode_tokens)
            except Exception as e:  # noqa: BLE001 - any load / generation error is the finding
                checks.append(Check("decode", FAIL, f"cannot generate with {s.model}: "
                                    f"{type(e).__name__}: {e}", "run `kimi-mlx generate "
                                    "--model` for the full error"))
                return checks
    predicted = None
    basis = ""
    if plan is not None and decode is not None:
        predicted = plan.tokens_per_s
        basis = (f" (planner constant {constant / GB:.0f} GB/s)" if constant else
                 " (at the measured bandwidth)")
    checks.append(check_decode(decode, predicted, basis, why))
    return checks


def node_checks(n: NodeFacts, need: Optional[int], what: str, need_rdma: bool) -> List[Check]:
    """The per-node checks of a node's host facts (as sent in its Health reply)."""
    out: List[Check] = []
    if not n.facts:
        out.append(Check("host facts", SKIP, "the node sends no host facts (kimi-mlx before "
                         "`cluster doctor`): update it"))
    else:
        out += [check_macos(n.facts), check_wired(n.facts, need, what),
                check_disk("models folder", n.facts.get("disk", {}).get("models folder")),
                check_rdma(n.facts, need_rdma), check_bridge(n.facts)]
        out.append(check_clock(n.facts.get("time"), n.sent, n.received))
    for c in out:
        c.node = n.name
    return out


def cross_checks(head: Dict[str, str], nodes: Sequence[NodeFacts], backend: str) -> List[Check]:
    """Versions equal on this head and every node, macOS equal where jaccl would run,
    and the Thunderbolt cabling of every pair."""
    from kimi_mlx.cluster.net.jaccl import parse_ibv_devices

    checks = []
    ver = {"this head": head["kimi-mlx"], **{n.name: n.version for n in nodes}}
    mlx = {"this head": head["MLX"], **{n.name: n.mlx_version for n in nodes}}
    proto = {"this head": head["stage protocol"], **{n.name: str(n.protocol) for n in nodes}}
    same = "install the same kimi-mlx (and MLX) on every Mac: pip install -U kimi-mlx"
    checks.append(check_same("stage protocol", proto, "stage protocol", same))
    checks.append(check_same("kimi-mlx version", ver, "kimi-mlx", same))
    rdma_everywhere = bool(nodes) and all(
        n.facts and parse_ibv_devices(n.facts["outputs"].get("ibv_devices", "")) for n in nodes)
    jaccl = backend == "jaccl" or (backend == "auto" and rdma_everywhere)
    checks.append(check_same("MLX version", mlx, "MLX", same, FAIL if jaccl else WARN))
    with_facts = [n for n in nodes if n.facts and n.facts.get("platform") == "darwin"]
    if with_facts:
        macos = {n.name: hf.parse_sw_vers(n.facts["outputs"].get("sw_vers")).get("ProductVersion", "?")
                 for n in with_facts}
        c = check_same("macOS versions", macos, "macOS", "update every Mac to the same macOS "
                       "(jaccl needs the same RDMA stack on each)", FAIL if jaccl else WARN)
        checks.append(c)
    else:
        checks.append(Check("macOS versions", SKIP, "no node is a Mac"))
    if with_facts:
        checks.append(check_bridge_subnets(
            {n.name: hf.parse_ifconfig(n.facts["outputs"].get("bridge"))["inet"] for n in with_facts}))
    if not with_facts:
        checks.append(Check("cabling", SKIP, "no node is a Mac (no Thunderbolt to check)"))
    else:
        checks.append(check_cabling([n.rdma for n in nodes if n.rdma is not None],
                                    backend == "jaccl"))
    return checks


def cluster_checks(s: DoctorSettings, nodes: str = "auto", secret_file: Optional[Path] = None,
                   tls: bool = False, browse_s: float = 3.0, interface: Optional[str] = None,
                   connect=socket.create_connection) -> List[Check]:
    """Every check of the nodes named in `nodes` ("host:port,..." or "auto": zeroconf's)
    and between them, as seen from this machine (the head)."""
    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.net.auth import AuthError, load_secret
    from kimi_mlx.cluster.net.control import ControlClient, rpc_reason
    from kimi_mlx.cluster.net.discovery import DEFAULT_PORT, browse, interface_addresses
    from kimi_mlx.cluster.net.jaccl import JacclError, NodeReport
    from kimi_mlx.cluster.net.nodes import parse_address

    import grpc

    checks: List[Check] = []
    try:
        found = browse(browse_s, interface_addresses(interface))
        advertised = [n.address for n in found]
    except (OSError, ValueError) as e:
        found, advertised = [], []
        checks.append(Check("zeroconf", WARN, f"cannot browse: {e}", "check --interface"))
    if nodes == "auto":
        targets = [(n.node_id, n.host, n.port) for n in found]
        if not targets:
            checks.append(Check("nodes", FAIL, f"no kimi-mlx node answered a {browse_s:g} s "
                                "zeroconf browse", "start `kimi-mlx cluster serve` on each Mac, "
                                "or list them with --nodes host:port,..."))
            return checks
    else:
        targets = []
        for spec in nodes.split(","):
            if spec.strip():
                try:
                    host, port = parse_address(spec, DEFAULT_PORT)
                except ValueError as e:
                    checks.append(Check("nodes", FAIL, str(e), "fix --nodes"))
                    continue
                targets.append((spec.strip(), host, port))
        if not targets:
            checks.append(Check("nodes", SKIP, "--nodes lists no node"))
            return checks
    try:
        secret = load_secret(secret_file)
    except AuthError as e:
        secret = None
        checks.append(Check("secret", FAIL, str(e), "copy the cluster secret from the Mac "
                            "that ran `kimi-mlx cluster init`"))
    client = ControlClient(secret, secret_file if tls else None) if secret else None
    seen: List[NodeFacts] = []
    for name, host, port in targets:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        c = check_port(address, host, port, connect)
        c.node = name
        checks.append(c)
        if nodes != "auto":
            z = check_zeroconf(address, advertised, browse_s)
            z.node = name
            checks.append(z)
        if c.status != OK or client is None:
            continue
        stub = client.stub_for(address)
        for attempt in range(3):  # a node gathers its facts in the background: ask again
            sent = time.time()
            try:
                reply = stub.Health(pb.HealthRequest(), timeout=5.0)
            except grpc.RpcError as e:
                reply = None
                checks.append(Check("health", FAIL, rpc_reason(e, "Health"),
                                    "see the reason; `kimi-mlx cluster ls` lists what answers",
                                    name))
                break
            received = time.time()
            try:
                facts = json.loads(reply.host_facts) if reply.host_facts else None
            except ValueError:
                facts = None
            if not (facts and facts.get("pending")):
                break
            time.sleep(1.0)
        if reply is None:
            continue
        if facts and facts.get("pending"):
            facts = None
        try:
            rdma = NodeReport.from_json(reply.rdma_report, reply.node_id) if reply.rdma_report else None
        except JacclError:
            rdma = None
        seen.append(NodeFacts(reply.node_id or name, address, reply.version, reply.mlx_version,
                              reply.protocol, facts, rdma, sent, received, reply.total_memory,
                              reply.usable_memory, reply.bandwidth, reply.chip))
        checks.append(Check("health", OK, f"{address} answers (kimi-mlx {reply.version}, "
                            f"MLX {reply.mlx_version}, {reply.state})", node=name))
        if reply.node_id and reply.node_id != name:  # name it as its other lines will
            for c in checks:
                if c.node == name:
                    c.node = reply.node_id
    return checks + nodes_checks(s, seen)


def nodes_checks(s: DoctorSettings, seen: Sequence[NodeFacts]) -> List[Check]:
    """The checks of the nodes that answered (`NodeFacts`, from their Health replies or
    recorded): each node's own, the plan of --model over them against each node's wired
    limit, and those between nodes (versions, macOS, cabling)."""
    checks: List[Check] = []
    needs, note = node_plan_needs(seen, s.model, s.context)
    for n in seen:
        checks += node_checks(n, needs.get(n.name) if needs else None,
                              f"its stage of {note} " if needs else "", s.backend == "jaccl")
    if s.model and not needs:
        checks.append(Check("plan", FAIL if seen else SKIP, note))
    checks += cross_checks(_versions(), seen, s.backend)
    checks.append(Check("bandwidth/decode", SKIP, "measured on each Mac itself: run "
                        "`kimi-mlx doctor --model ...` there"))
    return checks
