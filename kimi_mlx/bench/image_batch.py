"""Images in the batching server (issue 37, parts 3 and 4), on micro-vision:

1. the others' decode while an image request is prefilled: 3 requests stream (their EOS
   suppressed by logit_bias, so they decode throughout), then a request with one picture
   and a long text (`--words`) arrives; prints the largest inter-token gap of the three
   inside its prefill window (its arrival to its first token), their median gap outside
   it, and its time to first token;
2. the vision tower's runs for a 3-turn conversation with 2 pictures (the server's
   `kimi_mlx_vision_tower_runs_total`, or images counted by hand where the server has
   none).

    python -m kimi_mlx.bench.image_batch [--model PATH] [--words 900] [--rounds 3]

Each round uses a fresh in-process server (max_concurrency 4, prompt cache on); the
figures printed are per round and their medians.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import threading
import time
from pathlib import Path

ASSET = Path(__file__).resolve().parents[1] / "assets" / "micro-vision"


def _picture(shape: str, colour: str, seed: int) -> str:
    import numpy as np

    from kimi_mlx.micro.vision_train import draw

    buf = io.BytesIO()
    draw(shape, colour, np.random.default_rng(seed)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_msg(url: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def _decode_gaps(client, svc, words: int) -> dict:
    """Section 1 (module doc) on a running server."""
    filler = " ".join(f"word{i}" for i in range(words))
    image = [{"role": "user", "content": [{"type": "text", "text": filler}]
              + _image_msg(_picture("circle", "red", 7), "What is in the image?")["content"]}]
    # warm-up: the tower loaded, graphs of both kinds built
    client.chat.completions.create(model="m", messages=image, max_tokens=2, temperature=0)
    no_eos = {str(e): -100 for e in svc.tok.eos_token_ids}
    stamps = {i: [] for i in range(3)}

    def stream(i):
        for _ in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Tell story {i}."}],
                max_tokens=300, temperature=0, stream=True, logit_bias=no_eos):
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    while min(len(v) for v in stamps.values()) < 20:
        time.sleep(0.005)
    t0, t_first = time.perf_counter(), None
    for chunk in client.chat.completions.create(model="m", messages=image, max_tokens=3,
                                                temperature=0, stream=True):
        if t_first is None and chunk.choices:
            d = chunk.choices[0].delta
            if d.content or getattr(d, "reasoning_content", None):
                t_first = time.perf_counter()
    t_first = t_first or time.perf_counter()
    for t in threads:
        t.join()
    inside, outside = [], []
    for v in stamps.values():
        for a, b in zip(v, v[1:]):
            (inside if b > t0 and a < t_first else outside).append(b - a)
    return {"image_ttft_s": round(t_first - t0, 3),
            "max_gap_during_image_prefill_ms": round(1000 * max(inside), 1) if inside else None,
            "median_gap_otherwise_ms": round(1000 * statistics.median(outside), 1)}


def _tower_runs(client, srv, svc) -> dict:
    """Section 2 (module doc) on a running server: tower runs of a 3-turn conversation."""
    import re

    import httpx

    def runs():
        text = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k"}).text
        m = re.search(r"^kimi_mlx_vision_tower_runs_total ([0-9.]+)$", text, re.M)
        return float(m.group(1)) if m else None

    before = runs()
    counted = []
    vision = svc.images.vision
    if before is None:  # a server without the counter: count the tower's calls by hand
        model = vision.model
        inner = type(model).__call__

        class Counting(type(model)):
            def __call__(self, patches, grids):
                counted.extend(grids)
                return inner(self, patches, grids)

        model.__class__ = Counting
    chat = [_image_msg(_picture("circle", "red", 21), "What is in the image?")]
    for turn in range(3):
        r = client.chat.completions.create(model="m", messages=chat, max_tokens=16, temperature=0)
        chat.append({"role": "assistant", "content": r.choices[0].message.content})
        chat.append(_image_msg(_picture("square", "blue", 22), "What is in the image?")
                    if turn == 0 else {"role": "user", "content": "And the first one?"})
    after = runs()
    return {"tower_runs_3_turns_2_images": (after - before) if before is not None else len(counted)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ASSET))
    p.add_argument("--words", type=int, default=900, help="text before the picture")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import openai

    from kimi_mlx.testing.servers import start_server, stop_server

    rows = []
    for _ in range(args.rounds):
        srv, svc = start_server(args.model, "k", "m", 8 << 20, max_concurrency=4)
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0,
                                   timeout=600)
            row = _decode_gaps(client, svc, args.words)
            row.update(_tower_runs(client, srv, svc))
        finally:
            stop_server(srv, svc)
        print(json.dumps(row), flush=True)
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if rows[0][k] is not None}
    print("median:", json.dumps(med))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
