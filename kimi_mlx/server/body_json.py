"""Request bodies parsed without holding up the other clients.

`json.loads` of a multi-MB body holds the GIL for its whole run (about 0.2 s for 5 MB of
small objects on a 2-core x86 machine), and a walk of the parsed tree to measure its
nesting took over 0.7 s in pure Python. On the event loop either stalls every stream for
that long; on a worker thread `json.loads` still stalls them, since the GIL is not
released inside one C call. So a body is read here in two steps:

1. `structure(raw)`: NumPy passes over the bytes (no Python object per value) find which
   bytes are inside strings and the bracket depth after each byte. That bounds the
   nesting before anything is parsed (a body nested past the limit is refused without
   parsing it) and refuses unbalanced brackets or quotes at once.
2. `loads(raw)`: a body under `CHUNK_BYTES` is one `json.loads`; a larger one is split at
   its containers' top-level commas (found from step 1) into pieces of at most about
   `CHUNK_BYTES`, each parsed by `json.loads` and joined, so that the GIL is given up
   between pieces (Python switches threads every `sys.getswitchinterval()`, 5 ms). The
   result equals `json.loads(raw)` (the same parser reads every value; a repeated key
   keeps its last value, as `json.loads` does); invalid JSON raises `BodyError`.

`Document` keeps step 1's scan so that a request's fields can be measured from the bytes
first (`find` locates the values at a key path, `compact_size` sizes one): a schema over
--max-schema-bytes is refused (`server.common.load_body`) before step 2 builds its objects.

Run on a worker thread (`server.common.parse_body_async`) this costs a neighbour's
stream a few milliseconds per piece at most. Source of the JSON grammar: RFC 8259
(strings are the only place where brackets, commas or colons are not structure; a
backslash escapes exactly the next character inside a string)."""

from __future__ import annotations

import json
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["BodyError", "CHUNK_BYTES", "Document", "loads", "structure"]

CHUNK_BYTES = 64 << 10  # a piece one json.loads reads: ~1-2 ms of GIL on this machine

_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))
_DELTA = np.zeros(256, np.int8)
_DELTA[list(_OPEN)] = 1
_DELTA[list(_CLOSE)] = -1
_WS = b" \t\r\n"
_IS_WS = np.zeros(256, bool)
_IS_WS[list(_WS)] = True


class BodyError(ValueError):
    """The body is not valid JSON (`message` says where), or is nested deeper than asked
    (`nested` True)."""

    def __init__(self, message: str, nested: bool = False):
        super().__init__(message)
        self.nested = nested


BLOCK_BYTES = 256 << 10  # bytes `structure` reads per NumPy pass (~1 ms), GIL free between


def _blocks(raw: bytes, a: int, b: int):
    """(start, c, ins, quote) for each block of raw[a:b] (`a` outside any string), read
    in blocks of BLOCK_BYTES cut where no backslash run is split: c the bytes (uint8),
    quote the `"` bytes that open or close a string (escaped ones not), ins True from a
    string's opening quote up to, not including, its closing quote."""
    inside = False  # carried from block to block
    while a < b:
        e = min(a + BLOCK_BYTES, b)
        while e < b and raw[e - 1] == 92:  # keep a backslash run and what it escapes together
            e += 1
        c = np.frombuffer(raw, np.uint8, e - a, a)
        quote = c == 34
        bs = np.flatnonzero(c == 92)
        if bs.size:  # a quote after an odd run of backslashes is escaped, not a string's end
            after = bs + 1
            after = after[after < c.size]
            after = after[c[after] == 34]
            if after.size:
                first = np.empty(bs.size, bool)
                first[0] = True
                first[1:] = np.diff(bs) != 1
                run_start = bs[np.maximum.accumulate(np.where(first, np.arange(bs.size), 0))]
                k = np.searchsorted(bs, after - 1)
                quote[after[((after - run_start[k]) & 1) == 1]] = False
        ins = (np.cumsum(quote, dtype=np.int32) & 1).astype(bool)
        if inside:
            ins = ~ins
        inside = bool(ins[-1])
        yield a, c, ins, quote
        a = e


def structure(raw: bytes, max_depth: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(depth, commas, colons) of a JSON text: depth int32 [len(raw)], the bracket depth
    after each byte (brackets inside strings not counted); commas and colons int64, the
    sorted positions of the `,` and `:` bytes that are outside strings. Raises BodyError
    for unbalanced quotes or brackets, or (nested=True) when the depth passes
    `max_depth`. Read in blocks of BLOCK_BYTES (cut where no backslash run is split),
    a few NumPy passes each, with no Python object per value."""
    n = len(raw)
    depth = np.empty(n, np.int32)
    commas, colons = [], []
    inside, level = False, 0  # carried from block to block
    for a, c, ins, quote in _blocks(raw, 0, n):
        b = a + c.size
        outside = ~(ins | quote)
        np.cumsum(np.where(outside, _DELTA[c], 0), dtype=np.int32, out=depth[a:b])
        depth[a:b] += level
        commas.append(np.flatnonzero((c == 44) & outside) + a)
        colons.append(np.flatnonzero((c == 58) & outside) + a)
        inside, level = bool(ins[-1]), int(depth[b - 1])
        if int(depth[a:b].max()) > max_depth:
            raise BodyError(f"nested more than {max_depth} levels deep", nested=True)
        if int(depth[a:b].min()) < 0:
            raise BodyError(f"a bracket closes at byte {a + int(np.argmax(depth[a:b] < 0))} "
                            "that was not opened")
    if inside:
        raise BodyError("a string is not closed")
    if level:
        raise BodyError("brackets are not balanced")
    return (depth, np.concatenate(commas) if commas else np.zeros(0, np.int64),
            np.concatenate(colons) if colons else np.zeros(0, np.int64))


def loads(raw: bytes, max_depth: int) -> Any:
    """`json.loads(raw)` for a body nested at most `max_depth` levels, parsed in pieces
    of about `CHUNK_BYTES` (see the module docstring). Raises BodyError (invalid JSON,
    or nested=True past `max_depth`); UnicodeDecodeError as `json.loads` does."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:  # cannot be nested deeper
        return _one(raw, 0)
    return Document(raw, max_depth).value()


class Document:
    """A JSON text scanned once by `structure` (BodyError as it raises): its value
    (`value`, as `loads`), and the byte spans of the values at a key path (`find`) with
    their sizes (`compact_size`), read from the scan without parsing them, so that a
    request's oversized field is refused before any Python object is built for it."""

    def __init__(self, raw: bytes, max_depth: int):
        self.raw = raw
        self._p = _Pieces(raw, *structure(raw, max_depth))

    def value(self) -> Any:
        """`json.loads(raw)`, in pieces when over CHUNK_BYTES. Raises BodyError."""
        raw = self.raw
        if len(raw) <= CHUNK_BYTES:
            return _one(raw, 0)
        return self._p.value(*_strip(raw, 0, len(raw)))

    def find(self, path: Sequence[str]) -> List[Tuple[Tuple[int, ...], int, int]]:
        """(indices, start, end) of each value at `path` from the top-level value: a
        step is an object key (the member's last occurrence, as `json.loads` keeps it)
        or "*" (each element of an array; `indices` holds their positions, in order).
        raw[start:end] is the value's text, whitespace stripped. A step that meets a
        value of another kind, or a missing key, yields nothing for that branch."""
        raw = self.raw
        spans = [((),) + _strip(raw, 0, len(raw))]
        for step in path:
            out = []
            for idx, a, b in spans:
                if b - a < 2:
                    continue
                if step == "*":
                    if raw[a] == ord("["):
                        out.extend((idx + (k,), s, e) for k, (s, e) in enumerate(self._p.items(a, b)))
                elif raw[a] == ord("{"):
                    hit = self._p.member(a, b, step)
                    if hit is not None:
                        out.append((idx,) + hit)
            spans = out
        return spans

    def compact_size(self, a: int, b: int, cap: Optional[int] = None) -> int:
        """Bytes of raw[a:b] (a value's text) not counting whitespace outside strings:
        its size as compact JSON as sent (escapes as written). With `cap`, counted only
        until past it (a block at a time)."""
        n = 0
        for _, c, ins, _q in _blocks(self.raw, a, b):
            n += c.size - int(np.count_nonzero(_IS_WS[c] & ~ins))
            if cap is not None and n > cap:
                break
        return n


def _one(text: bytes, at: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(f"{e.msg} (near byte {at + max(e.pos - 1, 0)})") from None


def _strip(raw: bytes, a: int, b: int) -> Tuple[int, int]:
    while a < b and raw[a] in _WS:
        a += 1
    while b > a and raw[b - 1] in _WS:
        b -= 1
    return a, b


class _Pieces:
    """One body's piecewise parse: `value(a, b)` is the JSON value raw[a:b] (stripped)."""

    def __init__(self, raw: bytes, depth: np.ndarray, commas: np.ndarray, colons: np.ndarray):
        self.raw, self.depth, self.commas, self.colons = raw, depth, commas, colons
        self.comma_depth, self.colon_depth = depth[commas], depth[colons]

    def _at_level(self, pos, pos_depth, a: int, b: int, level: int) -> np.ndarray:
        lo, hi = np.searchsorted(pos, a), np.searchsorted(pos, b)
        return pos[lo:hi][pos_depth[lo:hi] == level]

    def items(self, a: int, b: int) -> List[Tuple[int, int]]:
        """(start, end) of each element (an array's values, an object's `key: value`
        members), whitespace stripped, of the container raw[a:b]; empty ones left out."""
        level = int(self.depth[a])
        seps = self._at_level(self.commas, self.comma_depth, a + 1, b - 1, level)
        bounds = zip([a + 1] + [int(p) + 1 for p in seps], [int(p) for p in seps] + [b - 1])
        return [(s, e) for s, e in (_strip(self.raw, s, e) for s, e in bounds) if e > s]

    def member(self, a: int, b: int, key: str):
        """(start, end) of the value of `key`'s last occurrence in the object raw[a:b],
        whitespace stripped, or None."""
        raw, level, want, hit = self.raw, int(self.depth[a]), key.encode(), None
        colons = self._at_level(self.colons, self.colon_depth, a + 1, b - 1, level)
        for s, e in self.items(a, b):
            k = np.searchsorted(colons, s)
            if k == colons.size or colons[k] >= e:
                continue
            c = int(colons[k])
            ks, ke = _strip(raw, s, c)
            name = raw[ks + 1:ke - 1] if ke - ks >= 2 and raw[ks] == raw[ke - 1] == 34 else None
            if name is not None and 92 in name:  # escapes: read the key as JSON does
                try:
                    name = json.loads(raw[ks:ke]).encode()
                except (ValueError, UnicodeError):
                    name = None
            if name == want:
                hit = _strip(raw, c + 1, e)
        return hit

    def value(self, a: int, b: int) -> Any:
        raw = self.raw
        if b - a <= CHUNK_BYTES or raw[a] not in _OPEN:
            return _one(raw[a:b], a)  # small, or a scalar (one long string parses fast)
        is_list = raw[a] == ord("[")
        if raw[b - 1] != (ord("]") if is_list else ord("}")):
            raise BodyError(f"a container opened at byte {a} is not closed where it ends")
        level = int(self.depth[a])
        if b - a > 2 and int(self.depth[a:b - 1].min()) < level:
            raise BodyError(f"a container opened at byte {a} closes early")
        seps = self._at_level(self.commas, self.comma_depth, a + 1, b - 1, level)
        starts = [a + 1] + [int(p) + 1 for p in seps]
        ends = [int(p) for p in seps] + [b - 1]
        out: Any = [] if is_list else {}
        if len(starts) == 1 and not raw[a + 1:b - 1].strip(_WS):
            return out  # [] or {}
        i = 0
        while i < len(starts):
            j = i  # a run of elements that together stay under CHUNK_BYTES
            while j + 1 < len(starts) and ends[j + 1] - starts[i] <= CHUNK_BYTES:
                j += 1
            if j > i or ends[i] - starts[i] <= CHUNK_BYTES:
                text = raw[starts[i]:ends[j]]
                if not text.strip(_WS):  # `[1,,2]`: wrapped alone it would read as `[]`
                    raise BodyError(f"a value is missing before byte {ends[j]}")
                part = _one(b"[" + text + b"]" if is_list else b"{" + text + b"}", starts[i])
                if is_list:
                    out.extend(part)
                else:
                    out.update(part)
            elif is_list:
                out.append(self.value(*_strip(raw, starts[i], ends[i])))
            else:
                s, e = starts[i], ends[i]
                colon = self._at_level(self.colons, self.colon_depth, s, e, level)
                if not colon.size:
                    raise BodyError(f"an object member at byte {s} has no ':'")
                key = _one(raw[s:int(colon[0])], s)
                if not isinstance(key, str):
                    raise BodyError(f"an object key at byte {s} is not a string")
                out[key] = self.value(*_strip(raw, int(colon[0]) + 1, e))
            i = j + 1
        return out
