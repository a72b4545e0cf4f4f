"""The server's OpenAPI document (GET /openapi.json): the generating routes read their
body themselves (so that size, content type and JSON are checked before pydantic), so
FastAPI cannot see their request models; this adds them, with the model-dependent bounds
(top_k below the vocabulary size), and the responses each route can give: the
non-streamed JSON bodies, the event stream, and the error shapes of both dialects.
Schema-driven fuzzing (schemathesis, tests/test_server_fuzz.py) runs against it."""

from __future__ import annotations

from typing import Any, Dict, Optional

from pydantic.json_schema import models_json_schema

from kimi_mlx.server.schemas import ChatRequest, CompletionRequest, CountTokensRequest, MessagesRequest

# path -> (request model, non-streamed 200 schema name, streams, dialect)
ROUTES = {
    "/v1/chat/completions": (ChatRequest, "ChatCompletion", True, "openai"),
    "/v1/completions": (CompletionRequest, "Completion", True, "openai"),
    "/v1/messages": (MessagesRequest, "Message", True, "anthropic"),
    "/v1/messages/count_tokens": (CountTokensRequest, "TokenCount", False, "anthropic"),
}
ERROR_STATUSES = ("400", "401", "404", "413", "415", "500", "503")

_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}
_OPENAI_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                 "properties": {"prompt_tokens": _INT, "completion_tokens": _INT,
                                "total_tokens": _INT}}
_FINISH = {"enum": ["stop", "length", "tool_calls", "cancelled"]}

RESPONSES: Dict[str, Dict[str, Any]] = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": _STR, "type": _STR, "param": _NULLABLE_STR,
                       "code": _NULLABLE_STR}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                              "properties": {"type": _STR, "message": _STR}}}},
    "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model",
                                                      "choices", "usage"], "properties": {
        "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                "index": {"const": 0}, "finish_reason": _FINISH,
                "message": {"type": "object", "required": ["role", "content"], "properties": {
                    "role": {"const": "assistant"}, "content": _NULLABLE_STR,
                    "reasoning_content": _STR, "tool_calls": {"type": "array"}}}}}},
        "usage": _OPENAI_USAGE}},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model",
                                                  "choices", "usage"], "properties": {
        "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
        # one choice per prompt (a list of prompts), in order
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
                "index": _INT, "text": _STR, "finish_reason": _FINISH,
                "logprobs": {"type": ["object", "null"], "properties": {
                    "tokens": {"type": "array", "items": _STR},
                    # the first of an echoed prompt's tokens has no log-probability
                    "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                    "top_logprobs": {"type": "array", "items": {"type": ["object", "null"]}},
                    "text_offset": {"type": "array", "items": _INT}}}}}},
        "usage": _OPENAI_USAGE}},
    "Message": {"type": "object", "required": ["id", "type", "role", "model", "content",
                                               "stop_reason", "usage"], "properties": {
        "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _STR,
        "content": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "thinking", "tool_use"]}}}},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use",
                                 "cancelled"]},
        "stop_sequence": _NULLABLE_STR,
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens",
                                                 "cache_read_input_tokens"],
                  "properties": {"input_tokens": _INT, "output_tokens": _INT,
                                 "cache_read_input_tokens": _INT,
                                 "cache_creation_input_tokens": _INT}}}},
    # one server-sent event ({event, data} as an SSE parser gives it); data is JSON,
    # or [DONE] at the end of an OpenAI stream
    "OpenAIEvent": {"type": "object", "required": ["data"], "properties": {
        "event": {"const": "message"}, "data": _STR}},
    "AnthropicEvent": {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"enum": ["message_start", "content_block_start", "content_block_delta",
                           "content_block_stop", "message_delta", "message_stop", "ping",
                           "error"]}, "data": _STR}},
    "TokenCount": {"type": "object", "required": ["input_tokens"],
                   "properties": {"input_tokens": _INT}},
}


def add_generation_routes(schema: Dict[str, Any], vocab: Optional[int] = None) -> Dict[str, Any]:
    """`schema` (FastAPI's OpenAPI document) with the request bodies and responses of
    the generating routes; `vocab`, when known, bounds top_k (exclusive)."""
    refs, defs = models_json_schema([(m, "validation") for m, *_ in ROUTES.values()],
                                    ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    components.update(RESPONSES)
    if vocab:
        for model in (ChatRequest, CompletionRequest, MessagesRequest, CountTokensRequest):
            top_k = components[model.__name__]["properties"]["top_k"]
            for branch in top_k.get("anyOf", [top_k]):
                if branch.get("type") == "integer":
                    branch["maximum"] = vocab - 1
        for branch in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            items = branch.get("items", {})
            items = items.get("items", items)  # a list of token-id lists
            if items.get("type") == "integer":
                items["maximum"] = vocab - 1
    for path, (model, ok, streams, dialect) in ROUTES.items():
        ref = lambda name: {"$ref": f"#/components/schemas/{name}"}  # noqa: E731
        content = {"application/json": {"schema": ref(ok)}}
        if streams:
            content["text/event-stream"] = {"schema": ref(
                "AnthropicEvent" if dialect == "anthropic" else "OpenAIEvent")}
        error = {"application/json": {"schema": ref(
            "AnthropicError" if dialect == "anthropic" else "OpenAIError")}}
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        op["responses"] = {"200": {"description": "the reply (an event stream when the "
                                                  "body asks for one)", "content": content},
                           **{s: {"description": "error", "content": error}
                              for s in ERROR_STATUSES}}
    return schema
