"""Expert merging (`kimi-mlx prune --merge`): fold each dropped expert into a kept one.

REAM-style (Router-weighted Expert Activation Merging, Jha et al. 2026, arXiv 2604.04356):
instead of deleting the experts the saliency did not keep, each is merged into the kept
expert it is closest to, so its function is not thrown away.

Closeness, per MoE layer, on the calibration tokens the pass samples (`observe(...,
router_inputs=N, similarity=True)`, every ceil(tokens / N)-th token; `SimilarityAccumulator`):

* router: the correlation over tokens of two experts' raw router logits (centred);
* output: the cosine of two experts' outputs f_i(z), f_j(z) over the same tokens (every
  expert is run on every sampled token; sum_x <f_i, f_j> / sqrt(sum ||f_i||^2 sum ||f_j||^2)).

`similarity = (router + output) / 2`; each dropped expert goes into the kept expert of
highest similarity (`assign`).

Merging one group (kept expert k and the dropped experts assigned to it; `merge_group`):
SwiGLU experts f(z) = w2 (act(w1 z) * (w3 z)) are unchanged when their intermediate
neurons are permuted (rows of w1 and w3, columns of w2 alike), so before averaging each
dropped expert's neurons are matched to k's (`align`): neuron a of k to neuron b of the
other by the cosine of their concatenated, per-matrix normalised (w1 row, w3 row, w2
column), with the Hungarian assignment (`scipy.optimize.linear_sum_assignment`) up to
`HUNGARIAN_MAX` neurons and a greedy matching (rows in order of their best score, each
taking its best free column) above it or without scipy: the Hungarian assignment takes
~7 s for 3072 neurons (K3.1's `moe_intermediate_size`) on 2 x86 cores, which at K3.1
would be hours per build. Then w = sum_j n_j P_j(w_j) / sum_j n_j, n_j the calibration
tokens routed to j (frequency; a group with no routed token keeps k as is).

MXFP4 experts are dequantized (exact) to float32, merged, and requantized to MXFP4
(`mx.quantize(mode="mxfp4")`) or to `--expert-bits` affine; the relative requantization
error ||w - deq(q(w))||_F / ||w||_F of every merged projection is reported.

The router rows stay the kept experts' own (the dropped rows go); `--refit-router` then
fits the kept rows to the full gate with each dropped expert's weight folded into its
merge target (`refit.target_gates(into=...)`).

Memory: while a layer runs, three E x E float64 sums (E = num_experts) and the outputs
of every expert on a chunk of sampled tokens (`SIM_CHUNK_BYTES`; the sampled tokens'
outputs are never held whole: at K3.1 size, 16,384 tokens x 896 experts x 3584 latent x
4 bytes = 210 GB a layer); each finished layer keeps its E x E float32 similarity; the
merge itself, at write time, holds three experts in float32 (k, the running sum, one
dropped expert) and one I x I score matrix. `memory_estimate` gives the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

DEFAULT_TOKENS = 16384  # sampled calibration tokens per MoE layer (as refit.DEFAULT_TOKENS)
SIM_CHUNK_BYTES = 1 << 30  # all experts' outputs on one chunk of sampled tokens, float32
DEFAULT_MIN_SIMILARITY = -1.0  # merge every dropped expert
HUNGARIAN_MAX = 1024  # neurons; greedy matching above (see the module docstring)
PROJ = ("w1", "w3", "w2")  # gate, up (rows = neurons), down (columns = neurons)


class SimilarityAccumulator:
    """Sums over sampled tokens for one MoE layer: router logits and expert outputs.

    `add(moe, switch, x)` runs every expert of `moe` on the tokens x [n, hidden] (the router
    input); the partial sums stay MLX arrays until `flush()` (after `mx.eval(*pending())`).
    Attributes (after flush): tokens; logit_sum float64 [E]; logit_gram [E, E] (sum of
    l l^T); out_gram [E, E] (sum over tokens of <f_i(z), f_j(z)>).
    """

    def __init__(self, num_experts: int):
        e = num_experts
        self.num_experts = e
        self.tokens = 0
        self.logit_sum = np.zeros(e, np.float64)
        self.logit_gram = np.zeros((e, e), np.float64)
        self.out_gram = np.zeros((e, e), np.float64)
        self._parts: List[Tuple[mx.array, mx.array, mx.array]] = []
        self._sim: Optional[np.ndarray] = None

    def add(self, moe, switch, x: mx.array) -> None:
        """x [n, hidden]: router inputs; `switch` the layer's SwitchGLU (unwrapped)."""
        if x.shape[0] == 0:
            return
        e = self.num_experts
        logits = moe.gate(x).astype(mx.float32)
        z = moe.routed_expert_down_proj(x) if getattr(moe, "latent", False) else x
        d = z.shape[-1]
        step = max(1, SIM_CHUNK_BYTES // (e * d * 4))
        every = mx.broadcast_to(mx.arange(e, dtype=mx.int32), (min(step, z.shape[0]), e))
        for a in range(0, z.shape[0], step):
            zc = z[a:a + step]
            y = switch(zc, every[: zc.shape[0]]).astype(mx.float32)  # [n, E, d]
            yp = y.transpose(1, 0, 2).reshape(e, -1)
            lc = logits[a:a + step]
            self._parts.append((lc.sum(axis=0), lc.T @ lc, yp @ yp.T))
        self.tokens += int(x.shape[0])

    def pending(self) -> List[mx.array]:
        return [a for p in self._parts for a in p]

    def flush(self) -> None:
        for ls, lg, og in self._parts:
            self.logit_sum += np.array(ls, dtype=np.float64)
            self.logit_gram += np.array(lg, dtype=np.float64)
            self.out_gram += np.array(og, dtype=np.float64)
        self._parts.clear()

    def finish(self) -> None:
        """Reduce the sums to the [E, E] float32 similarity and free them (the pass calls
        this when its layer is done, so each finished layer keeps E x E x 4 bytes)."""
        if self._sim is None and self.tokens:
            self._sim = self.similarity().astype(np.float32)
            self.logit_sum = self.logit_gram = self.out_gram = None

    def similarity(self) -> np.ndarray:
        """[E, E] in [-1, 1]: (router logit correlation + output cosine) / 2.

        Raises:
            ValueError: no token was sampled.
        """
        if self._sim is not None:
            return self._sim
        if self.tokens == 0:
            raise ValueError("expert similarity: no calibration token was sampled")
        n = self.tokens
        mean = self.logit_sum / n
        cov = self.logit_gram / n - np.outer(mean, mean)
        router = _cosine(cov)
        return 0.5 * (router + _cosine(self.out_gram))


def _cosine(gram: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.maximum(np.diag(gram), 0.0))
    d = np.where(d > 0, d, 1.0)
    return np.clip(gram / d[:, None] / d[None, :], -1.0, 1.0)


def assign(similarity: np.ndarray, kept: Sequence[int]) -> Dict[int, int]:
    """{dropped expert: kept expert of highest similarity} for every expert not in `kept`.

    similarity [E, E]; kept: kept expert ids (ties go to the lower id).
    Raises:
        ValueError: empty `kept` or an id outside [0, E).
    """
    e = similarity.shape[0]
    kept = sorted(kept)
    if not kept or kept[0] < 0 or kept[-1] >= e:
        raise ValueError(f"merge: kept experts must be ids in [0, {e}), got {kept[:8]}")
    k = np.array(kept)
    dropped = [j for j in range(e) if j not in set(kept)]
    return {j: int(k[int(np.argmax(similarity[j, k]))]) for j in dropped}


@dataclass
class LayerMerge:
    """The merge plan of one MoE layer.

    Attributes:
        groups: {kept id: [(expert id, weight), ...]} with the kept expert first; only
            kept experts that absorb at least one dropped expert are listed. Weights are
            calibration tokens routed to each expert (frequency).
        into: {dropped id: kept id}.
        similarity: {dropped id: its similarity to the kept expert it went into}.
    """

    groups: Dict[int, List[Tuple[int, float]]]
    into: Dict[int, int]
    similarity: Dict[int, float] = field(default_factory=dict)


def plan_merges(similarities: Mapping[int, SimilarityAccumulator], counts: Mapping[int, np.ndarray],
                kept: Mapping[int, Sequence[int]], min_similarity: float = DEFAULT_MIN_SIMILARITY
                ) -> Dict[int, LayerMerge]:
    """`LayerMerge` per MoE layer of `kept` from the calibration pass's sums and the
    per-expert routed-token counts ({layer: int [E]}). A dropped expert whose best
    similarity is below `min_similarity` is deleted, not merged (it is in neither
    `groups` nor `into`).

    Raises:
        ValueError: a layer of `kept` without similarity sums (calibrate with
            `observe(similarity=True)`).
    """
    out: Dict[int, LayerMerge] = {}
    for layer, ids in sorted(kept.items()):
        if layer not in similarities:
            raise ValueError(f"merge: layer {layer} has no expert similarity from the "
                             "calibration pass")
        sim = similarities[layer].similarity()
        into = {d: k for d, k in assign(sim, ids).items() if sim[d, k] >= min_similarity}
        n = np.asarray(counts[layer], dtype=np.float64)
        groups: Dict[int, List[Tuple[int, float]]] = {}
        for d, k in sorted(into.items()):
            groups.setdefault(k, [(k, float(n[k]))]).append((d, float(n[d])))
        out[layer] = LayerMerge(groups, into, {d: float(sim[d, k]) for d, k in into.items()})
    return out


def _features(w1: np.ndarray, w3: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """[I, 2 * in + out]: per neuron its w1 row, w3 row and w2 column, each matrix scaled
    to unit Frobenius norm, the row then to unit length."""
    parts = []
    for m in (w1, w3, w2.T):
        m = np.asarray(m, np.float32)
        parts.append(m / max(float(np.linalg.norm(m)), 1e-30))
    f = np.concatenate(parts, axis=1)
    return f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-30)


def _greedy(score: np.ndarray) -> np.ndarray:
    """col[a] for each row a: rows in order of their best score take their best free column."""
    n = score.shape[0]
    col = np.full(n, -1, np.int64)
    free = np.ones(n, bool)
    for a in np.argsort(-score.max(axis=1), kind="stable"):
        s = np.where(free, score[a], -np.inf)
        b = int(np.argmax(s))
        col[a], free[b] = b, False
    return col


def align(ref: Sequence[np.ndarray], other: Sequence[np.ndarray], method: str = "auto") -> np.ndarray:
    """Permutation perm [I] int64 so that neuron perm[a] of `other` matches neuron a of `ref`.

    ref, other: (w1 [I, in], w3 [I, in], w2 [out, I]) float arrays of two SwiGLU experts.
    method: "hungarian" (scipy.optimize.linear_sum_assignment, maximum total cosine),
    "greedy", or "auto" (Hungarian up to HUNGARIAN_MAX neurons when scipy is installed).
    Raises:
        ValueError: shapes that differ or an unknown method; ImportError: "hungarian"
            without scipy.
    """
    if [np.shape(a) for a in ref] != [np.shape(a) for a in other]:
        raise ValueError(f"merge: expert shapes differ: {[np.shape(a) for a in ref]} vs "
                         f"{[np.shape(a) for a in other]}")
    # [I, I]; the product in MLX (the GPU on a Mac: ~1e11 flops at K3.1 size)
    score = np.array(mx.array(_features(*ref)) @ mx.array(_features(*other)).T, np.float64)
    if method == "auto":
        method = "greedy"
        if score.shape[0] <= HUNGARIAN_MAX:
            try:
                import scipy.optimize  # noqa: F401

                method = "hungarian"
            except ImportError:
                pass
    if method == "hungarian":
        from scipy.optimize import linear_sum_assignment

        rows, cols = linear_sum_assignment(-score)
        perm = np.empty(score.shape[0], np.int64)
        perm[rows] = cols
        return perm
    if method == "greedy":
        return _greedy(score)
    raise ValueError(f"merge: unknown alignment {method!r} (hungarian, greedy, auto)")


def permute(expert: Sequence[np.ndarray], perm: np.ndarray) -> Tuple[np.ndarray, ...]:
    """(w1, w3, w2) with the intermediate neurons reordered: row a <- row perm[a]."""
    w1, w3, w2 = expert
    return w1[perm], w3[perm], w2[:, perm]


def merge_group(experts: Sequence[Sequence[np.ndarray]], weights: Sequence[float],
                method: str = "auto") -> Tuple[np.ndarray, ...]:
    """Frequency-weighted average of aligned SwiGLU experts.

    experts: [(w1 [I, in], w3 [I, in], w2 [out, I])], the kept expert first (the basis the
    others are aligned to); weights: one >= 0 per expert (all 0: the kept one as is).
    Returns (w1, w3, w2) float32. Holds the sum and one other expert at a time when
    `experts` is an iterator-backed sequence.
    Raises:
        ValueError: lengths or shapes that do not agree, or a negative weight.
    """
    if len(experts) != len(weights) or not experts:
        raise ValueError(f"merge: {len(experts)} experts but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any():
        raise ValueError(f"merge: negative weight in {w.tolist()}")
    ref = tuple(np.asarray(a, np.float32) for a in experts[0])
    total = float(w.sum())
    if total <= 0:
        return ref
    acc = [a.astype(np.float64) * w[0] for a in ref]
    for j in range(1, len(experts)):
        if w[j] == 0:
            continue
        other = tuple(np.asarray(a, np.float32) for a in experts[j])
        other = permute(other, align(ref, other, method))
        for a, o in zip(acc, other):
            a += w[j] * o
    return tuple((a / total).astype(np.float32) for a in acc)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 U8 packed [out, in/2] + E8M0 U8 scale [out, in/32] -> float32 [out, in] (exact)."""
    w = mx.array(np.ascontiguousarray(packed, np.uint8)).view(mx.uint32)
    s = mx.array(np.ascontiguousarray(scale, np.uint8))
    return np.array(mx.dequantize(w, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))


def quantize_mxfp4(w: np.ndarray) -> Tuple[np.ndarray, np.ndarray, float]:
    """float [out, in] -> (packed U8 [out, in/2], scale U8 [out, in/32], relative error
    ||w - deq(q(w))||_F / ||w||_F)."""
    q, s = mx.quantize(mx.array(np.asarray(w, np.float32)), group_size=32, bits=4, mode="mxfp4")
    back = np.array(mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))
    return np.array(q.view(mx.uint8)), np.array(s), rel_error(w, back)


def quantize_affine(w: np.ndarray, bits: int, group: int):
    """float [out, in] -> (weight uint32, scales BF16, biases BF16 as MLX arrays, relative
    error), MLX affine as `quantize.requantize_mxfp4` writes it."""
    dense = mx.array(np.asarray(w, np.float32)).astype(mx.bfloat16)
    q, scales, biases = mx.quantize(dense, group_size=group, bits=bits, mode="affine")
    back = np.array(mx.dequantize(q, scales, biases, group_size=group, bits=bits,
                                  mode="affine").astype(mx.float32))
    return q, scales, biases, rel_error(w, back)


def rel_error(w: np.ndarray, back: np.ndarray) -> float:
    n = float(np.linalg.norm(w))
    return float(np.linalg.norm(np.asarray(w, np.float64) - back)) / n if n > 0 else 0.0


def memory_estimate(num_experts: int, hidden: int, latent: int, intermediate: int,
                    tokens: int = DEFAULT_TOKENS, moe_layers: int = 1) -> Dict[str, int]:
    """Bytes `--merge` adds to a prune, by what holds them (see the module docstring).

    Returns {"similarity": E x E float32 per MoE layer, for all `moe_layers` (kept to
    the end of the pass); "sums": the running layer's three E x E float64 sums;
    "inputs_one_layer": tokens x hidden float32, what the running layer's sampled router
    inputs would take held whole (they are used chunk by chunk, not held);
    "outputs_chunk": every expert's output on one chunk of sampled tokens (<=
    SIM_CHUNK_BYTES); "outputs_all": what the running layer's outputs would take held
    whole (tokens x E x latent float32, not held); "merge": three experts in float32
    plus one I x I float64 score, at write time}.
    """
    per_token = num_experts * latent * 4
    step = max(1, SIM_CHUNK_BYTES // per_token)
    expert = (2 * intermediate * latent + latent * intermediate) * 4
    return {
        "similarity": num_experts * num_experts * 4 * moe_layers,
        "sums": 3 * num_experts * num_experts * 8,
        "inputs_one_layer": tokens * hidden * 4,
        "outputs_chunk": min(step, tokens) * per_token,
        "outputs_all": tokens * per_token,
        "merge": 3 * expert + intermediate * intermediate * 8,
    }
