"""How to run each real client program non-interactively against a local kimi-mlx server.

One function per client writes the client's configuration into a fresh HOME (and work
folder) and returns the command line and environment: the server's loopback URL as the
only endpoint, telemetry, update checks, error reporting and other nonessential traffic
off. tests/test_clients.py runs them; run this file to try one by hand:

    .venv/bin/python tests/clients/drivers.py claude --base-url http://127.0.0.1:8081

Where the programs live: npm clients in .clients/node_modules/.bin (`make clients`), pip
clients in .venv-tools/bin (llm, the Agents SDK) and .venv-aider/bin (aider, whose exact
pins clash with llm's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NODE_BIN = ROOT / ".clients" / "node_modules" / ".bin"
TOOLS_BIN = ROOT / ".venv-tools" / "bin"
AIDER_BIN = ROOT / ".venv-aider" / "bin"
API_KEY = "sk-kimi-mlx-test"
PROMPT = "Reply with one word: hello."
MAX_TOKENS = 48    # each client's own output cap where it has one (micro: ~30 tokens/s here)
CONTEXT = 65536    # the context the tests serve micro with (--max-kv-size)


@dataclass
class Run:
    """A prepared client run: `argv` run in `cwd` with `env` (a full environment)."""
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    program: Path
    needs: list[str] = field(default_factory=list)  # other executables it needs (node)


def base_env(home: Path) -> dict[str, str]:
    """A minimal environment: PATH, a private HOME / XDG dirs, no proxies, no colour."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_CACHE_HOME": str(home / ".cache"),
           "XDG_DATA_HOME": str(home / ".local" / "share"),
           "XDG_STATE_HOME": str(home / ".local" / "state"),
           "TERM": "dumb", "NO_COLOR": "1", "CI": "1", "LANG": "C.UTF-8",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    for d in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        Path(env[d]).mkdir(parents=True, exist_ok=True)
    return env


def claude(home: Path, work: Path, base_url: str, model: str, prompt: str = PROMPT,
           extra: list[str] | None = None) -> Run:
    """Claude Code `claude -p` through the Anthropic Messages API (ANTHROPIC_BASE_URL)."""
    env = base_env(home)
    env.update({"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": API_KEY,
                "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "CLAUDE_CONFIG_DIR": str(home / ".claude"),
                "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
                "DISABLE_AUTOUPDATER": "1", "DISABLE_BUG_COMMAND": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
                "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1", "DISABLE_COST_WARNINGS": "1",
                "API_TIMEOUT_MS": "1800000", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS)})
    argv = [str(NODE_BIN / "claude"), "-p", prompt, "--model", model,
            "--output-format", "json", *(extra or [])]
    return Run("claude", argv, env, work, NODE_BIN / "claude")


def codex(home: Path, work: Path, base_url: str, model: str, prompt: str = PROMPT) -> Run:
    """Codex `codex exec` through the Responses API, a custom model_provider in config.toml."""
    env = base_env(home)
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(textwrap.dedent(f"""\
        model = "{model}"
        model_provider = "kimi"
        check_for_update_on_startup = false
        model_context_window = {CONTEXT}

        [model_providers.kimi]
        name = "kimi-mlx"
        base_url = "{base_url}/v1"
        wire_api = "responses"
        env_key = "KIMI_API_KEY"
        request_max_retries = 0
        stream_max_retries = 0
        stream_idle_timeout_ms = 1800000

        [analytics]
        enabled = false

        [feedback]
        enabled = false

        [otel]
        exporter = "none"
        """))
    env.update({"CODEX_HOME": str(codex_home), "KIMI_API_KEY": API_KEY,
                "RUST_LOG": "error"})
    argv = [str(NODE_BIN / "codex"), "exec", "--skip-git-repo-check", prompt]
    return Run("codex", argv, env, work, NODE_BIN / "codex", needs=["node"])


def opencode(home: Path, work: Path, base_url: str, model: str, prompt: str = PROMPT) -> Run:
    """opencode `opencode run` with an openai-compatible provider in opencode.json."""
    env = base_env(home)
    cfg = {"$schema": "https://opencode.ai/config.json", "autoupdate": False,
           "share": "disabled", "model": f"kimi/{model}", "small_model": f"kimi/{model}",
           "provider": {"kimi": {"npm": "@ai-sdk/openai-compatible", "name": "kimi-mlx",
                                 "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY},
                                 "models": {model: {"name": model,
                                                    "limit": {"context": CONTEXT,
                                                              "output": MAX_TOKENS}}}}}}
    (work / "opencode.json").write_text(json.dumps(cfg, indent=2))
    env.update({"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_TELEMETRY": "1"})
    argv = [str(NODE_BIN / "opencode"), "run", "--model", f"kimi/{model}", prompt]
    return Run("opencode", argv, env, work, NODE_BIN / "opencode")


def qwen(home: Path, work: Path, base_url: str, model: str, prompt: str = PROMPT) -> Run:
    """Qwen Code `qwen -p` through the OpenAI chat API (OPENAI_BASE_URL / OPENAI_MODEL)."""
    env = base_env(home)
    settings = home / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        "model": {"name": model,
                  "generationConfig": {"samplingParams": {"max_tokens": MAX_TOKENS}}}},
        indent=2))
    env.update({"OPENAI_BASE_URL": f"{base_url}/v1", "OPENAI_API_KEY": API_KEY,
                "OPENAI_MODEL": model})
    argv = [str(NODE_BIN / "qwen"), "-p", prompt, "--auth-type", "openai", "--model", model]
    return Run("qwen", argv, env, work, NODE_BIN / "qwen", needs=["node"])


def aider(home: Path, work: Path, base_url: str, model: str, prompt: str = PROMPT) -> Run:
    """aider `aider --message` through litellm's openai/ provider."""
    env = base_env(home)
    (work / ".aider.model.settings.yml").write_text(textwrap.dedent(f"""\
        - name: openai/{model}
          edit_format: whole
          use_repo_map: false
          extra_params:
            max_tokens: {MAX_TOKENS}
        """))
    (work / ".aider.model.metadata.json").write_text(json.dumps({f"openai/{model}": {
        "max_input_tokens": CONTEXT, "max_output_tokens": MAX_TOKENS,
        "max_tokens": MAX_TOKENS, "litellm_provider": "openai", "mode": "chat",
        "input_cost_per_token": 0, "output_cost_per_token": 0}}))
    env.update({"OPENAI_API_BASE": f"{base_url}/v1", "OPENAI_API_KEY": API_KEY,
                "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_ANALYTICS": "false",
                "AIDER_CHECK_UPDATE": "false"})
    argv = [str(AIDER_BIN / "aider"), "--model", f"openai/{model}", "--message", prompt,
            "--no-git", "--yes-always", "--no-check-update", "--analytics-disable",
            "--no-show-model-warnings", "--no-auto-commits", "--no-pretty", "--no-stream",
            "--no-detect-urls", "--no-show-release-notes", "--map-tokens", "0",
            "--edit-format", "whole",
            "--model-settings-file", str(work / ".aider.model.settings.yml"),
            "--model-metadata-file", str(work / ".aider.model.metadata.json")]
    return Run("aider", argv, env, work, AIDER_BIN / "aider")


def llm(home: Path, work: Path, base_url: str, model: str, prompt: str = PROMPT) -> Run:
    """Simon Willison's `llm` with an OpenAI-compatible model from extra-openai-models.yaml."""
    env = base_env(home)
    user = home / "llm"
    user.mkdir(parents=True, exist_ok=True)
    (user / "extra-openai-models.yaml").write_text(textwrap.dedent(f"""\
        - model_id: kimi-micro
          model_name: {model}
          api_base: "{base_url}/v1"
          api_key_name: kimi
        """))
    (user / "keys.json").write_text(json.dumps({"kimi": API_KEY}))
    env["LLM_USER_PATH"] = str(user)
    argv = [str(TOOLS_BIN / "llm"), "-m", "kimi-micro", "--no-log",
            "-o", "max_tokens", str(MAX_TOKENS), prompt]
    return Run("llm", argv, env, work, TOOLS_BIN / "llm")


AGENTS_SCRIPT = '''\
"""One OpenAI Agents SDK run with a function tool the model is made to call."""
import sys
from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api,
                    set_default_openai_client, set_tracing_disabled)
from agents.exceptions import ModelBehaviorError
from openai import AsyncOpenAI

base_url, model, api, key = sys.argv[1:5]
calls = []


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    calls.append((a, b))
    return a + b


set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=base_url + "/v1", api_key=key), use_for_tracing=False)
set_default_openai_api(api)
agent = Agent(name="adder", instructions="Use the add tool to add numbers.", model=model,
              tools=[add], model_settings=ModelSettings(tool_choice="add", max_tokens=int(sys.argv[5])))
try:
    result = Runner.run_sync(agent, "What is 2 + 3?", max_turns=4)
except ModelBehaviorError as e:  # e.g. a reply cut at max_tokens with no output at all
    print("tool calls:", calls)
    print("ModelBehaviorError:", e)
    sys.exit(3)
print("tool calls:", calls)
print("final:", repr(result.final_output))
'''


def agents(home: Path, work: Path, base_url: str, model: str, prompt: str = PROMPT,
           api: str = "responses") -> Run:
    """An OpenAI Agents SDK run (`api`: responses or chat_completions) forcing one function
    tool by name (the SDK's way of making a tool run)."""
    env = base_env(home)
    script = work / "agent_run.py"
    script.write_text(AGENTS_SCRIPT)
    env["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    argv = [str(TOOLS_BIN / "python"), str(script), base_url, model, api, API_KEY,
            str(MAX_TOKENS)]
    return Run("agents", argv, env, work, TOOLS_BIN / "python")


CLIENTS = {"claude": claude, "codex": codex, "opencode": opencode, "qwen": qwen,
           "aider": aider, "llm": llm, "agents": agents}


def version(run: Run) -> str:
    """The client's version string (its own --version, or the pip package's version)."""
    pkgs = {"agents": "openai-agents", "llm": "llm", "aider": "aider-chat"}
    if run.name in pkgs:
        py = run.program.parent / "python"
        out = subprocess.run([str(py), "-c", f"import importlib.metadata as m; "
                              f"print(m.version('{pkgs[run.name]}'))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip()
    out = subprocess.run([str(run.program), "--version"], capture_output=True, text=True,
                         timeout=60, env=run.env)
    return (out.stdout or out.stderr).strip().splitlines()[-1] if (out.stdout or out.stderr) else "?"


def execute(run: Run, timeout: float) -> tuple[int, str, str, float]:
    """Run it with stdin closed; returns (exit code, stdout, stderr, wall seconds). A run
    past `timeout` is killed with its process group and reported as exit code 124."""
    t0 = time.monotonic()
    p = subprocess.Popen(run.argv, cwd=run.cwd, env=run.env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        rc = 124
    return rc, out, err, time.monotonic() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="run one real client against a kimi-mlx server")
    p.add_argument("client", choices=sorted(CLIENTS))
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8081 (no /v1)")
    p.add_argument("--model", default="micro")
    p.add_argument("--dir", type=Path, required=True, help="scratch folder (HOME and work)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--prompt", default=PROMPT)
    a = p.parse_args(argv)
    home, work = a.dir / "home", a.dir / "work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    run = CLIENTS[a.client](home, work, a.base_url, a.model, a.prompt)
    print("version:", version(run))
    print("argv:", run.argv)
    rc, out, err, wall = execute(run, a.timeout)
    print(f"rc={rc} wall={wall:.1f}s")
    print("--- stdout\n" + out[-4000:])
    print("--- stderr\n" + err[-4000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
