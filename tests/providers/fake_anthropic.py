"""A loopback Anthropic Messages API: POST /v1/messages, JSON and SSE (message_start,
content_block_start/delta/stop, message_delta with usage, message_stop), x-api-key auth and
Anthropic's error body shape.

Tool calls: `calls` holds scripted calls, one list per request (taken before `answers`; an
empty list answers with a text): `tool_use` blocks (input: the arguments parsed; empty text:
`{}`, streamed with no input_json_delta at all), stop_reason `tool_use`, streamed as
content_block_start (id, name, empty input) then `input_json_delta` fragments. `thinking` puts
thinking blocks (text, signature) first in every answer, streamed as thinking_delta by words
then one signature_delta; `redacted` adds a redacted_thinking block after them."""

from __future__ import annotations

import json
from typing import Any

from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "sk-ant-test-0123456789abcdef"
# Characters per streamed input_json_delta (real fragments are a token or a few).
ARGUMENT_FRAGMENT = 5


def words(text: str) -> list[str]:
    """Whitespace "tokens" keeping their leading space, so joining them gives the text back."""
    out: list[str] = []
    for i, w in enumerate(text.split(" ")):
        out.append(w if i == 0 else " " + w)
    return [w for w in out if w]


class FakeAnthropic:
    """Answers scripted texts (or a greeting) with Anthropic's shapes; records every request."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.calls: list[list[tuple[str, str]]] = []
        self.reset_quirks()
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        self.server.add_route("POST", "/v1/messages", self._messages)

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
        self.stop_reason = "end_turn"
        self.tool_stop_reason = "tool_use"
        self.thinking: list[tuple[str, str]] = []  # (text, signature) of each thinking block
        self.redacted: str | None = None  # a redacted_thinking block's data

    @staticmethod
    def _auth(rec: Recorded) -> bool:
        return API_KEY in (
            rec.headers.get("x-api-key"),
            rec.headers.get("authorization", "").removeprefix("Bearer "),
        )

    @staticmethod
    def _unauthorized() -> Json:
        body = {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}
        return Json(body, status=401)

    def _answer(self) -> str:
        return self.answers.pop(0) if self.answers else "Hello from the fake Claude"

    def _content(self, rec: Recorded) -> tuple[list[dict[str, Any]], bool]:
        """The answer's content blocks (thinking first), and whether it calls tools."""
        blocks: list[dict[str, Any]] = [
            {"type": "thinking", "thinking": text, "signature": signature}
            for text, signature in self.thinking
        ]
        if self.redacted is not None:
            blocks.append({"type": "redacted_thinking", "data": self.redacted})
        scripted = self.calls.pop(0) if self.calls else []
        for k, (name, arguments) in enumerate(scripted):
            call_id = f"toolu_fake_{len(self.server.requests)}_{k}"
            given = json.loads(arguments) if arguments else {}
            blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": given})
        if not scripted:
            blocks.append({"type": "text", "text": self._answer()})
        return blocks, bool(scripted)

    def _messages(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        prompt_words = sum(len(json.dumps(m).split()) for m in body["messages"])
        blocks, called = self._content(rec)
        said = " ".join(b.get("text") or b.get("thinking") or json.dumps(b.get("input", "")) for b in blocks)
        out_tokens = len(words(said))
        stop_reason = self.tool_stop_reason if called else self.stop_reason
        message: dict[str, Any] = {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_words, "output_tokens": out_tokens},
        }
        if not body.get("stream"):
            return Json(message)
        start = dict(
            message, content=[], stop_reason=None, usage={"input_tokens": prompt_words, "output_tokens": 1}
        )
        events: list[tuple[str | None, str]] = [
            ("message_start", json.dumps({"type": "message_start", "message": start})),
            ("ping", json.dumps({"type": "ping"})),
        ]

        def event(kind: str, **fields: Any) -> None:
            events.append((kind, json.dumps({"type": kind, **fields})))

        for index, block in enumerate(blocks):
            deltas: list[dict[str, Any]] = []
            if block["type"] == "text":
                opened: dict[str, Any] = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": piece} for piece in words(block["text"])]
            elif block["type"] == "thinking":
                opened = {"type": "thinking", "thinking": "", "signature": ""}
                deltas = [{"type": "thinking_delta", "thinking": piece} for piece in words(block["thinking"])]
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
            elif block["type"] == "tool_use":
                opened = {**block, "input": {}}
                arguments = json.dumps(block["input"]) if block["input"] else ""
                deltas = [
                    {"type": "input_json_delta", "partial_json": arguments[at : at + ARGUMENT_FRAGMENT]}
                    for at in range(0, len(arguments), ARGUMENT_FRAGMENT)
                ]
            else:
                opened = block
            event("content_block_start", index=index, content_block=opened)
            for delta in deltas:
                event("content_block_delta", index=index, delta=delta)
            event("content_block_stop", index=index)
        event(
            "message_delta",
            delta={"stop_reason": stop_reason, "stop_sequence": None},
            usage={"output_tokens": out_tokens},
        )
        event("message_stop")
        return Sse(events)
