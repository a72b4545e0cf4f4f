"""The real client programs end to end against `kimi-mlx server` on micro (issue 32).

Each test runs one agent program or library the way its users do, non-interactively, in a
fresh HOME and work folder, against a server on the shipped micro model with a 64k
context (`--max-kv-size 65536`, above micro's trained 4096: the agents' first prompts are
9k-40k tokens), through a recording proxy (tests/clients/proxy.py) that logs every
request and reply. Each asserts that the program exits 0, that every request it made got
a 2xx, and that what it printed holds the reply the server sent (micro is not
chat-tuned: the reply is noise, often all reasoning and an empty answer).

Slow (the server loads once, then a client takes 10 s - 2 min), so marked `clients`:
excluded from `make test`, run by `make test-clients`. The programs come from `make
clients` (pinned in tests/clients/); a missing one is a skip that says how to get it.
Only loopback: telemetry, update checks and nonessential traffic are off in each client's
configuration (tests/clients/drivers.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent / "clients"))
import drivers  # noqa: E402  (tests/clients/drivers.py)
from proxy import read_log  # noqa: E402

pytestmark = pytest.mark.clients

ROOT = Path(__file__).resolve().parents[1]
KIMI = Path(sys.executable).parent / "kimi-mlx"
RUN_TIMEOUT = 600  # seconds one client run may take before it is killed (a failure)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s:\n{log.read_text()[-3000:]}")


class Stack:
    """The server on micro and the recording proxy in front of it (`base_url`)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.server_log = tmp / "server.log"
        self.requests = tmp / "requests.jsonl"
        sport, pport = _free_port(), _free_port()
        self.procs = []
        from kimi_mlx.lifetime import child_env
        from kimi_mlx.testing.health import wait_healthy

        env = dict(os.environ)
        with self.server_log.open("w") as f:
            self.procs.append(subprocess.Popen(  # child_env: it ends with this process
                [str(KIMI), "server", "--port", str(sport), "--max-kv-size",
                 str(drivers.CONTEXT), "--max-tokens", str(drivers.MAX_TOKENS), "--quiet"],
                stdout=f, stderr=subprocess.STDOUT,
                env=child_env(env), start_new_session=True))
        # /health is 503 until the model has loaded
        wait_healthy(f"http://127.0.0.1:{sport}", 300, self.procs[0], output=self.server_log)
        plog = tmp / "proxy.log"
        penv = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
        with plog.open("w") as f:
            self.procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "clients" / "proxy.py"), "--upstream",
                 f"http://127.0.0.1:{sport}", "--port", str(pport), "--log",
                 str(self.requests)],
                stdout=f, stderr=subprocess.STDOUT, env=penv, start_new_session=True))
        _wait_ready(f"http://127.0.0.1:{pport}/v1/models", self.procs[1], plog, 60)
        self.base_url = f"http://127.0.0.1:{pport}"
        self.context = httpx.get(f"{self.base_url}/v1/models").json()["data"][0].get(
            "context_length")

    def mark(self) -> int:
        """The number of requests logged so far (pass to `since`)."""
        return len(read_log(self.requests))

    def since(self, mark: int) -> list[dict]:
        """The requests logged after `mark`, once each has finished."""
        return read_log(self.requests)[mark:]

    def server_errors(self, start: int) -> list[str]:
        """Tracebacks, ERROR lines and 4xx/5xx access-log lines (uvicorn's `"POST /path
        HTTP/1.1" 400 Bad Request`) the server logged after byte offset `start`."""
        text = self.server_log.read_text()[start:]
        return [ln for ln in text.splitlines() if "Traceback" in ln or " ERROR " in ln
                or re.search(r'HTTP/[\d.]+" [45]\d\d ', ln)]

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("clients"))
    if (s.context or 0) < drivers.CONTEXT:
        s.close()
        pytest.fail(f"the server serves micro with a {s.context}-token context although "
                    f"--max-kv-size {drivers.CONTEXT} was given: the clients' first prompts "
                    "(9k-40k tokens) cannot fit (issue 32 item 9)")
    yield s
    s.close()


def _program_or_skip(run: drivers.Run) -> None:
    if not run.program.exists():
        pytest.skip(f"{run.program.relative_to(ROOT)} is not installed (make clients)")
    real = run.program.resolve()
    if real.stat().st_size < 4096 and not real.read_bytes().startswith(b"#!"):
        pytest.skip(f"{real} is npm's placeholder: its install script, which puts the native "
                    "binary there, did not run (rm .clients/.installed; make clients)")
    for need in run.needs:
        if shutil.which(need) is None:
            pytest.skip(f"{run.name} needs {need} (Debian: apt-get install nodejs npm)")
    here = run.program.resolve().parent  # the package's folder or its bin/
    pkg = next((d / "package.json" for d in (here, here.parent) if (d / "package.json").exists()),
               None)
    want = json.loads(pkg.read_text()).get("engines", {}).get("node", "") \
        if pkg and "node" in run.needs else ""
    if want.startswith(">="):
        have = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout
        major = int(have.strip().lstrip("v").split(".")[0] or 0)
        if major < int(want[2:].split(".")[0]):
            pytest.skip(f"{run.name} needs node {want}; this node is {have.strip()}")


def _reply_text(entry: dict) -> str:
    """The answer text (not the reasoning) the server sent in one logged reply, from any of
    the four APIs, streamed or not."""
    raw, path = entry.get("response", ""), entry["path"]
    docs = []
    if raw.lstrip().startswith("{"):
        docs = [json.loads(raw)]
    else:
        for line in raw.splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                docs.append(json.loads(line[5:]))
    out = []
    for d in docs:
        if path.endswith("/chat/completions"):
            for c in d.get("choices", []):
                out.append((c.get("delta") or c.get("message") or {}).get("content") or "")
        elif path.endswith("/messages"):
            if d.get("type") == "content_block_delta" and d["delta"].get("type") == "text_delta":
                out.append(d["delta"]["text"])
            for block in d.get("content", []) if d.get("type") == "message" else []:
                out.append(block.get("text", "") if block.get("type") == "text" else "")
        elif path.endswith("/responses"):
            if d.get("type") == "response.output_text.delta":
                out.append(d["delta"])
            for item in d.get("output", []) if d.get("object") == "response" else []:
                for part in item.get("content") or []:
                    out.append(part.get("text", "") if part.get("type") == "output_text" else "")
    return "".join(out)


def _docs(entry: dict) -> list[dict]:
    raw = entry.get("response", "")
    if raw.lstrip().startswith("{"):
        return [json.loads(raw)]
    return [json.loads(line[5:]) for line in raw.splitlines()
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]


def _cut_in_reasoning(entry: dict) -> bool:
    """Whether a logged model reply stopped at its output cap (chat finish_reason length,
    Anthropic stop_reason max_tokens, Responses incomplete / max_output_tokens) with no
    answer text and no tool call: micro, not chat-tuned, reasons past any short cap."""
    cut = tool = False
    for d in _docs(entry):
        for c in d.get("choices", []):
            cut |= c.get("finish_reason") == "length"
            tool |= bool((c.get("delta") or c.get("message") or {}).get("tool_calls"))
        if d.get("type") == "message_delta":
            cut |= d["delta"].get("stop_reason") == "max_tokens"
        if d.get("type") == "content_block_start":
            tool |= d["content_block"].get("type") == "tool_use"
        resp = d.get("response") if isinstance(d.get("response"), dict) else d
        if resp.get("object") == "response":
            cut |= (resp.get("incomplete_details") or {}).get("reason") == "max_output_tokens"
            tool |= any(o.get("type") == "function_call" for o in resp.get("output") or [])
    return cut and not tool and not _reply_text(entry).strip()


MODEL_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions")


def _check(stack: Stack, run: drivers.Run, timeout: float = RUN_TIMEOUT,
           cut_says: str | None = None) -> dict:
    """Run `run`; assert every request got a 2xx, no server traceback, the program exited 0
    and showed the last model reply's answer text. `cut_says`: for a program that exits
    non-zero when a reply stops at its output cap with nothing in it (micro reasons past
    any cap), a non-zero exit passes only when the server's last reply was exactly that
    (`_cut_in_reasoning`) and the program's output says so with this text (it understood
    the stop reason). Returns what was measured (`outcome`: "answered" or "cut")."""
    _program_or_skip(run)
    mark, log_at = stack.mark(), len(stack.server_log.read_text())
    rc, out, err, wall = drivers.execute(run, timeout)
    time.sleep(0.5)  # the proxy writes a record once its reply has been relayed
    reqs = stack.since(mark)
    summary = [(r["method"], r["path"], r["status"]) for r in reqs]
    bad = [r for r in reqs if r["status"] >= 400]
    detail = "\n".join(f"{r['method']} {r['path']} -> {r['status']} {r['response'][:500]}"
                       for r in bad)
    assert not bad, f"{run.name}: the server answered an error:\n{detail}\nstderr: {err[-2000:]}"
    model_reqs = [r for r in reqs if r["path"] in MODEL_PATHS and r["method"] == "POST"]
    cut = bool(model_reqs) and _cut_in_reasoning(model_reqs[-1])
    if rc != 0 and cut_says and cut:
        assert cut_says in out + err, (f"{run.name} exited {rc} on a reply cut at its cap "
                                       f"without saying {cut_says!r}:\n{out[-2000:]}\n{err[-2000:]}")
    else:
        assert rc == 0, (f"{run.name} exited {rc} after {wall:.0f} s\nstdout: {out[-2000:]}\n"
                         f"stderr: {err[-3000:]}\nrequests: {summary}")
    assert model_reqs, f"{run.name} made no model request: {summary}"
    assert not stack.server_errors(log_at), stack.server_errors(log_at)
    answer = _reply_text(model_reqs[-1]).strip()
    words = answer.split()
    if words:  # a program may re-wrap or render the text; its first word must show
        assert words[0] in out + err, (f"{run.name} did not show the reply {answer[:200]!r}"
                                       f"\nstdout: {out[-2000:]}")
    return {"client": run.name, "rc": rc, "outcome": "cut" if cut else "answered", "wall_s": round(wall, 1), "requests": summary,
            "ttfb_s": [r["ttfb_s"] for r in model_reqs], "answer": answer[:80],
            "stdout": out, "reqs": reqs}


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    return home, work


def _report(m: dict) -> None:
    print(f"\n{m['client']}: exit {m['rc']} ({m['outcome']}) in {m['wall_s']} s; requests {m['requests']}; "
          f"ttfb {m['ttfb_s']}; answer {m['answer']!r}")


def _usage(entry: dict) -> dict:
    """The Anthropic usage of a logged /v1/messages reply (message_start's, streamed)."""
    raw = entry.get("response", "")
    if raw.lstrip().startswith("{"):
        return json.loads(raw).get("usage", {})
    for line in raw.splitlines():
        if line.startswith("data:"):
            d = json.loads(line[5:])
            if d.get("type") == "message_start":
                return d["message"].get("usage", {})
    return {}


def _billing(entry: dict) -> str:
    system = entry["body"].get("system") or []
    blocks = [system] if isinstance(system, str) else [b.get("text", "") for b in system]
    return next((b for b in blocks if b.startswith("x-anthropic-billing-header")), "")


CLAUDE_CUT = "output token maximum"  # Claude Code: "response exceeded the N output token maximum"


def test_claude_code_two_turns_read_the_cache(stack, tmp_path):
    """`claude -p`, then `claude -p --continue` with the billing line changed: every
    request a 2xx, and the second turn's main request reads the first turn's prompt from
    the prompt cache (cache_read_input_tokens > 0), which it cannot unless the server
    leaves the billing line (the first system block) out of the prompt. Claude Code 2.1.197
    keeps one billing line for a session (cc_version's suffix is derived from the
    session's first prompt), so the proxy changes its cc_version for the second turn."""
    home, work = _dirs(tmp_path)
    first = _check(stack, drivers.claude(home, work, stack.base_url, "micro"),
                   cut_says=CLAUDE_CUT)
    _report(first)
    main1 = [r for r in first["reqs"] if r["path"] == "/v1/messages" and r["body"].get("tools")]
    assert main1, first["requests"]
    b1 = _billing(main1[0])
    assert b1.startswith("x-anthropic-billing-header: cc_version="), b1
    rewrite = stack.requests.with_name(stack.requests.name + ".rewrite.json")
    rewrite.write_text(json.dumps([[b1, b1.replace("cc_version=", "cc_version=9.9.9-")]]))
    try:
        second = _check(stack, drivers.claude(home, work, stack.base_url, "micro",
                                              prompt="And once more, one word.",
                                              extra=["--continue"]), cut_says=CLAUDE_CUT)
    finally:
        rewrite.unlink()
    _report(second)
    main2 = [r for r in second["reqs"] if r["path"] == "/v1/messages" and r["body"].get("tools")]
    assert main2, second["requests"]
    b2 = _billing(main2[0])
    assert b2 and b2 != b1, (b1, b2)
    # the second turn's conversation holds the first turn's prompt
    texts = json.dumps(main2[0]["body"]["messages"])
    assert drivers.PROMPT in texts and "And once more" in texts
    usage = _usage(main2[0])
    print(f"turn 1 usage {_usage(main1[0])}; turn 2 usage {usage}; billing {b1!r} -> {b2!r}")
    assert usage.get("cache_read_input_tokens", 0) > 0, usage


def test_codex_exec(stack, tmp_path):
    """`codex exec` on the Responses API (namespace tools, reasoning summaries). Codex 0.171
    sends no max_output_tokens; the server's --max-tokens (drivers.MAX_TOKENS) caps it, as a
    user would start it."""
    home, work = _dirs(tmp_path)
    _report(_check(stack, drivers.codex(home, work, stack.base_url, "micro"),
                   cut_says="Incomplete response returned, reason: max_output_tokens"))


def test_opencode_run(stack, tmp_path):
    home, work = _dirs(tmp_path)
    _report(_check(stack, drivers.opencode(home, work, stack.base_url, "micro")))


def test_qwen_code(stack, tmp_path):
    home, work = _dirs(tmp_path)
    _report(_check(stack, drivers.qwen(home, work, stack.base_url, "micro")))


def test_aider_message(stack, tmp_path):
    home, work = _dirs(tmp_path)
    _report(_check(stack, drivers.aider(home, work, stack.base_url, "micro")))


def test_llm(stack, tmp_path):
    home, work = _dirs(tmp_path)
    _report(_check(stack, drivers.llm(home, work, stack.base_url, "micro")))


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_function_tool(stack, tmp_path, api):
    """An Agents SDK run forcing its one function tool by name (tool_choice="add", the
    SDK's way to make a tool run): every request a 2xx carrying the named tool_choice,
    and the run ends with a final output, or, where micro's reply was cut at max_tokens
    inside its reasoning (no answer, no tool call: the server's logged reply says so),
    with the SDK's own ModelBehaviorError about that empty reply (exit 3), which shows the
    SDK read our reply to the end. micro cannot call the tool: enforcing a named tool by
    constrained decoding is the structured-output issue."""
    home, work = _dirs(tmp_path)
    m = _check(stack, drivers.agents(home, work, stack.base_url, "micro", api=api),
               cut_says="ModelBehaviorError")
    _report(m)
    model_reqs = [r for r in m["reqs"] if r["path"] in MODEL_PATHS]
    assert model_reqs[0]["body"]["tool_choice"] not in (None, "auto", "required")
    assert m["rc"] in (0, 3) and ("final:" in m["stdout"]) == (m["rc"] == 0), m["stdout"]


def _stdlib_text(n_chars: int) -> str:
    """Python standard-library source (what micro was trained on), about `n_chars` long."""
    import inspect as mod_inspect
    import argparse as mod_argparse
    text = ""
    while len(text) < n_chars:
        for m in (mod_inspect, mod_argparse):
            text += Path(m.__file__).read_text()
    return text[:n_chars]


def test_ttfb_streaming_openai_20k_prompt(stack):
    """Time to first byte and to the first token of a streamed OpenAI chat request with a
    20k-token prompt on micro: the server shows life at once (an SSE comment) while the
    prefill runs (issue 32 item 8)."""
    tok = httpx.post(f"{stack.base_url}/tokenize", json={"content": _stdlib_text(200_000)},
                     timeout=120).json()["tokens"]
    text = httpx.post(f"{stack.base_url}/detokenize", json={"tokens": tok[:20_000]},
                      timeout=120).json()["content"]
    body = {"model": "micro", "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": 4, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first_byte = first_token = None
    usage = {}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body,
                      timeout=httpx.Timeout(1800)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            now = time.monotonic() - t0
            if first_byte is None:
                first_byte = now
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                d = json.loads(line[5:])
                usage = d.get("usage") or usage
                delta = (d.get("choices") or [{}])[0].get("delta") or {}
                if first_token is None and (delta.get("content") or delta.get("reasoning_content")):
                    first_token = now
    total = time.monotonic() - t0
    print(f"\n20k-token stream: prompt {usage.get('prompt_tokens')} tokens, first byte "
          f"{first_byte:.3f} s, first token {first_token:.1f} s, total {total:.1f} s")
    assert usage.get("prompt_tokens", 0) >= 20_000, usage
    assert first_byte < 5, first_byte
