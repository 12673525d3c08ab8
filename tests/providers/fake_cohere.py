"""A loopback Cohere v2 Chat API: POST /v2/chat, JSON and SSE (message-start, content-start,
content-delta, content-end, message-end with finish_reason and usage), bearer auth."""

from __future__ import annotations

import json
from typing import Any

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "co-test-0123456789abcdef"


class FakeCohere:
    """Answers scripted texts (or a greeting) with Cohere v2 shapes; records every request."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.finish_reason = "COMPLETE"
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        self.server.add_route("POST", "/v2/chat", self._chat)

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        self.server.reset()
        self.answers.clear()
        self.finish_reason = "COMPLETE"

    @staticmethod
    def _auth(rec: Recorded) -> bool:
        return rec.headers.get("authorization") == f"Bearer {API_KEY}"

    @staticmethod
    def _unauthorized() -> Json:
        return Json({"id": "x", "message": "invalid api token"}, status=401)

    def _chat(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        text = self.answers.pop(0) if self.answers else "Hello from the fake Command"
        input_tokens = sum(len(json.dumps(m).split()) for m in body["messages"])
        out_tokens = len(words(text))
        usage = {
            "billed_units": {"input_tokens": input_tokens, "output_tokens": out_tokens},
            "tokens": {"input_tokens": input_tokens + 7, "output_tokens": out_tokens},
        }
        if not body.get("stream"):
            return Json(
                {
                    "id": "chat-fake",
                    "finish_reason": self.finish_reason,
                    "message": {"role": "assistant", "content": [{"type": "text", "text": text}]},
                    "usage": usage,
                }
            )
        events: list[tuple[str | None, str]] = [
            (
                "message-start",
                json.dumps(
                    {"type": "message-start", "id": "chat-fake", "delta": {"message": {"role": "assistant"}}}
                ),
            ),
            (
                "content-start",
                json.dumps(
                    {
                        "type": "content-start",
                        "index": 0,
                        "delta": {"message": {"content": {"type": "text", "text": ""}}},
                    }
                ),
            ),
        ]
        for piece in words(text):
            delta = {"type": "content-delta", "index": 0, "delta": {"message": {"content": {"text": piece}}}}
            events.append(("content-delta", json.dumps(delta)))
        events.append(("content-end", json.dumps({"type": "content-end", "index": 0})))
        end = {"type": "message-end", "delta": {"finish_reason": self.finish_reason, "usage": usage}}
        events.append(("message-end", json.dumps(end)))
        return Sse(events)
