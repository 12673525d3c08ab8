"""A loopback Gemini API (generativelanguage v1 / v1beta): POST models/{model}:generateContent and
:streamGenerateContent?alt=sse, camelCase JSON, usageMetadata, candidateCount, x-goog-api-key
auth answered like Google does (HTTP 400 "API key not valid", status INVALID_ARGUMENT)."""

from __future__ import annotations

import json
from typing import Any

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "AIzaSyFakeKey0123456789abcdefghijk"


class FakeGemini:
    """Answers scripted texts (or a greeting) with Gemini shapes; records every request."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.finish_reason = "STOP"
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        for version in ("v1", "v1beta"):  # the SDK's default version moved from v1beta to v1
            self.server.add_route("POST", f"/{version}/models/{{tail}}", self._dispatch)

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        self.server.reset()
        self.answers.clear()
        self.finish_reason = "STOP"

    @staticmethod
    def _auth(rec: Recorded) -> bool:
        return rec.headers.get("x-goog-api-key") == API_KEY or rec.query.get("key") == API_KEY

    @staticmethod
    def _unauthorized() -> Json:
        body = {
            "error": {
                "code": 400,
                "message": "API key not valid. Please pass a valid API key.",
                "status": "INVALID_ARGUMENT",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID"}
                ],
            }
        }
        return Json(body, status=400)

    def _dispatch(self, rec: Recorded) -> Json | Sse:
        model, _, method = rec.path.rsplit("/", 1)[-1].partition(":")
        body: dict[str, Any] = rec.body
        config = body.get("generationConfig", {})
        n = int(config.get("candidateCount") or 1)
        texts = [self.answers.pop(0) if self.answers else f"Hello from the fake Gemini {i}" for i in range(n)]
        prompt_tokens = sum(len(json.dumps(c).split()) for c in body["contents"])
        usage = {
            "promptTokenCount": prompt_tokens,
            "candidatesTokenCount": sum(len(words(t)) for t in texts),
            "totalTokenCount": prompt_tokens + sum(len(words(t)) for t in texts),
        }
        if method == "generateContent":
            candidates = [
                {
                    "content": {"parts": [{"text": t}], "role": "model"},
                    "finishReason": self.finish_reason,
                    "index": i,
                }
                for i, t in enumerate(texts)
            ]
            return Json({"candidates": candidates, "usageMetadata": usage, "modelVersion": model})
        if method != "streamGenerateContent":
            return Json({"error": {"code": 404, "message": "no such method", "status": "NOT_FOUND"}}, 404)
        events: list[tuple[str | None, str]] = []
        pieces = [words(t) for t in texts]
        for step in range(max(len(p) for p in pieces)):
            candidates = [
                {"content": {"parts": [{"text": p[step]}], "role": "model"}, "index": i}
                for i, p in enumerate(pieces)
                if step < len(p)
            ]
            events.append(
                (
                    None,
                    json.dumps(
                        {"candidates": candidates, "usageMetadata": {"promptTokenCount": prompt_tokens}}
                    ),
                )
            )
        final = [
            {
                "content": {"parts": [{"text": ""}], "role": "model"},
                "finishReason": self.finish_reason,
                "index": i,
            }
            for i in range(n)
        ]
        events.append(
            (None, json.dumps({"candidates": final, "usageMetadata": usage, "modelVersion": model}))
        )
        return Sse(events)
