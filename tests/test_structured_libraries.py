"""The structured-output libraries as a new user calls them (openai's `parse`, instructor,
LangChain's `with_structured_output` / `bind_tools`, pydantic-ai) against the one-process
server (one at a time and batched) and a 2-rank tensor group on loopback, on the shipped
micro checkpoint: each must return its parsed object. They fail when a finished
constrained reply decodes on to max_tokens (finish_reason "length": openai raises
LengthFinishReasonError, instructor IncompleteOutputException), so the reference is the
libraries' own acceptance; the raw replies are checked for finish_reason stop /
tool_calls well inside max_tokens. A library that is not installed skips its cases
(instructor is not in the dev extra: its `jiter<0.15` pin conflicts with current openai)."""

import importlib.util
import json
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import structured_libraries as L  # noqa: E402

from kimi_mlx.generation.request import default_model  # noqa: E402
from kimi_mlx.testing.servers import start_server, stop_server  # noqa: E402

MICRO = str(default_model())


@pytest.fixture(scope="module", params=["one-process", "batched", "tensor"])
def base(request, tmp_path_factory):
    """The server's /v1 URL: one process one at a time, batched (4 rows), or `cluster
    server --parallel tensor` over this head and 1 rank."""
    if request.param != "tensor":
        srv, svc = start_server(MICRO, None, "micro", 1 << 20,
                                max_concurrency=1 if request.param == "one-process" else 4)
        yield srv.url + "/v1"
        stop_server(srv, svc)
        return
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.tensor_parallel import free_ports

    grpc_port, _ = free_ports(2, consecutive=True)
    cluster = LocalCluster(tmp_path_factory.mktemp("lt"), n=1, prefix="lt", ports=[grpc_port])
    srv = None
    try:
        srv = ServerProc(cluster, free_ports(1)[0], "--parallel", "tensor",
                         "--max-concurrency", "2", timeout=240)
        yield srv.url + "/v1"
    finally:
        if srv is not None:
            srv.stop()
        cluster.stop()


@pytest.mark.parametrize("case", list(L.CASES))
def test_library_gets_its_object(base, case):
    module = next((m for k, m in L.NEEDS.items() if case.startswith(k)), None)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    L.check(case, L.CASES[case](base))


def test_constrained_reply_ends_with_its_grammar(base):
    """The issue's example: a short JSON answer with max_tokens 300 ends with finish_reason
    stop far inside the budget (it ran to 300 of 300 with "length" before), streamed and
    not; a forced tool call ends with "tool_calls" likewise."""
    client = openai.OpenAI(base_url=base, api_key="x", timeout=240, max_retries=0)
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": L.PERSON_DICT,
                                                 "strict": True}}
    r = client.chat.completions.create(model="micro", messages=L.MESSAGES, max_tokens=300,
                                       temperature=0, response_format=rf, extra_body=L.EXTRA)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 100, r
    json.loads(r.choices[0].message.content)
    chunks = list(client.chat.completions.create(
        model="micro", messages=L.MESSAGES, max_tokens=300, temperature=0, response_format=rf,
        extra_body=L.EXTRA, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
    r = client.chat.completions.create(
        model="micro", messages=[{"role": "user", "content": "Add 2 and 3."}], max_tokens=300,
        temperature=0, tools=[tool], tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, extra_body=L.EXTRA)
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens < 100, r
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["add"]
