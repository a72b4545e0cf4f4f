"""A padded batch through Gated DSA decodes in one pass and equals single runs.

Rows of a continuous batch are left-padded (caches merged after single prefills) or
right-padded (prompts of different lengths prefilled together, then rolled left by
`finalize`). Each row's first real key reaches the indexer's top-k and the sparse attention
(`starts`, kimi_mlx/metal/dsa.py), so a row's logits equal its single run's within the
float32 tolerance rule (`kimi_mlx.testing.checkpoints.tolerance`) and its greedy tokens are the same,
with prompts shorter and longer than index_topk (8 on the tiny config), on the reference
ops and through the Metal kernels in the emulator. Reference: the same model run on each
prompt alone (B = 1, no padding anywhere), not the batched code under test.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import _merge_caches

from kimi_mlx.model import cache as cache_mod
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.metal.dispatch import use_sim
from kimi_mlx.testing.checkpoints import (
    argmax_margin, full_config, margins, model_tolerance, random_model, rel_err,
    tiny_text_config)

STEPS = 4
LENGTHS = [3, 11, 6, 9]  # index_topk is 8: rows start dense and sparse, and cross over


@pytest.fixture(scope="module")
def model():
    args = ModelArgs.from_config(full_config(tiny_text_config()))
    assert min(LENGTHS) < args.index_topk < max(LENGTHS)
    return random_model(args, seed=1, conditioned=True)


def _prompts(n=len(LENGTHS)):
    rng = np.random.default_rng(4)
    return [rng.integers(0, 256, L).tolist() for L in LENGTHS[:n]]


def _single(model, prompt):
    """Logits [STEPS + 1, vocab] of one prompt alone: its last prompt position, then
    STEPS greedy decode steps; and the greedy tokens."""
    cache = model.make_cache()
    logits = [model(mx.array(prompt)[None], cache)[0, -1]]
    toks = []
    for _ in range(STEPS):
        toks.append(int(mx.argmax(logits[-1]).item()))
        logits.append(model(mx.array([[toks[-1]]]), cache)[0, -1])
    return mx.stack(logits), toks


def _batched(model, prompts, tokens, padding):
    """Logits [B, STEPS + 1, vocab] of all prompts in one batch, fed the single runs'
    tokens (so rows stay comparable even if one disagreed); every decode step is one call
    over the whole batch.

    padding "left": each prompt but its last token prefilled alone, caches merged (left
    padding, as a request joining a running batch); "right": the same prefixes prefilled
    together, right-padded to the longest, then `finalize` (mlx-lm's batched prefill)."""
    B = len(prompts)
    if padding == "left":
        singles = []
        for p in prompts:
            c = model.make_cache()
            model(mx.array(p[:-1])[None], c)
            singles.append(c)
        cache = _merge_caches(singles)
    else:
        cache = _merge_caches([model.make_cache() for _ in prompts])
        lengths = [len(p) - 1 for p in prompts]
        n = max(lengths)
        for c in cache:
            c.prepare(lengths=lengths, right_padding=[n - k for k in lengths])
        model(mx.array([p[:-1] + [0] * (n + 1 - len(p)) for p in prompts]), cache)
        for c in cache:
            c.finalize()
    out = [model(mx.array([[p[-1]] for p in prompts]), cache)[:, -1]]
    for t in range(STEPS):
        out.append(model(mx.array([[tokens[b][t]] for b in range(B)]), cache)[:, -1])
    return mx.stack(out, axis=1)


def _check(model, padding, kernels):
    prompts = _prompts()
    tol = model_tolerance(model.args, max(LENGTHS) + STEPS)
    with margins() as m:
        singles = [_single(model, p) for p in prompts]
        want = [s[0] for s in singles]
        if kernels:
            with use_sim():
                got = _batched(model, prompts, [s[1] for s in singles], padding)
        else:
            got = _batched(model, prompts, [s[1] for s in singles], padding)
    m.check(tol, need_indexer=True)
    for b, (w, (_, toks)) in enumerate(zip(want, singles)):
        assert rel_err(got[b], w) < tol, f"row {b} ({LENGTHS[b]} prompt tokens, {padding} padding)"
        assert argmax_margin(w) > tol  # greedy choices the rounding cannot flip
        assert mx.argmax(got[b, :-1], axis=-1).tolist() == toks, f"row {b} greedy tokens"
    return got


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_equals_single_runs_reference_ops(model, padding):
    _check(model, padding, kernels=False)


def test_padded_batch_equals_single_runs_through_emulated_kernels(model, counted_topk):
    _check(model, "left", kernels=True)
    assert counted_topk["calls"] > 0  # the sparse decode ran the kernel with `starts`


@pytest.fixture
def counted_topk(monkeypatch):
    from kimi_mlx.metal import kernels

    real, seen = kernels.dsa_index_topk, {"calls": 0}

    def counting(*a, **kw):
        starts = kw.get("starts", a[5] if len(a) > 5 else None)
        if starts is not None and int(mx.max(starts).item()) > 0:
            seen["calls"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(kernels, "dsa_index_topk", counting)
    return seen


def test_a_batch_that_ignores_padding_is_caught(model, monkeypatch):
    """The planted bug this test exists for: padded keys left in the indexer's top-k and
    the attention (no `starts`) move the padded rows' logits far outside the tolerance."""
    real_init = cache_mod._WholeBatch.__init__

    def no_starts(self, batch):
        real_init(self, batch)
        self.starts = None

    monkeypatch.setattr(cache_mod._WholeBatch, "__init__", no_starts)
    prompts = _prompts()
    singles = [_single(model, p) for p in prompts]
    got = _batched(model, prompts, [s[1] for s in singles], "left")
    tol = model_tolerance(model.args, max(LENGTHS) + STEPS)
    errs = [rel_err(got[b], s[0]) for b, s in enumerate(singles)]
    assert max(errs) > 10 * tol, errs
