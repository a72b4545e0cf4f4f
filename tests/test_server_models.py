"""`kimi-mlx server` holding several checkpoints, one loaded at a time (`server.models`):
idle unload frees MLX memory, a reload or a swap by request answers as a fresh
single-model server does, Ollama's keep_alive, the allow list, the waiting bound, and
the prompt cache's disk tier kept apart per checkpoint. Driven by the real `openai`,
`ollama` and `anthropic` clients.

The independent references: a fresh single-model server on the same checkpoint (greedy
replies must be equal, text and token counts), MLX's own memory counter
(`mx.get_active_memory`) read in this process before the load, and the wall clock."""

import threading
import time
import urllib.request
from pathlib import Path

import anthropic
import mlx.core as mx
import ollama
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.testing.model_servers import model_server
from kimi_mlx.testing.servers import served

MICRO = str(default_model())
VISION = str(Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-vision")
DRAFT = str(Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-draft")
BOTH = {"micro": MICRO, "micro-vision": VISION}
MSGS = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "class Queue: a first-in first-out queue of items"}]
OPTS = {"temperature": 0, "num_predict": 12}


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(url: str, model: str) -> tuple:
    """A greedy chat reply through the openai client: (content, reasoning, usage)."""
    r = _openai(url).chat.completions.create(model=model, messages=MSGS, max_tokens=12,
                                             temperature=0)
    m = r.choices[0].message
    return (m.content, (m.model_extra or {}).get("reasoning_content"),
            r.usage.prompt_tokens, r.usage.completion_tokens)


def _ollama_chat(url: str, model: str, **kw) -> tuple:
    r = ollama.Client(host=url, timeout=120).chat(model=model, messages=MSGS, options=OPTS, **kw)
    return r.message.content, r.message.thinking, r.prompt_eval_count, r.eval_count


def _wait_unloaded(url: str, timeout: float = 30.0) -> float:
    """Seconds until /api/ps (the ollama client) lists no model; fails past `timeout`."""
    c, t0 = ollama.Client(host=url, timeout=30), time.monotonic()
    while c.ps().models:
        assert time.monotonic() - t0 < timeout, f"still loaded after {timeout}s: {c.ps()}"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def fresh():
    """Greedy replies of fresh single-model servers (no holder), the reference:
    {(name, route): reply} for micro and micro-vision, at max_concurrency 1 and 2."""
    out = {}
    for name, path in BOTH.items():
        for conc in (1, 2):
            with served(path, None, name, 1 << 20, max_concurrency=conc,
                        prompt_cache_bytes=0) as (srv, _svc):
                out[name, "openai", conc] = _chat(srv.url, name)
                out[name, "ollama", conc] = _ollama_chat(srv.url, name)
    return out


def test_idle_unload_frees_memory_and_reload_answers_as_fresh(fresh):
    mx.clear_cache()
    before = mx.get_active_memory()
    with model_server({"micro": MICRO}, idle_unload=0.5) as (srv, svc):
        loaded = mx.get_active_memory()
        assert loaded - before > 1 << 20, (before, loaded)  # micro's weights: ~5.5 MiB
        assert _chat(srv.url, "micro") == fresh["micro", "openai", 1]
        _wait_unloaded(srv.url)
        after = mx.get_active_memory()
        # the weights and caches are gone: back to within 2% of the load's size
        assert after - before < 0.02 * (loaded - before), (before, loaded, after)
        listed = {m.id: m.model_extra for m in _openai(srv.url).models.list().data}
        assert listed["micro"]["status"] == {"value": "unloaded"}
        health = urllib.request.urlopen(srv.url + "/health", timeout=30)
        assert health.status == 200  # unloaded is serving: the next request loads it
        t0 = time.monotonic()
        assert _chat(srv.url, "micro") == fresh["micro", "openai", 1]  # reloaded
        reload_s = time.monotonic() - t0
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
        assert 'kimi_mlx_model_load_seconds_count{reason="reload"} 1.0' in text, text
        assert 'kimi_mlx_model_unloads_total{reason="idle"}' in text
        last = float(next(l for l in text.splitlines()
                          if l.startswith("kimi_mlx_model_last_load_seconds ")).split()[1])
        assert 0 < last < reload_s  # the load is part of the request's wall time


def test_requests_during_reload_wait_and_succeed(fresh):
    def slow(name):
        time.sleep(1.0)

    with model_server({"micro": MICRO}, idle_unload=0.3, before_load=slow) as (srv, svc):
        _wait_unloaded(srv.url)
        out, errors = [], []

        def one():
            try:
                out.append(_chat(srv.url, "micro"))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and out == [fresh["micro", "openai", 1]] * 3


def test_wait_bound_is_a_named_503_with_retry_after():
    gate = threading.Event()

    def blocked(name):
        if name == "micro-vision":
            gate.wait(60)

    with model_server(BOTH, wait_s=1.0, before_load=blocked) as (srv, svc):
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            _chat(srv.url, "micro-vision")
        assert e.value.status_code == 503 and "micro-vision" in str(e.value.message)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert 1.0 <= time.monotonic() - t0 < 30
        gate.set()
        assert _chat(srv.url, "micro-vision")[3] > 0  # the load went on: served now


def test_a_failed_load_fails_its_requests_only(fresh):
    broken = {"on": True}

    def fail(name):
        if name == "micro-vision" and broken["on"]:
            raise OSError("disk unplugged")

    with model_server(BOTH, before_load=fail) as (srv, svc):
        with pytest.raises(openai.InternalServerError) as e:
            _chat(srv.url, "micro-vision")
        assert "micro-vision" in e.value.message and "disk unplugged" in e.value.message
        assert _chat(srv.url, "micro") == fresh["micro", "openai", 1]  # loaded again
        broken["on"] = False
        assert _chat(srv.url, "micro-vision") == fresh["micro-vision", "openai", 1]


def test_swap_by_request_answers_as_single_model_servers(fresh):
    import gc

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    with model_server(BOTH, max_concurrency=2) as (srv, svc):
        c = ollama.Client(host=srv.url, timeout=120)
        assert [m.model for m in c.list().models] == ["micro", "micro-vision"]
        assert "vision" in c.show("micro-vision").capabilities  # read from its folder
        assert "vision" not in c.show("micro").capabilities
        times = []
        for name in ("micro", "micro-vision", "micro", "micro-vision"):
            t0 = time.monotonic()
            assert _ollama_chat(srv.url, name) == fresh[name, "ollama", 2], name
            times.append(time.monotonic() - t0)
            assert _chat(srv.url, name) == fresh[name, "openai", 2], name
            assert [m.model for m in c.ps().models] == [name]
            listed = {m.id: m.model_extra["status"]["value"]
                      for m in _openai(srv.url).models.list().data}
            assert listed == {n: "loaded" if n == name else "unloaded" for n in BOTH}
            # one loaded at a time: what MLX holds beyond the start is one model's
            held = mx.get_active_memory() - base
            print(name, held, svc.models.current.weights_bytes)
            assert held < 1.5 * svc.models.current.weights_bytes, (name, held)


def test_keep_alive(fresh):
    with model_server({"micro": MICRO}) as (srv, svc):
        c = ollama.Client(host=srv.url, timeout=120)
        never = c.ps().models[0].expires_at
        assert never.year > 2300  # no --idle-unload: never
        r = c.generate(model="micro", prompt="class Queue:", raw=True, options=OPTS,
                       keep_alive="10m")
        exp = c.ps().models[0].expires_at.timestamp()
        assert abs(exp - (time.time() + 600)) < 30, exp
        assert r.done
        c.generate(model="micro", prompt="class Queue:", raw=True, options=OPTS, keep_alive=-1)
        assert c.ps().models[0].expires_at.year > 2300
        # 0: the reply comes whole, then the model is unloaded
        assert _ollama_chat(srv.url, "micro", keep_alive=0) == fresh["micro", "ollama", 1]
        assert _wait_unloaded(srv.url, 10) < 10
        r = c.generate(model="micro", prompt="class Queue:", raw=True, options=OPTS)
        assert r.load_duration > 1e6 and r.load_duration < r.total_duration  # it loaded (0 without a load)
        # the next request loads it again; `ollama stop` (empty, keep_alive 0) unloads
        assert _ollama_chat(srv.url, "micro:latest", keep_alive="1h") == fresh["micro", "ollama", 1]
        assert c.ps().models
        r = c.generate(model="micro", keep_alive=0)
        assert r.done_reason == "unload"
        _wait_unloaded(srv.url, 10)
        with pytest.raises(ollama.ResponseError) as e:
            c.generate(model="micro", prompt="x", keep_alive="300")  # no unit: Go refuses it
        assert e.value.status_code == 400 and "keep_alive" in e.value.error


def test_allow_list_refuses_in_each_dialect():
    with model_server(BOTH, allowed=["micro"]) as (srv, svc):
        assert [m.id for m in _openai(srv.url).models.list().data] == ["micro"]
        with pytest.raises(openai.NotFoundError) as e:
            _chat(srv.url, "micro-vision")
        assert "micro-vision" in e.value.message and e.value.body["code"] == "not_found_error"
        with pytest.raises(ollama.ResponseError) as e:
            _ollama_chat(srv.url, "micro-vision")
        assert e.value.status_code == 404 and "micro-vision" in e.value.error
        a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as e:
            a.messages.create(model="micro-vision", max_tokens=4,
                              messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "not_found_error"
        assert "micro-vision" in e.value.body["error"]["message"]
        assert [m.model for m in ollama.Client(host=srv.url).ps().models] == ["micro"]


def test_disk_prompt_cache_kept_apart_per_checkpoint(tmp_path, fresh):
    def cached(url, name):
        r = _openai(url).chat.completions.create(model=name, messages=MSGS, max_tokens=12,
                                                 temperature=0)
        m = r.choices[0].message
        reply = (m.content, (m.model_extra or {}).get("reasoning_content"),
                 r.usage.prompt_tokens, r.usage.completion_tokens)
        return reply, r.usage.prompt_tokens_details.cached_tokens

    with model_server(BOTH, prompt_cache_bytes=16 << 20,
                      prompt_cache_dir=str(tmp_path)) as (srv, svc):
        a1, hit = cached(srv.url, "micro")
        assert hit == 0 and a1 == fresh["micro", "openai", 1]
        # B gets the same tokens: A's snapshots on disk must not be read
        b1, hit = cached(srv.url, "micro-vision")
        assert hit == 0 and b1 == fresh["micro-vision", "openai", 1]
        # back to A: its memory cache went with the unload; its disk snapshots come back
        a2, hit = cached(srv.url, "micro")
        assert hit > 0 and a2 == a1
        b2, hit = cached(srv.url, "micro-vision")
        assert hit > 0 and b2 == b1
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 2, folders  # one per checkpoint identity


def test_draft_model_loads_and_unloads_with_its_target():
    from kimi_mlx.speculative.settings import DraftSettings

    drafts = DraftSettings(model=DRAFT, num_draft_tokens=3)
    with served(MICRO, None, "micro", 1 << 20, max_concurrency=1, prompt_cache_bytes=0,
                drafts=drafts) as (srv, _svc):
        ref = _chat(srv.url, "micro")
    mx.clear_cache()
    before = mx.get_active_memory()
    with model_server({"micro": MICRO}, idle_unload=0.3, drafts=drafts) as (srv, svc):
        loaded = mx.get_active_memory()
        assert svc.engine.speculation is not None
        assert _chat(srv.url, "micro") == ref
        _wait_unloaded(srv.url)
        assert mx.get_active_memory() - before < 0.02 * (loaded - before)
        assert _chat(srv.url, "micro") == ref
        assert svc.engine.speculation is not None


def test_tensor_bytes_are_what_mlx_holds_for_the_weights():
    """What the cluster server reports as its model's size (the shard headers' tensor
    bytes) is what MLX holds once the weights are loaded in one process."""
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.server.catalog import checkpoint_tensor_bytes

    import gc

    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model = load_for_generation(MICRO)[0]
    held = mx.get_active_memory() - before
    assert abs(checkpoint_tensor_bytes(MICRO) - held) <= 0.01 * held, (held, checkpoint_tensor_bytes(MICRO))
    del model


def test_cluster_server_reports_its_model_honestly(tmp_path):
    """`kimi-mlx cluster server` has no holder: /api/ps and /v1/models list its one model
    as loaded, never unloading, with the checkpoint's tensor bytes (held on its stages)."""
    import httpx

    from kimi_mlx.server.catalog import checkpoint_tensor_bytes
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.ports import free_ports

    cluster = LocalCluster(tmp_path, n=2, prefix="mdl")
    server = None
    try:
        server = ServerProc(cluster, free_ports(1)[0])
        want = checkpoint_tensor_bytes(cluster.ckpt)
        assert want > 0
        ps = ollama.Client(host=server.url, timeout=60).ps().models
        assert [(m.model, m.size, m.size_vram) for m in ps] == [("micro", want, 0)]
        assert ps[0].expires_at.year > 2300
        data = httpx.get(server.url + "/v1/models", timeout=60).json()["data"]
        assert [(d["id"], d["status"], d["weights_bytes"], d["expires_at"]) for d in data] == \
            [("micro", {"value": "loaded"}, want, None)]
    finally:
        if server is not None:
            server.stop()
        cluster.stop()


def test_idle_unload_gives_the_wired_limit_back(tmp_path):
    """`kimi-mlx server --idle-unload` on a faked Mac (`testing.fake_metal`): the wired
    limit set before the load goes back to the process's own at the unload, is set again
    for the reload, and restored at exit. Each figure is the fake device's record."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from kimi_mlx.testing import fake_metal
    from kimi_mlx.testing.ports import free_ports

    info = json.loads((Path(__file__).parent / "data" / "macos" / "device_info_64gb.json").read_text())
    rec, port = tmp_path / "calls.jsonl", free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kimi_mlx", "server", "--port", str(port),
                                 "--model", f"micro={MICRO}", "--idle-unload", "1",
                                 "--max-kv-size", "1024", "--quiet"],
                                env=fake_metal.env(info, str(rec)), stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def limits(n, timeout=120):
            t0 = time.monotonic()
            while len(fake_metal.records(rec)) < n:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                assert time.monotonic() - t0 < timeout, fake_metal.records(rec)
                time.sleep(0.1)
            return [c["limit"] for c in fake_metal.records(rec)]

        first = limits(2)  # wired for the load, then given back by the idle unload
        assert first[0] > 0 and first[1] == 0, first
        r = httpx.post(url + "/v1/completions", json={"model": "micro", "prompt": "class Queue:",
                                                     "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        assert limits(3)[2] == first[0]  # the reload wires the same plan again
        assert limits(4)[3] == 0  # and the next idle unload gives it back
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
