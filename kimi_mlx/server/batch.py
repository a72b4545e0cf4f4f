"""Continuous batching for the server engine: mlx-lm's `BatchGenerator` over our
batchable caches (`kimi_mlx.model.cache`).

A new job's prompt goes to the generator as segments split at its prompt-cache snapshot
points (`Engine.snapshot_points`), with the cache the prompt cache restored (or a fresh
one). The generator interleaves: each step decodes every active sequence in one batch,
then runs one prefill chunk (`PREFILL_STEP` tokens at most) of the jobs still being
prefilled, together as one right-padded batch. So a joining request stalls the others by
one chunk, not by its whole prompt, and requests that arrive together share their
prefill. At the end of a segment that is a snapshot point the job's row is extracted as a
single-sequence cache and stored, so snapshots hold what a B = 1 prefill would hold.
A job that finishes, is cancelled or whose client left is removed before the next step.
A prompt with images joins the batched prefill like any other (`_MediaFeed`): the tower
runs when it is admitted, only on its images with pads left to prefill that are not in
the tower cache, one image between two of the others' steps (`_admit`), and each of its `<|media_pad|>` tokens left to prefill is handed to the
generator as a token id past the vocabulary that names its row; the model the generator
calls embeds such ids as those rows, so the image's rows land in its own row of each
right-padded chunk, and it holds the others' decode for one chunk at a time, as text does.

With drafts (n-gram, a draft model, the MTP, a block drafter) the generator's decode
steps verify every row's drafts in one batched pass (`speculative.batch.SpeculativeBatch`,
installed here; each row is registered with its prompt ids when it is admitted); the loop
below is the same, a step just yields several tokens of a row in order. The acceptance
figures go to the metrics after each step. A drafter of the target's hidden states (the
MTP, a block drafter, `speculative.hidden_rows`) needs them at every prompt position, so
each prompt is prefilled alone with capture when it is admitted (it holds the others'
decode for its whole prompt, not one chunk) and joins for its last token.

One request cannot fail or poison the others (`_RowGuard`): its sampler and logits
processors run guarded, row by row; when one raises (building its graph or evaluating
it) that row gets a placeholder token for the step, so the step completes for the other
rows exactly as it would have without it, then the job is removed from the generator
and fails alone with its own message, and MLX's random state is reseeded
(`jobs.reseed_random`). Only a failure outside every row's own computation (the batched
forward pass) fails the whole step.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.server.jobs import Failed, Finished, Job, Started, TokenEmitter, reseed_random

log = logging.getLogger(__name__)

# Prompt tokens per row per prefill chunk between two decode steps: bounds how long a
# joining request holds up the others' next token.
PREFILL_STEP = 512


class _RowGuard:
    """One job's sampler and logits processors, as the generator calls them for its row
    alone (mlx-lm's `GenerationBatch._step` calls per-row samplers on logprobs[e:e+1]
    and per-row processors on logits[e:e+1] whenever the rows' samplers differ).

    The row's input (the batch's forward pass) is evaluated first, outside the guard: a
    failure there is the step's, not this row's. Then the row's own computation is built
    and evaluated inside it; an exception there is recorded in `error`, MLX's random state
    is reseeded at once (so rows sampled after it in the same step draw from a valid
    state) and a placeholder is returned (the argmax token; the unchanged logits), which
    the engine discards when it removes the job after the step. Evaluating the row's
    token here means the step's next forward pass runs before the generator returns, not
    overlapped with the Python that follows it; only jobs that sample (temperature > 0)
    or carry logits processors are guarded at all (greedy rows share mlx-lm's argmax).
    """

    def __init__(self, sampler=None, processors=(), real_ids=None):
        self.error: Optional[str] = None
        self._real_ids = real_ids  # a row with images: its prompt's remapped pad ids back
        self._sampler = sampler
        self.sampler = self._sample if sampler is not None else None
        self.processors = [self._processor(p) for p in processors]

    def _fail(self, e: Exception) -> None:
        if self.error is None:
            log.warning("a request's sampling failed: %s: %s", type(e).__name__, e)
            self.error = f"generation failed: {type(e).__name__}: {e}"
        reseed_random()

    def _sample(self, logprobs):
        if self.error is None:
            mx.eval(logprobs)
            try:
                out = self._sampler(logprobs)
                mx.eval(out)
                return out
            except Exception as e:  # noqa: BLE001 - this row fails, the others go on
                self._fail(e)
        return mx.argmax(logprobs, axis=-1)

    def _processor(self, proc):
        def run(tokens, logits):
            if self.error is not None:
                return logits
            if self._real_ids is not None:
                tokens = self._real_ids(tokens)
            mx.eval(tokens, logits)
            try:
                out = proc(tokens, logits)
                mx.eval(out)
                return out
            except Exception as e:  # noqa: BLE001 - this row fails, the others go on
                self._fail(e)
                return logits
        return run


class _MediaFeed:
    """The model as the generator calls it, feeding image rows through token ids.

    mlx-lm's `BatchGenerator` passes token ids only ([B, L] right-padded chunks, [B, 1]
    decode steps). A job with images left to prefill `add`s its rows [n, hidden] and gets
    a base id b >= vocab: its k-th pad left to prefill goes to the generator as b + k.
    While any rows are registered, each call embeds the ids itself (an id past the
    vocabulary as the row it names, cast to the activation dtype as
    `embed_with_media` does; every other id as its token embedding, bit for bit) and
    passes them as `input_embeddings`; with none registered the call goes straight to
    the model. All lazy: no evaluation, so decode steps still overlap graph building.

    Args:
        model: our `Model` (or a stand-in with `text.embed`, `args.vocab_size`).
        pad_id: the `<|media_pad|>` id (what a remapped id embeds as before its row
            replaces it; also what logits processors see for it, `real_ids`).
    """

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.vocab = int(model.args.vocab_size)
        self._rows: Dict[int, mx.array] = {}
        self._next = self.vocab

    def add(self, rows: mx.array) -> int:
        """Register a job's rows [n, hidden]; returns its base id (pad k -> base + k)."""
        base = self._next
        if base + rows.shape[0] >= 2**31:
            raise ValueError("too many image rows in flight for int32 token ids")
        self._rows[base] = rows
        self._next += rows.shape[0]
        return base

    def drop(self, base: Optional[int]) -> None:
        """Forget a job's rows (its prefill is over, or it left); ids restart from the
        vocabulary once none are registered."""
        if base is not None:
            self._rows.pop(base, None)
        if not self._rows:
            self._next = self.vocab

    def clear(self) -> None:
        self._rows.clear()
        self._next = self.vocab

    def real_ids(self, tokens: mx.array) -> mx.array:
        """`tokens` with every id past the vocabulary replaced by the pad id."""
        return mx.where(tokens >= self.vocab, self.pad_id, tokens)

    def __call__(self, inputs: mx.array, cache=None):
        if not self._rows:
            return self.model(inputs, cache=cache)
        real = self.real_ids(inputs)
        h = self.model.text.embed(real)
        for base, rows in self._rows.items():
            at = inputs - base
            inside = (at >= 0) & (at < rows.shape[0])
            picked = rows.astype(h.dtype)[mx.clip(at, 0, rows.shape[0] - 1)]
            h = mx.where(inside[..., None], picked, h)
        return self.model(real, cache=cache, input_embeddings=h)


class _Live:
    """A job in the generator: `ends` are its prompt segments' end positions still to
    come (snapshot points, then the end of the prompt but its last token)."""

    def __init__(self, job: Job, cached: int, ends: List[int], snaps: List[int],
                 out: TokenEmitter, guard: Optional[_RowGuard] = None,
                 media: Optional[int] = None):
        self.job, self.cached, self.guard, self.out = job, cached, guard, out
        self.ends, self.snaps = ends, set(snaps)
        self.media = media  # its base id in the `_MediaFeed` while its prefill runs


class BatchHost(Protocol):
    """What `run_batched` reads of an engine: public members only. The one-process
    `server.engine.Engine` is one; a tensor group's `cluster.tensor.batched.BatchHost`
    answers it for `TensorEngine`. An engine implements either this (and runs
    `run_batched` from its `_serve`) or `BaseEngine._run` for one job at a time.

    Attributes:
        model: what the generator calls (tokens [B, L] -> logits [B, L, vocab], with
            `make_cache`). eos_ids: ids that end a reply. max_concurrency: rows at once.
        metrics: the server's `Metrics` or None. prompt_cache: a cache with `every`,
            `store`, `note_prompt_speed` (snapshots), or None. pad_id / vision: the image
            pad id and the vision tower (None without). feeds_media_by_id: whether
            `model` embeds image rows given as ids past the vocabulary (`_MediaFeed`).
        active: rows in flight, set by the loop (the queue's admission reads it).
    """

    model: Any
    eos_ids: Any
    max_concurrency: int
    metrics: Any
    prompt_cache: Any
    pad_id: Optional[int]
    vision: Any
    feeds_media_by_id: bool
    active: int

    def stopping(self) -> bool:
        """Whether the engine is stopping (the loop returns)."""

    def next_job(self, block: bool = True) -> Optional[Job]:
        """The next queued job (None: stopping; queue.Empty when not `block`)."""

    def start_cache(self, job: Job) -> Tuple[list, int]:
        """(the job's cache, prompt tokens it already holds)."""

    def cache_models(self, cache) -> List[Tuple[Any, list]]:
        """(model, its part of `cache`) pairs, for a scored prompt's prefill."""

    def batch_drafts(self):
        """A `speculative.batch.BatchDrafts` for the generator, or None."""

    def speculates(self, job: Job) -> bool:
        """Whether `job`'s row may be drafted for."""

    def snapshot_points(self, ids: Sequence[int], start: int,
                        segment_ends: Sequence[int]) -> List[int]:
        """Prompt positions where the prompt cache keeps a snapshot."""

    def embeddings(self, job: Job, start: int):
        """Image rows of a prompt prefilled alone, or None."""

    def prefill(self, ids: List[int], cache, start: int, segment_ends: Sequence[int],
                step: int = 2048, embeddings=None, key: Optional[Sequence] = None) -> None:
        """Run ids[start:-1] into `cache` alone (snapshots where the policy says)."""


def run_batched(engine: BatchHost) -> None:
    """Worker loop of an engine with max_concurrency > 1 (`BatchHost`; runs until its
    `stopping()`)."""
    from mlx_lm.generate import BatchGenerator

    drafts = engine.batch_drafts()
    # a drafter of hidden states (MTP, block drafter) has every prompt prefilled alone with
    # capture (`_admit`): image rows then go in as embeddings, not by id
    captures = drafts is not None and drafts.captures
    feed = (_MediaFeed(engine.model, engine.pad_id)
            if engine.pad_id is not None and engine.feeds_media_by_id and not captures
            else None)
    gen = BatchGenerator(feed or engine.model, max_tokens=1 << 30,
                         stop_tokens=[[e] for e in sorted(engine.eos_ids)],
                         completion_batch_size=engine.max_concurrency,
                         prefill_batch_size=engine.max_concurrency,
                         prefill_step_size=PREFILL_STEP)
    if drafts is not None:
        from kimi_mlx.speculative.batch import install

        install(gen, drafts)
    live: Dict[int, _Live] = {}
    staged: list = []  # a job between its images' tower runs (`_admit`)
    try:
        while not engine.stopping():
            if not _admit(engine, gen, live, feed, staged, drafts):
                return
            engine.active = len(live)
            gone = [uid for uid, s in live.items() if s.job.cancelled.is_set()]
            if gone:
                gen.remove(gone)
                _drop_drafts(drafts, gone)  # those still prefilling never reached the batch
                for uid in gone:
                    _finish(engine, live.pop(uid), "cancelled", feed)
                engine.active = len(live)
            if not live:
                continue
            try:
                before = _spec_counts(drafts)
                prompt_responses, responses = gen.next()
                if drafts is not None and engine.metrics is not None:
                    engine.metrics.speculated(*(b - a for a, b in
                                                zip(before, _spec_counts(drafts))))
                _drop_failed_rows(gen, live, feed)
                _snapshot(engine, gen, live, prompt_responses)
            except Exception as e:  # noqa: BLE001 - a failed step fails the jobs in it
                log.exception("batched generation step failed")
                gen.remove(list(live))
                _drop_drafts(drafts, list(live))
                for s in live.values():
                    s.job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                live.clear()
                if feed is not None:
                    feed.clear()
                reseed_random()
                continue
            for r in responses:
                s = live.get(r.uid)
                if s is None:
                    continue
                if s.out.t_first is None:
                    dt = s.out.first(s.cached)
                    if feed is not None:  # its prompt is in the cache: rows no longer read
                        feed.drop(s.media)
                        s.media = None
                    if engine.prompt_cache is not None:
                        engine.prompt_cache.note_prompt_speed(len(s.job.ids) - s.cached, dt)
                if s.out.token(r.token, r.logprobs) == "stop":
                    live.pop(r.uid)
                    _finish(engine, s, "stop", feed)
                    continue
                if r.finish_reason is not None:
                    live.pop(r.uid)
                    _finish(engine, s, "length", feed)
            engine.active = len(live)
    finally:
        engine.active = 0
        for s in live.values():
            s.job.emit(Failed("the server is shutting down"))
        for job, _, _ in staged:
            job.emit(Failed("the server is shutting down"))
        gen.close()


def _admit(engine, gen, live: Dict[int, _Live], feed: Optional[_MediaFeed] = None,
           staged: Optional[list] = None, drafts=None) -> bool:
    """Hand waiting jobs to the generator while there is room; blocks when idle.
    False when the engine is stopping. A job with images left to prefill gets its rows
    registered with `feed` and its pads from there on replaced by their row ids. While
    others are live, the tower runs on one image per call: a job whose images it has
    not run on yet waits in `staged` (job, cache, cached) and the call returns, so the
    others take a step between two tower runs and before the job's first chunk."""
    staged = [] if staged is None else staged
    while len(live) < engine.max_concurrency:
        if staged:
            job, cache, cached = staged.pop()
        else:
            try:
                job = engine.next_job(block=not live)
            except queue.Empty:
                return True
            if job is None:
                return False
            cache = None
        if job.cancelled.is_set():
            job.emit(Finished("cancelled", len(job.ids)))
            if engine.metrics is not None:  # left while queued: nothing generated
                engine.metrics.finished_requests.labels("cancelled").inc()
            continue
        media = None
        try:
            if cache is None:
                cache, cached = engine.start_cache(job)
            start = cached
            ids = job.ids
            if job.score is not None:
                # scored alone (its logits kept, `server.scoring`), then joins for its
                # last token like a prompt with images
                from kimi_mlx.server.scoring import finish_scored, score_prefill

                tic = time.perf_counter()
                job.prompt_scores = score_prefill(engine, job.ids, cache, job.score,
                                                  job.segment_ends, job.key)
                start = len(job.ids) - 1
                if job.max_tokens == 0:
                    job.emit(Started(0))
                    finish_scored(job, tic, engine.metrics)
                    continue
            elif job.images and engine.pad_id in job.ids[start:]:
                if feed is None:
                    # an engine whose model takes no rows by id (the tensor group's rows):
                    # prefilled here, alone (snapshots included), and joins for its last token
                    embeddings = engine.embeddings(job, start)
                    if embeddings is not None:
                        engine.prefill(job.ids, cache, cached, job.segment_ends,
                                       embeddings=embeddings, key=job.key)
                        start = len(job.ids) - 1
            if job.images and feed is not None and engine.pad_id in job.ids[start:]:
                todo = [im for im in engine.vision.images_from(job.ids, job.images,
                                                               engine.pad_id, start)
                        if not engine.vision.has_rows(im)]
                if todo and live:  # one tower run, then the others' next step
                    engine.vision.image_rows(todo[0])
                    staged.append((job, cache, cached))
                    return True
                # the images with pads left to prefill (their tower rows cached, or run
                # now when nobody else is live); their rows go in by id
                rows = engine.vision.rows_from(job.ids, job.images, engine.pad_id, start)
                media = feed.add(rows)
                ids, k = list(job.ids), 0
                for i in range(start, len(ids)):
                    if ids[i] == engine.pad_id:
                        ids[i] = media + k
                        k += 1
            hidden = None
            if drafts is not None and drafts.captures and start < len(job.ids) - 1:
                # its drafter reads the target's hiddens at every prompt position: the
                # prompt runs alone here, captured, and joins for its last token
                hidden = drafts.prefill(engine.model, job.ids, cache, start, PREFILL_STEP)
                start = len(job.ids) - 1
            snaps = engine.snapshot_points(job.ids, start, job.segment_ends)
            cuts = [start] + snaps + [len(job.ids)]
            segments = [ids[a:b] for a, b in zip(cuts, cuts[1:])]
            # the generator runs the last prompt token as the first decode step
            ends = snaps + ([len(job.ids) - 1] if len(segments[-1]) > 1 else [])
            sampler = None if job.sampling.temp == 0 else job.sampling.sampler()
            guard = _RowGuard(sampler, job.logits_processors or (),
                              real_ids=feed.real_ids if media is not None else None)
            (uid,) = gen.insert_segments([segments], max_tokens=[job.max_tokens],
                                         caches=[cache], samplers=[guard.sampler],
                                         logits_processors=[guard.processors])
            if drafts is not None:
                # a seeded sampled request keeps its own PRNG stream: no drafts for it
                seeded = job.sampling.seed is not None and not job.sampling.greedy
                drafts.add(uid, job.ids, job.sampling,
                           engine.speculates(job) and not seeded, hidden=hidden)
        except Exception as e:  # noqa: BLE001 - this job fails, the others go on
            log.exception("admitting a job failed")
            if feed is not None:
                feed.drop(media)
            job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
            reseed_random()
            continue
        live[uid] = _Live(job, cached, ends, snaps,
                          TokenEmitter(job, engine.eos_ids, time.perf_counter(), engine.metrics),
                          guard, media)
        job.emit(Started(cached))
        engine.active = len(live)
    return True


def _spec_counts(drafts) -> tuple:
    """(verify steps, drafted, accepted) so far of a batch's drafts ((0, 0, 0) without)."""
    if drafts is None:
        return (0, 0, 0)
    st = drafts.stats
    return (st.steps, st.drafted, st.accepted)


def _drop_drafts(drafts, uids) -> None:
    """Forget the drafting state of rows removed from the generator (a row removed
    while its prompt is prefilled never left the decode batch, which forgets the rest)."""
    if drafts is not None:
        for uid in uids:
            drafts.drop(uid)


def _drop_failed_rows(gen, live: Dict[int, _Live], feed: Optional[_MediaFeed] = None) -> None:
    """Remove the jobs whose sampler or logits processors raised in the step just run
    (`_RowGuard`): each fails with its own message; this step's responses for them are
    ignored (they are no longer live)."""
    failed = [uid for uid, s in live.items() if s.guard is not None and s.guard.error]
    if failed:
        gen.remove(failed)
        for uid in failed:
            s = live.pop(uid)
            if feed is not None:
                feed.drop(s.media)
            s.job.emit(Failed(s.guard.error))


def _snapshot(engine, gen, live: Dict[int, _Live], prompt_responses) -> None:
    """Store a prompt-cache snapshot for each job whose prefill just ended a segment at a
    snapshot point (its row, extracted as a single-sequence cache)."""
    for r in prompt_responses:
        s = live.get(r.uid)
        if s is None or not r.end_of_segment or r.end_of_prompt or not s.ends:
            continue
        end = s.ends.pop(0)
        if end in s.snaps and engine.prompt_cache is not None:
            cache, _ = gen.extract_cache([r.uid])[r.uid]
            # evaluated now: the row's own copy, not a lazy slice that keeps the whole
            # batch buffer alive (and that only this thread's stream could evaluate)
            mx.eval([c.state for c in cache])
            engine.prompt_cache.store(s.job.cache_key[:end], cache)


def _finish(engine, s: _Live, reason: str, feed: Optional[_MediaFeed] = None) -> None:
    if feed is not None:
        feed.drop(s.media)
        s.media = None
    s.out.finish(reason, s.cached)
