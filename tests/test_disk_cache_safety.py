"""The prompt cache's disk tier (`server.disk_cache`) against a hostile folder and a full
disk.

- An index entry naming a file outside its folder (an absolute path, `../../x`, a name
  with a separator through a symlinked sub-folder) or a snapshot file replaced by a
  symlink to a file outside: a victim file planted outside the folder survives the
  folder's opening (eviction down to a tiny bound), an eviction while running and a
  `get`, byte for byte; the entry is ignored, counted `foreign` (and shown so on
  /metrics), and a `get` of it is a miss, never the outside file's contents.
- A full disk: on a real 8 MB tmpfs (mounted here when the machine allows it, skipped
  otherwise) and with a fake that fails writes with ENOSPC (runs everywhere). The
  folder's own temporary files (a partial write, empty `.tmp.safetensors` files) are
  deleted before anything is written, so the next start serves from the same folder; a
  folder that still cannot be written gives a server with the memory cache only (one
  warning, kimi_mlx_prompt_cache_disk_enabled 0); a failed write leaves no temporary
  file and counts in kimi_mlx_prompt_cache_disk_write_errors_total.
"""

import errno
import hashlib
import json
import logging
import os
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest

from kimi_mlx.server import disk_cache
from kimi_mlx.server.disk_cache import DiskSnapshotStore
from kimi_mlx.server.metrics import Metrics

FP = {"checkpoint": "abc", "layers": [0, 1], "dtypes": ["float32"], "role": "test"}


pytestmark = pytest.mark.usefixtures("close_disk_stores")  # tests/fixtures/stores.py


def tiny_snap(seed: int):
    """A one-layer snapshot in `model.cache.snapshot`'s layout ('arrays' kind)."""
    return [("arrays", [mx.full((64,), float(seed)), None])]


def put(store, key, seed, length=3):
    assert store.put(key, length, tiny_snap(seed), 256)
    assert store.flush()


def metric(text: str, name: str):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


# ------------------------------------------------------------------ foreign index entries

FORMS = ["absolute", "dotdot", "separator", "symlink"]
PHASES = ["start-up", "eviction", "get"]


def planted(tmp_path, form):
    """A folder holding one real snapshot ('good', seed 1) and an entry 'evil' (oldest:
    evicted first) whose file lies outside the folder in the way `form` says, with the
    victim's true size and sha256 (so nothing but the path check stands in the way).
    Returns (root, victim path, victim bytes)."""
    root = tmp_path / "pc"
    store = DiskSnapshotStore(root, 1 << 30, FP)
    put(store, "good", 1)
    put(store, "evil", 2)
    store.close()
    folder = store.dir
    index = json.loads((folder / "index.json").read_text())
    evil = index["entries"]["evil"]
    outside = tmp_path / "outside"
    outside.mkdir()
    if form == "symlink":  # a real snapshot, moved out and linked back in its place
        victim = outside / evil["file"]
        os.replace(folder / evil["file"], victim)
        os.symlink(victim, folder / evil["file"])
    else:
        (folder / evil["file"]).unlink()
        victim = {"absolute": outside / "victim_abs.bin",
                  "dotdot": tmp_path / "victim_rel.bin",
                  "separator": outside / "victim.safetensors"}[form]
        victim.write_bytes(b"precious bytes that are not the cache's " * 10)
        if form == "absolute":
            evil["file"] = str(victim)
        elif form == "dotdot":
            evil["file"] = "../../victim_rel.bin"  # folder is tmp/pc/<id>
        else:
            os.symlink(outside, folder / "sub")
            evil["file"] = "sub/victim.safetensors"
        evil["nbytes"] = victim.stat().st_size
        evil["sha256"] = hashlib.sha256(victim.read_bytes()).hexdigest()
    evil["used"] = 0.0
    (folder / "index.json").write_text(json.dumps(index))
    return root, victim, victim.read_bytes()


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("form", FORMS)
def test_an_entry_outside_the_folder_is_ignored_and_its_file_survives(tmp_path, form, phase):
    root, victim, before = planted(tmp_path, form)
    if phase == "start-up":  # opening evicts down to the bound: everything goes
        store = DiskSnapshotStore(root, 1, FP)
    else:
        store = DiskSnapshotStore(root, 1 << 30, FP)
        if phase == "eviction":
            store.max_bytes = 300  # the next write (~500 B) evicts every entry
            put(store, "newer", 3)
        else:
            assert store.get("evil", 3) is None  # never the outside file's snapshot
            assert store.flush()
    assert victim.read_bytes() == before, f"{form}: the file outside the folder was touched"
    st = store.stats()
    assert st["ignored_foreign"] == 1
    assert "evil" not in {k for k, _, _ in store.entries()}
    if phase == "get":  # the plain entry beside it still works
        assert store.get("good", 3)[0][1][0].tolist() == [1.0] * 64


def test_a_snapshot_turned_symlink_while_running_is_never_read(tmp_path):
    """The entry was sound when the folder opened; its file replaced by a symlink to a
    file outside afterwards: a miss, counted foreign, the outside file untouched."""
    root = tmp_path / "pc"
    store = DiskSnapshotStore(root, 1 << 30, FP)
    put(store, "k", 4)
    (name,) = [p for p in store.dir.glob("*.safetensors")]
    victim = tmp_path / "victim.safetensors"
    os.replace(name, victim)
    os.symlink(victim, name)
    before = victim.read_bytes()
    assert store.get("k", 3) is None
    assert store.flush()
    assert victim.read_bytes() == before and store.stats()["ignored_foreign"] == 1


def test_foreign_entries_show_on_metrics(tmp_path):
    root, victim, _ = planted(tmp_path, "dotdot")
    store = DiskSnapshotStore(root, 1 << 30, FP)
    m = Metrics()
    m.watch_disk_cache(store)
    text = m.render().decode()
    assert metric(text, 'kimi_mlx_prompt_cache_disk_ignored_total{reason="foreign"}') == 1
    assert metric(text, "kimi_mlx_prompt_cache_disk_enabled") == 1
    assert victim.exists()


# ------------------------------------------------------------------ full disk: store


def temporary_files(folder: Path):
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def fill_with_own_temporaries(folder: Path, partial_bytes=None):
    """What a process that ran out of space leaves: 16 empty temporary snapshot files
    and a partial one (`partial_bytes`, or until the disk is full)."""
    for i in range(16):
        (folder / f".{i:032x}.99999.tmp.safetensors").touch()
    partial = folder / f".{16:032x}.99999.tmp.safetensors"
    if partial_bytes is not None:
        partial.write_bytes(b"\0" * partial_bytes)
    else:
        fill_disk(partial)


def fill_disk(path: Path) -> None:
    """Write `path` until its filesystem has not one byte left."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC


def enospc_while_temporaries(folder: Path):
    """A fake disk that is full while any of `folder`'s non-empty temporary files
    exists (their bytes are the space): every write of the store raises ENOSPC then."""
    real_atomic, real_save = disk_cache._write_atomic, mx.save_safetensors

    def full() -> bool:
        return any(".tmp" in p.name and p.stat().st_size > 0 for p in folder.iterdir()
                   if p.is_file())

    def atomic(path, data):
        if full():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.touch()  # what open() leaves before the write fails
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            finally:
                tmp.unlink()  # the real _write_atomic's clean-up, by contract
        return real_atomic(path, data)

    def save(file, arrays, metadata=None):
        if full():
            Path(file).write_bytes(b"\0" * 100)  # MLX: a partial file, then the error
            raise RuntimeError("[write] Unable to write 1048669 bytes to file.")
        return real_save(file, arrays, metadata=metadata)

    return atomic, save


def test_fake_full_disk_start_cleans_its_temporaries_first(tmp_path, monkeypatch):
    root = tmp_path / "pc"
    store = DiskSnapshotStore(root, 1 << 30, FP)
    put(store, "kept", 5)
    store.close()
    fill_with_own_temporaries(store.dir, partial_bytes=4096)
    atomic, save = enospc_while_temporaries(store.dir)
    monkeypatch.setattr(disk_cache, "_write_atomic", atomic)
    monkeypatch.setattr(mx, "save_safetensors", save)
    store = DiskSnapshotStore(root, 1 << 30, FP)  # today: OSError ENOSPC
    assert temporary_files(store.dir) == []
    assert store.get("kept", 3)[0][1][0].tolist() == [5.0] * 64
    put(store, "new", 6)
    assert store.stats()["write_errors"] == 0 and store.has("new")


def test_fake_full_disk_write_failures_are_counted_leave_no_temporary_and_warn_once(
        tmp_path, monkeypatch, caplog):
    root = tmp_path / "pc"
    store = DiskSnapshotStore(root, 1 << 30, FP)
    (store.dir / ".space.tmp.keep").write_bytes(b"x")  # the disk is "full" from now on
    atomic, save = enospc_while_temporaries(store.dir)
    monkeypatch.setattr(disk_cache, "_write_atomic", atomic)
    monkeypatch.setattr(mx, "save_safetensors", save)
    with caplog.at_level(logging.WARNING, logger="kimi_mlx.server.disk_cache"):
        put(store, "a", 1)
        put(store, "b", 2)
    assert store.stats()["write_errors"] >= 2 and not store.has("a") and not store.has("b")
    assert temporary_files(store.dir) == [".space.tmp.keep"]
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
    (store.dir / ".space.tmp.keep").unlink()  # space again: writes resume
    put(store, "c", 3)
    assert store.has("c")


def test_fake_unwritable_folder_serves_with_the_memory_cache_only(tmp_path, monkeypatch, caplog):
    """A folder that cannot be written at all (the fingerprint and index writes fail
    with ENOSPC): `kimi-mlx server` still starts, answers, reuses its memory cache, and
    says so once (a warning, kimi_mlx_prompt_cache_disk_enabled 0)."""
    def atomic(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_cache, "_write_atomic", atomic)
    with caplog.at_level(logging.WARNING, logger="kimi_mlx.server"):
        with served_micro(tmp_path / "pc") as url:
            text = chat_twice_and_metrics(url)
    assert metric(text, "kimi_mlx_prompt_cache_disk_enabled") == 0
    assert metric(text, "kimi_mlx_prompt_cache_hits_total") == 1  # the memory cache
    assert len([r for r in caplog.records if "prompt cache on disk off" in r.getMessage()]) == 1


# ------------------------------------------------------------------ full disk: real tmpfs


@contextmanager
def tmpfs(size: str):
    d = tempfile.mkdtemp(prefix="kimi-mlx-tmpfs-")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield Path(d)
    finally:
        subprocess.run(["umount", "-l", d], timeout=30)
        os.rmdir(d)


@contextmanager
def served_micro(folder):
    from kimi_mlx.generation.request import default_model
    from kimi_mlx.testing.servers import served

    with served(str(default_model()), prompt_cache_dir=str(folder),
                prompt_cache_disk_bytes=1 << 30) as (srv, _):
        yield srv.url


def chat_twice_and_metrics(url) -> str:
    """The same long-prefix request twice (the second reuses the cache), then /metrics
    once the background writer has taken up the snapshots (written or failed: it
    writes behind the replies; at most 30 s)."""
    import time

    import httpx

    msgs = [{"role": "system", "content": "You answer about Python's standard library. " * 20},
            {"role": "user", "content": "What is functools.partial?"}]
    for _ in range(2):
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "micro", "messages": msgs, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        done = [metric(text, f"kimi_mlx_prompt_cache_disk_{n}_total")
                for n in ("written_bytes", "write_errors")]
        if None in done or any(done) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def fp_folder(root: Path) -> Path:
    """The folder `kimi-mlx server` uses for the shipped micro model under `root`."""
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.generation.request import default_model
    from kimi_mlx.server.serving import model_cache_fingerprint

    model = load_for_generation(str(default_model()))[0]
    fp = dict(model_cache_fingerprint(default_model(), model), format=disk_cache.FORMAT_VERSION)
    fp_id = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return root / fp_id


def test_tmpfs_full_of_its_own_temporaries_restarts_and_serves_from_disk():
    """The restart that used to fail (`loading ... failed: OSError: [Errno 28] No space
    left on device`, exit 1): an 8 MB tmpfs filled by the folder's own partial write and
    16 empty temporaries. The server starts, deletes them, answers, and writes its
    snapshots to the same folder."""
    with tmpfs("8m") as mnt:
        folder = fp_folder(mnt / "pc")
        folder.mkdir(parents=True)
        fill_with_own_temporaries(folder)
        with served_micro(mnt / "pc") as url:
            assert temporary_files(folder) == []
            text = chat_twice_and_metrics(url)
        assert metric(text, "kimi_mlx_prompt_cache_disk_enabled") == 1
        assert metric(text, "kimi_mlx_prompt_cache_disk_written_bytes_total") > 0
        assert metric(text, "kimi_mlx_prompt_cache_disk_write_errors_total") == 0
        assert temporary_files(folder) == [] and list(folder.glob("*.safetensors"))


def test_tmpfs_full_of_other_files_serves_with_memory_only_and_counts_failures():
    """A tmpfs filled by a file that is not the cache's: the folder cannot be written,
    the server answers with the memory cache only (gauge 0). Then a folder that fills
    while serving: failed writes are counted and leave no temporary file."""
    with tmpfs("8m") as mnt:
        (mnt / "pc").mkdir()
        fill = mnt / "someone-elses.bin"
        fill_disk(fill)
        with served_micro(mnt / "pc") as url:
            text = chat_twice_and_metrics(url)
        assert metric(text, "kimi_mlx_prompt_cache_disk_enabled") == 0
        assert metric(text, "kimi_mlx_prompt_cache_hits_total") == 1
        folder = fp_folder(mnt / "pc")
        assert not folder.exists() or temporary_files(folder) == []

        fill.unlink()  # room to open the folder; filled again while serving
        with served_micro(mnt / "pc") as url:
            fill_disk(fill)
            text = chat_twice_and_metrics(url)
        assert metric(text, "kimi_mlx_prompt_cache_disk_enabled") == 1
        assert metric(text, "kimi_mlx_prompt_cache_disk_write_errors_total") >= 1
        assert temporary_files(folder) == []
