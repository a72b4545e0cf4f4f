"""Our KDA and DSA caches in mlx-lm's batch-cache protocol: batched generation through
mlx-lm's own `BatchGenerator` (right-padded batched prefill, continuous insertion with
left padding, removal) gives row for row the greedy tokens of single runs, on prompts
shorter and longer than the micro model's index_topk (64: the DSA sparse path); and
`mlx_lm.server` serves the micro checkpoint (the bug this issue was filed for)."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step

from kimi_mlx.model.cache import BatchDSACache, DSACache
from kimi_mlx.model.dsa import DSACache as OldPathDSACache
from kimi_mlx.generation.request import default_model
from kimi_mlx.checkpoint.loader import load_for_generation

MICRO = str(default_model())
N = 8


@pytest.fixture(scope="module")
def micro():
    model, wrapper, tok, _ = load_for_generation(MICRO)
    text = open(os.path.join(MICRO, "heldout", "prose.txt")).read()
    prompts = [tok.encode(text[i * 700 : i * 700 + n]) for i, n in enumerate([40, 150, 300, 420])]
    lengths = [len(p) for p in prompts]
    assert min(lengths) < model.args.index_topk < max(lengths)  # both DSA paths run
    singles = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=N)] for p in prompts]
    return model, prompts, singles


def _drain(gen, out):
    while True:
        rs = gen.next_generated()
        if not rs:
            return
        for r in rs:
            out.setdefault(r.uid, []).append(r.token)


def test_batched_prefill_and_decode_equal_single_runs(micro):
    model, prompts, singles = micro
    gen = BatchGenerator(model, max_tokens=N, prefill_batch_size=4, completion_batch_size=4)
    uids = gen.insert(prompts)  # one right-padded prefill batch of 4 different lengths
    out = {}
    _drain(gen, out)
    assert [out[u] for u in uids] == singles


def test_continuous_insertion_and_removal_equal_single_runs(micro):
    model, prompts, singles = micro
    gen = BatchGenerator(model, max_tokens=N, prefill_batch_size=1, completion_batch_size=4)
    out = {}
    first = gen.insert(prompts[2:])
    for _ in range(3):  # the first two are decoding when the others arrive (left padding)
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append(r.token)
    extra = gen.insert([prompts[1][:-5]])  # removed mid-way: the others must not notice
    later = gen.insert(prompts[:2])
    for _ in range(2):
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append(r.token)
    gen.remove(extra)
    out.pop(extra[0], None)
    _drain(gen, out)
    assert [out[u] for u in first + later] == singles[2:] + singles[:2]


def test_dsa_cache_merge_extract_filter_round_trip():
    rng = mx.random.key(0)
    caches = []
    for n in (3, 7, 5):
        c = DSACache()
        k1, k2, k3, rng = mx.random.split(rng, 4)
        c.update_and_fetch_all(mx.random.normal((1, 1, n, 8), key=k1),
                               mx.random.normal((1, 1, n, 4), key=k2),
                               mx.random.normal((1, 1, n, 6), key=k3))
        caches.append(c)
    batch = DSACache.merge(caches)
    assert isinstance(batch, BatchDSACache) and batch.left_padding.tolist() == [4, 0, 2]
    for i, c in enumerate(caches):
        e = batch.extract(i)
        for a, b in zip(e.state[:3], c.state[:3]):
            assert mx.array_equal(a, b[..., : c.offset, :])
    batch.filter([0, 2])  # the longest row leaves: padding shrinks by 2
    assert batch.left_padding.tolist() == [2, 0] == batch._pads
    assert batch.index_keys.shape[2] == batch.keys.shape[2]
    assert mx.array_equal(batch.extract(1).index_keys, caches[2].index_keys[..., :5, :])
    batch.extend(DSACache.merge([caches[1]]))  # 7 tokens join 5: everyone re-justified
    assert batch.left_padding.tolist() == [4, 2, 0] == batch._pads
    for i, c in zip(range(3), (caches[0], caches[2], caches[1])):
        assert mx.array_equal(batch.extract(i).index_keys, c.index_keys[..., : c.offset, :])
        assert mx.array_equal(batch.extract(i).keys, c.keys[..., : c.offset, :])
    assert OldPathDSACache is DSACache


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlx_lm_server_serves_the_micro_checkpoint(micro):
    """mlx_lm.server (BatchGenerator inside) on our checkpoint, driven by the openai
    client: concurrent chats all finish, and a greedy completion equals a single run."""
    import concurrent.futures as cf

    import openai

    model, _, _ = micro
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", MICRO, "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("mlx_lm.server did not start: " + proc.stderr.read1(4000).decode())
                time.sleep(0.3)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=60,
                          max_retries=0)

        def chat(i):
            r = c.chat.completions.create(model=MICRO, max_tokens=6, temperature=0, messages=[
                {"role": "user", "content": f"Message {i}. " * (1 + 8 * i)}])
            return r.usage.completion_tokens

        with cf.ThreadPoolExecutor(4) as ex:
            assert list(ex.map(chat, range(4))) == [6] * 4
        # 4 different raw prompts at once (its BatchGenerator batches them): each equals
        # a single greedy run
        from kimi_mlx.text.tokenizer import KimiTokenizer

        tok = KimiTokenizer.from_pretrained(MICRO)
        prose = open(os.path.join(MICRO, "heldout", "prose.txt")).read()
        prompts = [prose[500 * i : 500 * i + 25 + 60 * i] for i in range(4)]

        def complete(p):
            return c.completions.create(model=MICRO, prompt=p, max_tokens=6, temperature=0).choices[0].text

        with cf.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(complete, prompts))
        want = [tok.decode([t for t, _ in generate_step(mx.array(tok.encode(p)), model, max_tokens=6)])
                for p in prompts]
        assert got == want and len(set(want)) == 4
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_short_rows_share_one_masked_dense_call(micro):
    """Rows of different lengths within index_topk: one batched DSA call whose mask hides
    each row's left padding; still the single runs' tokens."""
    model, _, _ = micro
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(MICRO)
    text = open(os.path.join(MICRO, "heldout", "code.txt")).read()
    prompts = [tok.encode(text[i * 500 : i * 500 + n]) for i, n in enumerate([20, 60, 110])]
    assert max(len(p) for p in prompts) + N < model.args.index_topk
    runs = [list(generate_step(mx.array(p), model, max_tokens=N)) for p in prompts]
    singles = [[t for t, _ in r] for r in runs]
    gen = BatchGenerator(model, max_tokens=N, prefill_batch_size=1, completion_batch_size=4)
    out, lps = {}, {}

    def step():
        rs = gen.next_generated()
        for r in rs:
            out.setdefault(r.uid, []).append(r.token)
            lps.setdefault(r.uid, []).append(r.logprobs[r.token].item())
        return rs

    first = gen.insert(prompts[:1])
    step(), step()
    rest = gen.insert(prompts[1:])
    while step():
        pass
    assert [out[u] for u in first + rest] == singles
    assert len({tuple(s) for s in singles}) == 3
    # the padded positions carry no weight at all: log-probabilities agree to float32
    # rounding (a padding key left in the softmax shifts them by ~1e-3)
    for u, r in zip(first + rest, runs):
        assert lps[u] == pytest.approx([lp[t].item() for t, lp in r], abs=2e-5)
