"""A loopback Mistral chat API (the OpenAI-style chat-completions wire): POST
/v1/chat/completions, JSON and SSE `data:` chunks ending in `data: [DONE]`, usage in the last
chunk, native `n`, bearer auth. LiteLLM's fake reuses it as a plain OpenAI-compatible server."""

from __future__ import annotations

import json
from typing import Any

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "mistral-test-0123456789abcdef"


class FakeChatCompletions:
    """Answers scripted texts (or a greeting) in chat-completions shapes; records every request."""

    path = "/v1/chat/completions"
    greeting = "Hello from the fake Mistral"

    def __init__(self, api_key: str = API_KEY) -> None:
        self.api_key = api_key
        self.answers: list[str] = []
        self.finish_reason = "stop"
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        self.server.add_route("POST", self.path, self._chat)

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        self.server.reset()
        self.answers.clear()
        self.finish_reason = "stop"

    def _auth(self, rec: Recorded) -> bool:
        return rec.headers.get("authorization") == f"Bearer {self.api_key}"

    @staticmethod
    def _unauthorized() -> Json:
        return Json({"message": "Unauthorized", "request_id": "r"}, status=401)

    def _chat(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        n = int(body.get("n") or 1)
        texts = [self.answers.pop(0) if self.answers else f"{self.greeting} {i}" for i in range(n)]
        input_tokens = sum(len(json.dumps(m).split()) for m in body["messages"])
        out_tokens = sum(len(words(t)) for t in texts)
        usage = {
            "prompt_tokens": input_tokens,
            "completion_tokens": out_tokens,
            "total_tokens": input_tokens + out_tokens,
        }
        base = {"id": "cmpl-fake", "object": "chat.completion", "created": 1700000000, "model": body["model"]}
        if not body.get("stream"):
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": t},
                    "finish_reason": self.finish_reason,
                }
                for i, t in enumerate(texts)
            ]
            return Json(dict(base, choices=choices, usage=usage))
        chunk = dict(base, object="chat.completion.chunk")
        events: list[tuple[str | None, str]] = []
        for i, t in enumerate(texts):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            events.append((None, json.dumps(dict(chunk, choices=[first]))))
            for piece in words(t):
                choice = {"index": i, "delta": {"content": piece}, "finish_reason": None}
                events.append((None, json.dumps(dict(chunk, choices=[choice]))))
        for i in range(n):
            last: dict[str, Any] = dict(
                chunk, choices=[{"index": i, "delta": {"content": ""}, "finish_reason": self.finish_reason}]
            )
            if i == n - 1:
                last["usage"] = usage
            events.append((None, json.dumps(last)))
        events.append((None, "[DONE]"))
        return Sse(events)
