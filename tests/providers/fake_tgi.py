"""A loopback Text Generation Inference server: POST / (and /generate, /generate_stream) with
TGI's `inputs`/`parameters` body, `details` with tokens and logprobs, `data:` token events whose
last one carries generated_text and details, TGI's error bodies, plus TGI's OpenAI-style
/v1/chat/completions (from the Mistral fake). Bearer auth, as on Inference Endpoints.

Tool calls: `calls` holds scripted calls, one list per request, answered on the chat route as TGI
does: `message.tool_calls` with id "0", content null and finish_reason "stop"; arguments as text
or, with `object_arguments`, as the JSON object older TGI sends. Streamed as TGI streams them:
every fragment repeats id "0", index 0 and type, the name only on the first (whose arguments are
"{"), and no chunk carries a finish reason. `reasoning` adds the message's `reasoning` field."""

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

    def reset_quirks(self) -> None:
        super().reset_quirks()
        self.reasoning: str | None = None

    def _chat(self, rec: Recorded) -> Json | Sse:
        """Scripted calls or reasoning in TGI's chat shapes; plain answers as the base gives them."""
        if not self.calls and self.reasoning is None:
            return super()._chat(rec)
        body: dict[str, Any] = rec.body
        scripted = self.calls.pop(0) if self.calls else []
        text = "" if scripted else (self.answers.pop(0) if self.answers else self.greeting)
        usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
        base = {"id": "", "created": 1741372335, "model": "tgi", "system_fingerprint": "3.3.5-native"}
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": None if scripted else text}
            if scripted:
                message["tool_calls"] = [
                    {"id": "0", "type": "function", "function": self._function(name, arguments)}
                    for name, arguments in scripted
                ]
            if self.reasoning is not None:
                message["reasoning"] = self.reasoning
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            return Json({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        events: list[tuple[str | None, str]] = []

        def chunk(delta: dict[str, Any], finish: str | None = None) -> None:
            choice = {"index": 0, "delta": {"role": "assistant", **delta}, "finish_reason": finish}
            events.append(
                (None, json.dumps({**base, "object": "chat.completion.chunk", "choices": [choice]}))
            )

        for piece in words(self.reasoning or ""):
            chunk({"content": None, "reasoning": piece})
        for name, arguments in scripted:
            pieces = ["{", *words(arguments[1:])] if arguments.startswith("{") else words(arguments)
            for k, piece in enumerate(pieces):
                function = {"name": name if k == 0 else None, "arguments": piece}
                call = {"index": 0, "id": "0", "type": "function", "function": function}
                chunk({"content": None, "tool_calls": [call]})
        for piece in words(text):
            chunk({"content": piece})
        if not scripted:
            chunk({"content": ""}, "stop")
        events.append((None, "[DONE]"))
        return Sse(events)

    def _function(self, name: str, arguments: str) -> dict[str, Any]:
        value: Any = json.loads(arguments) if self.object_arguments else arguments
        return {"description": None, "name": name, "arguments": value}

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
