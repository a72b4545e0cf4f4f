"""The prompt cache's disk tier (`server.disk_cache`): snapshots of the shipped micro
model's caches written to a folder and read back by another store (a restart), checked
against a cold prefill of the same tokens; every part of the keys (token ids, image
digests, the fingerprint's parts) guarded; crashes, corruption, foreign folders and the
byte bound."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from kimi_mlx.model.cache import restore, snapshot, snapshot_nbytes
from kimi_mlx.server.disk_cache import DiskSnapshotStore, checkpoint_identity, prefix_keys, token_key
from kimi_mlx.server.prompt_cache import KeyedSnapshotCache, PromptCache

FP = {"checkpoint": "abc", "layers": [0, 4], "dtypes": ["bfloat16"], "role": "test"}


pytestmark = pytest.mark.usefixtures("close_disk_stores")  # tests/fixtures/stores.py


@pytest.fixture(scope="module")
def model():
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.generation.request import default_model

    return load_for_generation(str(default_model()))[0]


def ids_of(seed, n=120):
    return [3 + (seed * 7919 + 31 * i) % 150 for i in range(n)]


def prefilled(model, ids):
    cache = model.make_cache()
    mx.eval(model(mx.array([ids]), cache=cache))
    return cache


def snap_of(model, ids):
    s = snapshot(prefilled(model, ids))
    return s, snapshot_nbytes(s)


def last_logits(model, cache, token):
    out = model(mx.array([[token]]), cache=cache)[0, -1]
    mx.eval(out)
    return out


def store(tmp_path, fp=FP, max_bytes=1 << 30, **kw):
    return DiskSnapshotStore(tmp_path / "pc", max_bytes, fp, **kw)


def test_a_restart_reads_back_what_a_cold_prefill_computes(model, tmp_path):
    ids = ids_of(1)
    s, n = snap_of(model, ids[:-1])
    d = store(tmp_path)
    assert d.put("k", len(ids) - 1, s, n) and d.flush()
    d.close()
    d = store(tmp_path)  # a new process's view: only the folder
    got = d.get("k", len(ids) - 1)
    assert got is not None and d.hits == 1
    cold = model(mx.array([ids]), cache=model.make_cache())[0, -1]  # the whole prompt, no cache
    warm = last_logits(model, restore(got), ids[-1])
    assert mx.argmax(cold).item() == mx.argmax(warm).item()
    assert mx.allclose(cold, warm, atol=1e-3, rtol=1e-3).item()
    assert d.get("k", len(ids)) is None  # another number of positions: not this snapshot
    d.close()


@pytest.mark.parametrize("part,value", [("checkpoint", "abd"), ("layers", [0, 3]),
                                        ("dtypes", ["float32"]), ("role", "other")])
def test_each_fingerprint_part_separates_the_snapshots(model, tmp_path, part, value):
    s, n = snap_of(model, ids_of(2, 40))
    d = store(tmp_path)
    d.put("k", 40, s, n)
    d.close()
    other = store(tmp_path, dict(FP, **{part: value}))
    assert not other.has("k") and other.get("k", 40) is None
    assert other.ignored_foreign == 1  # the first store's file, seen and not used
    other.close()
    assert store(tmp_path).get("k", 40) is not None  # the same fingerprint still finds it


def test_another_format_version_is_ignored(model, tmp_path, monkeypatch):
    import kimi_mlx.server.disk_cache as dc

    s, n = snap_of(model, ids_of(3, 40))
    d = store(tmp_path)
    d.put("k", 40, s, n)
    d.close()
    monkeypatch.setattr(dc, "FORMAT_VERSION", dc.FORMAT_VERSION + 1)
    d = store(tmp_path)
    assert d.get("k", 40) is None and d.ignored_foreign == 1
    d.close()


def test_a_file_copied_in_from_another_fingerprint_is_refused(model, tmp_path):
    """The safetensors metadata names its fingerprint: a file moved between folders (by
    hand, a bad sync) is not used even though the index entry and checksum match."""
    s, n = snap_of(model, ids_of(4, 40))
    a = store(tmp_path, dict(FP, layers=[0, 2]))
    a.put("k", 40, s, n)
    a.close()
    b = store(tmp_path)
    b.close()
    src, dst = a.dir, b.dir
    for f in src.glob("*.safetensors"):
        os.replace(f, dst / f.name)
    os.replace(src / "index.json", dst / "index.json")
    idx = json.loads((dst / "index.json").read_text())
    idx["fingerprint"] = b.fp_id  # a hand-edited index: only the file's own metadata tells
    (dst / "index.json").write_text(json.dumps(idx))
    b = store(tmp_path)
    assert b.has("k") and b.get("k", 40) is None and b.ignored_foreign >= 1
    b.close()


def test_a_flipped_byte_is_ignored_and_counted(model, tmp_path):
    s, n = snap_of(model, ids_of(5, 40))
    d = store(tmp_path)
    d.put("k", 40, s, n)
    d.close()
    f = next(d.dir.glob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    d = store(tmp_path)
    assert d.get("k", 40) is None and d.ignored_corrupt == 1
    assert not d.has("k") and not f.exists()  # dropped, the next store rewrites it
    d.close()


def test_a_truncated_file_is_dropped_when_the_folder_opens(model, tmp_path):
    s, n = snap_of(model, ids_of(6, 40))
    d = store(tmp_path)
    d.put("k", 40, s, n)
    d.close()
    f = next(d.dir.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:100])
    d = store(tmp_path)
    assert not d.has("k") and d.ignored_corrupt == 1
    d.close()


def test_the_byte_bound_holds_under_a_stream_of_distinct_prompts(model, tmp_path):
    s, n = snap_of(model, ids_of(7, 30))
    d = store(tmp_path, max_bytes=int(3.5 * (n + 2000)))
    for i in range(10):
        d.put(f"k{i}", 30, s, n)
        d.flush()
        on_disk = sum(f.stat().st_size for f in d.dir.glob("*.safetensors"))
        assert on_disk == d.nbytes <= d.max_bytes
    assert len(d) == 3 and d.evictions == 7
    assert [d.has(f"k{i}") for i in (6, 7, 8, 9)] == [False, True, True, True]  # LRU
    d.close()


def test_one_process_per_folder(tmp_path):
    d = store(tmp_path)
    with pytest.raises(RuntimeError, match="in use by another process"):
        store(tmp_path)
    d.close()
    store(tmp_path).close()


CRASH = textwrap.dedent("""
    import os, sys, time
    import mlx.core as mx
    import kimi_mlx.server.disk_cache as dc
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.generation.request import default_model
    from kimi_mlx.model.cache import snapshot, snapshot_nbytes

    model = load_for_generation(str(default_model()))[0]
    def snap(seed):
        c = model.make_cache()
        mx.eval(model(mx.array([[3 + (seed * 13 + i) % 150 for i in range(40)]]), cache=c))
        s = snapshot(c)
        return s, snapshot_nbytes(s)
    d = dc.DiskSnapshotStore(sys.argv[1], 1 << 30, {"x": 1})
    d.put("whole", 40, *snap(1))
    d.flush()
    where = sys.argv[2]
    def hang(*a, **k):
        print("HANG", flush=True)
        time.sleep(600)
    if where == "rename":  # the new file written in full under its temporary name
        real = os.replace
        dc.os.replace = lambda a, b: hang() if ".tmp" in str(a) and str(b).endswith(".safetensors") else real(a, b)
    else:  # the file renamed, the index not yet saved
        dc.DiskSnapshotStore._save_index = lambda self: hang()
    d.put("killed", 40, *snap(2))
    time.sleep(600)
""")


@pytest.mark.parametrize("where", ["rename", "index"])
def test_sigkill_during_a_write_leaves_no_broken_entry(tmp_path, where):
    p = subprocess.Popen([sys.executable, "-c", CRASH, str(tmp_path / "pc"), where],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "HANG"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    d = DiskSnapshotStore(tmp_path / "pc", 1 << 30, {"x": 1})
    assert not d.has("killed") and d.has("whole")
    assert d.get("whole", 40) is not None and d.ignored_corrupt == 0
    assert sorted(f.name for f in d.dir.iterdir() if not f.name.startswith(".lock")) == \
        sorted(["fingerprint.json", "index.json", d._entries["whole"]["file"]])  # no leftovers
    d.close()


# ------------------------------------------------------------------ the caches' keys

PAD = 9


def with_image(ids, digest):
    """A prompt-cache key (`server.images.cache_key`) with an image's pads at 10..13."""
    return [(PAD, digest) if 10 <= i < 14 else t for i, t in enumerate(ids)]


def test_prompt_cache_keys_hold_every_token_and_image_digest(model, tmp_path):
    """One process: a snapshot stored for (tokens, image A) is found, in memory and on
    disk after a restart, only by the same tokens with the same image: another digest,
    another token id or a shorter prefix misses."""
    ids = ids_of(8, 60)
    a, b = "aa" * 32, "bb" * 32
    disk = store(tmp_path)
    pc = PromptCache(64 << 20, disk=disk)
    # the cache's contents do not matter to the keys (text rows stand for the image's)
    pc.store(with_image(ids, a)[:50], prefilled(model, ids[:50]))
    changed = list(ids)
    changed[20] += 1
    for c in (pc, None):
        if c is None:  # a restart: memory empty, the same folder
            disk.close()
            disk = store(tmp_path)
            c = PromptCache(64 << 20, disk=disk)
        assert c.fetch(with_image(ids, b))[1] == 0  # another picture
        assert c.fetch(with_image(changed, a))[1] == 0  # another token
        assert c.fetch(with_image(ids, a))[1] == 50
    assert disk.hits == 1
    disk.close()


def test_keyed_cache_keys_and_positions_on_disk(model, tmp_path):
    """Stage / rank side: a key stored on disk is held after a restart, restores only
    at its own number of positions, and other keys are not held."""
    ids = ids_of(9, 50)
    disk = store(tmp_path)
    kc = KeyedSnapshotCache(64 << 20, disk=disk)
    assert kc.store("50-aa", 50, prefilled(model, ids))
    kc.attach_disk(None)
    kc = KeyedSnapshotCache(0, disk=store(tmp_path))  # no memory at all: disk only
    assert kc.held(["50-ab", "50-aa", "49-aa"]) == ["50-aa"]
    assert kc.restore("50-aa", 49) is None
    got = kc.restore("50-aa", 50)
    cold = model(mx.array([ids + [5]]), cache=model.make_cache())[0, -1]
    assert mx.allclose(last_logits(model, got, 5), cold, atol=1e-3, rtol=1e-3).item()
    kc.attach_disk(None)


def test_checkpoint_identity_follows_config_and_weights(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"a": 1}')
    (ck / "model.safetensors").write_bytes(b"x" * 10)
    first = checkpoint_identity(ck)
    (ck / "config.json").write_text('{"a": 2}')
    second = checkpoint_identity(ck)
    (ck / "model.safetensors").write_bytes(b"x" * 11)
    assert len({first, second, checkpoint_identity(ck)}) == 3


def test_token_key_reads_every_id_and_digest():
    ids = [1, 2, 3, 4]
    a, b = "aa" * 32, "ab" + "aa" * 31
    keys = {token_key(ids), token_key([1, 2, 3, 5]), token_key([1, 2, 3]),
            token_key([1, (PAD, a), 3, 4]), token_key([1, (PAD, b), 3, 4])}
    assert len(keys) == 5
    mixed = [1, (PAD, a), (PAD, a), 4, 5]
    for seq in (ids, mixed):  # the one-pass hashing of several prefixes agrees with one at a time
        assert prefix_keys(seq, [1, 3, 4]) == {n: token_key(seq[:n]) for n in (1, 3, 4)}


# ------------------------------------------------------------------ one-process server

LONG_SYSTEM = {"role": "system", "content": "You answer questions about Python's standard "
               "library, briefly and with one example each. " * 12}


def _chat(url, messages, n=8):
    import httpx

    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "micro", "messages": messages, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    m = body["choices"][0]["message"]
    return (m.get("content") or "", m.get("reasoning_content") or ""), body["usage"]


def _metric(url, name):
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_server_restarted_on_the_same_folder_continues_from_disk(tmp_path, micro_cold_server):
    """`kimi-mlx server --prompt-cache-dir`: a conversation of a few hundred tokens, the
    server restarted (memory empty), the same conversation plus a turn: cached_tokens > 0
    read back from disk, and the reply equals a cache-free server's."""
    from kimi_mlx.generation.request import default_model
    from kimi_mlx.testing.servers import served

    model = str(default_model())
    first = [LONG_SYSTEM, {"role": "user", "content": "What is functools.partial?"}]
    kw = dict(prompt_cache_dir=str(tmp_path / "pc"), prompt_cache_disk_bytes=1 << 30)
    with served(model, **kw) as (srv, _):
        reply, usage = _chat(srv.url, first)
        assert usage["prompt_tokens"] > 300
        assert _metric(srv.url, "kimi_mlx_prompt_cache_disk_hits_total") == 0
    second = first + [{"role": "assistant", "content": reply[0], "reasoning_content": reply[1]},
                      {"role": "user", "content": "And functools.reduce?"}]
    with served(model, **kw) as (srv, _):
        got, usage = _chat(srv.url, second)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached > 300
        assert _metric(srv.url, "kimi_mlx_prompt_cache_disk_hits_total") == 1
        assert _metric(srv.url, "kimi_mlx_prompt_cache_disk_read_bytes_total") > 0
        assert _metric(srv.url, "kimi_mlx_prompt_cache_disk_bytes") > 0
    ref, _ = micro_cold_server  # the session's cache-free server (tests/fixtures/shared.py)
    want, ref_usage = _chat(ref.url, second)
    assert got == want and ref_usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_disk_read_is_chosen_only_when_faster_than_recomputing(model, tmp_path):
    """`worth_reading`: bytes / measured read speed against tokens / prompt speed. At an
    absurd prompt speed recomputing wins (the disk is not read); at none given, it is."""
    ids = ids_of(10, 80)
    disk = store(tmp_path)
    PromptCache(64 << 20, disk=disk).store(ids[:70], prefilled(model, ids[:70]))
    disk.flush()
    disk.prompt_tps = 1e15
    assert PromptCache(64 << 20, disk=disk).fetch(ids) == (None, 0) and disk.hits == 0
    disk.prompt_tps = 10.0  # 70 tokens: 7 s to recompute, a 0.3 MB read is faster
    assert PromptCache(64 << 20, disk=disk).fetch(ids)[1] == 70 and disk.hits == 1
    disk.close()


def test_sigterm_is_a_clean_stop_that_keeps_the_snapshots(tmp_path):
    """`kimi-mlx server` stopped with SIGTERM (kill, systemd, a container's stop) runs its
    cleanup like Ctrl-C: exit status 0, the engine stopped, the queued snapshot writes on
    disk and the index saved (uvicorn raises SIGTERM again once it has shut down, which
    used to end the process before the cleanup)."""
    from kimi_mlx.generation.request import default_model
    from kimi_mlx.lifetime import child_env
    from kimi_mlx.testing.health import wait_healthy
    from kimi_mlx.testing.ports import free_ports

    port = free_ports(1)[0]
    folder = tmp_path / "pc"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi_mlx.commands.main", "server", "--model",
         str(default_model()), "--port", str(port), "--prompt-cache-dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc)
        _chat(url, [LONG_SYSTEM, {"role": "user", "content": "What is functools.partial?"}], 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    (index,) = folder.glob("*/index.json")
    assert json.loads(index.read_text())["entries"]
