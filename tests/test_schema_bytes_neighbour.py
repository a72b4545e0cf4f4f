"""What a neighbour's streamed reply pays while other clients keep sending multi-MB
bodies, measured in one run as ratios to the same neighbour alone: (1) 5 MB schemas,
refused from the body's bytes before any parsing (`common.load_body`'s schema scan)
against the same bodies parsed first and refused after (the scan turned off, in pieces
as `body_json` parses them, and with orjson in one call); (2) an Ollama /api/chat body
carrying a ~4 MB base64 image against the same image sent to /v1/chat/completions (the
Ollama route converts the parsed dict; it no longer writes and re-reads its JSON on the
event loop). The senders are separate processes (their own JSON encoding does not share
this process's GIL); the figures are printed, and the bounds are loose (the machine is
shared): the scan must cost less than the parse it replaces, and the Ollama route no
more than the OpenAI route's ratio plus a margin."""

import signal
import statistics
import subprocess
import sys
import time

import httpx
import orjson
import pytest

from kimi_mlx.generation.constrain import SchemaLimits
from kimi_mlx.generation.request import default_model
from kimi_mlx.server import body_json, common
from kimi_mlx.testing.servers import start_server, stop_server

SENDER = r'''
import base64, http.client, json, os, sys
port, kind = int(sys.argv[1]), sys.argv[2]
if kind == "schema":
    schema = {"type": "object", "properties": {f"prop_{k}": {"type": "string"} for k in range(150_000)}}
    path, body = "/v1/chat/completions", {"model": "micro", "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
else:  # a PNG signature, then noise: refused when the image is read, on either route
    b64 = base64.b64encode(b"\x89PNG\r\n\x1a\n" + os.urandom(3_000_000)).decode()
    if kind == "ollama":
        path, body = "/api/chat", {"model": "micro", "stream": False, "messages": [
            {"role": "user", "content": "x", "images": [b64]}]}
    else:
        path, body = "/v1/chat/completions", {"model": "micro", "max_tokens": 8, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url",
             "image_url": {"url": "data:image/png;base64," + b64}}]}]}
body = json.dumps(body).encode()
assert len(body) > 4_000_000
while True:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, body, {"Content-Type": "application/json"})
    r = c.getresponse(); r.read(); c.close()
    print(r.status, flush=True)
'''


def _neighbour(url: str) -> float:
    """Seconds from the request to the last streamed token of a 24-token reply."""
    t0, last = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": "micro", "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 24, "temperature": 0, "stream": True, "reasoning_effort": "low"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
    assert last is not None
    return last - t0


class _Senders:
    """Two sender processes looping `kind` bodies; `pause` / `resume` stop and continue
    them (SIGSTOP / SIGCONT), `settle` waits for two more answers (a change of the
    server's mode is then in effect) and returns their statuses."""

    def __init__(self, port: int, kind: str):
        self.procs = [subprocess.Popen([sys.executable, "-c", SENDER, str(port), kind],
                                       stdout=subprocess.PIPE, text=True) for _ in range(2)]

    def settle(self) -> list:
        statuses, deadline = [], time.monotonic() + 180
        while len(statuses) < 2 * len(self.procs):
            assert time.monotonic() < deadline, "no answer to the bodies"
            statuses += [p.stdout.readline().strip() for p in self.procs]
        return statuses

    def pause(self):
        for p in self.procs:
            p.send_signal(signal.SIGSTOP)

    def resume(self):
        for p in self.procs:
            p.send_signal(signal.SIGCONT)

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait(30)


def _ratios(srv, kind: str, modes: dict, rounds: int = 3, n: int = 3) -> dict:
    """Median over `rounds` of (neighbour seconds beside the senders in each mode) /
    (neighbour seconds alone, the senders paused, in the same round); `modes`: name ->
    a function that puts the server in that mode. The modes are interleaved, so that a
    change in the machine's load touches each alike."""
    _neighbour(srv.url)
    senders = _Senders(srv.port, kind)
    out = {m: [] for m in modes}
    try:
        for _ in range(rounds):
            senders.pause()
            time.sleep(0.3)
            alone = statistics.median(_neighbour(srv.url) for _ in range(n))
            senders.resume()
            for name, enter in modes.items():
                enter()
                statuses = senders.settle()
                assert set(statuses) == {"400"}, (name, statuses)
                out[name].append(statistics.median(_neighbour(srv.url) for _ in range(n)) / alone)
    finally:
        senders.close()
    return {m: statistics.median(r) for m, r in out.items()}


@pytest.fixture(scope="module")
def server():
    srv, svc = start_server(str(default_model()), None, "micro", 16 << 20, max_concurrency=2)
    svc.schema_limits = SchemaLimits(max_bytes=256 << 10, timeout_s=1.0)
    yield srv, svc
    stop_server(srv, svc)


def test_a_5mb_schema_refused_from_its_bytes_costs_a_neighbour_less_than_parsing_it(server, monkeypatch):
    srv, _ = server
    scan, value = common._schema_too_large, body_json.Document.value

    def mode(check, parse):
        return lambda: (monkeypatch.setattr(common, "_schema_too_large", check),
                        monkeypatch.setattr(body_json.Document, "value", parse))

    off = lambda *a: None  # noqa: E731 - before: parsed, then refused after parsing
    ratios = _ratios(srv, "schema", {
        "parsed in pieces": mode(off, value),
        "parsed by orjson": mode(off, lambda self: orjson.loads(self.raw)),
        "refused from the bytes": mode(scan, value)})
    print("\nneighbour beside 5 MB schema bodies / alone: " + ", ".join(
        f"{k} {r:.2f}" for k, r in ratios.items()))
    assert ratios["refused from the bytes"] < ratios["parsed in pieces"], ratios


def test_an_ollama_image_body_costs_a_neighbour_no_more_than_the_openai_route(server):
    srv, _ = server
    ratios = {}
    for kind in ("openai", "ollama"):
        ratios.update(_ratios(srv, kind, {kind: lambda: None}))
    print("\nneighbour beside ~4 MB image bodies / alone: " + ", ".join(
        f"{k} {r:.2f}" for k, r in ratios.items()))
    assert ratios["ollama"] < ratios["openai"] + 0.5, ratios
