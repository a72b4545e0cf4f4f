"""Expert saliency and the choice of experts to keep.

Methods (scores per expert j of one layer, from `observe.LayerStats`; higher = keep):

* `reap` (REAP, arXiv 2510.13999, eq. 9): S_j = mean over tokens x routed to j of
  g_j(x) * ||f_j(x)||_2, the router-weighted expert activation norm;
* `reap-sum`: the same terms summed instead of averaged (frequency x mean), which keeps
  more of the calibration domain's routing;
* `frequency`: number of tokens routed to j;
* `ean`: sum over routed tokens of ||f_j(x)||_2 (expert activation norm, REAP's EAN
  baseline);
* `random`: a seeded random score (the floor every criterion must beat).

The router weight g_j of `reap` / `reap-sum` is chosen by `gate` (`observe.GATES`):
"softmax" (REAP's reference code: softmax of the raw router logits renormalised over the
model's selected experts; the default) or "model" (the model's renormalised sigmoid gate).

Budgets (how many experts each layer keeps; the total is the same either way):

* `uniform` (REAP): every MoE layer keeps n_keep;
* `spread`: the total n_keep x layers is shared out by where the saliency mass is spread.
  Each layer's scores are normalised to shares of that layer's total; every layer first
  gets its top_k best experts, then the remaining slots go, one by one, to the expert
  with the largest share not yet kept, in any layer (at most num_experts per layer). This
  maximises the sum over layers of the share of saliency kept, so a layer whose saliency
  sits on a few experts gives up its tail to a layer whose saliency is flat. The build
  records the per-layer counts in `num_experts_per_layer` (config.json);
* `auto` (the command's default): spread at keep <= `AUTO_SPREAD_KEEP`, uniform above
  (`resolve_budget`; the evidence is at `DEFAULT_BUDGET`).

Domain balance (`balance`; calibration data from several domains, `calib.CalibSet.domains`,
statistics per domain from `observe.ObserveResult.domain_stats`). Pooling every token
lets the domain with the most (or the loudest) tokens decide; these take each expert's
score per domain, s_d[j], and combine them so that no domain's top experts are all
dropped:

* `none`: the pooled score (REAP as published);
* `max`: max over domains of s_d[j] / max_i s_d[i], each domain's saliency normalised by
  its own most salient expert in the layer, so every domain's top expert scores 1 and is
  kept whenever a layer keeps at least as many experts as there are domains;
* `mean`: mean over domains of s_d[j] / sum_i s_d[i] (each domain's saliency share, every
  domain weighted alike: pooling with equal token mass per domain);
* `floor`: each domain's top max(1, floor(n / (2 D))) experts by s_d are kept first (n
  the layer's budget, D the domains), the rest by the pooled score.

A domain with no routed token in a layer is left out of that layer's combination.

Ties are broken by frequency,
then by the lower index, so an expert the calibration never routes to goes first under
every non-random method.

Super experts ("--protect-super-experts"): experts whose largest output activation is an
extreme outlier. As in REAP's code (`get_super_expert_indices`): threshold =
max(99.5th percentile of all experts' max activation over all MoE layers, the global
maximum / 10), looking only at the first 75% of MoE layers; protected experts are kept
regardless of score. REAP takes the signed maximum of the output; we take the maximum
magnitude, since an outlier is extreme in either sign.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

import numpy as np

from kimi_mlx.prune.observe import GATES, LayerStats

METHODS = ("reap", "reap-sum", "frequency", "ean", "random")
BUDGETS = ("uniform", "spread", "auto")
BALANCES = ("none", "max", "mean", "floor")
# Chosen by `make bench-domains` (micro-moe; keep 0.5 / 0.25 / 0.125; calibrated on code,
# prose, data and a mix, 3 calibration seeds each; prune/bench/DOMAINS_RESULTS.md) by its
# rule: never worse than uniform REAP beyond the seed noise in any (keep, calibration,
# domain) cell, then the lowest geometric mean over the cells. The spread budget alone is
# best on the mean (86.34 vs 86.91) but loses one cell at keep 0.5 (calibrated on code,
# data: 10.58 vs 9.61 + 0.83); at keep 0.25 and 0.125 it passes every cell. So "auto":
# spread at keep <= 0.25, uniform above; with it the rule's choice is no domain balance
# (86.38; balanced max with auto 86.44, balanced max alone 86.80: all pass, within 0.5%
# of each other). Worst domain / full at keep 0.25, mixed calibration, per seed: 1.144,
# 1.124, 1.144 against uniform REAP's 1.184, 1.175, 1.180. The auto candidates were
# composed after that run from its own cells (spread's below 0.5, uniform's at 0.5), so a
# run with new seeds is what would confirm them. Nothing was measured between 0.25 and
# 0.5, so spread starts at the keep measured.
DEFAULT_BALANCE = "none"
DEFAULT_BUDGET = "auto"
AUTO_SPREAD_KEEP = 0.25  # "auto" spreads at n_keep <= this fraction of the routed experts


def resolve_budget(budget: str, n_keep: int, num_experts: int, method: str = "reap-sum",
                   top_k: int = 1) -> str:
    """The budget a prune uses: `budget` itself unless "auto", which is "spread" when
    top_k <= n_keep <= AUTO_SPREAD_KEEP x num_experts for a saliency method (not
    "random", whose scores say nothing about a layer), else "uniform" (evidence:
    `DEFAULT_BUDGET`).

    Raises:
        ValueError: an unknown budget."""
    if budget not in BUDGETS:
        raise ValueError(f"unknown budget {budget!r}; choose from {', '.join(BUDGETS)}")
    if budget != "auto":
        return budget
    if method != "random" and top_k <= n_keep <= AUTO_SPREAD_KEEP * num_experts:
        return "spread"
    return "uniform"
GATED = ("reap", "reap-sum")  # methods that use the router weight (--gate)
# The best mean rank of the --method choices in `make bench-prune` (micro-moe test bed,
# experts specialised; code and mixed calibration; held-out code, prose and data at keep
# 0.5 and 0.25): reap-sum 5.42, ean 5.50, frequency 5.83, reap 6.92-9.00, random 7.33; it
# beats random's seed range in every check. The spread budget (3.33) and spread + router
# refit (3.17) rank better and beat it at keep 0.25 on every domain, but lose on data at
# keep 0.5 with the code calibration, so they stay options (README's table).
DEFAULT_METHOD = "reap-sum"
DEFAULT_GATE = "softmax"
SUPER_QUANTILE = 99.5
SUPER_FACTOR = 10.0
SUPER_LAYER_FRACTION = 0.75


class KeepError(ValueError):
    """A --keep / --experts request that cannot be met (message says why)."""


def experts_to_keep(num_experts: int, top_k: int, keep: Optional[float] = None,
                    experts: Optional[int] = None) -> int:
    """Number of routed experts to keep per layer.

    Args:
        num_experts: experts per layer now; top_k: num_experts_per_token.
        keep: fraction in (0, 1]; the count is round(keep * num_experts).
        experts: the count itself (exactly one of `keep` / `experts`).
    Raises:
        KeepError: both or neither given, `keep` outside (0, 1], `experts` outside
            [1, num_experts], or a result below top_k (each token must still find top_k
            experts).
    """
    if (keep is None) == (experts is None):
        raise KeepError("give exactly one of --keep FRACTION or --experts N")
    if keep is not None:
        if not (isinstance(keep, (int, float)) and 0 < keep <= 1):
            raise KeepError(f"--keep must be a fraction in (0, 1], got {keep}")
        n = int(round(keep * num_experts))
        what = f"--keep {keep} leaves {n} of {num_experts} experts"
    else:
        n = int(experts)
        if not top_k <= n <= num_experts:
            raise KeepError(f"--experts must be in [{top_k}, {num_experts}] "
                            f"(num_experts_per_token to num_experts), got {n}")
        what = f"--experts {n}"
    if n < top_k:
        raise KeepError(f"{what}, fewer than num_experts_per_token = {top_k}; "
                        f"keep at least {top_k} (--keep >= {top_k / num_experts:.4f})")
    return n


def scores(stats: LayerStats, method: str, seed: int = 0, gate: str = DEFAULT_GATE) -> np.ndarray:
    """Saliency [E] float64 of one layer under `method` (see the module docstring).

    Raises:
        ValueError: unknown method or gate.
    """
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; choose from {', '.join(GATES)}")
    if method == "reap":
        return stats.reap(gate)
    if method == "reap-sum":
        return stats.reap_sum(gate)
    if method == "frequency":
        return stats.frequency
    if method == "ean":
        return stats.ean.copy()
    if method == "random":
        return np.random.default_rng([seed, stats.layer]).random(stats.num_experts)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def super_experts(stats: Mapping[int, LayerStats], quantile: float = SUPER_QUANTILE,
                  factor: float = SUPER_FACTOR,
                  layer_fraction: float = SUPER_LAYER_FRACTION) -> Dict[int, List[int]]:
    """Experts with outlier activations, per layer (REAP's rule; see module docstring).

    Returns:
        {layer: sorted expert ids} for layers with any (empty dict when none).
    """
    layers = sorted(stats)
    if not layers:
        return {}
    peaks = np.stack([stats[l].max_abs for l in layers])  # [layers, E]
    threshold = max(float(np.percentile(peaks, quantile)), float(peaks.max()) / factor)
    considered = layers[: int(len(layers) * layer_fraction)]
    out = {}
    for l in considered:
        ids = np.flatnonzero(stats[l].max_abs > threshold)
        if ids.size:
            out[l] = ids.tolist()
    return out


def domain_scores(domain_stats: Mapping[str, Mapping[int, LayerStats]], method: str,
                  seed: int = 0, gate: str = DEFAULT_GATE) -> Dict[str, Dict[int, np.ndarray]]:
    """{domain: {layer: float64 [E] score of `method` over that domain's tokens alone}}.

    Raises:
        ValueError: unknown method or gate.
    """
    return {d: {l: scores(st, method, seed, gate) for l, st in per.items()}
            for d, per in domain_stats.items()}


def normalised(per_domain: Mapping[str, np.ndarray], how: str = "max") -> Dict[str, np.ndarray]:
    """Each domain's scores [E] divided by their maximum (`how` "max") or their sum
    ("sum"); domains whose scores are all <= 0 are left out."""
    out = {}
    for d, v in per_domain.items():
        v = np.maximum(np.asarray(v, np.float64), 0.0)
        top = v.max() if how == "max" else v.sum()
        if v.size and top > 0:
            out[d] = v / top
    return out


def combine(per_domain: Mapping[str, np.ndarray], balance: str,
            pooled: Optional[np.ndarray] = None) -> np.ndarray:
    """One layer's combined score [E] of `balance` "max" or "mean" (module docstring) from
    {domain: score [E]}; `pooled` [E] is returned when no domain has a positive score.

    Raises:
        ValueError: unknown balance (or "none" / "floor", which rank, not combine).
    """
    if balance not in ("max", "mean"):
        raise ValueError(f"combine: balance {balance!r} has no combined score")
    norm = normalised(per_domain, "max" if balance == "max" else "sum")
    if not norm:
        if pooled is None:
            raise ValueError("combine: no domain has a positive score and no pooled score")
        return np.asarray(pooled, np.float64)
    stack = np.stack(list(norm.values()))
    return stack.max(axis=0) if balance == "max" else stack.mean(axis=0)


def floor_size(n_keep: int, n_domains: int) -> int:
    """Experts of each domain kept first by `balance` "floor": max(1, n // (2 D))."""
    return max(1, n_keep // (2 * max(n_domains, 1)))


@dataclass
class Selection:
    """Which experts each MoE layer keeps.

    Attributes:
        method: saliency method; n_keep: experts kept per layer (with a `spread`
            budget: the mean, total / layers; `counts` has each layer's).
        gate: router weight of `reap` / `reap-sum` ("softmax" or "model"; recorded but
            unused by the other methods).
        kept: {layer: sorted old expert ids}; new id k is kept[layer][k].
        scores: {layer: float64 [E] saliency as ranked (protected experts not inflated)}.
        protected: {layer: super-expert ids that were forced in}.
        seed: seed of the random method.
        balance: how per-domain scores were combined (`BALANCES`).
        domain_scores: {domain: {layer: float64 [E] score over the domain's tokens,
            normalised by its layer maximum}} (empty without per-domain statistics).
    """

    method: str
    n_keep: int
    kept: Dict[int, List[int]]
    scores: Dict[int, np.ndarray]
    protected: Dict[int, List[int]] = field(default_factory=dict)
    seed: int = 0
    gate: str = DEFAULT_GATE
    budget: str = DEFAULT_BUDGET
    balance: str = DEFAULT_BALANCE
    domain_scores: Dict[str, Dict[int, np.ndarray]] = field(default_factory=dict)

    @property
    def counts(self) -> Dict[int, int]:
        """{layer: experts kept}."""
        return {l: len(ids) for l, ids in self.kept.items()}

    @property
    def uniform(self) -> bool:
        """Whether every layer keeps the same number of experts."""
        return len(set(self.counts.values())) <= 1


def layer_budgets(layer_scores: Mapping[int, np.ndarray], n_keep: int, top_k: int,
                  protected: Optional[Mapping[int, List[int]]] = None) -> Dict[int, int]:
    """Per-layer expert counts of the `spread` budget (see the module docstring).

    Args:
        layer_scores: {layer: float [E] saliency >= 0}; n_keep: mean experts per layer
            (the total is n_keep x layers); top_k: the floor of every layer.
        protected: {layer: expert ids} that count as kept first (super experts).
    Returns:
        {layer: count}, top_k <= count <= E, summing to n_keep x layers.
    Raises:
        ValueError: n_keep below top_k or above a layer's expert count.
    """
    layers = sorted(layer_scores)
    total = n_keep * len(layers)
    sizes = {l: len(layer_scores[l]) for l in layers}
    if n_keep < top_k or any(n_keep > e for e in sizes.values()):
        raise ValueError(f"spread budget: n_keep {n_keep} must be in [top_k {top_k}, experts]")
    counts, cands = {}, []
    for l in layers:
        s = np.maximum(np.asarray(layer_scores[l], dtype=np.float64), 0.0)
        share = s / s.sum() if s.sum() > 0 else np.full(len(s), 1.0 / len(s))
        order = np.argsort(-share, kind="stable")
        floor = max(top_k, len((protected or {}).get(l, [])))
        counts[l] = min(floor, sizes[l])
        cands += [(-float(share[j]), l, r) for r, j in enumerate(order) if r >= counts[l]]
    left = total - sum(counts.values())
    for _, l, _ in sorted(cands):  # largest share first; ties: lower layer, better rank
        if left <= 0:
            break
        counts[l] += 1
        left -= 1
    return counts


def select(stats: Mapping[int, LayerStats], method: str, n_keep: int, *,
           protect_super_experts: bool = False, seed: int = 0,
           gate: str = DEFAULT_GATE, budget: str = "uniform",
           balance: str = DEFAULT_BALANCE,
           domain_stats: Optional[Mapping[str, Mapping[int, LayerStats]]] = None) -> Selection:
    """Keep the most salient experts of every layer: `n_keep` each (`budget` "uniform"),
    or n_keep x layers in all, shared out by `layer_budgets` ("spread"); "auto" is one of
    the two by `resolve_budget`.

    `balance` (module docstring) combines the per-domain scores of `domain_stats`
    ({domain: {layer: LayerStats}}, `ObserveResult.domain_stats`); with fewer than two
    domains, or `method` random, every balance is the pooled score.

    Ranking: protected super experts first (by their peak activation), then (balance
    "floor") each domain's floor experts, then by score, then by frequency, then by lower
    index. Kept ids are returned sorted so renumbering keeps the experts' relative order
    (`n_keep == num_experts` is the identity).

    Raises:
        ValueError: unknown method, gate, budget or balance, or n_keep outside
            [1, num_experts] for a layer.
    """
    budget = resolve_budget(budget, n_keep,
                            max((st.num_experts for st in stats.values()), default=n_keep),
                            method, max((st.top_k for st in stats.values()), default=1))
    if balance not in BALANCES:
        raise ValueError(f"unknown balance {balance!r}; choose from {', '.join(BALANCES)}")
    protected = super_experts(stats) if protect_super_experts else {}
    layer_scores = {l: scores(st, method, seed, gate) for l, st in stats.items()}
    per_domain = (domain_scores(domain_stats, method, seed, gate)
                  if domain_stats and method != "random" else {})
    shown = {d: {l: normalised({d: v}).get(d, np.zeros_like(v)) for l, v in per.items()}
             for d, per in per_domain.items()}
    if len(per_domain) < 2:
        per_domain = {}
    if per_domain and balance in ("max", "mean"):
        layer_scores = {l: combine({d: per[l] for d, per in per_domain.items() if l in per},
                                   balance, layer_scores[l]) for l in layer_scores}
    counts = {l: n_keep for l in stats}
    if budget == "spread" and stats:
        top_k = min(st.top_k for st in stats.values())
        counts = layer_budgets(layer_scores, n_keep, top_k, protected)
    kept, all_scores = {}, {}
    for layer, st in sorted(stats.items()):
        n = counts[layer]
        if not 1 <= n <= st.num_experts:
            raise ValueError(f"layer {layer}: cannot keep {n} of {st.num_experts} experts")
        s = layer_scores[layer]
        prot = np.zeros(st.num_experts)
        for j in protected.get(layer, []):
            prot[j] = 1.0 + st.max_abs[j]
        first = np.zeros(st.num_experts)
        if per_domain and balance == "floor":
            doms = {d: per[layer] for d, per in per_domain.items()
                    if layer in per and per[layer].max() > 0}
            f = floor_size(n, len(doms))
            for v in doms.values():
                top = np.lexsort((np.arange(st.num_experts), -st.frequency, -v))[:f]
                first[top] = 1.0
        # np.lexsort sorts by the last key first; negate for descending, index ascending.
        order = np.lexsort((np.arange(st.num_experts), -st.frequency, -s, -first, -prot))
        kept[layer] = sorted(int(j) for j in order[:n])
        all_scores[layer] = s
    return Selection(method, n_keep, kept, all_scores, protected, seed, gate, budget,
                     balance if per_domain else "none", shown)
