"""`kimi_mlx.testing.health.wait_healthy`, against a real HTTP server (the standard
library's) and real processes: it returns once /health says 200 (not on the 503 before),
fails at once naming the url, the exit status and the output's tail when the process
dies first, and names the url and the last answer at its deadline."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time

import pytest

from kimi_mlx.testing.health import wait_healthy
from kimi_mlx.testing.ports import free_ports


class _Health(http.server.BaseHTTPRequestHandler):
    ready_at = 0.0  # monotonic time from which /health answers 200
    seen = []

    def do_GET(self):
        code = 200 if time.monotonic() >= self.ready_at else 503
        _Health.seen.append((self.path, code))
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Health.seen = []
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_waits_through_503_until_200(server):
    _Health.ready_at = time.monotonic() + 0.6
    took = wait_healthy(server, 30, poll_s=0.05)
    assert took >= 0.5
    assert [p for p, _ in _Health.seen] == ["/health"] * len(_Health.seen)
    assert 503 in [c for _, c in _Health.seen] and _Health.seen[-1][1] == 200


def test_a_process_that_dies_first_is_named_with_its_status_and_output():
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('model "
                             "folder missing\\n'); sys.exit(3)"], stderr=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            wait_healthy(f"http://127.0.0.1:{port}", 120, proc)
        assert time.monotonic() - t0 < 60  # at once, not at the deadline
    finally:
        proc.wait(30)
    msg = str(e.value)
    assert f"http://127.0.0.1:{port}/health" in msg
    assert "status 3" in msg and "model folder missing" in msg


def test_the_deadline_names_the_url_and_the_last_answer(server, tmp_path):
    _Health.ready_at = float("inf")
    log = tmp_path / "server.log"
    log.write_text("loading shard 2 of 2\n")
    with pytest.raises(RuntimeError) as e:
        wait_healthy(server + "/health", 0.5, output=log, poll_s=0.05)
    msg = str(e.value)
    assert f"{server}/health did not answer 200 within 0.5 s (last: 503)" in msg
    assert "loading shard 2 of 2" in msg


def test_nothing_listening_is_a_connection_error_at_the_deadline():
    port = free_ports(1)[0]
    with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{port}/health did not answer 200 "
                                           r"within 0\.3 s \(last: .*(Refused|refused)"):
        wait_healthy(f"http://127.0.0.1:{port}", 0.3, poll_s=0.05)
