"""The chat page at / in real headless Chromium (Debian's `chromium`, driven by
playwright with `executable_path`; nothing is downloaded). Skipped, with the reason, when
chromium or playwright is missing (`make install` installs both where it can).

References are independent of the page: the API's own non-streamed greedy reply for the
same request, the server's /metrics, the request bodies the browser actually sent."""

import json
import os
import re
import shutil
import time

import httpx
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.server.jobs import Finished
from kimi_mlx.testing.servers import sibling_server

from fixtures.scripted import ScriptedEngine

MICRO = str(default_model())
KEY = "sk-page-key"
CHROMIUM = os.environ.get("KIMI_MLX_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium, or set KIMI_MLX_CHROMIUM)")
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _browser_or_skip()
    # the OpenBLAS preload (Makefile, LD_PRELOAD) breaks thread creation in playwright's
    # node driver and in chromium: both start without it (this process keeps its BLAS)
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        p = sync_playwright().start()
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, env=dict(os.environ),
                              args=["--no-sandbox", "--disable-gpu"])
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    yield b
    b.close()
    p.stop()


@pytest.fixture(scope="module")
def server(micro_server):
    """The session's one-process server on micro (tests/fixtures/shared.py): the tests
    read it, or put their own key or engine in front of its model (`_shared`)."""
    return micro_server


def _shared(real, key=None, engine=None):
    """Another app over the same model (another key or engine), on its own port."""
    return sibling_server(real, engine, api_key=key)


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1100, "height": 760})
    pg = ctx.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # console errors too (a Content-Security-Policy violation is one), except the
    # browser's own line for a refused request (the 401 test makes those on purpose)
    pg.on("console", lambda m: m.type == "error" and "Failed to load resource" not in m.text
          and errors.append(m.text))
    yield pg
    ctx.close()
    assert not errors, errors


def settings(pg, effort="low", temperature="0", max_tokens="24"):
    pg.select_option("#effort", effort)
    pg.fill("#temperature", temperature)
    pg.fill("#max-tokens", max_tokens)


def ask(pg, text, n_done):
    """Type `text`, send it, wait for the n_done-th finished assistant reply."""
    pg.fill("#prompt", text)
    pg.press("#prompt", "Enter")
    pg.wait_for_selector(f'.msg.assistant[data-done="1"] >> nth={n_done - 1}', timeout=60000)


def until(pg, js, timeout=60.0):
    """Poll `js` (an expression) in the page until it is truthy (wait_for_function
    evaluates strings, which the page's Content-Security-Policy forbids)."""
    deadline = time.monotonic() + timeout
    while not pg.evaluate(js):
        assert time.monotonic() < deadline, f"timed out waiting for {js}"
        time.sleep(0.1)


def stored(pg):
    return pg.evaluate("JSON.parse(localStorage.getItem('kimi-mlx.conversations'))")


def test_page_is_served_offline_with_its_licences(server):
    url = server[0].url
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    srcs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert srcs and not [s for s in srcs if "//" in s]  # nothing from another host
    for s in srcs:
        assert httpx.get(f"{url}/{s}").status_code == 200, s
    for lic, words in (("marked.LICENSE", "MIT license"), ("dompurify.LICENSE", "Apache License"),
                       ("dompurify.LICENSE-MPL", "Mozilla Public License"),
                       ("highlight.js.LICENSE", "BSD 3-Clause")):
        assert words in httpx.get(f"{url}/web/vendor/{lic}").text, lic
    assert "marked.LICENSE" in httpx.get(f"{url}/web/vendor/README.txt").text


def test_streamed_reply_equals_the_api_then_reload_and_second_turn(server, page, tmp_path_factory):
    srv, _ = server
    page.goto(srv.url + "/")
    page.wait_for_selector("#status .ok")
    settings(page)
    ask(page, "Name a colour.", 1)
    conv = stored(page)[0]
    user, reply = conv["messages"]
    want = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "micro", "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 24, "temperature": 0, "reasoning_effort": "low"}).json()
    msg = want["choices"][0]["message"]
    assert reply["reasoning_content"] == msg.get("reasoning_content", "")
    assert reply["content"] == msg["content"]
    assert reply["reasoning_content"] + reply["content"]  # compares something
    assert page.text_content(".msg.assistant .reasoning-text") == reply["reasoning_content"]
    assert not page.eval_on_selector(".msg.assistant details.reasoning", "d => d.open")  # collapsed
    st = reply["stats"]
    assert st["tokens"] == want["usage"]["completion_tokens"] == 24 and st["ttft"] > 0 and st["tps"] > 0
    stats = page.inner_text(".msg.assistant .stats")
    assert "24 tokens" in stats and "tok/s" in stats and "cached prompt tokens" in stats and "TTFT" in stats
    page.click(".msg.assistant details.reasoning summary")  # opened by hand for the picture
    shot = tmp_path_factory.mktemp("web") / "chat-after-reply.png"
    page.screenshot(path=str(shot))
    print(f"\nscreenshot: {shot}")
    # reload: the conversation comes back from localStorage
    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.locator(".msg").count() == 2
    assert page.inner_text(".msg.user .content") == "Name a colour."
    assert page.text_content(".msg.assistant .reasoning-text") == reply["reasoning_content"]
    # the second turn sends the first reply back whole, reasoning included
    settings(page, max_tokens="4")
    with page.expect_request("**/v1/chat/completions") as req:
        ask(page, "And another?", 2)
    body = json.loads(req.value.post_data)
    assert body["messages"] == [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": reply["content"], "reasoning_content": reply["reasoning_content"]},
        {"role": "user", "content": "And another?"}]
    assert body["stream"] and body["reasoning_effort"] == "low" and body["max_tokens"] == 4
    assert len(stored(page)[0]["messages"]) == 4


def _metric(url, name):
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_stop_button_cancels_the_generation_on_the_server(server, page):
    srv, svc = server
    cancelled = 'kimi_mlx_finished_requests_total{reason="cancelled"}'
    before, gen_before = _metric(srv.url, cancelled), _metric(srv.url, "kimi_mlx_generation_tokens_total")
    page.goto(srv.url + "/")
    settings(page, max_tokens="3000")
    page.fill("#prompt", "Tell me a long story.")
    page.press("#prompt", "Enter")
    until(page, "document.querySelector('.msg.assistant .reasoning-text')?.textContent.length > 5")
    page.click("#stop")
    page.wait_for_selector('.msg.assistant[data-done="1"]', timeout=10000)
    assert "stopped" in page.inner_text(".msg.assistant .stats")
    deadline = time.monotonic() + 30
    while _metric(srv.url, cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(srv.url, cancelled) == before + 1
    assert svc.engine.active == 0
    generated = _metric(srv.url, "kimi_mlx_generation_tokens_total") - gen_before
    print(f"\nstopped after {generated:.0f} of 3000 tokens")
    assert generated < 1000  # not 3000
    assert not page.is_disabled("#send")


XSS_REPLY = (
    "Planning <b>bold</b> <img src=x onerror=\"window.__xss='reasoning'\"><|close|>think<|sep|>"
    "<|open|>response<|sep|>Here:\n\n<img src=x onerror=\"window.__xss='img'\">\n\n"
    "[click me](javascript:window.__xss='link') and <a href=\"javascript:window.__xss='a'\">this</a>"
    "<script>window.__xss='script'</script>\n\n```python\nprint('hi')\n```\n"
    "<|close|>response<|sep|>"
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"
)


def test_model_output_is_sanitized_and_tool_calls_shown(server, page, tmp_path_factory):
    _, real = server
    srv = _shared(real, engine=ScriptedEngine(delay=0.002, tokens=real.tok.encode(XSS_REPLY, allow_special=True)))
    try:
        page.goto(srv.url + "/")
        settings(page, max_tokens="400")
        ask(page, "Show me", 1)
        content = page.locator(".msg.assistant .content")
        assert "Here:" in content.inner_text() and "print('hi')" in content.inner_text()
        assert page.locator(".msg.assistant .content img").count() <= 1
        assert page.evaluate("""() => [...document.querySelectorAll('.msg *')].every(e =>
            [...e.attributes].every(a => !a.name.startsWith('on') && !/^\\s*javascript:/i.test(a.value)))""")
        assert page.locator(".msg.assistant .content script").count() == 0
        for link in page.locator(".msg.assistant .content a").all():
            link.click()
        page.wait_for_timeout(300)
        assert page.evaluate("window.__xss") is None
        # the renderer itself, on the payloads
        html = page.evaluate("""() => kimiChat.renderMarkdown(
            '<img src=x onerror=alert(1)> [x](javascript:alert(1)) <a href="javascript:alert(2)">y</a>')""")
        assert "onerror" not in html and "javascript:" not in html and "<img" in html
        # reasoning is text, never HTML
        assert "<b>bold</b>" in page.text_content(".msg.assistant .reasoning-text")
        # the code block is highlighted and has a copy button; the tool call is shown
        assert page.locator(".msg.assistant pre code.hljs").count() == 1
        assert page.locator(".msg.assistant pre button.copy").count() == 1
        call = page.inner_text(".msg.assistant .tool-call")
        assert "get_weather" in call and "Paris" in call and "functions.get_weather:1" in call
        page.screenshot(path=str(tmp_path_factory.mktemp("web") / "chat-markdown.png"))
    finally:
        srv.stop()


def test_api_key_is_asked_for_and_a_wrong_one_shows_the_401(server, page):
    _, real = server
    srv = _shared(real, key=KEY)
    urls = []
    page.on("request", lambda r: urls.append(r.url))
    try:
        page.goto(srv.url + "/")
        settings(page, max_tokens="2")
        page.fill("#prompt", "Hello")
        page.press("#prompt", "Enter")
        page.wait_for_selector("#key-dialog[open]")
        assert "401" in page.inner_text("#error") and "missing API key" in page.inner_text("#error")
        page.fill("#api-key", "sk-wrong")
        page.click("#key-save")
        until(page, "document.querySelector('#error').textContent.includes('invalid API key')")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#api-key", KEY)
        page.click("#key-save")
        page.wait_for_selector('.msg.assistant[data-done="1"]', timeout=60000)
        assert page.is_hidden("#error")
        assert stored(page)[0]["messages"][-1]["stats"]["tokens"] == 2
        assert not [u for u in urls if KEY in u or "sk-wrong" in u]  # never in a URL
        # asked once: a reload keeps the key
        page.reload()
        ask(page, "Again", 2)
        assert page.is_hidden("#key-dialog") or not page.locator("#key-dialog[open]").count()
    finally:
        srv.stop()


def test_a_request_cancelled_while_queued_is_counted(server):
    """A job whose client left before it started ends as cancelled, in /metrics too."""
    from kimi_mlx.server.jobs import Job

    srv, svc = server
    cancelled = 'kimi_mlx_finished_requests_total{reason="cancelled"}'
    before = _metric(srv.url, cancelled)
    job = Job(svc.tok.encode("Hello"), 4)
    job.attach(None)
    job.cancel()
    svc.engine.submit(job)
    (ev,) = list(job.events(timeout=60))
    assert isinstance(ev, Finished) and ev.reason == "cancelled"
    assert _metric(srv.url, cancelled) == before + 1


def test_conversations_new_rename_export_delete(server, page, tmp_path):
    _, real = server
    srv = _shared(real, engine=ScriptedEngine(delay=0.002, tokens=real.tok.encode(
        "Hm.<|close|>think<|sep|><|open|>response<|sep|>Blue.<|close|>response<|sep|><|close|>message<|sep|>",
        allow_special=True)))
    try:
        page.goto(srv.url + "/")
        ask(page, "First question", 1)
        page.click("#new-chat")
        ask(page, "Second question", 1)
        assert page.locator("#conversations li").all_inner_texts() == ["Second question", "First question"]
        page.once("dialog", lambda d: d.accept("Renamed"))
        page.click("#rename-chat")
        assert page.inner_text("#conversations li.current") == "Renamed"
        with page.expect_download() as dl:
            page.click("#export-chat")
        path = tmp_path / "export.json"
        dl.value.save_as(path)
        exported = json.loads(path.read_text())
        assert exported["title"] == "Renamed"
        assert [(m["role"], m["content"]) for m in exported["messages"]] == [
            ("user", "Second question"), ("assistant", "Blue.")]
        assert exported["messages"][1]["reasoning_content"] == "Hm."
        page.once("dialog", lambda d: d.accept())
        page.click("#delete-chat")
        assert page.locator("#conversations li").all_inner_texts() == ["First question"]
        page.reload()
        assert page.inner_text(".msg.user .content") == "First question"
        assert page.inner_text(".msg.assistant .content") == "Blue."
    finally:
        srv.stop()
