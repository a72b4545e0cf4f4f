"""The stage service's `Forward` RPC: open a session (fresh, or restored from a prompt-cache
snapshot), check every chunk, run it on the stage's MLX thread and hand the result on (to
the next stage's stream, or the head's `Watch`); batched decode rows too (see
`node.service`'s module doc)."""

from __future__ import annotations

import logging
import queue
import time

import grpc
import mlx.core as mx

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.wire import (WireError, check_session_id, from_tensor, sampling_from_pb,
                                       to_tensor)
from kimi_mlx.cluster.node.compute import ComputeStopped
from kimi_mlx.cluster.node.runner import Refused, Session, StageRunner, StageSpec
from kimi_mlx.sampling import Sampling
from kimi_mlx.cluster.node.sessions import Downstream, DownstreamLost, Live, SessionLimit
from kimi_mlx.cluster.net.cache_keys import CACHE_MISS, key_length

log = logging.getLogger(__name__)


class ForwardRPC:
    """`Forward` and the per-chunk work, part of `node.service.StageService` (uses its
    sessions, runner, MLX thread, prompt cache, `_emit` and `_free`)."""

    def _new_session(self, runner: StageRunner, o, sampling: Sampling) -> Session:
        """A session's state (on the MLX thread): fresh caches, or restored from the
        prompt-cache snapshot `o.restore_key` (CacheMiss when it is not held)."""
        session = runner.new_session(o.session, o.head, sampling, o.return_logprobs)
        if o.restore_key:
            cache = self.prompt_cache.restore(o.restore_key, o.restore_length)
            if cache is None:
                raise Refused(f"{self.who}: {CACHE_MISS}: no snapshot {o.restore_key} here "
                              "(evicted, or this stage restarted)")
            session.cache, session.offset = cache, o.restore_length
        return session

    def _open(self, first, context, runner: StageRunner) -> Live:
        if not first.HasField("open") or first.seq != 0:
            raise Refused("the first message of a stream must open a session (seq 0 with open)")
        o = first.open
        try:
            check_session_id(o.session)
            check_session_id(o.head)
        except WireError as e:
            raise Refused(str(e)) from None
        if first.session != o.session:
            raise Refused(f"message for session {first.session!r} opens session {o.session!r}")
        self._check_plan(o, runner.spec)
        if o.batch and o.restore_key:
            raise Refused("a batch stream restores no prompt-cache snapshot")
        try:
            sampling = sampling_from_pb(o.sampling)
        except ValueError as e:
            raise Refused(f"session {o.session!r}: {e}") from None
        if len(self.sessions) >= self.max_sessions:  # checked again below, under the lock
            raise self._full()
        if o.restore_key:
            try:
                n = key_length(o.restore_key)
            except ValueError as e:
                raise Refused(str(e)) from None
            if n != o.restore_length or not 0 < n < runner.max_positions:
                raise Refused(f"restore key {o.restore_key!r} holds {n} positions, the session "
                              f"says {o.restore_length}")
        if o.batch:  # its rows' sessions hold the state
            session = Session(o.session, o.head, sampling, False, [])
        else:
            session = self.compute.call(self._new_session, runner, o, sampling)
        with self.lock:
            if o.session in self.sessions:
                raise Refused(f"session {o.session} is already open here")
            if len(self.sessions) >= self.max_sessions:
                raise self._full()
            live = Live(session, context, context.peer())
            live.batch = o.batch
            self.sessions[o.session] = live
        context.add_callback(lambda: self._free(live, "stream ended"))
        if not runner.is_last:
            live.down = Downstream(self, live, self.next_address)
        return live

    def _check_plan(self, o, spec: StageSpec) -> None:
        """Refused unless the plan the session was opened for (`SessionOpen.bounds` and
        `fingerprint`, when sent) puts exactly this stage's layers here."""
        if not o.bounds and not o.fingerprint:
            return
        b = list(o.bounds)
        planned = (f"layers [{b[spec.index]}, {b[spec.index + 1]})"
                   if len(b) == spec.num_stages + 1 else f"a {max(len(b) - 1, 0)}-stage pipeline")
        if (planned != f"layers [{spec.start}, {spec.end})"
                or (o.fingerprint and o.fingerprint != spec.fingerprint)):
            raise Refused(f"session {o.session} was planned with {planned} of checkpoint "
                          f"{o.fingerprint or '?'} here, but this stage now holds layers "
                          f"[{spec.start}, {spec.end}) of {spec.fingerprint} as stage {spec.index} "
                          f"of {spec.num_stages} (another head loaded it since): load again")

    def _full(self) -> SessionLimit:
        return SessionLimit(f"{self.who}: session table full: {len(self.sessions)} sessions "
                            f"open, the limit is {self.max_sessions} (cluster serve "
                            "--max-sessions); try again when one ends")

    def _next(self, it):
        try:
            return next(it)
        except StopIteration:
            return None

    def Forward(self, request_iterator, context):
        """Serve one session's chunks in order (see the module doc); ends with a CLOSED
        event, or INVALID_ARGUMENT / UNAVAILABLE naming this stage and the reason."""
        runner = self.runner
        if runner is None or self.state != "ready":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.who}: no layers loaded")
        first = self._next(request_iterator)
        if first is None:
            return
        live, msg, code = None, first, grpc.StatusCode.INVALID_ARGUMENT
        try:
            live = self._open(first, context, runner)
            while msg is not None:
                if live.freed:
                    return
                live.last_active = time.monotonic()
                out = self.compute.call(self._process_and_pass, live, msg, runner)
                live.last_active = time.monotonic()
                if isinstance(out, pb.Activation):  # the queue was full: the MLX thread never waits
                    live.down.send(out, self.idle_timeout)
                elif isinstance(out, list):  # a batched step's tokens without a Watch
                    yield from out
                elif out is not None:
                    yield out  # no Watch from this head: answer on the stream itself
                msg = self._next(request_iterator)
            if live.down is not None:
                live.down.finish(self.idle_timeout)
            yield self._event(pb.Event.CLOSED, live.id)
        except (Refused, DownstreamLost, ComputeStopped) as e:
            if isinstance(e, SessionLimit):
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            elif not isinstance(e, Refused):
                code = grpc.StatusCode.UNAVAILABLE
            if isinstance(e, SessionLimit):
                text = str(e)
            elif isinstance(e, Refused):
                text = f"{self.who} refused message seq {msg.seq} of session {msg.session!r}: {e}"
            else:
                text = f"{self.who}: {e}"
            log.warning("%s (from %s)", text, context.peer())
            head = live.session.head if live else (first.open.head if first.HasField("open") else "")
            self._emit(head, self._event(pb.Event.ERROR, msg.session, msg.seq, message=text))
            for r in msg.rows:  # a batched step: every row's session hears of it
                self._emit(head, self._event(pb.Event.ERROR, r.session, r.seq, message=text))
            self._free(live, "refused" if isinstance(e, Refused) else "next stage lost", cancel=False)
            context.abort(code, text)
        except grpc.RpcError:
            pass  # the upstream call ended (cancelled, reset, network): freed below
        finally:
            if live is not None and not live.freed:
                self._free(live, "" if context.is_active() else "stream ended", cancel=False)

    def _process_and_pass(self, live: Live, msg, runner: StageRunner):
        """`_process`, then hand its result on from the MLX thread when that cannot wait:
        an Activation into the next stage's send queue if it has room, a TOKEN event to
        the head's Watch. Returns what is left for the stream's handler thread to send
        (a full queue: its bounded wait; no Watch: the stream's own answer), else None.
        Saves the handler thread's wake-up on the way to the next stage."""
        out = self._process(live, msg, runner)
        if isinstance(out, list):  # a batched step's tokens, one event per row session
            left = [ev for ev in out if not self._emit(live.session.head, ev)]
            return left or None
        down = live.down
        if isinstance(out, pb.Activation) and down is not None and not (down.error or down.cancelled):
            try:
                down.q.put_nowait(out)
                return None
            except queue.Full:
                return out
        if isinstance(out, pb.Event) and self._emit(live.session.head, out):
            return None
        return out

    def _process(self, live: Live, msg, runner: StageRunner):
        """Check and run one chunk (on the MLX thread). Returns the Activation for the
        next stage, a TOKEN event (last stage, sampled chunk), or None."""
        s = live.session
        if live.freed:  # freed while queued: its caches are gone
            return None
        if live.batch or msg.rows:
            return self._process_rows(live, msg, runner)
        if msg.session != s.session:
            raise Refused(f"message for session {msg.session!r} on the stream of session {s.session!r}")
        if msg.seq != 0 and msg.HasField("open"):
            raise Refused("only seq 0 may open a session")
        keep = msg.keep if msg.HasField("keep") else None
        # Speculative fields go to the runner only when set: a runner that cannot verify
        # (the hop bench's null stages) keeps the plain signature.
        spec = dict(verify=True) if msg.verify else {}
        if keep is not None:
            spec["keep"] = keep
        runner.check(s, msg.seq, msg.offset, msg.length, msg.sample, **spec)
        shape, dtype = runner.input_spec(msg.length)
        try:
            x = from_tensor(msg.tensor, shape, dtype, "activation" if not runner.is_first else "tokens")
        except WireError as e:
            raise Refused(str(e)) from None
        if msg.snapshot_key:
            try:
                n = key_length(msg.snapshot_key)
            except ValueError as e:
                raise Refused(str(e)) from None
            if n != msg.offset + msg.length or msg.verify:
                raise Refused(f"snapshot key {msg.snapshot_key!r} holds {n} positions, but the "
                              f"chunk ends at {msg.offset + msg.length}"
                              + (" (and is a verify chunk)" if msg.verify else ""))
        if msg.HasField("media"):
            spec["media"] = self._media(msg, runner, x)
        if msg.score_targets:  # a scored prefill chunk (only then: the plain signature)
            spec["score"] = (list(msg.score_targets), msg.score_top)
        if msg.capture_layers:  # a block drafter's capture (only then: the plain signature)
            spec["capture"] = self._captured(msg, runner)
        elif msg.HasField("captured"):
            raise Refused(f"session {msg.session}: captured hidden states without capture_layers")
        out = runner.run(s, msg.seq, msg.offset, x, msg.sample, **spec)
        if msg.snapshot_key:
            self.prompt_cache.store(msg.snapshot_key, s.offset, s.cache)
        if out.hidden is not None:
            nxt = pb.Activation(session=msg.session, seq=msg.seq, offset=msg.offset,
                                length=msg.length, sample=msg.sample, verify=msg.verify,
                                keep=keep, snapshot_key=msg.snapshot_key,
                                score_targets=msg.score_targets, score_top=msg.score_top,
                                capture_layers=msg.capture_layers)
            to_tensor(out.hidden, out=nxt.tensor)
            if out.captured is not None:
                to_tensor(out.captured, out=nxt.captured)
            if msg.seq == 0:
                nxt.open.CopyFrom(msg.open)
            return nxt
        if out.logits is not None:  # a verify chunk's answer: every position's logits
            ev = self._event(pb.Event.TOKEN, msg.session, msg.seq,
                             peak_memory=mx.get_peak_memory())
            to_tensor(out.logits, out=ev.logits)
            if out.captured is not None:
                to_tensor(out.captured, out=ev.hidden)
            return ev
        if out.scores is not None:  # a scored chunk's answer: per position, not [T, vocab]
            ev = self._event(pb.Event.TOKEN, msg.session, msg.seq,
                             peak_memory=mx.get_peak_memory())
            to_tensor(mx.array([[o.logprob] + [lp for _, lp in o.top] for o in out.scores],
                               mx.float32), out=ev.scores)
            if msg.score_top:
                to_tensor(mx.array([[i for i, _ in o.top] for o in out.scores], mx.int32),
                          out=ev.score_ids)
            return ev
        if out.token is not None:
            ev = self._event(pb.Event.TOKEN, msg.session, msg.seq, token=out.token,
                             peak_memory=mx.get_peak_memory())
            if out.logprobs is not None:
                to_tensor(out.logprobs, out=ev.logprobs)
            if out.captured is not None:
                to_tensor(out.captured, out=ev.hidden)
            return ev
        if out.captured is not None:  # a capturing prefill chunk: answered with the rows
            ev = self._event(pb.Event.TOKEN, msg.session, msg.seq,
                             peak_memory=mx.get_peak_memory())
            to_tensor(out.captured, out=ev.hidden)
            return ev
        return None

    @staticmethod
    def _captured(msg, runner):
        """(capture_layers, prior rows or None) of a capturing chunk, checked: the rows
        the stages before this one captured must be [n_before, length, hidden] in the
        wire dtype (`node.capture`), absent when n_before is 0. Refused otherwise, naming
        the previous stage."""
        who = f"session {msg.session}"
        plan = runner.capture_plan(msg.capture_layers, who)
        want = plan.prior_shape(msg.length, runner.args.hidden_size)
        prev = f"the captured hidden states from stage {runner.spec.index - 1}"
        if want is None:
            if msg.HasField("captured"):
                raise Refused(f"{who}: {prev} arrived, but no capture layer lies before "
                              f"stage {runner.spec.index}")
            return list(plan.ids), None
        if not msg.HasField("captured"):
            raise Refused(f"{who}: {prev} are missing ({plan.before} layers expected)")
        try:
            prior = from_tensor(msg.captured, want, runner.spec.wire_dtype, f"{who}: {prev}")
        except WireError as e:
            raise Refused(str(e)) from None
        return list(plan.ids), prior

    def _process_rows_check(self, live: Live, msg) -> list:
        if not live.batch:
            raise Refused(f"rows on session {live.id}'s stream: batched steps go on a batch stream")
        if not msg.rows:
            raise Refused(f"a message on batch stream {live.id} without rows")
        if msg.session != live.id or msg.seq != live.session.next_seq:
            raise Refused(f"batch stream {live.id}: message {msg.session!r} seq {msg.seq}, "
                          f"expected seq {live.session.next_seq}")
        if msg.verify or msg.HasField("keep") or msg.snapshot_key or not msg.sample:
            raise Refused("a batched step is a plain sampled decode step")
        lives = []
        for r in msg.rows:
            l = self.sessions.get(r.session)
            if l is None or l.freed or l.batch or l.session.head != live.session.head:
                raise Refused(f"batched step: no session {r.session!r} of head "
                              f"{live.session.head} here")
            lives.append(l)
        return lives

    @staticmethod
    def _media(msg, runner, x):
        """(pad id, rows mx.array [P, hidden]) of a chunk with image rows, checked: stage 0
        only, P = the chunk's pad tokens, float32 [P, hidden_size]. Refused otherwise."""
        if not runner.is_first:
            raise Refused(f"session {msg.session}: image rows (media) go to stage 0 only, "
                          f"this is stage {runner.spec.index}")
        pad = msg.media_pad
        if not 0 <= pad < runner.args.vocab_size:
            raise Refused(f"session {msg.session}: media_pad {pad} is not a token id in "
                          f"[0, {runner.args.vocab_size})")
        n_pad = int((x == pad).sum().item())
        if n_pad == 0:
            raise Refused(f"session {msg.session}: image rows for a chunk without "
                          f"<|media_pad|> (id {pad}) tokens")
        try:
            rows = from_tensor(msg.media, (n_pad, runner.args.hidden_size), "float32", "media")
        except WireError as e:
            raise Refused(str(e)) from None
        return pad, rows

    def _process_rows(self, live: Live, msg, runner: StageRunner):
        """A batched decode step (on the MLX thread): every row's session advances one
        position in one forward pass (`runner.run_rows`). Returns the Activation for the
        next stage, or (last stage) one TOKEN event per row."""
        lives = self._process_rows_check(live, msg)
        shape, dtype = runner.rows_input_spec(len(lives))
        try:
            x = from_tensor(msg.tensor, shape, dtype, "activation" if not runner.is_first else "tokens")
        except WireError as e:
            raise Refused(str(e)) from None
        outs = runner.run_rows([l.session for l in lives], [r.seq for r in msg.rows],
                               [r.offset for r in msg.rows], x)
        live.session.next_seq += 1
        now = time.monotonic()
        for l in lives:
            l.last_active = now
        if outs[0].hidden is not None:
            nxt = pb.Activation(session=msg.session, seq=msg.seq, length=1, sample=True)
            nxt.rows.extend(msg.rows)
            to_tensor(outs[0].hidden, out=nxt.tensor)
            if msg.seq == 0:
                nxt.open.CopyFrom(msg.open)
            return nxt
        peak = mx.get_peak_memory()
        events = []
        for r, o in zip(msg.rows, outs):
            ev = self._event(pb.Event.TOKEN, r.session, r.seq, token=o.token, peak_memory=peak)
            if o.logprobs is not None:
                to_tensor(o.logprobs, out=ev.logprobs)
            events.append(ev)
        return events
