"""Stage planner: which contiguous layer range each Mac holds.

The policy is one class with one method (`StagePlanner.plan`), apart from discovery,
networking and inference, so it is easy to read and to replace. It takes per-layer bytes
(`layer_bytes.ModelBytes`), the nodes in pipeline order, the context length and the number
of concurrent sequences, and returns a `Plan` or raises `PlanError`.

Rules:
- Stage k runs on node k and holds layers [start, end); the ranges are contiguous and in
  node order and cover every layer. The stage holding layer 0 also holds the embedding;
  the one holding the last layer also holds norm, output AttnRes mix and lm_head.
- A stage fits when weights + caches (at `context` tokens x `sequences`) <= usable bytes
  minus headroom (kept free for activations, the Metal heap and the service itself).
- Objective: minimise the slowest stage's decode time (bytes read per step / bandwidth;
  the pipeline's throughput with sequences in flight), then the sum of stage times plus
  hop latencies (one sequence's time per token), then balance (sum of squared stage
  times); remaining ties give earlier nodes more layers. Deterministic.
- A node that gets no layers (it cannot hold one, or the objective does not need it) is
  reported as unused.

Mac figures: peak memory bandwidth by chip (Apple specifications) and a rule for the
usable GPU memory; see `usable_bytes_for_ram`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from kimi_mlx.placement.layer_bytes import ModelBytes

GB = 10**9
DEFAULT_CONTEXT = 131072  # tokens planned for when no context is given


def planned_context(requested: Optional[int], limit: Optional[int]) -> int:
    """Tokens per sequence to plan for: `requested`, or DEFAULT_CONTEXT capped at the
    model's max_position_embeddings `limit` (a 4k-context model is not planned for 128k
    tokens). `kimi-mlx plan` and `prune --dry-run` both use it."""
    if requested is not None:
        return requested
    return min(DEFAULT_CONTEXT, limit) if limit else DEFAULT_CONTEXT
GiB = 2**30

# Peak unified-memory bandwidth in bytes/s (Apple specifications; the Max chips are the
# top GPU bins: the binned M3 Max is 300 GB/s, the binned M4 Max 410 GB/s).
MAC_BANDWIDTH: Dict[str, int] = {
    "m3-ultra": 819 * GB,
    "m2-ultra": 800 * GB,
    "m1-ultra": 800 * GB,
    "m4-max": 546 * GB,
    "m3-max": 400 * GB,
    "m2-max": 400 * GB,
    "m1-max": 400 * GB,
    "m4-pro": 273 * GB,
    "m3-pro": 150 * GB,
    "m2-pro": 200 * GB,
    "m1-pro": 200 * GB,
    "m4": 120 * GB,
    "m3": 100 * GB,
    "m2": 100 * GB,
    "m1": 68 * GB,
}
DEFAULT_CHIP = "m3-ultra"
DEFAULT_HOP_LATENCY_S = 0.5e-3


def macos_default_wired_bytes(ram_bytes: int) -> int:
    """macOS's own GPU wired limit with `iogpu.wired_limit_mb` unset (bytes).

    About 2/3 of RAM up to 36 GiB, 3/4 above (Metal's recommendedMaxWorkingSetSize, which
    mlx-lm reports as max_recommended_working_set_size).
    """
    return ram_bytes * 2 // 3 if ram_bytes <= 36 * GiB else ram_bytes * 3 // 4


def usable_bytes_for_ram(ram_bytes: int, wired_limit_mb: Optional[int] = None) -> int:
    """GPU memory (bytes) a Mac with `ram_bytes` of RAM gives kimi-mlx.

    With `wired_limit_mb` (the Mac's `sysctl iogpu.wired_limit_mb`, when set): that limit.
    Otherwise the limit kimi-mlx asks users to set on a dedicated node:
    max(3/4 of RAM, RAM - 16 GiB), i.e. 3/4 up to 64 GiB (a small Mac also runs a desktop)
    and all but 16 GiB above (macOS, the stage service and the file cache). A 512 GiB Mac
    Studio gives 496 GiB; macOS's default would give 384 GiB
    (`macos_default_wired_bytes`), too little for 1.56 TB over 4 Macs.
    """
    if wired_limit_mb:
        return int(wired_limit_mb) * 2**20
    return max(ram_bytes * 3 // 4, ram_bytes - 16 * GiB)


@dataclass(frozen=True)
class Node:
    """One machine of the pipeline.

    Attributes:
        name: unique label (host name, or "mac1"...).
        usable_bytes: GPU memory the stage may use, bytes.
        bandwidth_bytes_per_s: memory bandwidth, bytes/s (peak; decode is bandwidth-bound).
        ram_bytes: physical RAM, bytes, if known (for messages).
        chip: chip name, e.g. "m3-ultra", if known.
    """

    name: str
    usable_bytes: int
    bandwidth_bytes_per_s: int
    ram_bytes: Optional[int] = None
    chip: Optional[str] = None

    @property
    def label(self) -> str:
        """"512GB m3-ultra"-style description (RAM in Apple's binary GB)."""
        ram = f"{self.ram_bytes // GiB}GB" if self.ram_bytes else f"{self.usable_bytes / GB:.0f}GB usable"
        return f"{ram} {self.chip}" if self.chip else ram


def mac_node(name: str, ram_bytes: int, chip: str = DEFAULT_CHIP,
             wired_limit_mb: Optional[int] = None, usable_bytes: Optional[int] = None) -> Node:
    """A Node for a Mac: bandwidth from `MAC_BANDWIDTH`, usable memory from
    `usable_bytes_for_ram` unless `usable_bytes` is given.

    Raises:
        ValueError: unknown chip (the message lists the known ones).
    """
    chip = chip.lower().replace(" ", "-").replace("_", "-")
    if chip not in MAC_BANDWIDTH:
        raise ValueError(f"unknown chip {chip!r}; known: {', '.join(MAC_BANDWIDTH)}")
    usable = usable_bytes if usable_bytes is not None else usable_bytes_for_ram(ram_bytes, wired_limit_mb)
    return Node(name, int(usable), MAC_BANDWIDTH[chip], int(ram_bytes), chip)


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)


def parse_bytes(text: str, binary: bool = False, default_unit: Optional[str] = None) -> int:
    """'512GB', '1.5TB', '480GiB', '8G', '4096B' -> bytes. GB/TB are decimal unless `binary`
    (Apple sells RAM in binary GB: a "512GB" Mac has 512 GiB); GiB/TiB are always binary.

    A number without a unit takes `default_unit` (e.g. "GB" for Mac RAM sizes); without
    one it is refused rather than read as bytes ("512" is never 512 bytes by intent).

    Raises:
        ValueError: not a size, or no unit and no default.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 512GB, 1.5TB, 480GiB)")
    number, unit = float(m.group(1)), m.group(2)
    if unit is None:
        if default_unit is None:
            raise ValueError(f"size {text!r} has no unit: write e.g. {text.strip()}GB or {text.strip()}B")
        unit = default_unit
    unit = unit.lower()
    if unit == "b":
        return int(number)
    power = "kmgt".index(unit[0]) + 1
    base = 1024 if ("i" in unit or binary) else 1000
    return int(number * base**power)


def parse_macs(spec: str, chip: str = DEFAULT_CHIP, wired_limit_mb: Optional[int] = None) -> List[Node]:
    """'4x512GB' or '2x512GB,1x256GB@m2-ultra' -> Nodes mac1, mac2, ... in that order.

    RAM sizes are Apple's (binary) GB; a bare number is GB ('4x512' = '4x512GB').
    `chip` applies where a group has no '@chip'.

    Raises:
        ValueError: malformed spec or unknown chip.
    """
    nodes: List[Node] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.match(r"^(?:(\d+)\s*[x×*]\s*)?([^@]+?)(?:@(.+))?$", part, re.I)
        if not part or not m:
            raise ValueError(f"--macs: cannot read {part!r} (e.g. 4x512GB or 2x512GB,1x256GB@m2-ultra)")
        count = int(m.group(1) or 1)
        ram = parse_bytes(m.group(2), binary=True, default_unit="GB")
        if count < 1 or ram <= 0:
            raise ValueError(f"--macs: {part!r} has no Macs or no memory (e.g. 4x512GB)")
        for _ in range(count):
            nodes.append(mac_node(f"mac{len(nodes) + 1}", ram, m.group(3) or chip, wired_limit_mb))
    if not nodes:
        raise ValueError("--macs: no Macs given")
    return nodes


@dataclass(frozen=True)
class Stage:
    """One node's share of the model (bytes; seconds per decode step).

    `start == end` means the node holds nothing (unused).
    """

    node: Node
    start: int
    end: int
    num_kda: int
    num_dsa: int
    num_mla: int
    has_embed: bool
    has_head: bool
    weight_bytes: int
    cache_bytes: int
    headroom_bytes: int
    read_bytes: int
    seconds: float

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def used(self) -> bool:
        return self.end > self.start

    @property
    def total_bytes(self) -> int:
        """Weights + caches, bytes (headroom not included)."""
        return self.weight_bytes + self.cache_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes + self.headroom_bytes <= self.node.usable_bytes


@dataclass(frozen=True)
class Plan:
    """A placement: one `Stage` per node, in node order (unused nodes have empty ranges).

    Attributes:
        hops: network hops per decode step: one per used stage (the last stage returns the
            token to the head) when there are two or more, else 0.
        seconds_per_step: one decode step through every used stage (sum of stage times)
            plus a hop latency per stage boundary and for the token's return to the head.
        tokens_per_s: bandwidth-bound ceiling per sequence, 1 / seconds_per_step.
        aggregate_tokens_per_s: sequences / seconds_per_step.
    """

    stages: Tuple[Stage, ...]
    context: int
    sequences: int
    hops: int
    seconds_per_step: float
    cache_bytes_per_token: int
    state_bytes_per_sequence: int

    @property
    def used_stages(self) -> Tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.used)

    @property
    def unused_nodes(self) -> Tuple[Node, ...]:
        return tuple(s.node for s in self.stages if not s.used)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds_per_step if self.seconds_per_step else math.inf

    @property
    def aggregate_tokens_per_s(self) -> float:
        return self.sequences * self.tokens_per_s

    @property
    def read_bytes_per_step(self) -> int:
        return sum(s.read_bytes for s in self.stages)

    def ranges(self) -> List[Tuple[str, int, int]]:
        """[(node name, start, end)] of the used stages, in pipeline order."""
        return [(s.node.name, s.start, s.end) for s in self.used_stages]


class PlanError(ValueError):
    """The model does not fit the nodes. `str()` says by how much and what would fit.

    Attributes (None where not found):
        need_bytes: weights + caches of the whole model at the plan's context.
        have_bytes: sum over nodes of usable minus headroom.
        short_bytes: need - have (0 when the total fits but no contiguous split does).
        more_nodes: how many more nodes like `template` make it fit.
        template: the largest node given.
        keep_fraction: a `--keep` pruning fraction that fits on the given nodes.
        keep_experts: routed experts per layer at that fraction.
        pruned_bytes: weights of that pruned build.
    """

    def __init__(self, message: str, *, need_bytes: int, have_bytes: int, short_bytes: int,
                 more_nodes: Optional[int] = None, template: Optional[Node] = None,
                 keep_fraction: Optional[float] = None, keep_experts: Optional[int] = None,
                 pruned_bytes: Optional[int] = None):
        super().__init__(message)
        self.need_bytes = need_bytes
        self.have_bytes = have_bytes
        self.short_bytes = short_bytes
        self.more_nodes = more_nodes
        self.template = template
        self.keep_fraction = keep_fraction
        self.keep_experts = keep_experts
        self.pruned_bytes = pruned_bytes


class StagePlanner:
    """Memory-aware, bandwidth-balanced contiguous stage planner.

    Args:
        headroom: fraction of each node's usable bytes kept free (activations, prefill
            buffers, Metal heap), default 10%.
        min_headroom_bytes: at least this many bytes kept free per node (default 2 GiB).
        hop_latency_s: seconds per network hop per decode step (default 0.5 ms).
    """

    def __init__(self, headroom: float = 0.10, min_headroom_bytes: int = 2 * GiB,
                 hop_latency_s: float = DEFAULT_HOP_LATENCY_S):
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom}")
        self.headroom = headroom
        self.min_headroom_bytes = int(min_headroom_bytes)
        self.hop_latency_s = hop_latency_s

    def plan(self, model: ModelBytes, nodes: Sequence[Node], context: int,
             sequences: int = 1) -> Plan:
        """Place `model`'s layers on `nodes` (in that order) for `sequences` sequences of
        up to `context` tokens.

        Raises:
            ValueError: no nodes, duplicate node names, a node with bandwidth <= 0 or
                usable < 0, context < 1 or sequences < 1.
            PlanError: nothing fits; the message gives the shortfall and what would fit
                (more nodes like the largest one, or a pruned build's --keep fraction).
        """
        nodes = list(nodes)
        if not nodes:
            raise ValueError("no nodes to plan on")
        if len({n.name for n in nodes}) != len(nodes):
            raise ValueError(f"node names must be unique: {[n.name for n in nodes]}")
        bad = [n.name for n in nodes if n.bandwidth_bytes_per_s <= 0 or n.usable_bytes < 0]
        if bad:
            raise ValueError(f"nodes need bandwidth > 0 and usable bytes >= 0: {bad}")
        if context < 1 or sequences < 1:
            raise ValueError(f"context and sequences must be >= 1 (got {context}, {sequences})")
        table = _Costs(model, context, sequences)
        budgets = [self._budget(n) for n in nodes]
        ends = _best_split(table, nodes, budgets, self.hop_latency_s)
        if ends is None:
            raise self._error(model, nodes, context, sequences, table, budgets)
        return self._plan(model, nodes, budgets, ends, table, context, sequences)

    # -- helpers ----------------------------------------------------------------------
    def _headroom(self, node: Node) -> int:
        return max(int(node.usable_bytes * self.headroom), self.min_headroom_bytes)

    def _budget(self, node: Node) -> int:
        return node.usable_bytes - self._headroom(node)

    def _plan(self, model, nodes, budgets, ends, table, context, sequences) -> Plan:
        stages, start = [], 0
        for node, end in zip(nodes, ends):
            kinds = [model.layers[i].kind for i in range(start, end)]
            read = table.read(start, end)
            used = end > start
            stages.append(Stage(
                node=node, start=start, end=end,
                num_kda=kinds.count("kda"), num_dsa=kinds.count("dsa"), num_mla=kinds.count("mla"),
                has_embed=used and start == 0, has_head=used and end == table.n,
                weight_bytes=table.weights(start, end), cache_bytes=table.cache(start, end),
                headroom_bytes=self._headroom(node), read_bytes=read,
                seconds=read / node.bandwidth_bytes_per_s,
            ))
            start = end
        used = sum(1 for s in stages if s.used)
        hops = used if used > 1 else 0
        return Plan(
            stages=tuple(stages), context=context, sequences=sequences, hops=hops,
            seconds_per_step=sum(s.seconds for s in stages) + hops * self.hop_latency_s,
            cache_bytes_per_token=model.cache_bytes_per_token,
            state_bytes_per_sequence=model.state_bytes_per_sequence,
        )

    def _error(self, model, nodes, context, sequences, table, budgets) -> PlanError:
        need = table.mem(0, table.n)
        have = sum(max(b, 0) for b in budgets)
        short = max(need - have, 0)
        template = max(nodes, key=lambda n: n.usable_bytes)  # first of the largest
        tb = self._budget(template)
        more = None
        if tb > 0:
            for extra in range(max(1, math.ceil(short / tb)), 257):
                grown = nodes + [template] * extra
                if _feasible(table, [self._budget(n) for n in grown]):
                    more = extra
                    break
        keep_fraction = keep_experts = pruned_bytes = None
        e, k = model.num_experts, model.experts_per_token
        if e and k:
            fits = lambda n: _feasible(_Costs(model.pruned(n), context, sequences), budgets)
            if fits(k):
                lo, hi = k, e  # fits(lo) and not fits(hi)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
                keep_fraction = math.floor(100 * lo / e) / 100
                keep_experts = max(k, round(keep_fraction * e))
                if keep_fraction == 0 or keep_experts > lo:
                    keep_fraction, keep_experts = lo / e, lo
                pruned_bytes = model.pruned(keep_experts).weight_bytes
        lines = [
            f"does not fit: needs {need / GB:.1f} GB (weights {model.weight_bytes / GB:.1f} GB + "
            f"cache {model.cache_bytes(context, sequences) / GB:.1f} GB at {context} tokens x "
            f"{sequences} sequence(s)), the {len(nodes)} node(s) give {have / GB:.1f} GB after headroom"
        ]
        if short:
            lines.append(f"short by {short / GB:.1f} GB")
        else:
            big = max(range(table.n), key=lambda i: table.mem(i, i + 1))
            lines.append(
                f"enough memory in total, but no contiguous split fits (largest layer: "
                f"{big}, {table.mem(big, big + 1) / GB:.1f} GB)")
        options = []
        if more is not None:
            options.append(f"on {len(nodes) + more} nodes ({more} more {template.label})")
        if keep_fraction is not None:
            options.append(f"with --keep {keep_fraction:g} pruning ({keep_experts} of {e} experts "
                           f"per layer, weights {pruned_bytes / GB:.1f} GB)")
        if options:
            lines.append("would fit " + ", or ".join(options))
        elif e:
            lines.append("no pruning level fits these nodes either")
        return PlanError("; ".join(lines), need_bytes=need, have_bytes=have, short_bytes=short,
                         more_nodes=more, template=template, keep_fraction=keep_fraction,
                         keep_experts=keep_experts, pruned_bytes=pruned_bytes)


class _Costs:
    """Prefix sums of memory / read bytes of layer ranges, embedding and head included."""

    def __init__(self, model: ModelBytes, context: int, sequences: int):
        self.n = len(model.layers)
        self.embed = model.embed_bytes
        self.head = model.head_bytes
        self.embed_read = model.embed_read_bytes(sequences)
        w, c, r = [0], [0], [0]
        for layer in model.layers:
            w.append(w[-1] + layer.weight_bytes)
            c.append(c[-1] + layer.cache_bytes(context, sequences))
            r.append(r[-1] + layer.read_bytes(context, sequences))
        self._w, self._c, self._r = w, c, r

    def _ends(self, s: int, e: int) -> Tuple[bool, bool]:
        return e > s and s == 0, e > s and e == self.n

    def weights(self, s: int, e: int) -> int:
        first, last = self._ends(s, e)
        return self._w[e] - self._w[s] + first * self.embed + last * self.head

    def cache(self, s: int, e: int) -> int:
        return self._c[e] - self._c[s]

    def mem(self, s: int, e: int) -> int:
        return self.weights(s, e) + self.cache(s, e)

    def read(self, s: int, e: int) -> int:
        first, last = self._ends(s, e)
        return self._r[e] - self._r[s] + first * self.embed_read + last * self.head


def _ps(read_bytes: int, bandwidth: int) -> int:
    """Stage time in integer picoseconds, so comparisons and ties are exact."""
    return read_bytes * 10**12 // int(bandwidth)


def _greedy_ends(table: _Costs, budgets: Sequence[int], caps: Optional[Sequence[int]] = None,
                 bandwidths: Optional[Sequence[int]] = None) -> Optional[List[int]]:
    """Each node in order takes as many layers as fit (and, with `caps`, as its time cap
    allows). Taking the most never hurts later nodes, so this finds a split whenever one
    exists. Returns the ends, or None."""
    ends, s = [], 0
    for k, budget in enumerate(budgets):
        e = s
        while e < table.n and table.mem(s, e + 1) <= budget and (
                caps is None or _ps(table.read(s, e + 1), bandwidths[k]) <= caps[k]):
            e += 1
        ends.append(e)
        s = e
    return ends if s == table.n else None


def _feasible(table: _Costs, budgets: Sequence[int]) -> bool:
    return _greedy_ends(table, budgets) is not None


def _best_split(table: _Costs, nodes: Sequence[Node], budgets: Sequence[int],
                hop_latency_s: float) -> Optional[List[int]]:
    """Ends per node: min bottleneck time, then min total time, then balance, then earlier
    nodes fuller (see the module doc). None when no split fits."""
    n, bws = table.n, [int(x.bandwidth_bytes_per_s) for x in nodes]
    if not _feasible(table, budgets):
        return None
    # 1. Smallest bottleneck: binary search over every possible stage time.
    times = sorted({_ps(table.read(s, e), bws[k])
                    for k in range(len(nodes)) for s in range(n) for e in range(s + 1, n + 1)
                    if table.mem(s, e) <= budgets[k]})
    lo, hi = 0, len(times) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy_ends(table, budgets, [times[mid]] * len(nodes), bws) is not None:
            hi = mid
        else:
            lo = mid + 1
    cap = times[lo]
    # 2. Under that cap: DP from the last node back, minimising (total time incl. hops,
    #    sum of squared times); iterating e downwards and replacing only on strictly
    #    better keeps the largest end on ties (earlier nodes fuller).
    hop = int(hop_latency_s * 10**12)
    inf = None
    best = [[inf] * (n + 1) for _ in range(len(nodes) + 1)]
    choice = [[0] * (n + 1) for _ in range(len(nodes))]
    best[len(nodes)][n] = (0, 0)
    for k in range(len(nodes) - 1, -1, -1):
        for s in range(n, -1, -1):
            for e in range(n, s - 1, -1):
                rest = best[k + 1][e]
                if rest is inf or (e > s and table.mem(s, e) > budgets[k]):
                    continue
                t = _ps(table.read(s, e), bws[k])
                if t > cap:
                    continue
                cost = (rest[0] + t + (hop if e > s else 0), rest[1] + t * t)
                if best[k][s] is inf or cost < best[k][s]:
                    best[k][s], choice[k][s] = cost, e
    ends, s = [], 0
    for k in range(len(nodes)):
        s = choice[k][s]
        ends.append(s)
    return ends
