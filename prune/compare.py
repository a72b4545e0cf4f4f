"""What a pruned build lost, per domain: the table `kimi-mlx prune` writes into the build's
card and `kimi-mlx eval --compare FULL BUILD [DATA ...]` prints.

Per domain (a calibration domain's held-out text, or one `--compare` data file):

* full ppl, build ppl: perplexity of the full model and of the build on the same token
  sequences (each sequence one window: tokens 1.. predicted from the ones before them, as
  `kimi_mlx.generation.evaluate.perplexity` with seq_len = len - 1), exp(summed NLL /
  predicted tokens), NLL summed in float64;
* gate KL: at every MoE layer of the build, on the build's own router inputs x, KL(q || p)
  with q the full model's gate (`refit._gate`: top-k of sigmoid + bias over all E experts,
  renormalised) restricted to the kept experts and renormalised, p the build's gate; the
  `refit.gate_kl` measure (smoothed), mean over tokens with a target, then over layers;
* routing kept: the share of the full gate's mass at x that falls on kept experts, mean
  over tokens and layers (1 unpruned; what the dropped experts carried is 1 minus it);
* experts kept per layer: from the build's config (`num_experts_per_layer` or
  `num_experts`), one line for the whole table.

Both models are run streamed, one layer at a time (`observe`'s machinery: `load_model(ckpt,
i, i + 1)`, activations of every sequence kept between layers), so the peak memory is one
layer of the larger model plus the activations of the evaluated tokens (tokens x hidden x
4 bytes x (1 + AttnRes banks), as `observe.activation_bytes`) plus one sequence's logits
in blocks of `LOGIT_BLOCK` positions; the full model's router for the gate figures is read
lazily, its gate tensors only. Which source expert each build expert is comes from the
build's `saliency.json` (`layers[].kept`, written by `kimi-mlx prune`); without it the
gate columns are left empty.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

from kimi_mlx.model.attn_res import Banks
from kimi_mlx.model.config import ModelArgs, read_config
from kimi_mlx.prune.calib import CalibSet
from kimi_mlx.prune.observe import DEFAULT_CHUNK, _embed, _run_sequence
from kimi_mlx.prune.refit import KL_EPS, _gate

LOGIT_BLOCK = 512  # positions whose logits are held at once


@dataclass
class DomainLoss:
    """One row of the table (see the module docstring); gate_kl / routing_kept are None
    when the build's kept experts are unknown."""

    domain: str
    tokens: int
    full_ppl: float
    build_ppl: float
    gate_kl: Optional[float] = None
    routing_kept: Optional[float] = None

    @property
    def ratio(self) -> float:
        """build ppl / full ppl."""
        return self.build_ppl / self.full_ppl


@dataclass
class Comparison:
    """The table: rows per domain and the build's experts kept per MoE layer."""

    rows: List[DomainLoss]
    kept_per_layer: Dict[int, int]
    num_experts: int
    full: str = ""
    build: str = ""
    extra: Dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"full": self.full, "build": self.build, "num_experts": self.num_experts,
                "experts_kept_per_layer": {str(l): n for l, n in self.kept_per_layer.items()},
                "domains": [asdict(r) | {"ratio": r.ratio} for r in self.rows]}

    def table(self) -> str:
        """Markdown table (the card's and `eval --compare`'s)."""
        f = lambda v, fmt: "n/a" if v is None else format(v, fmt)
        lines = ["| domain | tokens | full ppl | build ppl | build / full | gate KL | "
                 "routing kept |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in self.rows:
            lines.append(f"| {r.domain} | {r.tokens:,} | {r.full_ppl:.3f} | {r.build_ppl:.3f} | "
                         f"{r.ratio:.3f} | {f(r.gate_kl, '.4f')} | "
                         + ("n/a" if r.routing_kept is None else f"{100 * r.routing_kept:.1f}%")
                         + " |")
        counts = sorted(set(self.kept_per_layer.values()))
        kept = (f"{counts[0]} of {self.num_experts} in each of the {len(self.kept_per_layer)} "
                "MoE layers" if len(counts) == 1 else
                ", ".join(f"layer {l}: {n}" for l, n in sorted(self.kept_per_layer.items()))
                + f" (of {self.num_experts})")
        lines += ["", f"Experts kept per layer: {kept}."]
        return "\n".join(lines)


def _args(ckpt: Path) -> ModelArgs:
    return ModelArgs.from_config(read_config(ckpt), str(ckpt / "config.json"))


def kept_experts(build: Path) -> Optional[Dict[int, List[int]]]:
    """{MoE layer: source expert ids, in the build's order} from the build's
    `saliency.json`; None when it has none (not made by `kimi-mlx prune`)."""
    f = Path(build) / "saliency.json"
    if not f.is_file():
        return None
    try:
        layers = json.loads(f.read_text())["layers"]
        return {int(r["layer"]): [int(j) for j in r["kept"]] for r in layers}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{f}: cannot read the kept experts ({e})") from None


class _GateMeter:
    """Wraps a build MoE's `route`: for each call, the full gate at the same input vs the
    build's gate (module docstring), added to the current sequence's sums."""

    def __init__(self, moe, full_w: mx.array, full_b: mx.array, kept: Sequence[int]):
        self.moe, self.full_w, self.full_b = moe, full_w, full_b
        self.kept = mx.array(list(kept))
        self.sums: Optional[np.ndarray] = None  # [kl sum, target tokens, kept mass, tokens]

    def install(self) -> "_GateMeter":
        inner = self.moe.route

        def route(x):
            self.measure(x)
            return inner(x)

        self.moe.route = route
        return self

    def uninstall(self) -> None:
        if "route" in vars(self.moe):
            del self.moe.__dict__["route"]

    def measure(self, x: mx.array) -> None:
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        top_k = self.moe.top_k
        g = _gate(flat @ self.full_w.T, self.full_b, top_k)[:, self.kept]  # [N, K]
        mass = g.sum(axis=-1)
        gate = self.moe.gate
        p = _gate(flat @ gate.weight.astype(mx.float32).T,
                  gate.e_score_correction_bias.astype(mx.float32), top_k)
        p = (p + KL_EPS) / (1 + KL_EPS * p.shape[-1])
        valid = mass > 0
        q = g / mx.maximum(mass, 1e-30)[:, None]
        kl = (q * (mx.log(mx.maximum(q, 1e-30)) - mx.log(p))).sum(axis=-1)
        kl = mx.where(valid, kl, 0.0)
        vals = mx.stack([kl.sum(), valid.sum().astype(mx.float32), mass.sum(),
                         mx.array(float(flat.shape[0]))])
        self.sums += np.array(vals, dtype=np.float64)


def streamed_eval(ckpt, sequences: Sequence[Sequence[int]], *, chunk: int = DEFAULT_CHUNK,
                  reference=None, kept: Optional[Mapping[int, Sequence[int]]] = None,
                  progress: bool = False) -> dict:
    """Run token sequences through `ckpt` one layer at a time (module docstring).

    Args:
        ckpt: checkpoint folder; sequences: token id lists (each >= 2 ids).
        chunk: prefill chunk per layer, tokens.
        reference: the full checkpoint whose router the gate figures compare with (needs
            `kept`, {MoE layer: source expert ids in `ckpt`'s order}); None: no gate figures.
    Returns:
        {"nll": [summed NLL per sequence, nats], "tokens": [predicted tokens per sequence],
         "gate": [float64 [MoE layers, 4] per sequence: KL sum, tokens with a target,
         kept mass, tokens] or None}.
    Raises:
        ValueError: a sequence shorter than 2 ids; CheckpointError from the loader.
    """
    from kimi_mlx.checkpoint.loader import load_model

    ckpt = Path(ckpt)
    seqs = [list(s) for s in sequences]
    if any(len(s) < 2 for s in seqs):
        raise ValueError("streamed_eval: every sequence needs at least 2 tokens")
    args = _args(ckpt)
    n_layers = args.num_hidden_layers
    calib = CalibSet(seqs, ["eval"] * len(seqs), [], len(seqs))
    moe_layers = [i for i in range(n_layers) if args.is_moe(i)]
    gate = ([np.zeros((len(moe_layers), 4)) for _ in seqs]
            if reference is not None and kept is not None else None)
    nll = [0.0] * len(seqs)
    store = None
    try:
        for i in range(n_layers):
            model, _, _ = load_model(ckpt, i, i + 1, lazy=True, verbose=False)
            if store is None:
                store, _ = _embed(model, calib, args, None, None)
            layer = model.layers[0]
            meter = None
            if gate is not None and "block_sparse_moe" in layer:
                ref, _, _ = load_model(reference, i, i + 1, lazy=True, verbose=False)
                rg = ref.layers[0].block_sparse_moe.gate
                meter = _GateMeter(layer.block_sparse_moe, rg.weight.astype(mx.float32),
                                   rg.e_score_correction_bias.astype(mx.float32),
                                   kept[i]).install()
                del ref
            try:
                for s in range(len(seqs)):
                    if meter is not None:
                        meter.sums = gate[s][moe_layers.index(i)]
                    _run_sequence(layer, model.make_cache, store, s, chunk, None, _NoBar())
            finally:
                if meter is not None:
                    meter.uninstall()
            if i == n_layers - 1:
                for s, ids in enumerate(seqs):
                    nll[s] = _sequence_nll(model, store, s, ids)
            del model, layer, meter
            gc.collect()
            mx.clear_cache()
    finally:
        if store is not None:
            store.close()
    return {"nll": nll, "tokens": [len(s) - 1 for s in seqs], "gate": gate}


class _NoBar:
    def update(self, n):
        pass


def _sequence_nll(model, store, s: int, ids: Sequence[int]) -> float:
    """Summed NLL (nats) of ids[1:] given the final hidden state of sequence s."""
    h = store.get_h(s)
    banks = Banks(store.eps)
    for b in store.banks(s):
        banks.append(b)
    out = model.text.finish(h, banks)
    target = mx.array(list(ids[1:]), dtype=mx.int32)
    total = 0.0
    n = len(ids) - 1
    for a in range(0, n, LOGIT_BLOCK):
        logits = model.language_model.logits(out[:, a:min(a + LOGIT_BLOCK, n)]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logp[0], target[a:a + logits.shape[1], None], axis=-1)
        total -= math.fsum(np.array(picked, dtype=np.float64).reshape(-1).tolist())
    return total


def kept_per_layer(build: Path) -> Dict[int, int]:
    """{MoE layer: routed experts} of a checkpoint's config."""
    args = _args(Path(build))
    return {i: args.experts_in(i) for i in range(args.num_hidden_layers) if args.is_moe(i)}


def compare(full, build, data: Mapping[str, Sequence[Sequence[int]]], *,
            chunk: int = DEFAULT_CHUNK, log=None,
            kept: Optional[Mapping[int, Sequence[int]]] = None) -> Comparison:
    """The table of `build` against `full` on {domain: token id sequences}; `kept`
    ({MoE layer: source expert ids}) defaults to the build's saliency.json.

    Raises:
        ValueError: no data, an empty domain, or models whose vocabularies differ.
    """
    full, build = Path(full), Path(build)
    if not data or any(not seqs for seqs in data.values()):
        raise ValueError("compare: give at least one domain with at least one sequence")
    fa, ba = _args(full), _args(build)
    if fa.vocab_size != ba.vocab_size:
        raise ValueError(f"compare: {full} and {build} have different vocabularies "
                         f"({fa.vocab_size} vs {ba.vocab_size})")
    names = list(data)
    flat = [s for d in names for s in data[d]]
    owner = [d for d in names for _ in data[d]]
    kept = kept if kept is not None else kept_experts(build)
    if log:
        log(f"evaluating {full} on {sum(len(s) - 1 for s in flat):,} tokens")
    a = streamed_eval(full, flat, chunk=chunk)
    if log:
        log(f"evaluating {build}")
    b = streamed_eval(build, flat, chunk=chunk, reference=full if kept else None, kept=kept)
    rows = []
    for d in names:
        idx = [k for k, o in enumerate(owner) if o == d]
        tok = sum(a["tokens"][k] for k in idx)
        ppl = lambda r: math.exp(math.fsum(r["nll"][k] for k in idx) / tok)
        kl = rk = None
        if b["gate"] is not None:
            g = sum(b["gate"][k] for k in idx)  # [layers, 4]
            kl = float(np.mean(g[:, 0] / np.maximum(g[:, 1], 1)))
            rk = float(np.mean(g[:, 2] / np.maximum(g[:, 3], 1)))
        rows.append(DomainLoss(d, tok, ppl(a), ppl(b), kl, rk))
    return Comparison(rows, kept_per_layer(build), fa.num_experts, str(full), str(build))


def split_tokens(ids: Sequence[int], seq_len: int) -> List[List[int]]:
    """Consecutive sequences of at most seq_len + 1 ids (windows as `evaluate.windows`)."""
    from kimi_mlx.generation.evaluate import windows

    return windows(ids, seq_len)
