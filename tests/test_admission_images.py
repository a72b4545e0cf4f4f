"""Images are sized from their headers before any is decoded: a decompression bomb (a
19999 x 19999 PNG of a few tens of KB) sent to `kimi-mlx server` on micro-vision (context
4096) is a 400 naming the image, its token count and the context, and Pillow never
decodes a pixel of it (spied on `load` / `convert`, not timed). The same for three
bombs at once, on the chat, messages and Responses routes, and for the per-request
pixel limit (--max-image-pixels). An ordinary image still decodes and is answered.

The expected token count, 16641, is K3's processor rule worked by hand (K31_SPEC.md
section 7): 19999 // 14 = 1428 patches a side, scale sqrt(65536 / 1428^2) = 0.17927,
int(19999 * 0.17927) = 3585 px, padded to 3612 = 129 * 28, so 129 x 129 tokens; it is
also the count the issue measured after a full decode."""

import base64
import io
import struct
import threading
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageFile

from kimi_mlx.testing.servers import served
from kimi_mlx.vision.preprocess import image_size

MICRO_VISION = str(Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-vision")
KEY = "sk-test"
BOMB_SIDE = 19999
BOMB_TOKENS = 16641  # by hand, module docstring
CONTEXT = 4096


def bomb_png(side: int = BOMB_SIDE) -> bytes:
    """A side x side 1-bit greyscale PNG of zeros, written with zlib row by row (never
    held decoded): ~50 MB of pixels in a few tens of KB."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    body = b"".join(z.compress(row * 1000) for _ in range(side // 1000))
    body += z.compress(row * (side % 1000)) + z.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body)
            + chunk(b"IEND", b""))


def small_png(w: int = 64, h: int = 48, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def bomb():
    return bomb_png()


@pytest.fixture()
def decodes(monkeypatch):
    """Every Pillow decode / conversion in this process, recorded (the server runs in
    this process, on its worker threads)."""
    calls = []
    lock = threading.Lock()
    for cls, name in ((ImageFile.ImageFile, "load"), (Image.Image, "load"),
                      (Image.Image, "convert")):
        real = getattr(cls, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            with lock:
                calls.append((_name, self.size))
            return _real(self, *a, **kw)

        monkeypatch.setattr(cls, name, spy)
    return calls


@pytest.fixture(scope="module")
def server():
    with served(MICRO_VISION, KEY, "micro", 8 << 20, max_kv_size=CONTEXT) as both:
        yield both


def _post(srv, path, body):
    return httpx.post(f"{srv.url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})


def _chat(url, text="what is this?"):
    return {"model": "micro", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}


def test_the_bomb_is_what_it_claims():
    data = bomb_png()
    assert len(data) < 400_000
    assert image_size(data) == (BOMB_SIDE, BOMB_SIDE)


def test_image_size_reads_the_header_only(bomb, decodes):
    small = small_png(64, 48)
    decodes.clear()  # (writing it decoded its array)
    assert image_size(bomb, name="x") == (BOMB_SIDE, BOMB_SIDE)
    assert image_size(small) == (64, 48)
    assert decodes == []


def test_bomb_is_refused_from_its_header(server, bomb, decodes):
    srv, _ = server
    r = _post(srv, "/v1/chat/completions", _chat(data_url(bomb)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("messages[0].content[1]:"), err
    assert f"{BOMB_TOKENS} tokens" in err["message"] and f"{CONTEXT} tokens" in err["message"], err
    assert f"{BOMB_SIDE}x{BOMB_SIDE}" in err["message"]
    assert err["param"] == "messages"
    assert decodes == [], decodes


def test_three_bombs_at_once_decode_nothing(server, bomb, decodes):
    srv, _ = server
    out = [None] * 3

    def send(i):
        out[i] = _post(srv, "/v1/chat/completions", _chat(data_url(bomb), f"bomb {i}"))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [r.status_code for r in out] == [400] * 3, [r.text for r in out]
    assert all(f"{BOMB_TOKENS} tokens" in r.json()["error"]["message"] for r in out)
    assert decodes == [], decodes


def test_bomb_on_messages_and_responses_routes(server, bomb, decodes):
    srv, _ = server
    b64 = base64.b64encode(bomb).decode()
    r = _post(srv, "/v1/messages", {"model": "micro", "max_tokens": 4, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": "what?"}]}]})
    assert r.status_code == 400, r.text
    assert "messages[0].content[0]" in r.text and f"{BOMB_TOKENS} tokens" in r.text
    r = _post(srv, "/v1/responses", {"model": "micro", "max_output_tokens": 4, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(bomb)}]}]})
    assert r.status_code == 400, r.text
    assert f"{BOMB_TOKENS} tokens" in r.json()["error"]["message"]
    assert decodes == [], decodes


def test_pixels_per_request_are_bounded_before_decoding(server, decodes):
    srv, svc = server
    a, b = small_png(64, 48, 1), small_png(64, 48, 2)
    decodes.clear()  # (writing them decoded their arrays)
    saved = svc.images.max_pixels
    svc.images.max_pixels = 64 * 48 + 100  # room for one, not two
    try:
        body = _chat(data_url(a))
        body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": data_url(b)}})
        r = _post(srv, "/v1/chat/completions", body)
    finally:
        svc.images.max_pixels = saved
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("messages[0].content[2]:") and str(2 * 64 * 48) in msg, msg
    assert "--max-image-pixels" in msg
    assert decodes == [], decodes


def test_an_ordinary_image_is_decoded_and_answered(server, decodes):
    srv, _ = server
    url = data_url(small_png(64, 48, 3))
    decodes.clear()
    r = _post(srv, "/v1/chat/completions", _chat(url))
    assert r.status_code == 200, r.text
    assert any(name == "load" and size == (64, 48) for name, size in decodes), decodes
