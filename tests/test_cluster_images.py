"""Images through the pipeline: 3 loopback stages of a random checkpoint with vision weights.
The head runs the tower and sends the rows to stage 0 (in prefill chunks that split an
image's pads); `cluster launch --image` prints what `kimi-mlx generate --image` prints, and
`cluster server` answers image requests with the greedy tokens of a cache-free one-process
reference, its stage prompt cache never sharing a prefix past an image that differs."""

import os
import subprocess
import sys

import httpx
import openai
import pytest

from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.generation.images import Vision
from kimi_mlx.generation.request import build_chat_prompt_with_ends
from kimi_mlx.testing.checkpoints import build_checkpoint, tiny_text_config, tiny_vision_config
from kimi_mlx.testing.cluster import LocalCluster, ServerProc
from kimi_mlx.testing.ports import free_ports
from kimi_mlx.text.tokenizer import KimiTokenizer
from test_server_images import data_url, greedy_reference, png


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("vcl")
    ckpt = build_checkpoint(work / "tiny", text_config=tiny_text_config(num_experts_per_token=8),
                            seed=2, conditioned=True, vision=tiny_vision_config())
    c = LocalCluster(work, n=3, prefix="vstage", ckpt=ckpt)
    try:
        yield c
    finally:
        c.stop()


def _run(cmd, timeout=180):
    return subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main"] + cmd, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _body(stdout: str) -> str:
    return "\n".join(l for l in stdout.splitlines()
                     if not l.startswith(("Prompt:", "Generation:", "Peak memory:")))


@pytest.mark.e2e  # a whole launch + generate --image run; the cluster server's image test stays in make test
def test_launch_with_images_prints_what_generate_prints(cluster, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.jpg"
    a.write_bytes(png(112, 84, 0))  # 12 image tokens: split over 3 prefill chunks of 5
    b.write_bytes(png(60, 30, 1, "JPEG"))
    flags = ["--model", str(cluster.ckpt), "--prompt", "Compare the pictures.", "--image", str(a),
             "--image", str(b), "--max-tokens", "8", "--reasoning-effort", "low"]
    nodes = ",".join(p.address for p in cluster.procs)
    launch = _run(["cluster", "launch", "--nodes", nodes, "--secret-file", str(cluster.secret_file),
                   "--prefill-chunk", "5", "--activation-dtype", "float32", "--wire-dtype",
                   "float32"] + flags)
    gen = _run(["generate"] + flags)
    assert launch.returncode == 0, launch.stderr
    assert gen.returncode == 0, gen.stderr
    prompt_line = [l for l in gen.stdout.splitlines() if l.startswith("Prompt:")][0]
    assert prompt_line.split(",")[0] in launch.stdout  # the same prompt token count
    assert _body(launch.stdout) == _body(gen.stdout)
    assert "stage 2" in launch.stderr


def test_launch_image_errors(cluster, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    nodes = ",".join(p.address for p in cluster.procs)
    r = _run(["cluster", "launch", "--nodes", nodes, "--secret-file", str(cluster.secret_file),
              "--model", str(cluster.ckpt), "--prompt", "hi", "--image", str(bad)])
    assert r.returncode == 2 and "bad.png: corrupt or truncated image" in r.stderr
    text_only = build_checkpoint(tmp_path / "text", extras=False)
    good = tmp_path / "ok.png"
    good.write_bytes(png(28, 28, 0))
    r = _run(["cluster", "launch", "--nodes", nodes, "--secret-file", str(cluster.secret_file),
              "--model", str(text_only), "--prompt", "hi", "--image", str(good)])
    assert r.returncode == 2 and "no vision weights" in r.stderr


def test_server_images_and_cache_isolation(cluster):
    srv = ServerProc(cluster, free_ports(1)[0], "--prefill-chunk", "5")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0)
        a, b = png(56, 56, 10), png(56, 56, 11)

        def msgs(raw):
            return [{"role": "system", "content": "You look at pictures."},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(raw)}},
                                                 {"type": "text", "text": "What is it?"}]},
                    {"role": "assistant", "content": "A picture."},
                    {"role": "user", "content": "More?"}]

        def ask(raw):
            return c.chat.completions.create(model="micro", max_tokens=5, temperature=0,
                                             logprobs=True, messages=msgs(raw))

        # A, B, A, then B again: the fourth restores B's snapshots past the image, which
        # a stage key without the images' digests would have answered from A's (issue 34)
        ra, rb, ra2, rb2 = ask(a), ask(b), ask(a), ask(b)
        # the head's tower ran once per image: the repeats took its cached rows
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer x"},
                            timeout=30).text.splitlines()
        assert "kimi_mlx_vision_tower_runs_total 2.0" in metrics
        assert "kimi_mlx_vision_tower_cache_hits_total 2.0" in metrics
        model, _, _ = load_model(cluster.ckpt, verbose=False)
        tok = KimiTokenizer.from_pretrained(cluster.ckpt)
        vision = Vision(cluster.ckpt)
        pad = tok.special_tokens["<|media_pad|>"]
        got = {}
        for raw, r in ((a, ra), (b, rb)):
            im = vision.load_image(raw)
            chat = msgs(raw)
            chat[1] = {"role": "user", "content": [{"type": "image", "media": im},
                                                   {"type": "text", "text": "What is it?"}]}
            ids, _ = build_chat_prompt_with_ends(tok, chat, "max")
            want = greedy_reference(model, vision, pad, ids, [im], 5, set(tok.eos_token_ids))
            assert r.usage.prompt_tokens == len(ids)
            assert [bytes(e.bytes) for e in r.choices[0].logprobs.content] == \
                [tok.decode_bytes([t]) for t in want]
            got[raw] = want
        first_pad = ids.index(pad)
        assert got[a] != got[b]  # the image matters
        assert rb.usage.prompt_tokens_details.cached_tokens <= first_pad
        assert ra2.usage.prompt_tokens_details.cached_tokens > first_pad
        assert [e.bytes for e in ra2.choices[0].logprobs.content] == \
            [e.bytes for e in ra.choices[0].logprobs.content]
        assert rb2.usage.prompt_tokens_details.cached_tokens > first_pad
        assert [e.bytes for e in rb2.choices[0].logprobs.content] == \
            [e.bytes for e in rb.choices[0].logprobs.content]
    finally:
        srv.stop()
