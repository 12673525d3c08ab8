"""A loopback Anthropic Messages API: POST /v1/messages, JSON and SSE (message_start,
content_block_start/delta/stop, message_delta with usage, message_stop), x-api-key auth and
Anthropic's error body shape."""

from __future__ import annotations

import json
from typing import Any

from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "sk-ant-test-0123456789abcdef"


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
        self.stop_reason = "end_turn"
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        self.server.add_route("POST", "/v1/messages", self._messages)

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        self.server.reset()
        self.answers.clear()
        self.stop_reason = "end_turn"

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

    def _messages(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        prompt_words = sum(len(json.dumps(m).split()) for m in body["messages"])
        text = self._answer()
        out_tokens = len(words(text))
        message: dict[str, Any] = {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [{"type": "text", "text": text}],
            "stop_reason": self.stop_reason,
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
            (
                "content_block_start",
                json.dumps(
                    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                ),
            ),
            ("ping", json.dumps({"type": "ping"})),
        ]
        for piece in words(text):
            delta = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": piece},
            }
            events.append(("content_block_delta", json.dumps(delta)))
        events.append(("content_block_stop", json.dumps({"type": "content_block_stop", "index": 0})))
        end = {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": out_tokens},
        }
        events.append(("message_delta", json.dumps(end)))
        events.append(("message_stop", json.dumps({"type": "message_stop"})))
        return Sse(events)
