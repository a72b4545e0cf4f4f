"""The chat page's image button in real headless Chromium (see test_web.py): a picked file
goes to the server as a data-URL `image_url` part before the text, the page shows it, and
the streamed reply equals the API's own non-streamed greedy reply for the same body. A
random checkpoint with vision weights (official layout) serves."""

import base64
import json

import httpx
import pytest

from kimi_mlx.testing.servers import served
from kimi_mlx.testing.checkpoints import build_checkpoint, tiny_text_config, tiny_vision_config
from test_server_images import png
from test_web import browser, page, settings, stored  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def vserver(tmp_path_factory):
    ckpt = build_checkpoint(tmp_path_factory.mktemp("vweb") / "tiny",
                            text_config=tiny_text_config(num_experts_per_token=8), seed=2,
                            conditioned=True, vision=tiny_vision_config())
    with served(str(ckpt), None, "tiny", 8 << 20) as (srv, _svc):
        yield srv


def test_attach_an_image_and_the_reply_equals_the_api(vserver, page, tmp_path):
    raw = png(84, 56, 3)
    path = tmp_path / "shape.png"
    path.write_bytes(raw)
    page.goto(vserver.url + "/")
    page.wait_for_selector("#status .ok")
    settings(page, max_tokens="6")
    page.set_input_files("#image-file", str(path))
    page.wait_for_selector("#attachments img")
    page.fill("#prompt", "What is in the image?")
    with page.expect_request("**/v1/chat/completions") as req:
        page.press("#prompt", "Enter")
    page.wait_for_selector('.msg.assistant[data-done="1"]', timeout=60000)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    sent = json.loads(req.value.post_data)["messages"]
    assert sent == [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is in the image?"}]}]
    assert page.locator(".msg.user .images img").count() == 1
    assert page.inner_text(".msg.user .content") == "What is in the image?"
    assert page.is_hidden("#attachments")  # sent with this message only
    want = httpx.post(vserver.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": sent, "max_tokens": 6, "temperature": 0,
        "reasoning_effort": "low"}).json()
    msg = want["choices"][0]["message"]
    reply = stored(page)[0]["messages"][1]
    assert reply["content"] == msg["content"]
    assert reply["reasoning_content"] == msg.get("reasoning_content", "")
    assert reply["stats"]["tokens"] == want["usage"]["completion_tokens"]
    # a reload shows the image again (kept in the conversation)
    page.reload()
    page.wait_for_selector(".msg.user .images img")


def test_a_file_that_is_not_an_image_is_refused(vserver, page, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not an image")
    page.goto(vserver.url + "/")
    page.wait_for_selector("#status .ok")
    page.set_input_files("#image-file", str(path))
    page.wait_for_selector("#error:not([hidden])")
    assert "notes.txt: not a PNG, JPEG, WebP or GIF image" in page.inner_text("#error")
    assert page.is_hidden("#attachments")
