"""`/v1/completions` scoring text (echo + logprobs, OpenAI's legacy format) through the
real `openai` client on the shipped micro checkpoint: every prompt form (a string, a
list of strings, token ids, a list of token-id lists as lm-evaluation-harness sends),
max_tokens 0, both engines (one at a time and continuous batching), streamed and not,
and the errors that name their field. The reference is an independent float32 forward
pass over the whole text (no cache, no server code) and `kimi-mlx eval --per-text`."""

import json
import math
import subprocess
import sys

import httpx
import mlx.core as mx
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.speculative.settings import DraftSettings
from kimi_mlx.testing.servers import served

KEY = "sk-test-key"
MICRO = str(default_model())
TEXTS = ["The for statement is used to iterate over the elements of a sequence.",
         "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module", params=[1, 3], ids=["one-at-a-time", "batched"])
def server(request):
    with served(MICRO, KEY, None, max_concurrency=request.param,
                prompt_cache_bytes=64 << 20) as both:
        yield both


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def reference(model, ids, k=3):
    """(logprob of ids[i] given ids[:i], top-k ids at i) for i >= 1: one float32 forward
    pass over the whole sequence, no cache."""
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    lps = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    tops = [mx.argsort(-logp[i - 1])[:k].tolist() for i in range(1, len(ids))]
    return lps, tops


def test_echo_logprobs_of_a_string_prompt_match_a_forward_pass(server, oai):
    _, svc = server
    ids = svc.tok.encode(TEXTS[0])
    r = oai.completions.create(model="micro", prompt=TEXTS[0], max_tokens=0, echo=True,
                               logprobs=3, temperature=0)
    ch = r.choices[0]
    assert ch.text == TEXTS[0]
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == TEXTS[0]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    ref, tops = reference(svc.engine.model, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref)) < 1e-4
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert list(top) == [svc.tok.decode([t]) for t in tops[i]] or len(set(top)) < 3
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0


def test_token_id_lists_as_lm_eval_sends_them(server, oai):
    """`[[ids], [ids]]` with max_tokens 1 (lm-eval's loglikelihood request): one choice
    per prompt, in order, each the prompt's scores then the one generated token."""
    _, svc = server
    prompts = [svc.tok.encode(t) for t in TEXTS]
    r = oai.completions.create(model="micro", prompt=prompts, max_tokens=1, echo=True,
                               logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for ids, ch in zip(prompts, r.choices):
        lp = ch.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then one new token
        ref, tops = reference(svc.engine.model, ids + [svc.tok.encode(lp.tokens[-1])[0]])
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], ref)) < 1e-4
        # greedy: the generated token is the argmax after the prompt
        assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))
        assert ch.text.startswith(svc.tok.decode(ids))
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    # a flat id list and a list of strings are the same prompts
    flat = oai.completions.create(model="micro", prompt=prompts[1], max_tokens=0, echo=True, logprobs=1)
    assert flat.choices[0].logprobs.token_logprobs == r.choices[1].logprobs.token_logprobs[:-1]
    strs = oai.completions.create(model="micro", prompt=TEXTS, max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in strs.choices] == TEXTS
    assert strs.choices[1].logprobs.token_logprobs == flat.choices[0].logprobs.token_logprobs


def test_echo_then_generation_is_the_plain_generation(server, oai):
    """Scoring the prompt does not change what is generated after it (the scored
    prefill leaves the cache a plain prefill leaves)."""
    plain = oai.completions.create(model="micro", prompt=TEXTS[1], max_tokens=8, temperature=0,
                                   logprobs=1)
    echo = oai.completions.create(model="micro", prompt=TEXTS[1], max_tokens=8, temperature=0,
                                  logprobs=1, echo=True)
    assert echo.choices[0].text == TEXTS[1] + plain.choices[0].text
    n = len(plain.choices[0].logprobs.tokens)
    assert echo.choices[0].logprobs.tokens[-n:] == plain.choices[0].logprobs.tokens
    gen = echo.choices[0].logprobs.token_logprobs[-n:]
    assert max(abs(a - b) for a, b in zip(gen, plain.choices[0].logprobs.token_logprobs)) < 1e-3
    # echo without logprobs: the text only
    bare = oai.completions.create(model="micro", prompt=TEXTS[1], max_tokens=0, echo=True)
    assert bare.choices[0].text == TEXTS[1] and bare.choices[0].logprobs is None


def test_streamed_echo_carries_the_same_scores(server, oai):
    whole = oai.completions.create(model="micro", prompt=TEXTS[0], max_tokens=3, echo=True,
                                   logprobs=2, temperature=0)
    chunks = list(oai.completions.create(model="micro", prompt=TEXTS[0], max_tokens=3, echo=True,
                                         logprobs=2, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    offs = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert text == whole.choices[0].text
    assert lps[0] is None and lps[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-3)
    assert offs == whole.choices[0].logprobs.text_offset


def test_an_end_of_turn_after_the_prompt_is_still_reported(server, oai):
    """lm-eval reads token_logprobs[ctxlen:-1], counting on the one token generated after
    the prompt: when that token is the end of turn (forced here by logit_bias) it is
    still in the logprobs, with its log-probability, though not in the text."""
    _, svc = server
    eos = svc.tok.special_tokens["<|end_of_msg|>"]
    ids = svc.tok.encode(TEXTS[0])
    for stream in (False, True):
        kw = dict(model="micro", prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0,
                  logit_bias={str(eos): 100})
        if stream:
            chunks = list(oai.completions.create(stream=True, **kw))
            toks = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            ch = oai.completions.create(**kw).choices[0]
            toks, lps, text, finish = ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.text, ch.finish_reason
        assert finish == "stop" and text == TEXTS[0]
        assert len(toks) == len(ids) + 1 and toks[-1] == "<|end_of_msg|>", toks[-3:]
        assert lps[-1] is not None and lps[-1] > -1  # +100 bias: near certain
    # no echo: nothing changes for a plain request
    plain = oai.completions.create(model="micro", prompt=[ids], max_tokens=1, logprobs=1,
                                   temperature=0, logit_bias={str(eos): 100}).choices[0]
    assert plain.logprobs.tokens == [] and plain.text == ""


@pytest.mark.parametrize("body,field,needle", [
    ({"prompt": [[1, 2, 999999]]}, "prompt", "prompt[0]"),
    ({"prompt": [5, -1]}, "prompt", "prompt[1]"),
    ({"prompt": [[1, 2], "x"]}, "prompt", "mixed"),
    ({"prompt": [[]]}, "prompt", "prompt[0]"),
    ({"prompt": "hi", "max_tokens": 0, "echo": False}, "max_tokens", "echo"),
])
def test_bad_prompts_are_400_naming_the_field(server, body, field, needle):
    r = httpx.post(server[0].url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "micro", "echo": True, "logprobs": 1, "max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and needle in err["message"], err


def test_echo_with_a_prompt_over_the_context_is_400(server):
    _, svc = server
    ids = [65] * (svc.context + 1)
    r = httpx.post(server[0].url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "micro", "prompt": [ids], "echo": True, "logprobs": 0,
                         "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert str(svc.context) in r.json()["error"]["message"]


def test_kimi_mlx_eval_per_text_equals_the_server(server, oai, tmp_path):
    """`kimi-mlx eval --per-text` (generation/evaluate.py) and /v1/completions echo give
    the same summed log-likelihood per text."""
    if server[1].engine.max_concurrency != 1:
        pytest.skip("one engine is enough for this comparison")
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = subprocess.run([sys.executable, "-m", "kimi_mlx", "eval", "--model", MICRO,
                          "--data", str(data), "--per-text", "--seq-len", "4096", "-q"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    r = oai.completions.create(model="micro", prompt=TEXTS, max_tokens=0, echo=True, logprobs=0)
    for row, ch in zip(rows, r.choices):
        served_sum = math.fsum(ch.logprobs.token_logprobs[1:])
        assert row["tokens"] == len(ch.logprobs.tokens) - 1
        assert abs(served_sum - row["logprob"]) < 1e-4, (served_sum, row)


@pytest.mark.parametrize("draft", [
    DraftSettings(model=str(default_model().parent / "micro-draft")),
    DraftSettings(kind="ngram", ngram_max=3, ngram_min=1)],
    ids=["draft-model", "ngram"])
def test_scoring_with_speculative_decoding(draft):
    """A speculating server (draft caches prefilled beside the model's) scores the same
    and generates the same after the scored prompt as without the draft."""
    with served(MICRO, KEY, None, max_concurrency=1, drafts=draft) as (srv, svc):
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=120, max_retries=0)
        ids = svc.tok.encode(TEXTS[1])
        ref, _ = reference(svc.engine.model, ids)
        r = c.completions.create(model="micro", prompt=TEXTS[1], max_tokens=8, echo=True,
                                 logprobs=1, temperature=0).choices[0]
        assert max(abs(a - b) for a, b in zip(r.logprobs.token_logprobs[1:len(ids)], ref)) < 1e-4
        plain = c.completions.create(model="micro", prompt=TEXTS[1], max_tokens=8,
                                     temperature=0).choices[0]
        assert r.text == TEXTS[1] + plain.text
