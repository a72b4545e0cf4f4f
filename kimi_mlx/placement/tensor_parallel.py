"""Tensor-parallel placement: what each rank of a group loads and reads per decode step,
the collectives a token costs, and the decode speed that gives next to a pipeline.

The split of every tensor is `kimi_mlx.model.shard`'s table (`split_of`, `split_range`);
here it is applied to tensor shapes alone (a checkpoint's headers, or the shapes its config
implies), so `kimi-mlx plan` can answer before anything is loaded, and the ranged loader's
bytes can be checked against it (tests/test_tensor_parallel.py).

Time per token (one sequence), bandwidth-bound as the pipeline planner's:

    t = bytes read per Mac / bandwidth + collectives per token x latency per collective

Collectives per token: one all_sum per attention block and one per MoE (or dense MLP)
block, so 2 per layer, plus one all_gather of the logits when lm_head is split: 187 for
K3.1. Latency per collective (defaults, `--jaccl-latency-us` / `--tcp-latency-us`):
- JACCL (RDMA over Thunderbolt 5): 50 us.
- ring (TCP over the Thunderbolt bridge): 300 us (the figure the cluster's tensor
  group was first planned with, which assumed 30 us for JACCL).
Sources. Primary: Apple's TN3205 "Low-latency communication with RDMA over Thunderbolt"
(https://developer.apple.com/documentation/technotes/tn3205-low-latency-communication-with-rdma-over-thunderbolt:
macOS 26.2+, Apple silicon with Thunderbolt 5, an RDMA Verbs API, enabled with
`rdma_ctl enable` in Recovery) and MLX's distributed docs (docs/src/usage/distributed.rst,
"Getting Started with JACCL": JACCL's "communication latency an order of magnitude lower
than the ring backend"). Neither states a number of microseconds in the parts read
here, so the two figures themselves still come from a secondary summary of TN3205
(https://www.adwaitx.com/?p=10695: "~300us over TCP to under 50us with RDMA over
Thunderbolt"); their ratio agrees with MLX's order of magnitude. Measure on the Macs
(`kimi-mlx bench tensor` prints the bare all_sum floor) and pass the flags. On this
Linux box's loopback, with 2 busy cores, an all_sum of a few KB measured ~7 ms; that is
CPU contention, not a link.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kimi_mlx.checkpoint.shards import DTYPE_BYTES, read_header, weight_map
from kimi_mlx.model.config import ModelArgs, read_config
from kimi_mlx.model.shard import HEADS, IN, OUT, split_of, split_range
from kimi_mlx.model.tensor_map import canonical, kind
from kimi_mlx.placement.layer_bytes import (BuildSpec, _hf_cached_file, apply_build,
                                            expected_tensors, official_config, DEFAULT_MODEL_ID,
                                            KV_CACHE_DEFAULT_GROUP, cache_bytes)
from kimi_mlx.placement.planner import StagePlanner

JACCL_LATENCY_S = 50e-6
TCP_LATENCY_S = 300e-6

Tensors = Dict[str, Tuple[str, Tuple[int, ...]]]
_EXPERT = re.compile(r"^(?P<moe>.*\.block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.")
_SCALES = (".weight_scale", ".scales")
_SHARED = re.compile(r"^(?P<base>.*\.shared_experts\.)(?:gate|up)_proj\.")
_NUMBERS = re.compile(r"\.\d+\.")


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def tensors_of(model: str, build: Optional[BuildSpec] = None) -> Tuple[ModelArgs, Tensors]:
    """(config, {checkpoint name: (safetensors dtype, shape)}) for `--model`: a local
    folder's shard headers, else the config in the local Hugging Face cache or the one
    kimi-mlx ships (`layer_bytes.model_bytes`'s order, without its partial-cache case);
    with `build`, the shapes that build would have. Nothing is downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        config = read_config(path)
        args = ModelArgs.from_config(config, str(path / "config.json"))
        wm = weight_map(path)
        tensors: Tensors = {}
        for shard in sorted(set(wm.values())):
            header = read_header(path / shard)
            tensors.update({n: (header[n].dtype, header[n].shape) for n, s in wm.items()
                            if s == shard and n in header})
    else:
        found = _hf_cached_file(model, "config.json") or official_config(model) \
            or official_config(DEFAULT_MODEL_ID)
        config = json.loads(Path(found).read_text())
        args = ModelArgs.from_config(config, str(found))
        tensors = expected_tensors(args)
    tensors = {canonical(n): v for n, v in tensors.items() if kind(n, args) == "text"}
    return args, apply_build(tensors, args, build) if build is not None else tensors


def _lm_head(args: ModelArgs, ranks: int, lm_head: Optional[bool]) -> bool:
    """Whether lm_head is split: as asked, else `shard`'s default (the vocabulary divides)."""
    return args.vocab_size % ranks == 0 if lm_head is None else lm_head


def _sibling_scales(name: str, tensors: Tensors) -> Optional[Tuple[int, ...]]:
    for w, s in ((".weight_packed", ".weight_scale"), (".weight", ".scales")):
        if name.endswith(w) and name[: -len(w)] + s in tensors:
            return tensors[name[: -len(w)] + s][1]
    return None


def _glu_unit(base: str, gate: str, down: str, tensors: Tensors) -> int:
    """Elements of a gate/up/down block's intermediate dim kept together: its down
    projection's quantization group (32 for MXFP4), 1 for a float one."""
    inter = next(tensors[f"{base}{gate}.{f}"][1][0] for f in ("weight_packed", "weight")
                 if f"{base}{gate}.{f}" in tensors)
    for f in _SCALES:
        if f"{base}{down}{f}" in tensors:
            return inter // tensors[f"{base}{down}{f}"][1][-1]
    return 1


@dataclass(frozen=True)
class _Class:
    """Tensors that split alike: split, bytes, the split dimension and its unit."""

    split: Optional[str]
    nbytes: int
    dim: int  # rows (OUT), groups (IN), heads (HEADS)
    unit: int
    expert: bool
    embed_rows: int  # > 0 for the embedding (one row read per token)
    stored: int  # HEADS: values on disk


def _classes(tensors: Tensors, args: ModelArgs, lm_head: bool) -> Dict[_Class, int]:
    """The tensors grouped by how they split ({class: count}; K3.1's 500k expert tensors
    fall into a handful of classes). Tensors alike but for their layer and expert numbers
    are classified once, by a representative."""
    alike: Dict[Tuple[str, str, Tuple[int, ...]], list] = {}
    for name, (dtype, shape) in tensors.items():
        key = (_NUMBERS.sub(".0.", name), dtype, tuple(shape))
        entry = alike.get(key)
        if entry is None:
            alike[key] = [name, 1]
        else:
            entry[1] += 1
    out: Dict[_Class, int] = {}
    for (generic, dtype, shape), (name, count) in alike.items():
        split = split_of(generic, lm_head)
        nbytes = _prod(shape) * DTYPE_BYTES[dtype]
        m = _EXPERT.match(name)
        dim, unit, stored = 0, 1, 0
        if split == HEADS:
            dim, stored = args.linear_attn_config["num_heads"], shape[0]
        elif split == OUT:
            dim = shape[0]
            sh = _SHARED.match(name)
            if m:  # rows in whole groups of the down projection's input
                unit = _glu_unit(f"{m['moe']}.experts.{m['e']}.", "w1", "w2", tensors)
            elif sh:
                unit = _glu_unit(sh["base"], "gate_proj", "down_proj", tensors)
        elif split == IN:
            scales = _sibling_scales(name, tensors)
            dim = scales[-1] if scales is not None else shape[-1]
        c = _Class(split, nbytes, dim, unit, bool(m),
                   shape[0] if "embed_tokens" in name else 0, stored)
        out[c] = out.get(c, 0) + count
    return out


def _share(c: _Class, ranks: int, rank: int) -> Fraction:
    """Fraction of a class's bytes rank `rank` of `ranks` holds (the `shard` table on
    shapes: OUT rows, IN columns in whole quantization groups, HEADS the used heads)."""
    if c.split == HEADS:  # A_log: [128] on disk, the first num_heads used
        a, b = split_range(c.dim, ranks, rank)
        return Fraction(b - a, c.stored)
    if c.split is None or ranks == 1:
        return Fraction(1)
    a, b = split_range(c.dim, ranks, rank, c.unit)
    return Fraction(b - a, c.dim)


def rank_load_bytes(tensors: Tensors, args: ModelArgs, ranks: int, rank: int,
                    lm_head: Optional[bool] = None,
                    classes: Optional[Dict[_Class, int]] = None) -> int:
    """Tensor bytes rank `rank` of `ranks` loads (what `checkpoint.ranged` reads).
    classes: `_classes(tensors, args, lm_head)` if already computed."""
    classes = classes or _classes(tensors, args, _lm_head(args, ranks, lm_head))
    return int(sum(_share(c, ranks, rank) * c.nbytes * n for c, n in classes.items()))


def rank_read_bytes(tensors: Tensors, args: ModelArgs, ranks: int, rank: int, context: int,
                    lm_head: Optional[bool] = None, act_bytes: int = 2,
                    classes: Optional[Dict[_Class, int]] = None,
                    layers: Optional[Tuple[int, int]] = None, sequences: int = 1,
                    kv_bits: Optional[int] = None,
                    kv_group_size: int = KV_CACHE_DEFAULT_GROUP) -> int:
    """Bytes rank `rank` reads for one decode step of `sequences` rows (one token each) at
    `context` tokens: its share of every weight, of the routed experts only the picked
    ones (the expected union over the rows, `active_experts`: experts_per_token /
    num_experts for one), one embedding row per row; per row its heads' KDA states and
    the DSA caches whole (the latent and the index keys are replicated). `layers` (start,
    end): count the caches of those layers only (a checkpoint slice that holds only their
    tensors, as `make check-real`'s); default all. `kv_bits`, `kv_group_size`: the DSA
    caches in the `--kv-bits` format (`layer_bytes.cache_bytes`)."""
    total = Fraction(0)
    e, k = max(1, args.num_experts), min(args.num_experts_per_token, max(1, args.num_experts))
    picked = (Fraction(k, e) if sequences <= 1
              else Fraction(1.0 - (1.0 - k / e) ** sequences))
    for c, n in (classes or _classes(tensors, args, _lm_head(args, ranks, lm_head))).items():
        b = _share(c, ranks, rank) * c.nbytes * n
        if c.expert:
            b *= picked
        elif c.embed_rows:
            b = b * sequences / c.embed_rows
        total += b
    heads = args.linear_attn_config["num_heads"]
    a, b = split_range(heads, ranks, rank)
    for i in range(*(layers or (0, args.num_hidden_layers))):
        per_token, index, state = cache_bytes(args, i, act_bytes, kv_bits, kv_group_size)
        attended = min(context, args.index_topk) if args.is_dsa(i) else context
        total += sequences * (Fraction(state * (b - a), heads) + index * context
                              + (per_token - index) * attended)
    return int(total)


def collectives_per_token(args: ModelArgs, ranks: int,
                         lm_head: Optional[bool] = None) -> Tuple[int, int]:
    """(all_sums, all_gathers) per decode step: attention + FFN per layer; the logits.
    None in one process."""
    if ranks == 1:
        return 0, 0
    return 2 * args.num_hidden_layers, int(_lm_head(args, ranks, lm_head))


@dataclass(frozen=True)
class TensorPlan:
    """A tensor-parallel group of `ranks` Macs (bytes per rank, the largest rank's)."""

    ranks: int
    load_bytes: Tuple[int, ...]
    read_bytes_per_token: int
    cache_bytes: int
    all_sums: int
    all_gathers: int
    bandwidth: int
    # bytes the largest-read rank reads per decode step of r rows, r = 1.. (index r - 1;
    # the last entry stands for more rows than listed); () : read_bytes_per_token per row
    read_bytes_by_rows: Tuple[int, ...] = ()

    @property
    def collectives(self) -> int:
        return self.all_sums + self.all_gathers

    def seconds_per_token(self, latency_s: float) -> float:
        return self.read_bytes_per_token / self.bandwidth + self.collectives * latency_s

    def tokens_per_s(self, latency_s: float) -> float:
        return 1.0 / self.seconds_per_token(latency_s)

    def rank_bytes(self, sequences: int = 1) -> int:
        """Bytes the fullest rank holds for `sequences` sequences at the planned context:
        the largest share of the weights (`load_bytes`) plus, per sequence, the caches
        (`cache_bytes`: the replicated DSA caches whole and rank 0's KDA heads' states,
        the most any rank holds; in the `--kv-bits` format the plan was made with).

        Raises:
            ValueError: sequences < 1."""
        if sequences < 1:
            raise ValueError(f"sequences must be >= 1, got {sequences}")
        return max(self.load_bytes) + self.cache_bytes * int(sequences)

    def aggregate_tokens_per_s(self, latency_s: float, rows: int) -> float:
        """Tokens/s of `rows` sequences decoded together (`cluster server --parallel
        tensor` batches them: one forward command, the same collectives, for all rows):
        rows / (one step's reads at `rows` rows / bandwidth + collectives x latency)."""
        rows = max(1, int(rows))
        if not self.read_bytes_by_rows:
            read = self.read_bytes_per_token * rows
        else:
            read = self.read_bytes_by_rows[min(rows, len(self.read_bytes_by_rows)) - 1]
        return rows / (read / self.bandwidth + self.collectives * latency_s)


def plan_tensor(tensors: Tensors, args: ModelArgs, ranks: int, bandwidth: int, context: int,
                lm_head: Optional[bool] = None, kv_bits: Optional[int] = None,
                kv_group_size: int = KV_CACHE_DEFAULT_GROUP) -> TensorPlan:
    """`TensorPlan` for `ranks` Macs of `bandwidth` bytes/s at `context` tokens (the DSA
    caches in the `--kv-bits` format with `kv_bits`; None: bf16). Its `cache_bytes` is one
    sequence's; `TensorPlan.rank_bytes(n)` / `tensor_fits` count n."""
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
    lm_head = _lm_head(args, ranks, lm_head)
    classes = _classes(tensors, args, lm_head)
    load = tuple(rank_load_bytes(tensors, args, ranks, r, lm_head, classes) for r in range(ranks))
    read = max(rank_read_bytes(tensors, args, ranks, r, context, lm_head, classes=classes, **kv)
               for r in range(ranks))
    heads = args.linear_attn_config["num_heads"]
    cache = 0
    for i in range(args.num_hidden_layers):
        per_token, _, state = cache_bytes(args, i, **kv)
        a, b = split_range(heads, ranks, 0)
        cache += per_token * context + state * (b - a) // heads
    sums, gathers = collectives_per_token(args, ranks, lm_head)
    by_rows = tuple(max(rank_read_bytes(tensors, args, ranks, r, context, lm_head,
                                        classes=classes, sequences=rows, **kv)
                        for r in range(ranks))
                    for rows in range(1, MAX_ROWS_PLANNED + 1))
    return TensorPlan(ranks, load, read, cache, sums, gathers, bandwidth, by_rows)


def tensor_plan_for(tensors: Tensors, args: ModelArgs, bandwidths: Sequence[int],
                    context: int, kv_bits: Optional[int] = None,
                    kv_group_size: int = KV_CACHE_DEFAULT_GROUP) -> TensorPlan:
    """`plan_tensor` for one rank per Mac (the slowest Mac's bandwidth sets the pace);
    lm_head is split when the vocabulary divides evenly.

    Raises:
        ShardError: heads that do not split across the Macs (names the count)."""
    from kimi_mlx.model.shard import ShardError

    n = len(bandwidths)
    for what, heads in (("KDA", args.linear_attn_config["num_heads"]),
                        ("attention", args.num_attention_heads)):
        if heads % n:
            raise ShardError(f"{heads} {what} heads do not split across {n} Macs")
    return plan_tensor(tensors, args, n, min(bandwidths), context, kv_bits=kv_bits,
                       kv_group_size=kv_group_size)


def tensor_fits(tp: TensorPlan, nodes: Sequence, sequences: int = 1,
                headroom: Optional[Callable[[object], int]] = None) -> bool:
    """Whether a tensor group of one rank per node in `nodes` (`planner.Node`s) holds
    `sequences` sequences (`--max-concurrency`) at the plan's context: on every node
    `tp.rank_bytes(sequences)` plus `headroom(node)` bytes (default the stage planner's:
    10% of usable memory, at least 2 GiB, as the pipeline keeps) within its usable bytes.

    Raises:
        ValueError: sequences < 1."""
    if headroom is None:
        headroom = StagePlanner()._headroom
    need = tp.rank_bytes(sequences)
    return all(need + headroom(n) <= n.usable_bytes for n in nodes)


def recommend(pipeline_tokens_per_s: float, tensor: Optional[TensorPlan], latency_s: float,
              tensor_fits: bool) -> str:
    """"tensor" or "pipeline": the faster predicted decode of the two that fit (a tie or
    an unfit tensor plan keeps the pipeline, which needs no RDMA and no group)."""
    if tensor is None or not tensor_fits:
        return "pipeline"
    return "tensor" if tensor.tokens_per_s(latency_s) > pipeline_tokens_per_s else "pipeline"


def snapshot_bytes_per_rank(args: ModelArgs, ranks: int, rank: int = 0,
                            kv_bits: Optional[int] = None,
                            kv_group_size: int = KV_CACHE_DEFAULT_GROUP) -> Tuple[int, int]:
    """(bytes of KDA state, bytes per token of DSA cache) in one prompt-cache snapshot of
    rank `rank`'s shard (`cluster.tensor.prompt_cache`): the recurrent + conv states of
    its share of the KDA heads (copied into the snapshot), and the DSA latent, rope key
    and index key, replicated on every rank (kept by reference)."""
    heads = args.linear_attn_config["num_heads"]
    a, b = split_range(heads, ranks, rank)
    state = per_token = 0
    for i in range(args.num_hidden_layers):
        t, _, s = cache_bytes(args, i, kv_bits=kv_bits, kv_group_size=kv_group_size)
        per_token += t
        state += s * (b - a) // heads
    return state, per_token


# sequences a tensor group's server decodes in one forward pass: as many as --max-concurrency
# (`cluster.tensor.batched`: continuous batching through the group); None = no cap of its
# own. (With a draft it is one: speculative decoding runs one sequence.)
TENSOR_SERVER_ROWS = None
# rows whose step reads `plan_tensor` computes (`TensorPlan.read_bytes_by_rows`)
MAX_ROWS_PLANNED = 64


def choose_for_server(pipeline_tokens_per_s: float, pipeline_sequences: int,
                      tensor: Optional[TensorPlan], latency_s: float, tensor_fits: bool,
                      concurrency: int, tensor_rows: Optional[int] = TENSOR_SERVER_ROWS
                      ) -> Tuple[str, str]:
    """("tensor" | "pipeline", why in one line) for a server of `concurrency` requests at
    once: the higher predicted aggregate decode wins, the pipeline's with
    `pipeline_sequences` (= concurrency) sequences per step at `pipeline_tokens_per_s`
    each, the tensor group's min(concurrency, `tensor_rows`) rows decoded together
    (`TensorPlan.aggregate_tokens_per_s`: one step reads the weights once, the union of
    the rows' routed experts and each row's caches; `tensor_rows` None: no cap). A tie, no
    tensor plan or one that does not fit keeps the pipeline."""
    if tensor is None:
        return "pipeline", "a tensor group is not possible here (heads or memory)"
    if not tensor_fits:
        return "pipeline", "a tensor group does not fit in the Macs' memory"
    rows = max(1, concurrency if tensor_rows is None else min(concurrency, tensor_rows))
    tp = tensor.aggregate_tokens_per_s(latency_s, rows)
    pp = pipeline_tokens_per_s * pipeline_sequences
    choice = "tensor" if tp > pp else "pipeline"
    return choice, (f"at --max-concurrency {concurrency} the planner predicts {tp:.1f} tok/s "
                    f"for the tensor group ({rows} sequence(s) per step) vs {pp:.1f} for the "
                    f"pipeline ({pipeline_sequences} at {pipeline_tokens_per_s:.1f} each)")
