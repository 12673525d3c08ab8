"""A loopback OpenAI chat-completions API: POST /v1/chat/completions (and Azure's
/openai/deployments/{deployment}/chat/completions), JSON and SSE (`data: {chunk}` ... `data:
[DONE]`), `n`, logprobs, usage (in streams only with stream_options.include_usage), Bearer or
api-key auth and OpenAI's error body shape. Quirk switches mimic real compatible servers."""

from __future__ import annotations

import json
from typing import Any

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "sk-test-openai-0123456789abcdef"


class FakeOpenAI:
    """Answers scripted texts (one per choice, in order) or a greeting; records every request."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        for path in ("/v1/chat/completions", "/openai/deployments/{deployment}/chat/completions"):
            self.server.add_route("POST", path, self._chat)
        self.reset_quirks()

    def reset_quirks(self) -> None:
        self.ignore_n = False  # llama.cpp server, Ollama: one choice whatever n says
        self.stream_usage = True  # False: no usage chunk even when asked (llama.cpp server)
        self.finish_reason = "stop"
        self.stop_reason: str | None = None  # vLLM's extra field: the stop string that matched
        self.honour_structured_outputs = True  # vLLM canary: answer the first allowed choice
        self.refusal: str | None = None

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        self.server.reset()
        self.answers.clear()
        self.reset_quirks()

    @staticmethod
    def _auth(rec: Recorded) -> bool:
        return API_KEY in (
            rec.headers.get("api-key"),
            rec.headers.get("authorization", "").removeprefix("Bearer "),
        )

    @staticmethod
    def _unauthorized() -> Json:
        # Real OpenAI echoes a masked key here; gengate must not pass even that on.
        body = {
            "error": {
                "message": "Incorrect API key provided: sk-bad-k**********ey.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        return Json(body, status=401)

    def _texts(self, body: dict[str, Any]) -> list[str]:
        n = 1 if self.ignore_n else int(body.get("n") or 1)
        structured = (body.get("structured_outputs") or {}) if self.honour_structured_outputs else {}
        texts = []
        for i in range(n):
            if self.answers:
                texts.append(self.answers.pop(0))
            elif "choice" in structured:
                texts.append(structured["choice"][0])
            else:
                texts.append(f"Hello from the fake GPT {i}")
        return texts

    @staticmethod
    def _logprobs(text: str, top: int | None) -> dict[str, Any]:
        content = [
            {
                "token": w,
                "logprob": -0.5,
                "bytes": list(w.encode()),
                "top_logprobs": [{"token": w, "logprob": -0.5, "bytes": None}] * (top or 0),
            }
            for w in words(text)
        ]
        return {"content": content, "refusal": None}

    def _chat(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        prompt_tokens = sum(len(json.dumps(m["content"]).split()) for m in body["messages"])
        texts = self._texts(body)
        completion_tokens = sum(len(words(t)) for t in texts)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        want_logprobs = bool(body.get("logprobs"))
        top = body.get("top_logprobs")
        base = {"id": "chatcmpl-fake", "created": 1700000000, "model": body.get("model", "fake")}
        if not body.get("stream"):
            choices = []
            for i, text in enumerate(texts):
                choice: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": None if self.refusal else text},
                    "finish_reason": self.finish_reason,
                    "logprobs": self._logprobs(text, top) if want_logprobs else None,
                }
                if self.refusal:
                    choice["message"]["refusal"] = self.refusal
                if self.stop_reason is not None:
                    choice["stop_reason"] = self.stop_reason
                choices.append(choice)
            return Json({**base, "object": "chat.completion", "choices": choices, "usage": usage})
        events: list[tuple[str | None, str]] = []

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> None:
            events.append(
                (None, json.dumps({**base, "object": "chat.completion.chunk", "choices": choices, **extra}))
            )

        for i in range(len(texts)):
            chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        pieces = [words(t) for t in texts]
        for step in range(max(len(p) for p in pieces)):
            for i, p in enumerate(pieces):
                if step < len(p):
                    choice = {"index": i, "delta": {"content": p[step]}, "finish_reason": None}
                    if want_logprobs:
                        choice["logprobs"] = self._logprobs(p[step], top)
                    chunk([choice])
        for i in range(len(texts)):
            end: dict[str, Any] = {"index": i, "delta": {}, "finish_reason": self.finish_reason}
            if self.stop_reason is not None:
                end["stop_reason"] = self.stop_reason
            chunk([end])
        if self.stream_usage and (body.get("stream_options") or {}).get("include_usage"):
            chunk([], usage=usage)
        events.append((None, "[DONE]"))
        return Sse(events)
