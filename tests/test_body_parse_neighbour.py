"""A neighbour's streamed reply while other clients keep sending 5 MB request bodies
(a schema of 150,000 properties, refused by --max-schema-bytes once parsed): the
bodies are parsed off the event loop and in pieces (`server.body_json`), so the
neighbour's reply takes about as long as it does alone. The reference is the same
neighbour request alone, in the same run; the senders are separate processes (their
JSON encoding does not share this process's GIL). Before: 21.8x slower at load 4 (the
event loop ran json.loads and a pure-Python nesting walk of each body); the bound here
is 8x. Also `body_json.loads` equals `json.loads` on texts split at every size."""

import json
import random
import statistics
import subprocess
import sys
import time

import pytest

from kimi_mlx.generation.constrain import SchemaLimits
from kimi_mlx.generation.request import default_model
from kimi_mlx.server import body_json
from kimi_mlx.server.common import MAX_NESTING
from kimi_mlx.testing.servers import start_server, stop_server
from fixtures.neighbour import neighbour_seconds

SENDER = r'''
import http.client, json, sys
port = int(sys.argv[1])
schema = {"type": "object", "properties": {f"prop_{k}": {"type": "string"} for k in range(150_000)}}
body = json.dumps({"model": "micro", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}).encode()
assert len(body) > 5_000_000
while True:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse(); r.read(); c.close()
    print(r.status, flush=True)
'''


def test_5mb_bodies_do_not_slow_a_neighbours_stream():
    srv, svc = start_server(str(default_model()), None, "micro", 16 << 20, max_concurrency=2)
    svc.schema_limits = SchemaLimits(max_bytes=256 << 10, timeout_s=1.0)
    senders = []
    try:
        neighbour_seconds(srv.url)
        alone = statistics.median(neighbour_seconds(srv.url) for _ in range(3))
        senders = [subprocess.Popen([sys.executable, "-c", SENDER, str(srv.port)],
                                    stdout=subprocess.PIPE, text=True) for _ in range(2)]
        deadline = time.monotonic() + 120  # both senders have had a body refused
        while sum(1 for p in senders if p.stdout.readline().strip() == "400") < 2:
            assert time.monotonic() < deadline, "the 5 MB bodies were not refused"
        loaded = statistics.median(neighbour_seconds(srv.url) for _ in range(3))
    finally:
        for p in senders:
            p.kill()
            p.wait(30)
        stop_server(srv, svc)
    print(f"\nneighbour alone {alone:.3f} s, beside 5 MB bodies {loaded:.3f} s "
          f"(ratio {loaded / alone:.2f})")
    assert loaded / alone < 8, (alone, loaded)


def _value(rng, depth=0):
    r = rng.random()
    if depth > 6 or r < 0.3:
        return rng.choice([1, -2.5e10, 'a"b\\', "x]}[{,:", "\\\\", True, None, "é\u2028", 0.1, "",
                           '\\"]'])
    if r < 0.65:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {rng.choice(["k", "a,b", "c:d", '"q', "]"]) + str(rng.randint(0, 3)): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 6))}


@pytest.mark.parametrize("chunk,block", [(8, 61), (40, 200), (200, 1000)])
def test_piecewise_loads_equals_json_loads(monkeypatch, chunk, block):
    """Random JSON (strings holding brackets, commas, colons, escaped quotes and
    backslashes), compact and indented, and each with one byte changed: `loads` gives
    json.loads's value, or raises where json.loads raises."""
    monkeypatch.setattr(body_json, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(body_json, "BLOCK_BYTES", block)
    rng = random.Random(block)
    for _ in range(100):
        v = {"m": _value(rng)}
        for text in (json.dumps(v), json.dumps(v, indent=1, ensure_ascii=False)):
            raw = text.encode()
            assert body_json.loads(raw, MAX_NESTING) == json.loads(raw)
            k = rng.randrange(len(raw))
            bad = raw[:k] + rng.choice([b",", b"]", b"}", b'"', b"\\", b"", b":", b" "]) + raw[k + 1:]
            try:
                want = json.loads(bad)
            except ValueError:
                want = "error"
            try:
                got = body_json.loads(bad, MAX_NESTING)
            except ValueError:
                got = "error"
            assert got == want, bad
    raw = b'{"a": 1, "b": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], "a": [2]}'
    assert list(body_json.loads(raw, MAX_NESTING).items()) == list(json.loads(raw).items())


def test_nesting_is_refused_from_the_bytes():
    deep = b'{"x": ' + b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1) + b"}"
    with pytest.raises(body_json.BodyError) as e:
        body_json.loads(deep, MAX_NESTING)
    assert e.value.nested
    ok = b'{"x": "' + b"[" * 1000 + b'"}'  # brackets inside a string are no nesting
    assert body_json.loads(ok, MAX_NESTING) == {"x": "[" * 1000}
