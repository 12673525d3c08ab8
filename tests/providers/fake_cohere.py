"""A loopback Cohere v2 Chat API: POST /v2/chat, JSON and SSE (message-start, content-start,
content-delta, content-end, message-end with finish_reason and usage), bearer auth.

Tool calls: `calls` holds scripted calls, one list per request (taken before `answers`; an
empty list answers with a text): `message.tool_calls` (`{id, type: function, function: {name,
arguments}}`, arguments as sent), `tool_plan` before them, finish_reason TOOL_CALL; streamed as
tool-plan-delta by words, then per call tool-call-start (id, name, the first arguments
fragment), tool-call-delta fragments and tool-call-end. `thinking` puts a thinking content item
first in every answer, streamed as its own content block of thinking deltas."""

from __future__ import annotations

import json
from typing import Any

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "co-test-0123456789abcdef"
# Characters per streamed arguments fragment (real fragments are a token or a few).
ARGUMENT_FRAGMENT = 5


class FakeCohere:
    """Answers scripted texts (or a greeting) with Cohere v2 shapes; records every request."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.calls: list[list[tuple[str, str]]] = []
        self.reset_quirks()
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        self.server.add_route("POST", "/v2/chat", self._chat)

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        self.server.reset()
        self.answers.clear()
        self.calls.clear()
        self.reset_quirks()

    def reset_quirks(self) -> None:
        self.finish_reason = "COMPLETE"
        self.tool_plan = "I will look that up."
        self.thinking: str | None = None

    @staticmethod
    def _auth(rec: Recorded) -> bool:
        return rec.headers.get("authorization") == f"Bearer {API_KEY}"

    @staticmethod
    def _unauthorized() -> Json:
        return Json({"id": "x", "message": "invalid api token"}, status=401)

    def _message(self) -> tuple[dict[str, Any], str]:
        """The answer's assistant message and what it says (for counting output tokens)."""
        message: dict[str, Any] = {"role": "assistant"}
        content: list[dict[str, Any]] = []
        if self.thinking is not None:
            content.append({"type": "thinking", "thinking": self.thinking})
        scripted = self.calls.pop(0) if self.calls else []
        said = [self.thinking or ""]
        if scripted:
            n = len(self.server.requests)
            message["tool_plan"] = self.tool_plan
            message["tool_calls"] = [
                {
                    "id": f"call_fake_{n}_{k}",
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                for k, (name, args) in enumerate(scripted)
            ]
            said += [self.tool_plan, *(args for _, args in scripted)]
        else:
            text = self.answers.pop(0) if self.answers else "Hello from the fake Command"
            content.append({"type": "text", "text": text})
            said.append(text)
        if content:
            message["content"] = content
        return message, " ".join(s for s in said if s)

    def _chat(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        message, said = self._message()
        input_tokens = sum(len(json.dumps(m).split()) for m in body["messages"])
        out_tokens = len(words(said))
        usage = {
            "billed_units": {"input_tokens": input_tokens, "output_tokens": out_tokens},
            "tokens": {"input_tokens": input_tokens + 7, "output_tokens": out_tokens},
        }
        finish = "TOOL_CALL" if message.get("tool_calls") else self.finish_reason
        if not body.get("stream"):
            return Json({"id": "chat-fake", "finish_reason": finish, "message": message, "usage": usage})
        events: list[tuple[str | None, str]] = []

        def event(kind: str, **fields: Any) -> None:
            events.append((kind, json.dumps({"type": kind, **fields})))

        event("message-start", id="chat-fake", delta={"message": {"role": "assistant"}})
        for index, item in enumerate(message.get("content", [])):
            kind = item["type"]
            event("content-start", index=index, delta={"message": {"content": {"type": kind, kind: ""}}})
            for piece in words(item[kind]):
                event("content-delta", index=index, delta={"message": {"content": {kind: piece}}})
            event("content-end", index=index)
        if "tool_plan" in message:
            for piece in words(message["tool_plan"]):
                event("tool-plan-delta", delta={"message": {"tool_plan": piece}})
        for index, call in enumerate(message.get("tool_calls", [])):
            arguments = call["function"]["arguments"]
            pieces = [
                arguments[at : at + ARGUMENT_FRAGMENT] for at in range(0, len(arguments), ARGUMENT_FRAGMENT)
            ]
            first = dict(
                call, function={"name": call["function"]["name"], "arguments": pieces[0] if pieces else ""}
            )
            event("tool-call-start", index=index, delta={"message": {"tool_calls": first}})
            for piece in pieces[1:]:
                event(
                    "tool-call-delta",
                    index=index,
                    delta={"message": {"tool_calls": {"function": {"arguments": piece}}}},
                )
            event("tool-call-end", index=index)
        event("message-end", id="chat-fake", delta={"finish_reason": finish, "usage": usage})
        return Sse(events)
