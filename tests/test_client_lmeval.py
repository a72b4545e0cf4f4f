"""lm-evaluation-harness (the real program, from the tools virtualenv `.venv-tools` that
`make lmeval-tools` makes) against `kimi-mlx server` on the shipped micro model, over
loopback with the hub, datasets and telemetry offline (issue 32).

lm-eval's `local-completions` model tokenises with the checkpoint's own
`tokenization_kimi.py` (plain transformers, trust_remote_code, no kimi_mlx in that
Python) and sends `/v1/completions` requests: `[[ids]]` prompts with echo + logprobs for
a loglikelihood (multiple choice) task and plain generation for a generate_until task,
both on a task file written here over micro's held-out text. Asserted: lm-eval exits 0,
the server answered every request with a 2xx, lm-eval's loglikelihoods equal an
independent forward pass of the same token ids, and the summed log-likelihood of 5
held-out texts through /v1/completions (echo, logprobs) equals `kimi-mlx eval
--per-text` (generation/evaluate.py) to 1e-4."""

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kimi_mlx.generation.request import default_model

ROOT = Path(__file__).resolve().parents[1]
TOOLS_PY = ROOT / ".venv-tools" / "bin" / "python"
MICRO = Path(default_model())
HELDOUT = MICRO / "heldout" / "prose.txt"

pytestmark = pytest.mark.clients


def _lm_eval_version():
    if not TOOLS_PY.exists():
        pytest.skip(".venv-tools is missing: run `make lmeval-tools` (lm-eval, torch CPU)")
    r = subprocess.run([str(TOOLS_PY), "-c", "import importlib.metadata as m, lm_eval, transformers;"
                        "print(m.version('lm_eval'))"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"lm_eval is not importable in .venv-tools: {r.stderr.strip()[-300:]}")
    return r.stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _paragraphs(n_min=200, n_max=600):
    text = HELDOUT.read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n\n")]
    return [p for p in paras if n_min <= len(p) <= n_max and not p.startswith("*")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    port = _free_port()
    from kimi_mlx.lifetime import child_env
    from kimi_mlx.testing.health import wait_healthy

    env = child_env({**os.environ, "HF_HUB_OFFLINE": "1"})  # ends with this process
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kimi_mlx", "server", "--model", str(MICRO),
                                 "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", "1",
                                 "--log-level", "INFO"], stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 180, proc, output=log)
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _statuses(log: Path, start: int):
    """(path, status) of each request uvicorn logged after byte `start` of the log."""
    text = log.read_text(errors="replace")[start:]
    return re.findall(r'"(?:GET|POST|HEAD) (\S+) HTTP/[\d.]+" (\d{3})', text)


def _write_tasks(folder: Path, paras):
    """A multiple-choice task (each held-out paragraph's next words against the next
    words of two other paragraphs) and a generate_until task, as lm-eval YAML + JSONL."""
    mc, gen = [], []
    for i, p in enumerate(paras):
        words = p.split()
        cut = len(words) // 2
        ctx = " ".join(words[:cut])
        conts = [" ".join(q.split()[len(q.split()) // 2:][:4]) for q in paras]
        choices = [conts[i], conts[(i + 1) % len(paras)], conts[(i + 2) % len(paras)]]
        mc.append({"context": ctx, "choices": choices, "label": 0})
        gen.append({"context": ctx, "target": " ".join(words[cut:cut + 4])})
    for name, rows in (("mc", mc), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
              f"    test: {{path}}\ntest_split: test\n")
    (folder / "micro_mc.yaml").write_text(
        "task: micro_mc\n" + common.format(path=folder / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
          "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
          "metric_list:\n  - metric: acc\n")
    (folder / "micro_gen.yaml").write_text(
        "task: micro_gen\n" + common.format(path=folder / "gen.jsonl")
        + "output_type: generate_until\ndoc_to_text: \"{{context}}\"\n"
          "doc_to_target: \"{{target}}\"\n"
          "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
          "metric_list:\n  - metric: exact_match\n")
    return mc


def _forward_logprobs(model, ids):
    """log p(ids[i] | ids[:i]) for i >= 1: one float32 forward pass, no cache."""
    import mlx.core as mx

    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


# ~60 s: lm-eval's own start-up (torch, datasets) is most of it (marker clients: make test-clients)
def test_lm_eval_loglikelihood_and_generate_until_tasks(server, tmp_path):
    version = _lm_eval_version()
    url, log = server
    paras = _paragraphs()[:6]
    assert len(paras) == 6
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    mc = _write_tasks(tasks, paras)
    out_dir = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "HF_", "OPENAI"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1",
               NO_PROXY="127.0.0.1,localhost", OPENAI_API_KEY="unused", TOKENIZERS_PARALLELISM="false")
    env.pop("LD_PRELOAD", None)
    model_args = ",".join([
        "model=micro", f"base_url={url}/v1/completions", f"tokenizer={MICRO}",
        "tokenizer_backend=huggingface", "tokenized_requests=True", "trust_remote_code=True",
        "max_length=4096", "num_concurrent=1", "max_retries=1"])
    cmd = [str(TOOLS_PY), "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "micro_mc,micro_gen", "--include_path", str(tasks), "--batch_size", "1",
           "--output_path", str(out_dir), "--log_samples"]
    start = log.stat().st_size
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    seconds = time.perf_counter() - t0
    print(f"\nlm-eval {version}: {' '.join(cmd)}\n  exit {r.returncode} in {seconds:.1f} s")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    statuses = _statuses(log, start)
    completions = [s for p, s in statuses if p == "/v1/completions"]
    # 6 docs x 3 choices scored, 6 generations; nothing else was asked, nothing refused
    assert len(completions) >= 6 * 3 + 6, statuses
    assert all(s.startswith("2") for _, s in statuses), statuses

    # lm-eval's loglikelihoods against an independent forward pass of the same ids
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(MICRO)
    model, _, _ = load_model(MICRO, verbose=False)
    samples = next(out_dir.rglob("samples_micro_mc_*.jsonl"))
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    assert len(rows) == len(mc)
    worst = 0.0
    for row in rows:
        ctx = row["doc"]["context"]
        for choice, resp in zip(row["doc"]["choices"], row["resps"]):
            ll = float(resp[0][0])
            whole = tok.encode(ctx + " " + choice)  # lm-eval's pair encoding
            n_ctx = len(tok.encode(ctx))
            ref = math.fsum(_forward_logprobs(model, whole)[n_ctx - 1:])
            worst = max(worst, abs(ll - ref))
    print(f"  lm-eval loglikelihoods vs a forward pass: max |diff| {worst:.2e}")
    assert worst < 1e-4
    gen_rows = next(out_dir.rglob("samples_micro_gen_*.jsonl")).read_text().splitlines()
    assert len(gen_rows) == len(mc)
    assert all(isinstance(json.loads(x)["resps"][0][0], str) for x in gen_rows)


def test_served_loglikelihoods_equal_kimi_mlx_eval(server, tmp_path):
    """5 held-out micro texts: the sum of /v1/completions echo logprobs (prompt as a
    string) against `kimi-mlx eval --per-text`, to 1e-4."""
    url, log = server
    texts = _paragraphs()[:5]
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = subprocess.run([sys.executable, "-m", "kimi_mlx", "eval", "--model", str(MICRO),
                          "--data", str(data), "--per-text", "--seq-len", "4096", "-q"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ref = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert len(ref) == 5
    start = log.stat().st_size
    diffs = []
    for t, row in zip(texts, ref):
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "micro", "prompt": t, "echo": True, "logprobs": 1, "max_tokens": 0})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert lp[0] is None and len(lp) - 1 == row["tokens"]
        diffs.append(abs(math.fsum(lp[1:]) - row["logprob"]))
    print(f"\n  /v1/completions vs kimi-mlx eval --per-text, 5 texts: max |diff| {max(diffs):.2e}")
    assert max(diffs) < 1e-4, diffs
    assert all(s.startswith("2") for _, s in _statuses(log, start))
