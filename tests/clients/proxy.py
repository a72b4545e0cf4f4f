"""A recording HTTP proxy for the real-client tests (tests/test_clients.py).

It sits between a client program (Claude Code, Codex, ...) and `kimi-mlx server`, forwards
every request unchanged (streamed responses stay streamed) and appends one JSON line per
request to a log file: method, path, the request body (parsed JSON when it is JSON), the
status, the time to the first response byte and the total time (seconds), and the
response body (its first `RESPONSE_CAP` characters; SSE streams included, so a test can
read `cache_read_input_tokens` from an Anthropic stream).

Run on its own to capture what a client sends:

    .venv/bin/python tests/clients/proxy.py --upstream http://127.0.0.1:8080 --port 8081 \
        --log /tmp/requests.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

RESPONSE_CAP = 200_000  # characters of each response body kept in the log
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
        "accept-encoding"}


def make_app(upstream: str, log_path: Path) -> Starlette:
    """A Starlette app forwarding every method and path to `upstream` (a base URL such as
    http://127.0.0.1:8080) and appending one JSON record per request to `log_path`.
    Bodies are forwarded byte for byte, except for the (old, new) string pairs a test puts
    in `<log>.rewrite.json` (the record then says `"rewritten": true`)."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None))
    lock = threading.Lock()

    def record(entry: dict) -> None:
        with lock, log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    async def forward(request: Request):
        body = await request.body()
        t0 = time.monotonic()
        rewritten = False
        rewrite = log_path.with_name(log_path.name + ".rewrite.json")
        if rewrite.exists() and body:
            for old, new in json.loads(rewrite.read_text()):
                if old.encode() in body:
                    body, rewritten = body.replace(old.encode(), new.encode()), True
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        up = client.build_request(request.method, request.url.path, params=request.query_params,
                                  headers=headers, content=body)
        resp = await client.send(up, stream=True)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        entry = {"method": request.method, "path": request.url.path,
                 "query": str(request.query_params),
                 "headers": {k: v for k, v in headers.items()
                             if k.lower() not in ("authorization", "x-api-key")},
                 "body": parsed, "rewritten": rewritten, "status": resp.status_code,
                 "ttfb_s": None, "total_s": None}
        chunks: list[bytes] = []

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    if entry["ttfb_s"] is None:
                        entry["ttfb_s"] = round(time.monotonic() - t0, 3)
                    if sum(map(len, chunks)) < RESPONSE_CAP:
                        chunks.append(chunk)
                    yield chunk
            finally:
                await resp.aclose()
                entry["total_s"] = round(time.monotonic() - t0, 3)
                entry["response"] = b"".join(chunks).decode("utf-8", "replace")[:RESPONSE_CAP]
                record(entry)

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def read_log(log_path: Path) -> list[dict]:
    """The records written so far (a missing file is an empty list)."""
    if not log_path.exists():
        return []
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="base URL of kimi-mlx server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", type=Path, required=True, help="JSON-lines file to append to")
    a = p.parse_args(argv)
    uvicorn.run(make_app(a.upstream, a.log), host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
