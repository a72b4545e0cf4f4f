"""How many tokens to draft per verify step: a fixed k (`FixedK`), or k chosen as it runs
(`AutoK`, `--num-draft-tokens auto`) from the measured acceptance per draft position and
the measured time of a step at each k.

Every speculative loop (the draft model's, the n-gram's, the MTP's, and the cluster's,
which run those loops over a remote target) asks its policy `choose(left)` before a step
and tells it `record(drafted, accepted)` after the verify, or `skip()` when the step
drafted nothing (an n-gram without a match). A plain int k becomes a `FixedK`
(`draft_policy`), so the loops take either.

`AutoK` picks the k that maximises expected tokens per second,

    k* = argmax_k  E(k) / T(k),   E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j,

where a_j is the measured probability that draft j is accepted given drafts 1..j-1 were
(counts with a Laplace prior, decayed so that it follows the text: prose, then a copy),
the 1 is the target's own token every step yields, and T(k) is the measured wall time
of a step that verified k drafts: draft + verify + the acceptance check, measured
together because with MLX's lazy evaluation the draft computes while the verify graph is
built (timing them apart would need a host sync that removes that overlap). T(k) is the
median of the last 15 steps at k where k has been measured (the first step at each k,
which compiles its graphs, is left out), else a least-squares line through the measured k, else (one k
measured) that time scaled by (1 + c k) / (1 + c m) with the prior slope c (the relative
cost of one more verified token; `prior_slope`, default 0.15; a caller that knows its
target, e.g. a MoE on Macs, can set it from `placement.verify_cost.verify_seconds` as
(T(1) - T(0)) / T(0); only the first steps, before a second k is measured, use it). Every
`explore_every`-th step tries a neighbour of k* (the one measured least) so that the
times and the acceptance one position deeper stay measured. k moves at most one step
from the current k per step (hill climbing: E(k)/T(k) has one peak for acceptances that
fall with depth and times that grow with k), so noisy first figures cause no jump to a
far k, and each new k's graphs (a draft chain is compiled per k) are built only when
the climb reaches it.

Greedy output does not depend on k (each emitted token is the target's argmax), so
`auto` changes speed only; at temperature > 0 each step's rule is the same exact
speculative sampling for any k, so the output distribution is the target's too.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable, List, Optional, Union

__all__ = ["AUTO", "DEFAULT_AUTO_MAX", "AutoK", "FixedK", "draft_policy", "parse_num_draft_tokens"]

AUTO = "auto"
DEFAULT_AUTO_MAX = 8  # largest k `auto` tries unless `auto:N` says otherwise
DEFAULT_PRIOR_SLOPE = 0.15  # one more verified token costs 15% of a 1-token step (prior)
RECENT = 15  # step times per k whose median is T(k)


def parse_num_draft_tokens(text: Union[str, int]) -> Union[int, str]:
    """--num-draft-tokens: an int >= 1, "auto" or "auto:N" (N = largest k, >= 1).
    Returns the int, or the normalised "auto[:N]" string.

    Raises:
        ValueError: anything else (message names the flag)."""
    if isinstance(text, int) and not isinstance(text, bool):
        k = text
    else:
        s = str(text).strip().lower()
        if s == AUTO or s.startswith(AUTO + ":"):
            cap = s[len(AUTO) + 1:] if ":" in s else ""
            if cap and (not cap.isdigit() or int(cap) < 1):
                raise ValueError(f"--num-draft-tokens: {text!r}: auto:N needs a whole N >= 1")
            return f"{AUTO}:{int(cap)}" if cap else AUTO
        try:
            k = int(s)
        except ValueError:
            raise ValueError(f"--num-draft-tokens: expected a whole number >= 1, auto or "
                             f"auto:N, got {text!r}") from None
    if k < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {k}")
    return k


def auto_cap(value: Union[int, str]) -> Optional[int]:
    """The largest k of an "auto[:N]" value (DEFAULT_AUTO_MAX without N); None for an int."""
    if isinstance(value, str) and value.startswith(AUTO):
        return int(value.split(":", 1)[1]) if ":" in value else DEFAULT_AUTO_MAX
    return None


class FixedK:
    """The same k every step (clipped to what is left of max_tokens)."""

    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {k}")
        self.k = self.max_k = k

    def choose(self, left: int) -> int:
        return max(0, min(self.k, left))

    def record(self, drafted: int, accepted: int) -> None:
        pass

    def skip(self) -> None:
        pass

    def __str__(self) -> str:
        return str(self.k)


class AutoK:
    """k chosen per step from measured acceptance and step times (module docstring).

    Args:
        max_k: largest k tried (>= 1). start_k: k of the first steps, before any time is
            measured (clipped to max_k). explore_every: every n-th step tries a neighbour
            of the best k (>= 2). decay: weight kept by past acceptance counts per step
            (0 < decay <= 1). prior_slope: c of the one-k time prior (>= 0).
        clock: seconds (default time.perf_counter; tests give a fake one).
    Raises:
        ValueError: an argument out of range.
    State (read freely): steps, ks (k chosen per step), tried / accepted (decayed counts
    per draft position 1..max_k), times {m: [kept samples, median seconds of the last 15]}.
    """

    def __init__(self, max_k: int = DEFAULT_AUTO_MAX, start_k: int = 3, explore_every: int = 5,
                 decay: float = 0.98, prior_slope: float = DEFAULT_PRIOR_SLOPE,
                 clock: Callable[[], float] = time.perf_counter):
        if max_k < 1 or explore_every < 2 or not 0 < decay <= 1 or prior_slope < 0:
            raise ValueError(f"AutoK: need max_k >= 1, explore_every >= 2, 0 < decay <= 1, "
                             f"prior_slope >= 0; got {max_k}, {explore_every}, {decay}, "
                             f"{prior_slope}")
        self.max_k = max_k
        self.start_k = max(1, min(start_k, max_k))
        self.explore_every = explore_every
        self.decay = decay
        self.prior_slope = prior_slope
        self.clock = clock
        self.tried = [0.0] * (max_k + 1)  # index 1..max_k: position i was drafted and judged
        self.accepted = [0.0] * (max_k + 1)
        self.times = {}  # m -> [kept samples, mean seconds]
        self._warm = set()  # m whose first (compiling) step was seen
        self._recent = {}  # m -> deque of the last RECENT step times
        self.steps = 0
        self.ks: List[int] = []
        self._cur = self.start_k
        self._t0: Optional[float] = None

    # -- the model --------------------------------------------------------------------
    def acceptance(self) -> List[float]:
        """a_1..a_max_k: P(draft i accepted | drafts before it were), Laplace prior
        (acc + 1) / (tried + 2); a position never tried takes the deepest tried one's."""
        out, last = [], 0.5
        for i in range(1, self.max_k + 1):
            if self.tried[i] >= 0.5:
                last = (self.accepted[i] + 1.0) / (self.tried[i] + 2.0)
            out.append(last)
        return out

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a step that drafts k yields on average (the target's own token
        included): 1 + sum_{i<=k} prod_{j<=i} a_j."""
        a, total, run = self.acceptance(), 1.0, 1.0
        for i in range(k):
            run *= a[i]
            total += run
        return total

    def step_time(self, k: int) -> Optional[float]:
        """Predicted seconds of a step verifying k drafts (None: nothing measured yet)."""
        kept = {m: t for m, (n, t) in self.times.items() if n >= 1}
        if k in kept and self.times[k][0] >= 2:
            return kept[k]
        if len(kept) >= 2:
            ms = sorted(kept)
            w = [min(self.times[m][0], 10) for m in ms]
            sw = sum(w)
            mx_ = sum(wi * m for wi, m in zip(w, ms)) / sw
            my = sum(wi * kept[m] for wi, m in zip(w, ms)) / sw
            var = sum(wi * (m - mx_) ** 2 for wi, m in zip(w, ms))
            slope = max(0.0, sum(wi * (m - mx_) * (kept[m] - my) for wi, m in zip(w, ms)) / var)
            return max(my + slope * (k - mx_), 1e-9)
        if len(kept) == 1:
            (m, t), = kept.items()
            c = self.prior_slope
            return t * (1 + c * k) / (1 + c * m)
        return None

    def best_k(self, lo: int = 1, hi: Optional[int] = None) -> int:
        """argmax_k E(k) / T(k) over lo..hi (default 1..max_k; start_k before any time
        is measured); ties go to the smaller k."""
        best, best_rate = self.start_k, -1.0
        for k in range(max(1, lo), min(hi or self.max_k, self.max_k) + 1):
            t = self.step_time(k)
            if t is None:
                return self.start_k
            rate = self.expected_tokens(k) / t
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    # -- the loop's calls -------------------------------------------------------------
    def choose(self, left: int) -> int:
        """k for the next step (at most `left`, the rest of max_tokens; 0 when nothing is
        left); starts the step's clock."""
        # one step at a time from the current k (hill climbing on a unimodal rate): no
        # jump to a far k on the noisy first figures, and each new k's graphs (the draft
        # chain is compiled per k) are built only when the climb gets there
        k = self._cur = self.best_k(self._cur - 1, self._cur + 1)
        self.steps += 1
        if self.steps % self.explore_every == 0 and self.max_k > 1:
            near = [j for j in (k - 1, k + 1) if 1 <= j <= self.max_k]
            k = min(near, key=lambda j: (self.times.get(j, [0, 0])[0], -j))
        k = max(0, min(k, left))
        self.ks.append(k)
        self._t0 = self.clock()
        return k

    def record(self, drafted: int, accepted: int) -> None:
        """After a verify step that judged `drafted` drafts and accepted the first
        `accepted`: the step's time and the positions' outcomes."""
        t = None if self._t0 is None else self.clock() - self._t0
        self._t0 = None
        if t is not None:
            if drafted in self._warm:
                # the median of the last RECENT steps at this k: a burst of load on a
                # shared machine (or a GC pause) moves it little, a lasting change does
                recent = self._recent.setdefault(drafted, deque(maxlen=RECENT))
                recent.append(t)
                self.times[drafted] = [len(recent) if drafted not in self.times
                                       else self.times[drafted][0] + 1, statistics.median(recent)]
            else:
                self._warm.add(drafted)  # a k's first step compiles its graphs
        if drafted <= 0:
            return
        for i in range(1, self.max_k + 1):
            self.tried[i] *= self.decay
            self.accepted[i] *= self.decay
        for i in range(1, min(accepted + 1, drafted, self.max_k) + 1):
            self.tried[i] += 1.0
        for i in range(1, min(accepted, self.max_k) + 1):
            self.accepted[i] += 1.0

    def skip(self) -> None:
        """The chosen step drafted nothing (no n-gram match): no time is recorded."""
        self._t0 = None

    def describe(self) -> str:
        """One line: the k it settled on, E(k), T(k) and how often each k ran."""
        k = self.best_k()
        t = self.step_time(k)
        used = {j: self.ks.count(j) for j in sorted(set(self.ks))}
        return (f"auto k (<= {self.max_k}): best k={k}, expected {self.expected_tokens(k):.2f} "
                f"tokens per step" + (f" in {t * 1e3:.1f} ms" if t else "")
                + "; steps per k " + ", ".join(f"{j}: {c}" for j, c in used.items()))

    def __str__(self) -> str:
        return f"auto (<= {self.max_k})"


def draft_policy(num_draft_tokens) -> Union[FixedK, AutoK]:
    """The loops' policy for a num_draft_tokens argument: an AutoK / FixedK as given; an
    int k as FixedK(k); "auto" / "auto:N" as a new AutoK.

    Raises:
        ValueError: k < 1 or not a k (message: `num_draft_tokens must be >= 1, ...`)."""
    if isinstance(num_draft_tokens, (FixedK, AutoK)):
        return num_draft_tokens
    if isinstance(num_draft_tokens, str):
        cap = auto_cap(parse_num_draft_tokens(num_draft_tokens))
        if cap is not None:
            return AutoK(cap)
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
        raise ValueError(f"num_draft_tokens must be >= 1 or auto, got {num_draft_tokens!r}")
    return FixedK(num_draft_tokens)
