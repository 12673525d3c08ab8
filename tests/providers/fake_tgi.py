"""A loopback Text Generation Inference server: POST / (and /generate, /generate_stream) with
TGI's `inputs`/`parameters` body, `details` with tokens and logprobs, `data:` token events whose
last one carries generated_text and details, TGI's error bodies, plus TGI's OpenAI-style
/v1/chat/completions (from the Mistral fake). Bearer auth, as on Inference Endpoints."""

from __future__ import annotations

import json
from typing import Any

from fake_anthropic import words
from fake_mistral import FakeChatCompletions
from fakehttp import Json, Recorded, Sse

API_KEY = "hf_testtoken0123456789abcdef"


class FakeTGI(FakeChatCompletions):
    """Answers scripted texts (or a greeting) in TGI's generate shapes; records every request."""

    greeting = "Hello from the fake TGI"

    def __init__(self) -> None:
        super().__init__(api_key=API_KEY)
        for path in ("/", "/generate", "/generate_stream"):
            self.server.add_route("POST", path, self._generate)
        self.generate_finish = "eos_token"

    def reset(self) -> None:
        super().reset()
        self.generate_finish = "eos_token"

    @staticmethod
    def _unauthorized() -> Json:
        return Json({"error": "Authorization header is correct, but the token seems invalid"}, status=401)

    def _generate(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        params = body.get("parameters") or {}
        text = self.answers.pop(0) if self.answers else self.greeting
        pieces = words(text)
        tokens = [
            {"id": 100 + i, "text": piece, "logprob": -0.5 - i / 10, "special": False}
            for i, piece in enumerate(pieces)
        ]
        details = {
            "finish_reason": self.generate_finish,
            "generated_tokens": len(pieces),
            "seed": params.get("seed"),
            "prefill": [],
            "tokens": tokens,
        }
        if params.get("top_n_tokens"):
            details["top_tokens"] = [[dict(t, logprob=t["logprob"])] for t in tokens]
        streaming = body.get("stream") or rec.path == "/generate_stream"
        if not streaming:
            return Json({"generated_text": text, "details": details if params.get("details") else None})
        events: list[tuple[str | None, str]] = []
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            event = {
                "index": i + 1,
                "token": token,
                "top_tokens": None,
                "generated_text": text if last else None,
                "details": (
                    {"finish_reason": self.generate_finish, "generated_tokens": len(tokens), "seed": None}
                    if last
                    else None
                ),
            }
            events.append((None, json.dumps(event)))
        return Sse(events)
