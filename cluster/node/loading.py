"""The stage service's `Load` RPC: a layer range of a checkpoint this node found itself
(by fingerprint, in its own models folder), loaded on the stage's MLX thread while the
head sees progress; one load at a time (see `node.service`'s module doc)."""

from __future__ import annotations

import gc
import logging
import queue
import re
import time
from pathlib import Path

import grpc
import mlx.core as mx

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.fingerprint import fingerprint, named, scan
from kimi_mlx.cluster.net.wire import ACTIVATION_DTYPES
from kimi_mlx.cluster.node.compute import ComputeStopped
from kimi_mlx.cluster.node.runner import Refused, StageSpec, load_stage
from kimi_mlx.model.cache import KV_DEFAULT_GROUP, check_kv_quant

log = logging.getLogger(__name__)

ADDRESS_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


def rchar() -> int:
    """Bytes this process has read through read()/pread() so far (-1 when unknown)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _wire_stage(path: Path, spec: StageSpec, request, who: str) -> None:
    """MLX's wired limit for this stage's layers and their caches before loading them
    (`placement.wired`; a no-op without Metal), planned as the head planned them: the
    LoadRequest's `planned_tokens` per sequence x `planned_sequences` (the head's
    --max-kv-size / context and --max-concurrency); a head that sends neither (0) gets the
    trained context, or its longer `max_positions`, x one sequence; the DSA caches in
    the LoadRequest's format (`kv_bits` / `kv_group_size`, in `spec`). Raises
    `WiredLimitError` (one line with the sysctl to run) when they exceed the Mac's GPU
    working set."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.placement.wired import stage_plan, wire

    def plan():
        tokens = int(request.planned_tokens)
        if tokens <= 0:
            trained = ModelArgs.from_config(read_config(path)).max_position_embeddings
            tokens = max(trained, int(request.max_positions or 0))
        return stage_plan(path, spec.start, spec.end, f"{who} layers [{spec.start}, {spec.end})",
                          context=tokens, sequences=max(1, int(request.planned_sequences)),
                          kv_bits=spec.kv_bits, kv_group_size=spec.kv_group_size)

    wire(plan)


class LoadRPC:
    """`Load` and its checks, part of `node.service.StageService` (uses its catalog,
    models folder, locks, MLX thread, prompt cache and state)."""

    def _resolve(self, fp: str) -> Path:
        path = self.catalog.get(fp)
        if path is None:  # checkpoints copied in since start
            self.catalog = scan(self.models_dir)
            path = self.catalog.get(fp)
        if path is None:
            have = ", ".join(named(f, self.catalog) for f in sorted(self.catalog))
            raise Refused(f"{self.who}: no checkpoint with fingerprint {fp} in "
                          f"{self.models_dir or '(no --models folder)'} (it has: {have or 'none'}); "
                          "copy it there: it is picked up without a restart")
        return path

    def _check_load(self, r) -> StageSpec:
        for name in (r.compute_dtype, r.wire_dtype or r.compute_dtype):
            if name not in ACTIVATION_DTYPES:
                raise Refused(f"dtype {name!r} is not one of {', '.join(ACTIVATION_DTYPES)}")
        if not 0 <= r.stage < r.num_stages:
            raise Refused(f"stage {r.stage} of {r.num_stages} is not a pipeline position")
        last = r.stage == r.num_stages - 1
        if last != (r.next_address == ""):
            raise Refused("the last stage has no next address, every other stage needs one")
        if r.next_address and not ADDRESS_RE.match(r.next_address):
            raise Refused(f"next address {r.next_address[:80]!r} is not host:port")
        kv = (r.kv_bits or None, r.kv_group_size or KV_DEFAULT_GROUP)
        try:
            check_kv_quant(*kv)
        except ValueError as e:
            raise Refused(str(e)) from None
        return StageSpec(r.fingerprint, r.start, r.end, r.stage, r.num_stages,
                         r.compute_dtype, r.wire_dtype or r.compute_dtype, *kv)

    def Load(self, request, context):
        """Stream LoadProgress while loading the requested range of a local checkpoint
        (found by fingerprint in the models folder); INVALID_ARGUMENT for a bad request,
        FAILED_PRECONDITION when busy with another head's sessions (unless `force`).

        One load runs at a time: a Load that arrives while another is in progress says
        so (phase "waiting") and waits for it, then answers "already loaded" when that
        load was of the same range (several heads starting at once), or loads its own."""
        try:
            spec = self._check_load(request)
            path = self._resolve(request.fingerprint)
            from kimi_mlx.model.config import ModelArgs, read_config

            n = ModelArgs.from_config(read_config(path)).num_hidden_layers
            if not 0 <= spec.start < spec.end <= n:
                raise Refused(f"layers [{spec.start}, {spec.end}) are not inside [0, {n})")
        except Refused as e:
            log.warning("refused Load from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        waiting = False
        while not self.load_lock.acquire(timeout=0.2):
            if self._stop.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.who}: stopping")
            if not context.is_active():
                return
            if not waiting:
                waiting = True
                yield pb.LoadProgress(phase="waiting",
                                      message=f"{self.who}: waiting for a load in progress")
        try:
            heads = {l.session.head for l in self.sessions.values()}
            if self.sessions and (self.spec != spec or self.next_address != request.next_address):
                if not request.force:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{self.who}: busy with {len(self.sessions)} session(s) of "
                                  f"head(s) {', '.join(sorted(heads))}")
                for live in list(self.sessions.values()):
                    self._free(live, "replaced by a new load")
            if self.runner is not None and self.spec == spec:
                try:  # this head's plan may differ from the one loaded for (context, sequences)
                    _wire_stage(path, spec, request, self.who)
                except ValueError as e:  # WiredLimitError: the one line with the sysctl
                    yield pb.LoadProgress(phase="error", message=str(e))
                    return
                self.next_address = request.next_address
                self._set_positions(request.max_positions)
                tensor_bytes, disk, secs = self.load_stats
                yield pb.LoadProgress(bytes_done=1, bytes_total=1, phase="ready",
                                      message="already loaded", tensor_bytes=tensor_bytes,
                                      disk_read_bytes=disk, seconds=secs)
                return
            yield from self._load(spec, path, request.next_address, request)
        finally:
            self.load_lock.release()

    def _attach_disk_cache(self, spec: StageSpec, path: Path) -> None:
        """With `cluster serve --prompt-cache-dir`: the prompt cache's disk tier for the
        layers just loaded (`stage_cache.stage_fingerprint` names its folder); a folder
        that cannot be used is logged and the stage runs with memory only."""
        self.prompt_cache.attach_disk(None)
        if self.cache_dir is None:
            return
        from kimi_mlx.cluster.node.stage_cache import stage_fingerprint
        from kimi_mlx.server.disk_cache import DiskSnapshotStore, checkpoint_identity

        try:
            fp = stage_fingerprint(spec, checkpoint_identity(path))
            disk = DiskSnapshotStore(self.cache_dir, self.cache_disk_bytes, fp)
        except (OSError, RuntimeError) as e:
            log.warning("%s: prompt cache on disk off: %s", self.who, e)
            return
        self.prompt_cache.attach_disk(disk)
        log.info("%s: prompt cache on disk in %s (%d snapshots, %d bytes)", self.who,
                 disk.dir, len(disk), disk.nbytes)

    def _set_positions(self, head_context: int) -> None:
        """The loaded runner's position limit: the model's max_position_embeddings, or a
        head's longer context (`kimi-mlx cluster server --max-kv-size` past it)."""
        if self.runner is not None:
            self.runner.max_positions = max(self.runner.args.max_position_embeddings,
                                            int(head_context))

    def _load(self, spec: StageSpec, path: Path, next_address: str, request):
        """Load `spec` of `path` (its LoadRequest `request`: the head's context and plan)
        on the MLX thread, yielding LoadProgress."""
        head_context = int(request.max_positions or 0)
        self.state, self.runner, self.spec = "loading", None, None
        self.prompt_cache.clear()  # snapshots of the layers held before
        self.prompt_cache.attach_disk(None)  # their folder too (queued writes finish)
        yield pb.LoadProgress(phase="resolving", message=str(path.name))
        if fingerprint(path) != spec.fingerprint:
            self.catalog = scan(self.models_dir)
            self.state = "idle"
            changed = f"{path}: files changed since they were advertised (fingerprint differs)"
            log.warning(changed)
            yield pb.LoadProgress(phase="error", message=changed)
            return
        events: "queue.Queue" = queue.Queue()
        t0, r0 = time.monotonic(), rchar()

        def work():  # on the MLX thread
            try:
                gc.collect()  # the previous layers' memory goes back before the new load
                mx.clear_cache()
                loader = self.stage_loader or load_stage
                bar = self.load_bar(f"loading {path.name} [{spec.start},{spec.end})") if self.load_bar else None

                def report(d, t):
                    events.put(("progress", d, t))
                    if bar:
                        bar(d, t)

                _wire_stage(path, spec, request, self.who)
                res = loader(path, spec, report)
                events.put(("done", res, rchar()))
            except Exception as e:  # CheckpointError, ConfigError, MLX errors
                events.put(("error", f"{type(e).__name__}: {e}", None))

        try:
            done = self.compute.submit(work)
        except ComputeStopped as e:
            self.state = "idle"
            yield pb.LoadProgress(phase="error", message=f"{self.who}: {e}")
            return
        while True:
            try:
                kind, a, b = events.get(timeout=0.5)
            except queue.Empty:
                if not done.cancelled():
                    continue
                kind, a, b = "error", "the stage is stopping", None  # never ran
            if kind == "progress":
                yield pb.LoadProgress(bytes_done=a, bytes_total=b, phase="reading",
                                      seconds=time.monotonic() - t0)
            elif kind == "error":
                self.state = "idle"
                log.error("%s: load failed: %s", self.who, a)
                yield pb.LoadProgress(phase="error", message=a)
                return
            else:
                runner, report, total = a
                disk = b - r0 if r0 >= 0 and b >= 0 else -1
                secs = time.monotonic() - t0
                self.runner, self.spec, self.next_address = runner, spec, next_address
                self._set_positions(head_context)  # before "ready": sessions may follow at once
                if self.cache_bytes is None:
                    self.prompt_cache.max_bytes = max(self.usable_memory - mx.get_active_memory(), 0) // 4
                self._attach_disk_cache(spec, path)
                self.load_stats = (report.bytes_loaded, disk, secs)
                self.state = "ready"
                log.info("%s: loaded %s in %.1f s (%d tensor bytes, %d bytes read from files)",
                         self.who, path, secs, report.bytes_loaded, disk)
                yield pb.LoadProgress(bytes_done=total, bytes_total=total, phase="ready",
                                      tensor_bytes=report.bytes_loaded, disk_read_bytes=disk,
                                      seconds=secs)
                return
