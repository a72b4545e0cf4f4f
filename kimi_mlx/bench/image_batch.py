"""Images in the batching server, on micro-vision:

1. the others' decode while an image request is prefilled: 3 requests stream (their EOS
   suppressed by logit_bias, so they decode throughout), then a request with one picture
   and a long text (`--words`) arrives; prints the largest inter-token gap of the three
   inside its prefill window (its arrival to its first token), their median gap outside
   it, and its time to first token;
2. the vision tower's runs for a 3-turn conversation with 2 pictures (the server's
   `kimi_mlx_vision_tower_runs_total`, or images counted by hand where the server has
   none).

    python -m kimi_mlx.bench.image_batch [--model PATH] [--words 600] [--rounds 3]

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


def _decode_gaps(svc, words: int) -> dict:
    """Section 1 (module doc) on a running server, through its engine (each token's
    arrival is timed, not the HTTP chunks, which carry text, not tokens)."""

    from kimi_mlx.generation.request import build_chat_prompt_with_ends
    from kimi_mlx.sampling import Sampling
    from kimi_mlx.server.images import cache_key
    from kimi_mlx.server.jobs import Job, TokenOut

    vision, pad = svc.images.vision, svc.images.pad_id

    def image_job(n, word, seed):
        """A request with `words` words then a picture: its own words and picture, so
        that neither the prompt cache nor the tower cache holds any of it."""
        image = vision.load_image(base64.b64decode(_picture("circle", "red", seed).split(",", 1)[1]))
        filler = " ".join(f"{word}{i}" for i in range(words))
        msgs = [{"role": "user", "content": [{"type": "text", "text": filler},
                                             {"type": "image", "media": image},
                                             {"type": "text", "text": "What is in the image?"}]}]
        ids, ends = build_chat_prompt_with_ends(svc.tok, msgs, "low")
        job = Job(list(ids), n, segment_ends=ends, images=[image],
                  key=cache_key(ids, [image], pad))
        job.attach(None)
        return job

    no_eos = Sampling(logit_bias={e: -100.0 for e in svc.tok.eos_token_ids})
    stamps = {i: [] for i in range(3)}

    def run(job, out):
        for ev in job.events():
            if isinstance(ev, TokenOut):
                out.append(time.perf_counter())

    warm = image_job(2, "warm", 8)  # warm-up: the tower loaded, graphs built
    svc.engine.submit(warm)
    run(warm, [])
    texts = []
    for i in range(3):
        tids, _ = build_chat_prompt_with_ends(
            svc.tok, [{"role": "user", "content": f"Tell story {i}."}], "low")
        job = Job(tids, 300, sampling=no_eos)
        job.attach(None)
        texts.append(job)
    threads = [threading.Thread(target=run, args=(j, stamps[i])) for i, j in enumerate(texts)]
    for j in texts:
        svc.engine.submit(j)
    for t in threads:
        t.start()
    while min(len(v) for v in stamps.values()) < 20:
        time.sleep(0.005)
    img_stamps = []
    t0 = time.perf_counter()
    job = image_job(3, "word", 7)
    svc.engine.submit(job)
    run(job, img_stamps)
    t_first = img_stamps[0]
    for t in threads:
        t.join()
    inside, outside = [], []
    for v in stamps.values():
        for a, b in zip(v, v[1:]):
            (inside if b > t0 and a < t_first else outside).append(b - a)
    return {"image_prompt_tokens": len(job.ids), "image_ttft_s": round(t_first - t0, 3),
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
    p.add_argument("--words", type=int, default=600, help="text before the picture")
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
            row = _decode_gaps(svc, args.words)
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
