"""Distinct routed experts a block of n consecutive tokens reads, per MoE layer.

A speculative verify step runs a block of k + 1 tokens through the target in one pass.
Every token routes to its own top-k experts, so the expert bytes the step reads grow with
the union of the experts the block's tokens choose, not with k + 1 x top-k and not with
top-k alone. On a Mac, where a decode step is bound by the bytes it reads, that union
decides what a verify step costs (`verify_cost.py`) and so which k pays.

Data: `kimi_mlx/assets/expert_union.json`, measured on micro-moe (kimi_mlx/assets/
micro-moe: 32 routed experts, top-4, 5 MoE layers) over its own held-out corpus by
`kimi-mlx bench routing` (`kimi_mlx.bench.routing`, which regenerates the file). It holds
the measured mean distinct experts per layer D(n) for blocks of n = 1..16 consecutive
tokens, the same for n tokens drawn at random from the corpus (routing skew without the
locality of consecutive tokens), and the fit below.

Model (an assumption, stated as such): a block of n consecutive tokens reads as many
distinct experts as n^beta independent top-k draws from an *effective pool* of rho x E
equally likely experts:

    D(n) = P (1 - (1 - k / P)^(n^beta)),   P = rho E   (P >= k)

rho = beta = 1 is uniform independent routing. rho < 1 is the router's skew (popular
experts), fitted per layer (least squares over n = 1..16) on n tokens drawn at *random*
from the corpus, where only skew acts; beta < 1 is the locality of consecutive tokens (a
token tends to reuse its neighbours' experts: n neighbours count as n^beta independent
tokens), then fitted on the consecutive blocks with that layer's rho. In terms of the
experts / top-k ratio R = E / k the union fraction (distinct over the n x k picks) is
f(n) = (rho R / n) (1 - (1 - 1 / (rho R))^(n^beta)). For K3.1 (E = 896, k = 16, R = 56)
the planner takes micro-moe's mean rho and beta unchanged (micro-moe: R = 8): that a
trained router's skew, as a fraction of its pool, and the locality of neighbouring
tokens are the same at K3.1's size. Nothing K3.1-sized has been measured here; a K3.1
routing trace through `kimi-mlx bench routing --model` would replace the JSON, and
`kimi-mlx plan --expert-union uniform` shows the uniform-routing bound beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

CURVE_FILE = Path(__file__).resolve().parents[1] / "assets" / "expert_union.json"
MAX_BLOCK = 16  # blocks of 1..MAX_BLOCK tokens are measured


def union_experts(n: float, num_experts: int, top_k: int, rho: float = 1.0,
                  beta: float = 1.0, rows: int = 1) -> float:
    """Expected distinct experts of a block of n tokens under the effective-pool model:
    n^beta independent tokens each picking `top_k` of rho x E equally likely experts,
    P (1 - (1 - k/P)^(n^beta)) with P = max(rho E, k). n = 1 gives k exactly.
    `rows` blocks of n consecutive tokens from independent sequences (a batched verify
    step: B rows x (1 + k) tokens) count as rows x n^beta independent tokens: locality
    acts within a row's block, not across rows.

    Args:
        n: tokens in the block (>= 0; 0 gives 0). num_experts: E >= 1. top_k: 1..E.
        rho: effective pool fraction (> 0). beta: locality exponent (> 0; 1 = none).
        rows: independent blocks (>= 1).
    Returns:
        float in [0, P].
    Raises:
        ValueError: E < 1, k outside 1..E, rho <= 0, beta <= 0 or n < 0.
    """
    if (num_experts < 1 or not 1 <= top_k <= num_experts or rho <= 0 or beta <= 0 or n < 0
            or rows < 1):
        raise ValueError(f"union_experts: need E >= 1, 1 <= k <= E, rho > 0, beta > 0, "
                         f"n >= 0, rows >= 1; got E={num_experts}, k={top_k}, rho={rho}, "
                         f"beta={beta}, n={n}, rows={rows}")
    if n == 0:
        return 0.0
    pool = max(rho * num_experts, float(top_k))
    return pool * (1.0 - (1.0 - top_k / pool) ** (rows * n ** beta))


def fit_rho(counts: Sequence[float], num_experts: int, top_k: int) -> float:
    """The rho minimising sum_n (union_experts(n, E, k, rho) - counts[n-1])^2 over
    n = 1..len(counts), beta = 1 (golden-section search on rho in [k/E, 4]).

    Args:
        counts: measured mean distinct experts for n = 1, 2, ... tokens drawn at random.
    Returns:
        rho (float).
    """
    return _golden(lambda rho: sum((union_experts(n, num_experts, top_k, rho) - c) ** 2
                                   for n, c in enumerate(counts, start=1)),
                   top_k / num_experts, 4.0)


def fit_beta(counts: Sequence[float], num_experts: int, top_k: int, rho: float) -> float:
    """The beta in [0.05, 1.5] minimising the squared error of
    union_experts(n, E, k, rho, beta) against `counts` (consecutive blocks of n tokens)."""
    return _golden(lambda beta: sum((union_experts(n, num_experts, top_k, rho, beta) - c) ** 2
                                    for n, c in enumerate(counts, start=1)), 0.05, 1.5)


def _golden(err, lo: float, hi: float) -> float:
    """Minimum of a unimodal err on [lo, hi] (golden-section search, 80 steps)."""
    g = (5 ** 0.5 - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = err(a), err(b)
    for _ in range(80):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = err(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = err(b)
    return (lo + hi) / 2


@dataclass(frozen=True)
class UnionCurve:
    """The measured curve and its fit (`expert_union.json`).

    Attributes:
        source: what was measured (model, corpus, tokens).
        num_experts, top_k: of the measured model (micro-moe: 32, 4).
        block: {layer index: [D(1), ..., D(16)]} mean distinct experts for consecutive
            tokens; random: the same for tokens drawn at random (no locality).
        rho, beta: {layer: fitted value}; rho_mean, beta_mean: their means, what
            `distinct` uses.
        uniform: True for the uniform-routing bound (rho = beta = 1), not a measurement.
    """

    source: str
    num_experts: int
    top_k: int
    block: Mapping[int, List[float]]
    random: Mapping[int, List[float]]
    rho: Mapping[int, float]
    rho_mean: float
    beta: Mapping[int, float]
    beta_mean: float
    uniform: bool = False

    def mean_block(self) -> List[float]:
        """D(n) averaged over layers, n = 1..MAX_BLOCK."""
        rows = list(self.block.values())
        return [sum(r[i] for r in rows) / len(rows) for i in range(len(rows[0]))]

    def distinct(self, n: float, num_experts: int, top_k: int, rows: int = 1) -> float:
        """Distinct experts per layer for a block of n tokens of a model with `num_experts`
        routed experts and `top_k` per token (`rows` such blocks of independent sequences),
        scaled from this curve by the effective-pool model (module docstring):
        `union_experts(n, E, k, rho_mean, beta_mean, rows)`."""
        return union_experts(n, num_experts, top_k, self.rho_mean, self.beta_mean, rows)

    @classmethod
    def uniform_bound(cls) -> "UnionCurve":
        """Uniform independent routing (rho = beta = 1): the most experts a block can read
        on average; no measurement."""
        return cls("uniform independent routing (no measurement)", 1, 1, {}, {}, {}, 1.0,
                   {}, 1.0, True)

    def to_json(self) -> Dict:
        return {
            "source": self.source, "num_experts": self.num_experts, "top_k": self.top_k,
            "model": "D(n) = P (1 - (1 - k/P)^(n^beta)), P = rho E; per layer, rho fitted "
                     "on random draws, beta on consecutive blocks",
            "block": {str(k): v for k, v in self.block.items()},
            "random": {str(k): v for k, v in self.random.items()},
            "rho": {str(k): v for k, v in self.rho.items()}, "rho_mean": self.rho_mean,
            "beta": {str(k): v for k, v in self.beta.items()}, "beta_mean": self.beta_mean,
        }

    @classmethod
    def from_json(cls, data: Mapping, where: str = "expert_union.json") -> "UnionCurve":
        """Raises ValueError naming `where` and the key for a file of another shape."""
        try:
            block = {int(k): [float(x) for x in v] for k, v in data["block"].items()}
            return cls(str(data["source"]), int(data["num_experts"]), int(data["top_k"]),
                       block,
                       {int(k): [float(x) for x in v] for k, v in data.get("random", {}).items()},
                       {int(k): float(v) for k, v in data["rho"].items()},
                       float(data["rho_mean"]),
                       {int(k): float(v) for k, v in data["beta"].items()},
                       float(data["beta_mean"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not an expert-union curve ({type(e).__name__}: {e}); "
                             f"regenerate it with `kimi-mlx bench routing`") from None


def load_curve(path: Optional[Path] = None) -> UnionCurve:
    """The shipped curve (or the one at `path`).

    Raises:
        FileNotFoundError: no such file; ValueError: not a curve (names the file)."""
    path = Path(path or CURVE_FILE)
    return UnionCurve.from_json(json.loads(path.read_text()), str(path))
