"""Per-row drafting in a speculative batch (`speculative.batch`): a row with logits
processors is never given drafts, even on a prompt that drafts well, beside rows that
are. Its tokens equal mlx-lm's `generate_step` with the same processor (one sequence, no
speculation), and the rows without processors keep drafting (their drafted counts add up
to the batch's)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step

from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.request import default_model
from kimi_mlx.sampling import Sampling
from kimi_mlx.speculative.batch import BatchDrafts, install
from kimi_mlx.speculative.ngram import NgramDraft

N = 24
LOOP = [7, 8, 9, 10, 11, 12]


def greedy(lp):
    return mx.argmax(lp, axis=-1)


def counted(logits_seen):
    """A logits processor that changes nothing and counts the positions it is applied to
    (mlx-lm's processor signature: (tokens so far, logits [1, V]) -> logits)."""
    def proc(tokens, logits):
        logits_seen.append(logits.shape)
        return logits
    return proc


@pytest.fixture(scope="module")
def micro():
    model, _, tok, _ = load_for_generation(str(default_model()))
    code = "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a, b):"
    return model, [LOOP * 6 + [300, 301], tok.encode(code)]


def test_a_row_with_processors_is_never_drafted(micro, monkeypatch):
    model, (loop, code) = micro
    prompts = [loop, loop, code, code]  # rows 1 and 3 have a processor
    seen = [[], []]
    procs = [None, [counted(seen[0])], None, [counted(seen[1])]]
    gen = BatchGenerator(model, max_tokens=N, prefill_batch_size=4, completion_batch_size=8,
                         prefill_step_size=32)
    drafts = BatchDrafts(NgramDraft(), 3, gate=None)  # verify whenever a row has a draft
    install(gen, drafts)
    final = {}
    drop = BatchDrafts.drop

    def recording_drop(self, uid):  # each row's count as it leaves the batch
        if uid in self.rows:
            final[uid] = self.rows[uid].drafted
        drop(self, uid)

    monkeypatch.setattr(BatchDrafts, "drop", recording_drop)
    uids = []
    for p, pr in zip(prompts, procs):
        (uid,) = gen.insert([p], samplers=[None], logits_processors=[pr or []])
        drafts.add(uid, p, Sampling())
        uids.append(uid)
    out = {}
    while True:
        rs = gen.next_generated()
        if not rs:
            break
        for r in rs:
            out.setdefault(r.uid, []).append(int(r.token))
    gen.close()
    for uid in uids:  # rows still held at the end
        if uid not in final and uid in drafts.rows:
            final[uid] = drafts.rows[uid].drafted
    counts = [final[u] for u in uids]
    assert counts[1] == 0 and counts[3] == 0, counts  # the processor rows
    assert counts[0] > 0 and counts[2] > 0, counts  # the same prompts without: drafted
    assert sum(counts) == drafts.stats.drafted
    for i, p in enumerate(prompts):  # tokens: as one sequence through mlx-lm
        ref = [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N,
                                                 sampler=greedy)]
        assert out[uids[i]] == ref, i
    # the processor was applied at every generated position (mlx-lm computes one step
    # ahead, so it may have seen one more)
    assert all(len(s) >= N for s in seen), [len(s) for s in seen]
