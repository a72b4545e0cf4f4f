"""logit_bias ids outside the vocabulary are a 400, not a crash of the server process."""

from types import SimpleNamespace

import pytest

from kimi_mlx.sampling import Sampling
from kimi_mlx.server.common import APIError, sampling_from


def _svc(n_vocab=4352):
    return SimpleNamespace(tok=SimpleNamespace(vocab_size=n_vocab), engine=SimpleNamespace(),
                           defaults=Sampling())


def logits_processors(svc, req):
    return sampling_from(svc, req).logits_processors()


@pytest.mark.parametrize("key", ["99999999", "4352", "-1"])
def test_out_of_vocabulary_ids_are_refused(key):
    with pytest.raises(APIError) as e:
        logits_processors(_svc(), SimpleNamespace(logit_bias={key: 5.0}))
    assert e.value.status == 400 and f"token id {key} is not in the vocabulary" in str(e.value)


def test_ids_in_the_vocabulary_still_make_a_processor():
    assert logits_processors(_svc(), SimpleNamespace(logit_bias={"4351": 5.0, "0": -1.0}))
