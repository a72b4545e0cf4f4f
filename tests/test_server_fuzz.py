"""Schema-driven fuzzing of `kimi-mlx server` on micro (issue 26): schemathesis generates
requests from the server's own OpenAPI document (GET /openapi.json) for the four
generating endpoints, in positive (schema-valid) and negative (schema-invalid) mode.
Every response: no 5xx, a status and content type the document declares, a body that
conforms to its schema, and schema-invalid data refused with a 4xx. After each batch
(one endpoint, one mode) a fixed greedy request gives the text it gave before the
fuzzing, and an unseeded temperature-1 request succeeds (nothing poisoned the server).

Bounded for the suite (FUZZ_EXAMPLES per endpoint and mode, derandomized); set
KIMI_FUZZ_EXAMPLES=N for a longer, random run (its counts are printed with -s).

Positive cases get the served model id and a small max_tokens, so they reach generation
instead of stopping at a 404 or running to the end of the context; negative cases are
sent as generated (only an over-large max_tokens is lowered, which keeps them invalid)."""

import os
import time
from collections import Counter

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance, negative_data_rejection, response_schema_conformance,
    status_code_conformance)

from kimi_mlx.generation.request import default_model  # noqa: E402
from kimi_mlx.server.app import create_app  # noqa: E402
from kimi_mlx.server.openapi import ROUTES  # noqa: E402
from kimi_mlx.server.serving import BackgroundServer, load_service, make_service  # noqa: E402

MICRO = str(default_model())
LONG = int(os.environ.get("KIMI_FUZZ_EXAMPLES", "0"))
FUZZ_EXAMPLES = LONG or 10
MAX_TOKENS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
GREEDY = {"model": "micro", "messages": [{"role": "user", "content": "Name a colour."}],
          "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def served():
    svc = make_service(MICRO, None, None, 1 << 20)
    load_service(svc, MICRO, max_concurrency=4, prompt_cache_bytes=32 << 20, max_queue=64,
                 max_kv_size=None)
    srv = BackgroundServer(create_app(svc)).start()
    yield svc, srv.url
    srv.stop()
    svc.engine.stop()


def _greedy_text(url):
    r = httpx.post(url + "/v1/chat/completions", json=GREEDY, timeout=120)
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    return m.get("reasoning_content", ""), m["content"]


def _unseeded_ok(url):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        **GREEDY, "temperature": 1, "max_tokens": 3})
    assert r.status_code == 200, r.text


def _adjust(case, path, positive):
    """Keep a case cheap, and (positive mode) aimed at the served model."""
    body = case.body
    if not isinstance(body, dict):
        return case
    required = path == "/v1/messages"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        # (an integral float is an integer to the server: 175.0 is capped too)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if positive:
        if isinstance(body.get("model"), str):
            body["model"] = "micro"
        # absent or null: the room left in the context, for each prompt of a list
        if (not required and path != "/v1/messages/count_tokens"
                and body.get("max_tokens") is None):
            body["max_tokens"] = MAX_TOKENS
    elif not required and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS  # not required here: stays invalid elsewhere
    return case


def _fuzz(url, schema, path, mode, stats):
    op = schema[path]["POST"]
    positive = mode is GenerationMode.POSITIVE
    checks = CHECKS + ([] if positive else [negative_data_rejection])

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=not LONG,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate],
              report_multiple_bugs=False)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        case = _adjust(case, path, positive)
        response = case.call(base_url=url, timeout=120)
        stats[(path, mode.value, response.status_code // 100 * 100)] += 1
        stats["requests"] += 1
        stats[f"{response.status_code // 100}xx"] += 1
        if positive and response.status_code == 400 and os.environ.get("KIMI_FUZZ_SHOW"):
            print(path, response.text[:150])
        case.validate_response(response, checks=checks)

    run()


def test_fuzzing_from_the_openapi_schema(served):
    svc, url = served
    doc = httpx.get(url + "/openapi.json", timeout=30).json()
    top_k = doc["components"]["schemas"]["ChatRequest"]["properties"]["top_k"]["anyOf"][0]
    assert top_k["maximum"] == svc.vocab_size - 1  # the document knows the model
    schema = schemathesis.openapi.from_dict(doc)
    before = _greedy_text(url)
    stats = Counter()
    for path in ROUTES:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            t0 = time.perf_counter()
            _fuzz(url, schema, path, mode, stats)
            stats[f"seconds {path} {mode.value}"] = round(time.perf_counter() - t0, 1)
            assert _greedy_text(url) == before, (path, mode)
            _unseeded_ok(url)
    print("\nfuzzing:", dict(stats))
    assert stats["5xx"] == 0
    # the positive cases reached generation on every generating endpoint
    for path in ROUTES:
        assert stats[(path, "positive", 200)] > 0, (path, dict(stats))
