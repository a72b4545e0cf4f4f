"""Prometheus metrics of one server (prometheus_client, a registry per app so that two
servers in one process, as in tests, do not share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for app.py)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: clutter for a single-process server


class Metrics:
    """Requests by endpoint and status; generations by how they ended; prompt / generated / cached tokens; the last
    request's prompt and generation tokens/s; prompt-cache hits; queue length."""

    def __init__(self, queue_length=lambda: 0, active=lambda: 0):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kimi_mlx_requests", "HTTP requests", ["endpoint", "status"],
                                registry=r)
        self.finished_requests = Counter("kimi_mlx_finished_requests", "generations ended, "
                                         "by reason (stop, length, cancelled: the client "
                                         "left or stopped it)", ["reason"], registry=r)
        self.prompt_tokens = Counter("kimi_mlx_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("kimi_mlx_generation_tokens", "generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("kimi_mlx_cached_prompt_tokens",
                                     "prompt tokens served from the prompt cache", registry=r)
        self.cache_hits = Counter("kimi_mlx_prompt_cache_hits", "requests that reused a "
                                  "prompt-cache snapshot", registry=r)
        self.prompt_tps = Gauge("kimi_mlx_prompt_tokens_per_second",
                                "prompt tokens/s of the last finished request", registry=r)
        self.generation_tps = Gauge("kimi_mlx_generation_tokens_per_second",
                                    "generation tokens/s of the last finished request",
                                    registry=r)
        q = Gauge("kimi_mlx_queue_length", "requests waiting to start", registry=r)
        q.set_function(queue_length)
        a = Gauge("kimi_mlx_active_requests", "requests being generated", registry=r)
        a.set_function(active)
        self.stream_errors = Counter("kimi_mlx_stream_errors", "streamed replies ended by "
                                     "an error event after their 200 (generation failed, a "
                                     "stage was lost, an internal error)", ["endpoint"],
                                     registry=r)
        self.verify_steps = Counter("kimi_mlx_speculative_verify_steps", "speculative "
                                    "decoding: target passes that verified drafts", registry=r)
        self.drafted = Counter("kimi_mlx_speculative_draft_tokens", "speculative decoding: "
                               "tokens the draft proposed", registry=r)
        self.accepted = Counter("kimi_mlx_speculative_accepted_tokens", "speculative "
                                "decoding: draft tokens the target accepted", registry=r)
        self._model_collectors: list = []  # those of the loaded checkpoint (`forget_model`)
        self._disk_off = None

    def forget_model(self) -> None:
        """The checkpoint was unloaded (`server.models`): drop the collectors that read its
        prompt-cache disk tier and vision tower, so a reload registers fresh ones."""
        for c in self._model_collectors:
            self.registry.unregister(c)
        self._model_collectors = []

    def watch_disk_cache(self, disk) -> None:
        """Export a prompt-cache disk tier's counters (`server.disk_cache.DiskSnapshotStore
        .stats`): kimi_mlx_prompt_cache_disk_{hits,misses,read_bytes,written_bytes,
        read_seconds,write_seconds,evictions,write_errors,write_dropped}_total,
        _ignored_total{reason=foreign|corrupt}, the gauge kimi_mlx_prompt_cache_disk_bytes
        (files held now) and kimi_mlx_prompt_cache_disk_enabled 1."""
        c = _DiskCollector(disk)
        self.registry.register(c)
        self._model_collectors.append(c)

    def disk_cache_off(self) -> None:
        """A --prompt-cache-dir that could not be used (a full disk, a read-only folder):
        the gauge kimi_mlx_prompt_cache_disk_enabled 0, the server running with the memory
        cache only."""
        if self._disk_off is None:  # once: a reload may find the folder unusable again
            self._disk_off = Gauge("kimi_mlx_prompt_cache_disk_enabled", "1: the prompt "
                                   "cache's disk tier is in use; 0: --prompt-cache-dir could "
                                   "not be used (memory cache only)", registry=self.registry)
        self._disk_off.set(0)

    def watch_vision(self, vision) -> None:
        """Export the vision tower's counters (`generation.images.Vision.stats`):
        kimi_mlx_vision_tower_runs_total (images the tower ran on),
        kimi_mlx_vision_tower_cache_hits_total (images whose rows came from the tower
        cache) and the gauge kimi_mlx_vision_tower_cache_bytes (rows kept now)."""
        c = _VisionCollector(vision)
        self.registry.register(c)
        self._model_collectors.append(c)

    def speculated(self, steps: int, drafted: int, accepted: int) -> None:
        """Account one request's speculative decoding (verify steps, drafted and accepted
        draft tokens); accepted / steps is the mean accepted per target pass."""
        self.verify_steps.inc(steps)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def finished(self, done) -> None:
        """Account an engine `Finished` event."""
        self.finished_requests.labels(done.reason).inc()
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.generation_tokens)
        if done.cached_tokens:
            self.cached_tokens.inc(done.cached_tokens)
            self.cache_hits.inc()
        if done.prompt_tps:
            self.prompt_tps.set(done.prompt_tps)
        if done.generation_tps:
            self.generation_tps.set(done.generation_tps)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DiskCollector:
    """/metrics of a prompt-cache disk tier, read from its `stats()` at each scrape."""

    COUNTERS = (("hits", "snapshots read back from disk"),
                ("misses", "disk lookups that found no usable snapshot"),
                ("read_bytes", "bytes of snapshot files read"),
                ("written_bytes", "bytes of snapshot files written"),
                ("read_seconds", "seconds spent reading and checking snapshot files"),
                ("write_seconds", "seconds the background writer spent writing snapshots"),
                ("evictions", "snapshot files dropped for room"),
                ("write_errors", "snapshot or index writes that failed (a full or failing "
                 "disk): the snapshot stays in memory only"),
                ("write_dropped", "snapshots not written because too many bytes were "
                 "already waiting for the disk"))

    def __init__(self, disk):
        self.disk = disk

    def describe(self):
        return []

    def collect(self):
        st = self.disk.stats()
        for name, doc in self.COUNTERS:
            yield CounterMetricFamily(f"kimi_mlx_prompt_cache_disk_{name}", doc, value=st[name])
        ign = CounterMetricFamily("kimi_mlx_prompt_cache_disk_ignored", "snapshot files "
                                  "not used: of another checkpoint, shard or version "
                                  "(foreign), or failing their checksum (corrupt)",
                                  labels=["reason"])
        ign.add_metric(["foreign"], st["ignored_foreign"])
        ign.add_metric(["corrupt"], st["ignored_corrupt"])
        yield ign
        yield GaugeMetricFamily("kimi_mlx_prompt_cache_disk_bytes", "bytes of snapshot "
                                "files in --prompt-cache-dir", value=st["bytes"])
        yield GaugeMetricFamily("kimi_mlx_prompt_cache_disk_enabled", "1: the prompt "
                                "cache's disk tier is in use; 0: --prompt-cache-dir could "
                                "not be used (memory cache only)", value=1)


class _VisionCollector:
    """/metrics of the vision tower and its cache, read from `Vision.stats()` at each
    scrape."""

    def __init__(self, vision):
        self.vision = vision

    def describe(self):
        return []

    def collect(self):
        st = self.vision.stats()
        yield CounterMetricFamily("kimi_mlx_vision_tower_runs", "images the vision tower "
                                  "ran on (one run per image not in the tower cache)",
                                  value=st["tower_runs"])
        yield CounterMetricFamily("kimi_mlx_vision_tower_cache_hits", "images whose tower "
                                  "rows came from the tower cache", value=st["cache_hits"])
        yield GaugeMetricFamily("kimi_mlx_vision_tower_cache_bytes", "bytes of tower rows "
                                "kept in the tower cache", value=st["cache_bytes"])
