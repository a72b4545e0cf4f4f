"""One request's sampling settings, from the HTTP schema to the stage wire: `Sampling`.

Every front end (generate, chat, the servers, cluster launch) and every target (one
process, a pipeline's last stage, a tensor group's rank 0, the speculative loops) takes
this one type. mlx-lm does the sampling: `Sampling.sampler()` is its `make_sampler`, and
`Sampling.logits_processors()` its `make_logits_processors` (penalties, logit_bias). The
only filter chain written here is `log_probs`, the sampling *distribution* the
speculative acceptance rule needs and mlx-lm has no function for (it follows
`make_sampler`'s order).

Adding a parameter: a field here (with its check), the API schema's field, and, for a
sampler parameter the pipeline's last stage must see, its field in `cluster/net/stage.proto`
(the wire conversion, `cluster.net.wire.sampling_to_pb` / `sampling_from_pb`, goes by field
name). Logits processors run where the token is chosen on the head, never on the wire.

This module imports nothing of kimi_mlx, so every layer (speculative, generation,
server, cluster) may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Optional

__all__ = ["InputError", "Sampling", "DEFAULT_MAX_TOKENS", "PENALTIES"]

# tokens generated when nobody says how many (mlx-lm's generate default)
DEFAULT_MAX_TOKENS = 256

# the logits processors' knobs (mlx-lm `make_logits_processors`): they act on raw logits
# where the token is chosen (a head), so they never travel to a stage
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")


class InputError(ValueError):
    """Bad user input (empty prompt, prompt longer than the context, a sampling value out
    of range, ...): the message names the flag or field and what was expected; `param`,
    when given, is the API field at fault."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings (mlx-lm's names and meanings).

    temp: temperature, 0 = greedy (argmax). top_p: nucleus mass in (0, 1], 1 = off.
    min_p: in [0, 1], 0 = off. top_k: >= 0, 0 = off. seed: the request's own PRNG key
    (None: MLX's global random stream). repetition_penalty: > 0, divides positive /
    multiplies negative logits of tokens in the last `repetition_context_size` (>= 1,
    mlx-lm's default 20); presence_penalty / frequency_penalty: subtracted per seen token
    (once / per occurrence, over the last 20); logit_bias: {token id: added logit};
    constraint: a structured-output grammar and/or a thinking budget
    (`generation.constrain.Constraint`, built by the server from response_format /
    tool_choice / thinking_budget, never read from a request as such), whose processor
    masks the tokens it forbids to -inf after the penalties.
    Raises nothing when built: `check` validates.
    """

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Mapping[int, float]] = field(default=None, hash=False)
    # structured output (`generation.constrain.Constraint`, duck-typed here: anything with
    # `processor()` -> a fresh per-sequence logits processor); runs on the head like the
    # penalties, never on the wire
    constraint: Optional[Any] = field(default=None, hash=False, compare=False)

    # ------------------------------------------------------------------ checks

    def check(self, flags: bool = False, vocab: Optional[int] = None) -> "Sampling":
        """This, when every value is in range; InputError naming the first that is not.

        `flags`: name them as command-line flags (`--top-p`) instead of API fields
        (`top_p`). `vocab`: the logits width, when known: top_k must be below it (mlx-lm's
        compiled `apply_top_k` raises for k >= it, inside a function that shares MLX's
        random state) and logit_bias ids inside it (an id past the logits indexes out of
        bounds in the sampler)."""
        def name(n):
            if not flags:
                return n
            return "--temp" if n == "temperature" else f"--{n.replace('_', '-')}"

        if self.temp < 0:
            raise InputError(f"{name('temperature')} must be >= 0 (0 = greedy), got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"{name('top_p')} must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"{name('min_p')} must be in [0, 1] (0 = off), got {self.min_p}")
        if self.top_k < 0:
            raise InputError(f"{name('top_k')} must be >= 0 (0 = off), got {self.top_k}")
        if vocab is not None and not self.top_k < vocab:
            raise InputError(f"{name('top_k')}: must be in [0, {vocab}) (0 = off; this model "
                             f"has {vocab} tokens), got {self.top_k}", "top_k")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise InputError(f"{name('repetition_penalty')} must be > 0, got "
                             f"{self.repetition_penalty}")
        if self.repetition_context_size < 1:
            raise InputError(f"{name('repetition_context_size')} must be >= 1, got "
                             f"{self.repetition_context_size}", "repetition_context_size")
        bad = sorted(k for k in self.logit_bias or () if k < 0 or (vocab is not None and k >= vocab))
        if bad:
            raise InputError(f"{name('logit_bias')}: token id {bad[0]} is not in the vocabulary "
                             f"[0, {vocab})", "logit_bias")
        return self

    # ------------------------------------------------------------------ building

    @classmethod
    def from_request(cls, req: Any, defaults: Optional["Sampling"] = None) -> "Sampling":
        """The settings an API request asks for, over `defaults` (the checkpoint's
        generation_config): each field of this class the request has and sets (not None)
        replaces the default; the OpenAI name `temperature` is `temp`. logit_bias keys
        (JSON strings) become ints. InputError for a key that is no integer; ranges are
        not checked here (`check`)."""
        values = {}
        for f in fields(cls):
            if f.name == "constraint":  # built from response_format / tool_choice, never sent
                continue
            v = getattr(req, "temperature" if f.name == "temp" else f.name, None)
            if v is not None:
                values[f.name] = v
        bias = values.get("logit_bias")
        if bias is not None:
            try:
                values["logit_bias"] = {int(k): float(v) for k, v in bias.items()} or None
            except ValueError:
                raise InputError("logit_bias keys must be token ids", "logit_bias") from None
        for name, kind in (("temp", float), ("top_p", float), ("min_p", float), ("top_k", int)):
            if name in values:
                values[name] = kind(values[name])
        return replace(defaults if defaults is not None else cls(), **values)

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def has_processors(self) -> bool:
        """Whether this asks for logits processors (a penalty or a logit_bias)."""
        return bool(self.logit_bias or self.repetition_penalty or self.presence_penalty
                    or self.frequency_penalty or self.constraint is not None)

    def without_processors(self) -> "Sampling":
        """The same sampler settings, no penalties or bias (what a stage that samples
        with the head applying the processors must see)."""
        return replace(self, repetition_penalty=None, presence_penalty=None,
                       frequency_penalty=None, logit_bias=None, constraint=None)

    def sampler(self):
        """mlx-lm's `make_sampler` for these settings: logprobs [B, vocab] -> token ids [B].

        Seeded (and temp > 0): the same sampler drawing from this request's own PRNG key,
        starting where `mx.random.seed(seed)` starts (as `kimi-mlx generate --seed`
        does); MLX's global random state is put back after each draw, so a seeded request
        samples the same tokens whatever else samples at the same time. Each seeded draw
        is evaluated at once. TypeError/ValueError for a seed MLX cannot take."""
        from mlx_lm.sample_utils import make_sampler

        sampler = make_sampler(self.temp, self.top_p, self.min_p, top_k=self.top_k)
        if self.greedy or self.seed is None:
            return sampler
        import mlx.core as mx

        key = [mx.random.key(self.seed)]

        def seeded(logprobs):
            token, key[0] = _sample_with_key(sampler, logprobs, key[0])
            return token

        return seeded

    def logits_processors(self) -> list:
        """mlx-lm's `make_logits_processors` for the penalties and logit_bias, then the
        structured-output constraint's processor (fresh state: call once per sequence)
        last, so its -inf mask is what the sampler sees ([] when none is asked for): each
        (tokens [n], logits [B, vocab]) -> logits."""
        if not self.has_processors:
            return []
        from mlx_lm.sample_utils import make_logits_processors

        procs = make_logits_processors(self.logit_bias or None, self.repetition_penalty,
                                       self.repetition_context_size,
                                       presence_penalty=self.presence_penalty,
                                       frequency_penalty=self.frequency_penalty)
        if self.constraint is not None:
            procs.append(self.constraint.processor())
        return procs

    def log_probs(self, logits):
        """The sampling log-distribution [..., V] float32 for logits [..., V] (what the
        speculative acceptance rule compares): the log-softmax, mlx-lm's filters in
        `make_sampler`'s order (`apply_top_p`, `apply_min_p`, `apply_top_k`), then the
        temperature; filtered tokens get -inf. Needs temp > 0."""
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            lp = apply_top_p(lp, self.top_p)
        if self.min_p != 0.0:
            lp = apply_min_p(lp, self.min_p)
        if self.top_k > 0:
            lp = apply_top_k(lp, self.top_k)
        lp = lp * (1.0 / self.temp)
        return lp - mx.logsumexp(lp, axis=-1, keepdims=True)


def _seed_of(key) -> int:
    """The seed whose `mx.random.key(seed)` is `key` (uint32 [2]: high, low words)."""
    hi, lo = (int(v) for v in key.tolist())
    return (hi << 32) | lo


def _sample_with_key(sampler, logprobs, key):
    """`sampler(logprobs)` drawing from `key` instead of MLX's global PRNG state (which
    is put back afterwards); returns (token, the key after the draw)."""
    import mlx.core as mx

    saved = mx.random.state[0]
    mx.random.seed(_seed_of(key))
    try:
        token = sampler(logprobs)
        mx.eval(token)
        return token, mx.random.state[0]
    finally:
        mx.random.seed(_seed_of(saved))
