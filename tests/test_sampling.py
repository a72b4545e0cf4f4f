"""The one `Sampling` type (kimi_mlx/sampling.py): its sampler and processors are
mlx-lm's own (compared with `make_sampler` / `make_logits_processors` called directly),
a seeded sampler draws what `mx.random.seed(seed)` + `make_sampler` draws whatever else
samples meanwhile, an API request's fields arrive, and the stage wire carries the
sampler's fields both ways."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from kimi_mlx.cluster.net.wire import sampling_from_pb, sampling_to_pb
from kimi_mlx.sampling import InputError, Sampling

V = 64


def _logits(seed=0, rows=1):
    return mx.random.normal((rows, V), key=mx.random.key(seed)) * 3


def _logprobs(seed=0):
    x = _logits(seed)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def test_the_sampler_is_mlx_lms():
    lp = _logprobs(1)
    s = Sampling(temp=0.8, top_p=0.9, min_p=0.05, top_k=20)
    mx.random.seed(5)
    got = [s.sampler()(lp).item() for _ in range(20)]
    mx.random.seed(5)
    ref = make_sampler(0.8, 0.9, 0.05, top_k=20)
    want = [ref(lp).item() for _ in range(20)]
    assert got == want
    assert Sampling().sampler()(lp).item() == mx.argmax(lp, axis=-1).item()


def test_a_seeded_sampler_draws_as_a_fresh_seed_and_keeps_the_global_stream():
    lp = _logprobs(2)
    mx.random.seed(9)
    ref = make_sampler(1.0, 0.95)
    want = [ref(lp).item() for _ in range(12)]
    mx.random.seed(123)
    before = mx.random.state[0].tolist()
    sampler = Sampling(temp=1.0, top_p=0.95, seed=9).sampler()
    got = []
    for _ in range(12):
        got.append(sampler(lp).item())
        mx.random.uniform()  # someone else drawing from the global stream meanwhile
    assert got == want
    mx.random.seed(123)
    assert mx.random.state[0].tolist() == before


def test_the_processors_are_mlx_lms():
    s = Sampling(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                 logit_bias={3: 2.0, 7: -1.5})
    tokens = mx.array([3, 5, 5, 9, 3, 3])
    got = _logits(3)
    for p in s.logits_processors():
        got = p(tokens, got)
    want = _logits(3)
    for p in make_logits_processors({3: 2.0, 7: -1.5}, 1.3, presence_penalty=0.5,
                                    frequency_penalty=0.25):
        want = p(tokens, want)
    assert mx.array_equal(got, want)
    assert Sampling().logits_processors() == [] and not Sampling().has_processors


def test_an_api_request_arrives_over_the_defaults():
    defaults = Sampling(temp=0.6, top_p=0.95, top_k=40)
    req = SimpleNamespace(temperature=0.0, top_p=None, min_p=0.1, seed=4,
                          logit_bias={"12": 3}, presence_penalty=None)
    s = Sampling.from_request(req, defaults)
    assert s == Sampling(temp=0.0, top_p=0.95, min_p=0.1, top_k=40, seed=4,
                         logit_bias={12: 3.0})
    with pytest.raises(InputError, match="logit_bias keys must be token ids"):
        Sampling.from_request(SimpleNamespace(logit_bias={"x": 1}))


@pytest.mark.parametrize("bad, field", [
    (dict(temp=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(min_p=2), "min_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=V), "top_k"), (dict(logit_bias={V: 1.0}), "logit_bias"),
    (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_out_of_range_values_are_named(bad, field):
    with pytest.raises(InputError, match=field):
        Sampling(**bad).check(vocab=V)


def test_the_stage_wire_carries_the_samplers_fields_both_ways():
    s = Sampling(temp=0.7, top_p=0.9, min_p=0.05, top_k=12, seed=0,
                 presence_penalty=1.0, logit_bias={1: 2.0})
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - the proto's floats are float32
    # the processors run on the head: they do not travel; seed 0 is a seed, not "none"
    assert sampling_from_pb(sampling_to_pb(s)) == Sampling(f32(0.7), f32(0.9), f32(0.05), 12, 0)
    assert sampling_from_pb(sampling_to_pb(Sampling())) == Sampling()


def test_repetition_context_size_reaches_mlx_lms_processor_from_the_api_schema():
    """The parameter added end to end (issue 31's proof): the chat schema takes it, the
    request's Sampling carries it, and the processors are mlx-lm's with that window
    (a window of 2 penalises only the last two tokens; the default 20 all of them)."""
    from kimi_mlx.server.schemas import ChatRequest

    req = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                      repetition_penalty=2.0, repetition_context_size=2)
    s = Sampling.from_request(req).check(vocab=V)
    assert s.repetition_context_size == 2
    tokens = mx.array([3, 4, 5, 6])
    got, want = _logits(4), _logits(4)
    for p in s.logits_processors():
        got = p(tokens, got)
    for p in make_logits_processors(None, 2.0, 2):
        want = p(tokens, want)
    assert mx.array_equal(got, want)
    wide = _logits(4)
    for p in make_logits_processors(None, 2.0, 20):
        wide = p(tokens, wide)
    assert not mx.array_equal(got, wide)  # the window made a difference
    with pytest.raises(Exception, match="repetition_context_size"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                    repetition_context_size=0)
    with pytest.raises(InputError, match="repetition_context_size"):
        Sampling(repetition_context_size=0).check()
