"""The prompt cache's disk tier: cache snapshots (`kimi_mlx.model.cache.snapshot`) kept as
safetensors files that survive a restart, under `--prompt-cache-dir`.

Layout: `DIR/<fingerprint id>/` holds one `<sha256 of the key, 32 hex>.safetensors` per
snapshot, `index.json` (key -> file, positions held, file bytes, sha256 of the file,
last use) and `fingerprint.json` (what the id hashes, for people). The fingerprint is a
dict naming everything a snapshot depends on besides its tokens: the weights' identity
(`checkpoint_identity`), the layer range or shard, the dtypes, the quantization and
`FORMAT_VERSION`; another checkpoint / shard / version writes to another folder, and the
folders of other fingerprints are never read (their files are counted as
`ignored_foreign`). The key is the token prefix with its images' digests
(`token_key`, or the cluster's `prefix_key`); every file also carries its fingerprint
id, key and positions in its safetensors metadata, checked on load.

Writes are write-behind on one background thread (`put` only queues references to the
snapshot's immutable arrays, so a reply's tokens never wait for the disk): MLX writes the
file under a temporary name (`mx.save_safetensors`, without the GIL), it is read back for
its sha256, fsynced, renamed, the folder fsynced, then the index is replaced the same
way. A crash at any point leaves either no entry or a whole one:
temporary files and files the index does not name are deleted when the folder is
opened, and every read checks the file's sha256 (a mismatch is ignored, counted in
`ignored_corrupt`, and the entry dropped). The folder holds at most `max_bytes` of
files, least recently used dropped first. One process owns a folder at a time (an
exclusive `flock` on `DIR/<id>/.lock`).

Nothing in the folder is trusted beyond it (DESIGN.md principle 5): an index entry is
used only when its `file` is a plain snapshot name (`_plain_name`: no separator, no
`..`, not hidden, `.safetensors`) naming a regular file in the folder, never a symlink
(checked with `lstat`, opened with `O_NOFOLLOW`). Any other entry (an absolute path,
`../x`, `sub/x`, a snapshot replaced by a symlink) is ignored, counted in
`ignored_foreign`, and its file is never opened or unlinked.

A full or failing disk never stops the caller: opening the folder deletes this folder's
own temporary files (partial writes of a process that died or ran out of space) before
it writes anything, then reads the index and evicts down to `max_bytes`; only when the
folder still cannot be written does the constructor raise OSError (the servers then
run with the memory cache only). A failed write (the snapshot or the index) deletes its
temporary file, is counted in `write_errors`, and is logged once per stretch of
failures.

Reads (`get`) run on the caller's MLX thread. `worth_reading` chooses a read only when
it is estimated faster than recomputing the prefix: bytes / measured read speed (the
mean of the reads so far, `DEFAULT_READ_BPS` before the first) against tokens / the
prompt speed given in `prompt_tps` (None: always read, e.g. a pipeline stage, which
does not know the whole model's prompt speed).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import queue
import stat
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "DiskSnapshotStore", "checkpoint_identity", "prefix_keys", "token_key"]

FORMAT_VERSION = 2  # of the snapshot files: bump when snapshot()'s layout changes
# 2: a DSA layer may hold an 8-bit cache (packed latent / index keys plus their scales and
#    biases, layout ['dsa', positions, [kv_bits, kv_group_size]])
DEFAULT_READ_BPS = 1e9  # bytes/s assumed before the first read is measured
INDEX = "index.json"


def token_key(ids: Sequence) -> str:
    """The disk key of the snapshot holding exactly `ids`: '<length>-<sha256, 32 hex>'
    over the int32 little-endian ids, where an image pad given as a (pad id, image
    digest hex) pair (`server.images.cache_key`) hashes as the pad id then the digest's
    bytes (the cluster's `prefix_key` scheme), so the same text with another image has
    another key."""
    return prefix_keys(ids, [len(ids)])[len(ids)]


def prefix_keys(ids: Sequence, lengths: Iterable[int]) -> Dict[int, str]:
    """{n: token_key(ids[:n])} for each n in `lengths` (0 <= n <= len(ids)), hashed in
    one pass over the ids (a prompt of 100k tokens and hundreds of lengths costs one
    sha256 over 400 kB)."""
    ids = list(ids)
    if all(isinstance(t, int) for t in ids):
        data = np.asarray(ids, dtype="<i4").tobytes()
        offsets = None
    else:
        parts = [np.asarray([t[0]], dtype="<i4").tobytes() + bytes.fromhex(t[1])
                 if isinstance(t, tuple) else np.asarray([t], dtype="<i4").tobytes() for t in ids]
        data = b"".join(parts)
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in parts])]).tolist()
    h, at, out = hashlib.sha256(), 0, {}
    for n in sorted(set(lengths)):
        end = 4 * n if offsets is None else offsets[n]
        h.update(data[at:end])
        at = end
        out[n] = f"{n}-{h.copy().hexdigest()[:32]}"
    return out


def checkpoint_identity(folder) -> str:
    """24 hex digits identifying the weights in checkpoint `folder`: sha256 of its
    config.json and index bytes, and the name, size and mtime (ns) of each safetensors
    file (a rewritten or copied checkpoint gets a new identity: its cache starts cold).
    Raises OSError when config.json cannot be read."""
    folder = Path(folder)
    h = hashlib.sha256(b"kimi-mlx checkpoint identity v1\n")
    h.update((folder / "config.json").read_bytes())
    for p in sorted(folder.glob("*.json")):
        if p.name != "config.json" and p.name.endswith("index.json"):
            h.update(p.name.encode() + p.read_bytes())
    for p in sorted(folder.glob("*.safetensors")):
        st = p.resolve().stat()
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """`data` to `path` through a temporary file, fsynced, renamed, the folder fsynced.
    Raises OSError (a full disk: ENOSPC) after deleting the temporary file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _plain_name(name) -> bool:
    """Whether an index's `file` may be used: a plain, non-hidden `*.safetensors` name
    (no path separator of any platform, no NUL, not '.' / '..'), so that
    `folder / name` stays inside the folder."""
    return (isinstance(name, str) and name.endswith(".safetensors") and not name.startswith(".")
            and not any(c in name for c in ("/", "\\", "\0", os.sep, os.altsep or "/")))


def _regular_size(path: Path) -> Optional[int]:
    """The size of `path` when it is a regular file itself (`lstat`: a symlink is not
    followed and gives None); None when missing or of another kind."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _read_regular(path: Path) -> bytes:
    """The bytes of regular file `path`, never through a symlink (`O_NOFOLLOW`: OSError
    ELOOP for a symlink, as for any unreadable file)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _flatten(snap) -> Tuple[Dict[str, Any], list]:
    """A snapshot -> (name -> array, layout): 'i.k'/'i.v'/'i.x' (latent, rope key,
    indexer keys) of a DSA layer with layout ['dsa', positions] (['dsa', None] empty);
    an 8-bit layer adds 'i.ks'/'i.kb'/'i.xs'/'i.xb' (latent and index scales, biases)
    and its format: ['dsa', positions, [kv_bits, kv_group_size]];
    'i.j' of an ArraysCache layer with ['arrays', [slot j held]]."""
    arrays, layout = {}, []
    for i, (kind, state) in enumerate(snap):
        if kind == "dsa":
            if state is None:
                layout.append(["dsa", None])
            else:
                k, v, x, n = state[:4]
                arrays.update({f"{i}.k": k, f"{i}.v": v, f"{i}.x": x})
                if len(state) > 4:
                    q = state[4]
                    arrays.update({f"{i}.{s}": a for s, a in zip(("ks", "kb", "xs", "xb"), q[:4])})
                    layout.append(["dsa", int(n), [int(q[4]), int(q[5])]])
                else:
                    layout.append(["dsa", int(n)])
        else:
            held = [a is not None for a in state]
            arrays.update({f"{i}.{j}": a for j, a in enumerate(state) if a is not None})
            layout.append(["arrays", held])
    return arrays, layout


def _unflatten(arrays: Dict[str, Any], layout: list):
    """`_flatten`'s inverse (KeyError / ValueError on a file that does not match)."""
    snap = []
    for i, (kind, spec, *quant) in enumerate(layout):
        if kind == "dsa":
            state = None if spec is None else (arrays[f"{i}.k"], arrays[f"{i}.v"],
                                                arrays[f"{i}.x"], int(spec))
            if state is not None and quant:
                bits, group = (int(a) for a in quant[0])
                state += ((*(arrays[f"{i}.{s}"] for s in ("ks", "kb", "xs", "xb")), bits, group),)
            snap.append(("dsa", state))
        elif kind == "arrays":
            snap.append(("arrays", [arrays[f"{i}.{j}"] if h else None for j, h in enumerate(spec)]))
        else:
            raise ValueError(f"layer {i}: unknown snapshot kind {kind!r}")
    return snap


class DiskSnapshotStore:
    """Snapshots on disk under `root/<fingerprint id>/`, at most `max_bytes` of files
    (see module doc). Thread-safe: `put` from any thread (the write happens on this
    store's writer thread), `get` on the caller's MLX thread.

    Args:
        root: the `--prompt-cache-dir` folder (created when missing).
        max_bytes: bound of the files' bytes (`--prompt-cache-disk-bytes`).
        fingerprint: JSON-serialisable dict of what snapshots depend on besides tokens;
            `FORMAT_VERSION` is added to it.
        prompt_tps: prompt tokens/s of the model the snapshots save recomputing (None:
            a read is always chosen).
        max_pending_bytes: bytes of snapshots waiting for the writer; a put past it is
            dropped (counted in `write_dropped`) rather than holding more memory.

    Raises:
        OSError: the folder cannot be created, or cannot be written even after its own
            temporary files were deleted and it was evicted down to `max_bytes` (a full
            disk, a read-only folder).
        RuntimeError: another process holds the folder.
    """

    def __init__(self, root, max_bytes: int, fingerprint: Dict[str, Any],
                 prompt_tps: Optional[float] = None, max_pending_bytes: int = 8 << 30):
        self.root = Path(root).expanduser()
        self.max_bytes = max(int(max_bytes), 0)
        self.fingerprint = dict(fingerprint, format=FORMAT_VERSION)
        blob = json.dumps(self.fingerprint, sort_keys=True, default=str).encode()
        self.fp_id = hashlib.sha256(blob).hexdigest()[:24]
        self.dir = self.root / self.fp_id
        self.prompt_tps = prompt_tps
        self.max_pending_bytes = max_pending_bytes
        self.hits = self.misses = self.evictions = 0
        self.ignored_foreign = self.ignored_corrupt = self.write_dropped = self.write_errors = 0
        self.read_bytes = self.written_bytes = 0
        self.read_seconds = self.write_seconds = 0.0
        self.nbytes = 0
        self._entries: Dict[str, Dict[str, Any]] = {}
        self._pending: Dict[str, int] = {}  # key -> bytes, queued for the writer
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._failing = False  # the last write failed: the next failure is not logged again
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.dir / ".lock", "a")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise RuntimeError(f"prompt cache folder {self.dir} is in use by another process") from None
        try:
            # first of all, this folder's own temporary files: on a disk they filled, the
            # writes below would fail before the index's clean-up ever ran
            self._remove_temporary()
            self._open_index()
            _write_atomic(self.dir / "fingerprint.json", json.dumps(
                self.fingerprint, indent=1, sort_keys=True, default=str).encode())
        except BaseException:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            raise
        self._queue: "queue.Queue" = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="prompt-cache-disk")
        self._writer.start()

    # ------------------------------------------------------------------ opening

    def _remove_temporary(self) -> None:
        """Delete this folder's temporary files (`.tmp` in the name: partial snapshot
        or index writes of a process that died or ran out of space). `unlink` removes a
        symlink itself, never what it points to."""
        for p in self.dir.iterdir():
            if ".tmp" in p.name and (p.is_symlink() or _regular_size(p) is not None):
                p.unlink(missing_ok=True)

    def _open_index(self) -> None:
        """Read index.json; ignore entries naming anything but a plain regular file in
        this folder (counted foreign, their files untouched), drop entries whose file is
        missing or of another size (corrupt), delete unindexed snapshot files; count the
        files of other fingerprints; evict down to `max_bytes`."""
        entries = {}
        try:
            raw = json.loads((self.dir / INDEX).read_text())
            listed = raw.get("entries", {})
            if not isinstance(listed, dict):
                raise ValueError("'entries' is not an object")
            if raw.get("format") == FORMAT_VERSION and raw.get("fingerprint") == self.fp_id:
                entries = listed
            else:
                self.ignored_foreign += len(listed)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as e:
            log.warning("%s: unreadable (%s): starting with an empty disk cache", self.dir / INDEX, e)
        unsafe = []
        for key, e in list(entries.items()):
            name = e.get("file") if isinstance(e, dict) else None
            if not _plain_name(name):
                unsafe.append(name)
                del entries[key]
                continue
            size = _regular_size(self.dir / name)
            if size is None and os.path.islink(self.dir / name):
                unsafe.append(name)
                del entries[key]
                continue
            try:
                ok = (size == e["nbytes"] and isinstance(e["nbytes"], int)
                      and isinstance(e["length"], int) and isinstance(e["sha256"], str)
                      and isinstance(e["used"], (int, float)))
            except KeyError:
                ok = False
            if not ok:
                self.ignored_corrupt += 1
                del entries[key]
        if unsafe:
            self.ignored_foreign += len(unsafe)
            log.warning("%s: %d entries name files outside this folder or symlinks (%s): "
                        "ignored, their files left alone", self.dir / INDEX, len(unsafe),
                        ", ".join(repr(n) for n in unsafe[:3]))
        self._entries = entries
        self.nbytes = sum(e["nbytes"] for e in entries.values())
        named = {e["file"] for e in entries.values()}
        for p in self.dir.iterdir():
            if (p.suffix == ".safetensors" and p.name not in named
                    and _regular_size(p) is not None):
                p.unlink(missing_ok=True)
        for other in self.root.iterdir():
            if other.is_dir() and other.name != self.fp_id:
                self.ignored_foreign += sum(1 for _ in other.glob("*.safetensors"))
        self._evict()

    # ------------------------------------------------------------------ lookups

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> List[Tuple[str, int, int]]:
        """(key, positions, file bytes) of every snapshot on disk."""
        with self._lock:
            return [(k, e["length"], e["nbytes"]) for k, e in self._entries.items()]

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def miss(self) -> None:
        """Count a lookup that found nothing usable on disk."""
        with self._lock:
            self.misses += 1

    @property
    def read_bps(self) -> float:
        """Measured read speed (bytes/s; `DEFAULT_READ_BPS` before the first read)."""
        return self.read_bytes / self.read_seconds if self.read_seconds > 0 else DEFAULT_READ_BPS

    def worth_reading(self, nbytes: int, tokens: int) -> bool:
        """Whether reading `nbytes` is estimated faster than prefilling `tokens` tokens
        (always with no `prompt_tps`)."""
        if not self.prompt_tps:
            return True
        return nbytes / self.read_bps < tokens / self.prompt_tps

    def get(self, key: str, length: int):
        """The snapshot stored under `key` holding `length` positions, read and checked
        (sha256, fingerprint, key), its arrays evaluated; None when not on disk or not
        usable (corrupt / foreign files are counted and dropped)."""
        with self._lock:
            e = self._entries.get(key)
        if e is None or e["length"] != length:
            self.misses += 1
            return None
        path = self.dir / e["file"]  # a plain name (`_open_index`, `_write`)
        t0 = time.perf_counter()
        if os.path.islink(path):  # replaced by a symlink since: never followed
            log.warning("%s: a symlink, not a snapshot file: ignored", path)
            return self._drop(key, corrupt=False, unlink=False)
        try:
            data = _read_regular(path)
        except OSError as err:
            log.warning("%s: unreadable (%s): dropped", path, err)
            return self._drop(key, corrupt=True, unlink=not os.path.islink(path))
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            log.warning("%s: checksum mismatch (truncated or corrupted): ignored", path)
            return self._drop(key, corrupt=True)
        try:
            arrays, meta = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
            if (meta.get("fingerprint") != self.fp_id or meta.get("format") != str(FORMAT_VERSION)
                    or meta.get("key") != key or meta.get("length") != str(length)):
                log.warning("%s: written for another model, shard or version: ignored", path)
                return self._drop(key, corrupt=False)
            snap = _unflatten(arrays, json.loads(meta["layout"]))
            mx.eval(list(arrays.values()))
        except (KeyError, ValueError, RuntimeError) as err:
            log.warning("%s: not a snapshot (%s): ignored", path, err)
            return self._drop(key, corrupt=True)
        dt = time.perf_counter() - t0
        with self._lock:
            self.hits += 1
            self.read_bytes += len(data)
            self.read_seconds += dt
            if key in self._entries:
                self._entries[key]["used"] = time.time()
        return snap

    def _drop(self, key: str, corrupt: bool, unlink: bool = True):
        """Forget `key` (counted corrupt or foreign, and a miss); its file is deleted
        when `unlink` (the entry's name is plain: the file is in this folder)."""
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self.nbytes -= e["nbytes"]
            if corrupt:
                self.ignored_corrupt += 1
            else:
                self.ignored_foreign += 1
            self.misses += 1
        if e is not None:
            if unlink:
                (self.dir / e["file"]).unlink(missing_ok=True)
            self._queue.put(("index", None, None, None))
        return None

    # ------------------------------------------------------------------ writes

    def put(self, key: str, length: int, snap, nbytes: int) -> bool:
        """Queue `snap` (holding `length` positions, `nbytes` bytes of arrays) for writing
        under `key`; returns at once (the arrays are evaluated here, on the caller's MLX
        thread, which costs nothing for a snapshot of computed caches). False when it is
        already stored or queued, larger than the bound, or the queue is full."""
        with self._lock:
            if self._closed or key in self._pending or nbytes > self.max_bytes:
                return False
            if key in self._entries:
                self._entries[key]["used"] = time.time()
                return False
            if sum(self._pending.values()) + nbytes > self.max_pending_bytes:
                self.write_dropped += 1
                return False
            self._pending[key] = nbytes
        arrays, layout = _flatten(snap)
        mx.eval(list(arrays.values()))
        self._queue.put(("write", key, length, (arrays, layout)))
        return True

    def _write_loop(self) -> None:
        while True:
            kind, key, length, payload = self._queue.get()
            try:
                if kind == "stop":
                    return
                if kind == "write":
                    self._write(key, length, *payload)
                self._save_index()
                if self._failing:
                    self._failing = False
                    log.info("%s: prompt cache disk writes work again", self.dir)
            except Exception as e:  # a full disk, a removed folder: the cache only misses
                with self._lock:
                    self.write_errors += 1
                # once per stretch of failures (a full disk fails every write)
                (log.debug if self._failing else log.warning)(
                    "%s: prompt cache disk write of %s failed (%s): the snapshot stays in "
                    "memory only; failures are counted in /metrics "
                    "(kimi_mlx_prompt_cache_disk_write_errors_total)", self.dir,
                    key or INDEX, e)
                self._failing = True
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                    self._idle.notify_all()

    def _write(self, key: str, length: int, arrays: Dict[str, Any], layout: list) -> None:
        # MLX writes the file itself (into a Python BytesIO it would hold the GIL for the
        # whole copy, stalling the engine thread: 230 ms gaps measured against 28 ms), then
        # the file is read back in chunks for its checksum (hashlib and reads release it)
        t0 = time.perf_counter()
        name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".safetensors"
        tmp = self.dir / f".{name[:-12]}.{os.getpid()}.tmp.safetensors"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata={
                "format": str(FORMAT_VERSION), "fingerprint": self.fp_id, "key": key,
                "length": str(length), "layout": json.dumps(layout)})
            del arrays
            h = hashlib.sha256()
            with open(tmp, "rb+") as f:
                while True:
                    chunk = f.read(16 << 20)
                    if not chunk:
                        break
                    h.update(chunk)
                size = f.tell()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / name)
        except BaseException:  # MLX raises RuntimeError on a full disk, after a partial write
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.dir)
        entry = {"file": name, "length": int(length), "nbytes": size,
                 "sha256": h.hexdigest(), "used": time.time()}
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old["nbytes"]
            self._entries[key] = entry
            self.nbytes += size
            self.written_bytes += size
            self.write_seconds += time.perf_counter() - t0
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used files until the folder is within `max_bytes`."""
        gone = []
        with self._lock:
            while self.nbytes > self.max_bytes and self._entries:
                key = min(self._entries, key=lambda k: self._entries[k]["used"])
                e = self._entries.pop(key)
                self.nbytes -= e["nbytes"]
                self.evictions += 1
                gone.append(e["file"])
        for f in gone:
            (self.dir / f).unlink(missing_ok=True)

    def _save_index(self) -> None:
        with self._lock:
            doc = {"format": FORMAT_VERSION, "fingerprint": self.fp_id,
                   "entries": dict(self._entries)}
        _write_atomic(self.dir / INDEX, json.dumps(doc).encode())

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued write is on disk (False on timeout)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or not self._queue.empty():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued writes (up to `timeout` s), save the index, stop the writer
        and release the folder."""
        if self._closed:
            return
        self.flush(timeout)
        with self._lock:
            self._closed = True
        self._queue.put(("index", None, None, None))
        self._queue.put(("stop", None, None, None))
        self._writer.join(timeout)
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()

    def stats(self) -> Dict[str, float]:
        """Counters for /metrics and logs."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "bytes": self.nbytes,
                    "max_bytes": self.max_bytes, "entries": len(self._entries),
                    "read_bytes": self.read_bytes, "written_bytes": self.written_bytes,
                    "read_seconds": self.read_seconds, "write_seconds": self.write_seconds,
                    "evictions": self.evictions, "ignored_foreign": self.ignored_foreign,
                    "ignored_corrupt": self.ignored_corrupt, "write_dropped": self.write_dropped,
                    "write_errors": self.write_errors}
