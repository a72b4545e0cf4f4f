"""The structured-output client libraries as a new user calls them, against a server's
OpenAI-compatible base URL: each case returns the parsed object (or raises what the
library raises). Shared by `tests/test_structured_libraries.py` (one process, batched,
tensor group) and usable as a script for a before/after table:

    python tests/structured_libraries.py http://127.0.0.1:8080/v1

Every case asks micro for a short answer with a thinking budget of 4 tokens and
max_tokens 300: a reply that ends when its grammar completes is well inside it."""

from __future__ import annotations

import json
import sys
from typing import Callable, Dict

from pydantic import BaseModel, Field

MAX_TOKENS = 300
EXTRA = {"thinking_budget": 4}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON: name and age."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


PERSON_DICT = {"title": "person", "description": "A person", "type": "object",
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False}


def _openai(base: str):
    import openai

    return openai.OpenAI(base_url=base, api_key="x", timeout=240, max_retries=0)


def openai_parse(base: str):
    r = _openai(base).chat.completions.parse(
        model="micro", messages=MESSAGES, response_format=Person, max_tokens=MAX_TOKENS,
        temperature=0, extra_body=EXTRA)
    return r.choices[0].message.parsed


def openai_beta_parse(base: str):
    r = _openai(base).beta.chat.completions.parse(
        model="micro", messages=MESSAGES, response_format=Person, max_tokens=MAX_TOKENS,
        temperature=0, extra_body=EXTRA)
    return r.choices[0].message.parsed


def _instructor(base: str, mode: str):
    import instructor

    client = instructor.from_openai(_openai(base), mode=getattr(instructor.Mode, mode))
    return client.chat.completions.create(
        model="micro", messages=MESSAGES, response_model=Person, max_tokens=MAX_TOKENS,
        temperature=0, max_retries=0, extra_body=EXTRA)


def _chat(base: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="micro", base_url=base, api_key="x", max_tokens=MAX_TOKENS,
                      temperature=0, max_retries=0, timeout=240, extra_body=EXTRA)


def langchain(base: str, method: str):
    schema = PERSON_DICT if method == "json_mode" else Person
    out = _chat(base).with_structured_output(schema, method=method).invoke(MESSAGES)
    return Person.model_validate(out) if isinstance(out, dict) and method != "json_mode" else out


def langchain_bind_tools(base: str):
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    msg = _chat(base).bind_tools([add], tool_choice="add").invoke("What is 2 plus 3?")
    if not msg.tool_calls:
        raise AssertionError(f"no tool call: {msg!r}")
    call = msg.tool_calls[0]
    if call["name"] != "add" or not all(isinstance(call["args"].get(k), int) for k in "ab"):
        raise AssertionError(f"not a valid call to add: {call!r}")
    return call


def pydantic_ai(base: str, native: bool):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("micro", provider=OpenAIProvider(base_url=base, api_key="x"))
    agent = Agent(model, output_type=NativeOutput(Person) if native else Person, retries=0,
                  model_settings={"max_tokens": MAX_TOKENS, "temperature": 0,
                                  "extra_body": EXTRA})
    return agent.run_sync(MESSAGES[0]["content"]).output


CASES: Dict[str, Callable] = {
    "openai chat.completions.parse": openai_parse,
    "openai beta.chat.completions.parse": openai_beta_parse,
    "instructor TOOLS": lambda b: _instructor(b, "TOOLS"),
    "instructor JSON_SCHEMA": lambda b: _instructor(b, "JSON_SCHEMA"),
    "langchain json_schema": lambda b: langchain(b, "json_schema"),
    "langchain json_mode": lambda b: langchain(b, "json_mode"),
    "langchain function_calling": lambda b: langchain(b, "function_calling"),
    "langchain bind_tools forced": langchain_bind_tools,
    "pydantic-ai tool output": lambda b: pydantic_ai(b, False),
    "pydantic-ai NativeOutput": lambda b: pydantic_ai(b, True),
}
NEEDS = {"instructor": "instructor", "langchain": "langchain_openai", "pydantic-ai": "pydantic_ai"}


def check(name: str, out) -> None:
    """AssertionError unless `out` is what case `name` should give: a valid Person (a dict
    with a name and an age for json_mode, whose schema is only asked for in the prompt)."""
    if name == "langchain bind_tools forced":
        return
    if name == "langchain json_mode":
        assert isinstance(out, dict), out
        return
    assert isinstance(out, Person), out
    Person.model_validate(out.model_dump())


def run_all(base: str) -> Dict[str, str]:
    """{case: "ok" or the exception's type and first line}."""
    res = {}
    for name, fn in CASES.items():
        try:
            out = fn(base)
            check(name, out)
            res[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per case
            res[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}"
    return res


if __name__ == "__main__":
    print(json.dumps(run_all(sys.argv[1]), indent=1))
