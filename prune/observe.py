"""Streamed per-layer expert statistics: the calibration pass of `kimi-mlx prune`.

The model never sits in memory as a whole. The calibration sequences are embedded, then
for each layer i in order: only layer i is loaded (`load_model(src, i, i + 1)`), every
sequence is run through it (prefill in chunks with that layer's own KDA / DSA cache), the
routed experts' statistics are recorded, the layer's outputs become the next layer's
inputs, and the layer is freed. What crosses layers is what crosses a pipeline hop: the
partial sum h and the AttnRes banks (`attn_res.Banks`); both are kept in memory or, when
they would not fit, spilled to disk (`ActivationStore`). Peak memory is one layer plus
the calibration activations (plus one sequence's banks when spilled).

Recorded per MoE layer and routed expert j, over the tokens x routed to j (REAP, arXiv
2510.13999, eq. 9 and its code's `update_pruning_state`):

* count_j: number of tokens routed to j (frequency);
* sum g_j(x) and sum g_j(x) * ||f_j(x)||_2 for two router weights g_j:
  - "softmax" (REAP's reference code, CerebrasResearch/reap `observer.py`: softmax over
    the raw router logits, renormalised over the selected experts, i.e. the softmax of
    the selected experts' logits), with the selected set the model's own (top-k of
    sigmoid + e_score_correction_bias), the set the pruned model routes by;
  - "model": the renormalised sigmoid weight the model multiplies f_j(x) by, divided by
    `routed_scaling_factor` (a constant, so it changes no ranking). For K3-style routers
    it sits near 1/top_k for every selected expert and tells experts little apart;
* sum ||f_j(x)||_2;
* max |f_j(x)|: the largest activation magnitude, to find "super experts".

**Expert output in the latent space.** In K3's latent MoE the routed experts read and
write the 3584-dim latent z = routed_expert_down_proj(x); the layer output is
up_proj(RMSNorm(sum_k g_k f_k(z))). f_j here is expert j's own output, the output of the
mlx-lm `SwitchGLU` for j, before the weighted sum, the norm and the shared up projection.
This is the latent-MoE analogue of REAP's ||f_j(x)||: it is exactly the term each
expert adds to the sum that the layer normalises, and RMSNorm and up_proj are shared by
all experts, so they scale every expert's contribution alike instead of telling experts
apart. (Taking norms after up_proj would need each expert's output pushed through the
shared 3584 -> 7168 projection separately, 16x the up_proj work, for a ranking that
differs only through up_proj's anisotropy.)
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kimi_mlx.model.attn_res import Banks
from kimi_mlx.model.config import ModelArgs, read_config

from kimi_mlx.prune.calib import CalibSet

DEFAULT_CHUNK = 1024
GATES = ("softmax", "model")  # router weight g_j in REAP (see the module docstring)
_ARRAYS = ("count", "gate_sum", "norm_sum", "gate_norm_sum", "max_abs", "softmax_gate_sum",
           "softmax_gate_norm_sum")


@dataclass
class LayerStats:
    """Routed-expert statistics of one MoE layer over the calibration tokens.

    Attributes:
        layer: 0-based layer index.
        num_experts, top_k: the layer's routed experts and experts per token.
        tokens: calibration tokens that went through the layer.
        count: int64 [E], tokens routed to each expert.
        gate_sum: float64 [E], sum of the model's gate g_j(x) over those tokens.
        norm_sum: float64 [E], sum of ||f_j(x)||_2 (EAN, "expert activation norm").
        gate_norm_sum: float64 [E], sum of g_j(x) * ||f_j(x)||_2 (model gate).
        max_abs: float64 [E], max |f_j(x)| over elements and tokens (0 if never routed).
        softmax_gate_sum, softmax_gate_norm_sum: float64 [E], the same two sums with the
            softmax gate (softmax of the selected experts' raw router logits).
    """

    layer: int
    num_experts: int
    top_k: int
    tokens: int = 0
    count: np.ndarray = None
    gate_sum: np.ndarray = None
    norm_sum: np.ndarray = None
    gate_norm_sum: np.ndarray = None
    max_abs: np.ndarray = None
    softmax_gate_sum: np.ndarray = None
    softmax_gate_norm_sum: np.ndarray = None

    def __post_init__(self):
        e = self.num_experts
        for name in _ARRAYS:
            dtype = np.int64 if name == "count" else np.float64
            value = getattr(self, name)
            setattr(self, name, np.zeros(e, dtype) if value is None else np.asarray(value, dtype))

    def gate_norm(self, gate: str) -> np.ndarray:
        """Sum over routed tokens of g_j(x) * ||f_j(x)|| [E] for gate "softmax" or "model".

        Raises:
            ValueError: unknown gate.
        """
        if gate == "softmax":
            return self.softmax_gate_norm_sum
        if gate == "model":
            return self.gate_norm_sum
        raise ValueError(f"unknown gate {gate!r}; choose from {', '.join(GATES)}")

    def reap(self, gate: str = "softmax") -> np.ndarray:
        """REAP saliency [E] (arXiv 2510.13999 eq. 9): mean over the tokens routed to j
        of g_j(x) * ||f_j(x)||, 0 if never routed."""
        return np.where(self.count > 0, self.gate_norm(gate) / np.maximum(self.count, 1), 0.0)

    def reap_sum(self, gate: str = "softmax") -> np.ndarray:
        """REAP summed instead of averaged over routed tokens [E] (= frequency x mean)."""
        return self.gate_norm(gate).copy()

    @property
    def frequency(self) -> np.ndarray:
        """Tokens routed to each expert [E] (float64)."""
        return self.count.astype(np.float64)

    @property
    def ean(self) -> np.ndarray:
        """EAN saliency [E]: sum over routed tokens of ||f_j(x)||."""
        return self.norm_sum

    def to_dict(self) -> Dict[str, Any]:
        return {"layer": self.layer, "num_experts": self.num_experts, "top_k": self.top_k,
                "tokens": int(self.tokens), **{k: getattr(self, k).tolist() for k in _ARRAYS}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "LayerStats":
        """Inverse of `to_dict` (statistics missing from older reports read as zeros)."""
        keys = ("layer", "num_experts", "top_k", "tokens") + _ARRAYS
        return cls(**{k: d[k] for k in keys if k in d})



class _ObservedSwitch(nn.Module):
    """Stands in for a LatentMoE's `switch_mlp`: same output, and hands it to a recorder."""

    def __init__(self, inner: nn.Module, recorder: "ExpertRecorder"):
        super().__init__()
        self.inner = inner
        self._recorder = recorder

    def __call__(self, z: mx.array, inds: mx.array) -> mx.array:
        y = self.inner(z, inds)
        self._recorder.record(inds, y)
        return y


class ExpertRecorder:
    """Records `LayerStats` from a `LatentMoE` while it runs, without changing its output.

    `install()` wraps the module's `route` (to see the selection, the gate weights and
    the raw router logits) and `switch_mlp` (to see each selected expert's output
    [..., k, latent]); `uninstall()` restores both.
    Per-call partial sums stay as MLX arrays until `flush()` (call it after `mx.eval` of
    the layer output and `pending()`), which adds them into float64 NumPy totals.
    """

    def __init__(self, moe: nn.Module, stats: LayerStats, input_stride: int = 0,
                 keep_inputs: bool = True, similarity=None):
        """`input_stride` > 0 samples every `input_stride`-th router input: kept (float32
        NumPy, `inputs()`) for `refit` (--refit-router) when `keep_inputs`, and fed to
        `similarity` (a `merge.SimilarityAccumulator`, --merge) when given. `also` (set
        between sequences): a second LayerStats that every flush adds into too (the
        sequence's domain)."""
        self.moe = moe
        self.stats = stats
        self.also: Optional[LayerStats] = None
        self.scaling = float(getattr(moe, "scaling", 1.0) or 1.0)
        self._route = None
        self._gates = None
        self._parts: List[tuple] = []
        self.input_stride = input_stride
        self._seen = 0
        self._inputs: List[np.ndarray] = []
        self.keep_inputs = keep_inputs
        self.similarity = similarity
        self._switch = None

    def inputs(self) -> np.ndarray:
        """The kept router inputs [n, hidden] float32 (empty if none were kept)."""
        d = self.moe.gate.weight.shape[-1]
        return (np.concatenate(self._inputs) if self._inputs
                else np.zeros((0, d), np.float32))

    def install(self) -> "ExpertRecorder":
        self._route = self.moe.route
        inner_route = self._route
        self._switch = self.moe.switch_mlp

        def route(x):
            if self.input_stride:
                flat = x.reshape(-1, x.shape[-1])
                first = (-self._seen) % self.input_stride
                self._seen += flat.shape[0]
                if first < flat.shape[0]:
                    sample = flat[first::self.input_stride]
                    if self.keep_inputs:
                        self._inputs.append(np.array(sample.astype(mx.float32)))
                    if self.similarity is not None:
                        self.similarity.add(self.moe, self._switch, sample)
            inds, w = inner_route(x)
            # REAP's gate: softmax of the raw logits renormalised over the selected experts
            # = softmax over the selected logits (the other experts' terms cancel).
            logits = self.moe.gate(x).astype(mx.float32)
            soft = mx.softmax(mx.take_along_axis(logits, inds.astype(mx.int32), axis=-1), axis=-1)
            self._gates = (inds, w, soft)
            return inds, w

        self.moe.route = route  # instance attribute shadows the method
        self.moe.switch_mlp = _ObservedSwitch(self.moe.switch_mlp, self)
        return self

    def uninstall(self) -> None:
        if isinstance(self.moe.switch_mlp, _ObservedSwitch):
            self.moe.switch_mlp = self.moe.switch_mlp.inner
        if "route" in vars(self.moe):
            del self.moe.__dict__["route"]

    def record(self, inds: mx.array, y: mx.array) -> None:
        """Accumulate one call: inds [..., k] expert ids, y [..., k, latent] their outputs."""
        if self._gates is None or self._gates[0] is not inds:
            raise RuntimeError("ExpertRecorder: switch_mlp called without the routed gates")
        _, w, soft = self._gates
        self._gates = None
        e = self.stats.num_experts
        idx = inds.reshape(-1).astype(mx.int32)
        g = (w.astype(mx.float32) / self.scaling).reshape(-1)
        gs = soft.reshape(-1)
        yf = y.astype(mx.float32)
        norm = mx.sqrt((yf * yf).sum(axis=-1)).reshape(-1)
        peak = mx.abs(yf).max(axis=-1).reshape(-1)
        zero = mx.zeros((e,), mx.float32)
        self._parts.append((
            zero.at[idx].add(mx.ones_like(g)), zero.at[idx].add(g), zero.at[idx].add(norm),
            zero.at[idx].add(g * norm), zero.at[idx].maximum(peak), zero.at[idx].add(gs),
            zero.at[idx].add(gs * norm),
        ))
        for s in self._targets():
            s.tokens += int(np.prod(inds.shape[:-1]))

    def _targets(self) -> List[LayerStats]:
        return [self.stats] + ([self.also] if self.also is not None else [])

    def pending(self) -> List[mx.array]:
        """The not yet flushed partial sums (to evaluate together with the layer output)."""
        sim = self.similarity.pending() if self.similarity is not None else []
        return [a for part in self._parts for a in part] + sim

    def flush(self) -> None:
        for count, gate, norm, gate_norm, peak, soft, soft_norm in self._parts:
            parts = [np.array(count).round().astype(np.int64)] + [
                np.array(a, dtype=np.float64) for a in (gate, norm, gate_norm, peak, soft, soft_norm)]
            for s in self._targets():
                s.count += parts[0]
                s.gate_sum += parts[1]
                s.norm_sum += parts[2]
                s.gate_norm_sum += parts[3]
                s.max_abs = np.maximum(s.max_abs, parts[4])
                s.softmax_gate_sum += parts[5]
                s.softmax_gate_norm_sum += parts[6]
        self._parts.clear()
        if self.similarity is not None:
            self.similarity.flush()


class ActivationStore:
    """The activations crossing layers, per calibration sequence: the partial sum h
    [1, L, D] (replaced after every layer) and the AttnRes banks (append-only, one per
    block of `attn_res_block_size` layers, each [1, L, D]).

    In memory (`spill_dir=None`) or as safetensors files in `spill_dir` (each bank written
    once; h alternates between two files so the input is never overwritten while read).
    """

    def __init__(self, eps: float, spill_dir: Optional[Path] = None):
        self.eps = eps
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._h: Dict[int, Any] = {}
        self._banks: Dict[int, List[Any]] = {}

    @property
    def on_disk(self) -> bool:
        return self.spill_dir is not None

    def _file(self, name: str) -> Path:
        return self.spill_dir / f"{name}.safetensors"

    def put_h(self, s: int, h: mx.array) -> None:
        """Store sequence s's partial sum (evaluated)."""
        if not self.on_disk:
            self._h[s] = h
            return
        old = self._h.get(s)
        name = f"h{s}.{0 if old is None or old.endswith('.1') else 1}"
        mx.save_safetensors(str(self._file(name)), {"h": h})
        if old is not None:
            self._file(old).unlink(missing_ok=True)
        self._h[s] = name

    def get_h(self, s: int) -> mx.array:
        v = self._h[s]
        return v if not self.on_disk else mx.load(str(self._file(v)))["h"]

    def add_bank(self, s: int, x: mx.array) -> None:
        """Append a banked state [1, L, D] for sequence s."""
        banks = self._banks.setdefault(s, [])
        if self.on_disk:
            name = f"b{s}.{len(banks)}"
            mx.save_safetensors(str(self._file(name)), {"b": x})
            banks.append(name)
        else:
            banks.append(x)

    def banks(self, s: int) -> List[mx.array]:
        raw = self._banks.get(s, [])
        return raw if not self.on_disk else [mx.load(str(self._file(n)))["b"] for n in raw]

    def close(self) -> None:
        self._h.clear()
        self._banks.clear()
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)


@dataclass
class ObserveResult:
    """Output of `observe`.

    Attributes:
        stats: LayerStats per MoE layer index.
        tokens: calibration tokens per layer.
        seconds: wall time of the whole pass; layer_seconds: per layer.
        activation_bytes: estimated bytes of h + banks for all sequences.
        spilled: whether the activations lived on disk.
        peak_memory: MLX peak memory during the pass, bytes.
        router_inputs: {MoE layer: float32 [n, hidden]} router inputs kept for
            `refit` (empty unless `observe(router_inputs=...)`).
        routers: {MoE layer: (router weight float32 [E, hidden], correction bias [E])},
            filled with router_inputs.
        similarities: {MoE layer: `merge.SimilarityAccumulator`} (empty unless
            `observe(similarity=True)`).
        domain_stats: {domain: {MoE layer: LayerStats}}, the same statistics over each
            calibration domain's tokens alone (`CalibSet.domains`); they sum to `stats`
            (max_abs: their maximum).
    """

    stats: Dict[int, LayerStats]
    tokens: int
    seconds: float
    layer_seconds: List[float] = field(default_factory=list)
    activation_bytes: int = 0
    spilled: bool = False
    peak_memory: int = 0
    router_inputs: Dict[int, np.ndarray] = field(default_factory=dict)
    routers: Dict[int, Any] = field(default_factory=dict)
    similarities: Dict[int, Any] = field(default_factory=dict)
    domain_stats: Dict[str, Dict[int, LayerStats]] = field(default_factory=dict)


def physical_memory() -> int:
    """Physical RAM in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def activation_bytes(args: ModelArgs, tokens: int, itemsize: int) -> int:
    """Bytes of h plus the largest bank list for `tokens` calibration tokens."""
    block = args.attn_res_block_size
    banks = -(-args.num_hidden_layers // block) if block else 0
    return tokens * args.hidden_size * itemsize * (1 + banks)


def spills(estimate: int, budget: Optional[int]) -> bool:
    """Whether `estimate` bytes of activations go to disk under `budget` (None: a quarter
    of physical RAM, never when RAM is unknown; 0: always)."""
    if budget is None:
        ram = physical_memory()
        return bool(ram) and estimate > ram // 4
    return estimate > budget


def _cache_arrays(cache) -> List[mx.array]:
    state = getattr(cache, "state", None) or []
    if isinstance(state, mx.array):
        return [state]
    return [a for a in state if isinstance(a, mx.array)]


def observe(
    src,
    calib: CalibSet,
    *,
    chunk: int = DEFAULT_CHUNK,
    spill_dir: Optional[Path] = None,
    activation_budget: Optional[int] = None,
    activation_dtype: Optional[mx.Dtype] = None,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    router_inputs: int = 0,
    keep_router_inputs: bool = True,
    similarity: bool = False,
) -> ObserveResult:
    """Run the calibration sequences through the checkpoint one layer at a time.

    Args:
        src: checkpoint folder in the official layout.
        calib: tokenised calibration sequences (each becomes a batch of one).
        chunk: prefill chunk, tokens; longer sequences go through a layer in chunks
            with that layer's cache (KDA state / DSA latent and index keys).
        spill_dir: folder for activations on disk (created, and removed at the end).
        activation_budget: bytes of activations kept in memory; above it they go to
            `spill_dir` (None: a quarter of physical RAM; 0: always spill).
        activation_dtype: residual-stream dtype (None: the loader's choice, float32 on
            CPU, the checkpoint's BF16 on a GPU).
        progress: show a tqdm bar per layer (tokens/s) on stderr.
        router_inputs: keep about this many router inputs per MoE layer (every
            ceil(tokens / router_inputs)-th token, float32 in memory: router_inputs x
            hidden x 4 bytes per MoE layer) and the routers, for `refit`; 0 = none.
        keep_router_inputs: False: sample the router inputs (for `similarity`) without
            keeping them.
        similarity: accumulate the expert similarity sums of `merge` on the sampled
            tokens (needs router_inputs > 0): every expert runs on every sampled token.
    Returns:
        ObserveResult with a LayerStats per MoE layer.
    Raises:
        CheckpointError / ConfigError from the loader; ValueError for a bad chunk or a
        spill that is needed without `spill_dir`.
    """
    from tqdm import tqdm

    from kimi_mlx.checkpoint.loader import load_model

    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    src = Path(src)
    args = ModelArgs.from_config(read_config(src), str(src / "config.json"))
    n_layers = args.num_hidden_layers
    tokens = calib.num_tokens
    started = time.perf_counter()
    mx.reset_peak_memory()

    store: Optional[ActivationStore] = None
    stats: Dict[int, LayerStats] = {}
    domain_stats: Dict[str, Dict[int, LayerStats]] = {d: {} for d in calib.domain_names
                                                      if d in set(calib.domains)}
    kept_inputs: Dict[int, np.ndarray] = {}
    routers: Dict[int, Any] = {}
    stride = -(-tokens // router_inputs) if router_inputs > 0 else 0
    if similarity and not stride:
        raise ValueError("observe(similarity=True) needs router_inputs > 0 sampled tokens")
    sims: Dict[int, Any] = {}
    layer_seconds: List[float] = []
    est = 0
    try:
        for i in range(n_layers):
            t0 = time.perf_counter()
            model, _, _ = load_model(src, i, i + 1, lazy=True, verbose=False,
                                     activation_dtype=activation_dtype)
            if store is None:
                store, est = _embed(model, calib, args, spill_dir, activation_budget)
                if store.on_disk:
                    log(f"calibration activations ~{est / 2**30:.2f} GiB: kept on disk in "
                        f"{store.spill_dir}")
            layer = model.layers[0]
            recorder = None
            if "block_sparse_moe" in layer:
                stats[i] = LayerStats(i, args.num_experts, layer.block_sparse_moe.top_k)
                acc = None
                if similarity:
                    from kimi_mlx.prune.merge import SimilarityAccumulator

                    acc = sims[i] = SimilarityAccumulator(args.experts_in(i))
                recorder = ExpertRecorder(layer.block_sparse_moe, stats[i], stride,
                                          keep_router_inputs, acc).install()
                for d, per in domain_stats.items():
                    per[i] = LayerStats(i, args.num_experts, layer.block_sparse_moe.top_k)
            bar = tqdm(total=tokens, unit="tok", unit_scale=True, leave=True, file=sys.stderr,
                       desc=f"layer {i + 1:>3}/{n_layers}", dynamic_ncols=True,
                       disable=None if progress else True)  # None: on a terminal only
            try:
                for s in range(len(calib.sequences)):
                    if recorder is not None:
                        recorder.also = domain_stats[calib.domains[s]][i]
                    _run_sequence(layer, model.make_cache, store, s, chunk, recorder, bar)
            finally:
                bar.close()
                if recorder is not None:
                    recorder.uninstall()
            if i in sims:
                sims[i].finish()
            if recorder is not None and stride and keep_router_inputs:
                gate = layer.block_sparse_moe.gate
                kept_inputs[i] = recorder.inputs()
                routers[i] = (np.array(gate.weight.astype(mx.float32)),
                              np.array(gate.e_score_correction_bias.astype(mx.float32)))
            del model, layer, recorder
            gc.collect()
            mx.clear_cache()
            layer_seconds.append(time.perf_counter() - t0)
    finally:
        spilled = store is not None and store.on_disk
        if store is not None:
            store.close()
    return ObserveResult(stats, tokens, time.perf_counter() - started, layer_seconds, est,
                         spilled, mx.get_peak_memory(), kept_inputs, routers, sims,
                         domain_stats)


def _embed(model, calib: CalibSet, args: ModelArgs, spill_dir, budget):
    """Embed every sequence into a new ActivationStore (memory or disk by size)."""
    dtype = model.text.activation_dtype or model.text.embed_tokens.weight.dtype
    if dtype == mx.uint32:  # a quantized embedding: activations come out in its scales' dtype
        dtype = model.text.embed_tokens.scales.dtype
    est = activation_bytes(args, calib.num_tokens, dtype.size)
    spill = spills(est, budget)
    if spill and spill_dir is None:
        raise ValueError(f"calibration activations need ~{est / 2**30:.2f} GiB, more than the "
                         "in-memory budget, and no spill folder was given")
    store = ActivationStore(args.rms_norm_eps, Path(spill_dir) if spill else None)
    for s, ids in enumerate(calib.sequences):
        h = model.text.embed(mx.array([ids], dtype=mx.int32))
        mx.eval(h)
        store.put_h(s, h)
    return store, est


def _run_sequence(layer, make_cache, store: ActivationStore, s: int, chunk: int,
                  recorder: Optional[ExpertRecorder], bar) -> None:
    """Sequence s through one layer, chunk by chunk with a fresh cache of that layer."""
    h = store.get_h(s)
    raw = store.banks(s)
    cache = make_cache()[0]
    n = h.shape[1]
    outs = []
    banked = False
    for a in range(0, n, chunk):
        banks = Banks(store.eps)
        for r in raw:
            banks.append(r[:, a:a + chunk])
        before = len(banks)
        out, banks = layer(h[:, a:a + chunk], banks, cache)
        banked = len(banks) > before  # this layer banks its input (AttnRes block start)
        mx.eval(out, *_cache_arrays(cache), *(recorder.pending() if recorder else []))
        if recorder is not None:
            recorder.flush()
        outs.append(out)
        bar.update(out.shape[1])
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    mx.eval(out)
    if banked:
        store.add_bank(s, h)
    store.put_h(s, out)
