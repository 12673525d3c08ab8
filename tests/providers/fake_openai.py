"""A loopback OpenAI chat-completions API: POST /v1/chat/completions (and Azure's
/openai/deployments/{deployment}/chat/completions), and the text completions API POST
/v1/completions (vLLM's and llama.cpp's raw route): JSON and SSE (`data: {chunk}` ... `data:
[DONE]`), `n`, logprobs (each API's shape), usage (in streams only with
stream_options.include_usage), Bearer or api-key auth and OpenAI's error body shape. Quirk
switches mimic real compatible servers.

Tool calls: `calls` holds scripted calls, one list per choice (taken before `answers`; an empty
list answers that choice with a text), answered
as OpenAI does (`message.tool_calls`, content null, finish_reason `tool_calls`) and streamed as
it does (a first fragment with id, type and name and empty arguments, then argument fragments).
`reasoning` adds a compatible server's `reasoning_content` to every choice (streamed by words)."""

from __future__ import annotations

import json
from typing import Any

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "sk-test-openai-0123456789abcdef"
# Characters per streamed argument fragment (real fragments are a token or a few).
ARGUMENT_FRAGMENT = 5


class FakeOpenAI:
    """Answers scripted texts (one per choice, in order) or a greeting; records every request."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        # One entry per choice answered with calls: (name, arguments JSON text) pairs.
        self.calls: list[list[tuple[str, str]]] = []
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        for path in ("/v1/chat/completions", "/openai/deployments/{deployment}/chat/completions"):
            self.server.add_route("POST", path, self._chat)
        self.server.add_route("POST", "/v1/completions", self._completions)
        self.reset_quirks()

    def reset_quirks(self) -> None:
        self.ignore_n = False  # llama.cpp server, Ollama: one choice whatever n says
        self.stream_usage = True  # False: no usage chunk even when asked (llama.cpp server)
        self.finish_reason = "stop"
        self.stop_reason: str | None = None  # vLLM's extra field: the stop string that matched
        self.honour_structured_outputs = True  # vLLM canary: answer the first allowed choice
        self.refusal: str | None = None
        self.call_ids = True  # False: calls come without ids (some compatible servers)
        self.tool_finish_reason = "tool_calls"  # OpenAI says "stop" when a named tool is forced
        self.reasoning: str | None = None  # reasoning_content of every choice
        self.reasoning_field = "reasoning_content"  # "reasoning": Ollama's and newer vLLM's name

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        self.server.reset()
        self.answers.clear()
        self.calls.clear()
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
        return [self._text(body, i) for i in range(self._n(body))]

    def _n(self, body: dict[str, Any]) -> int:
        return 1 if self.ignore_n else int(body.get("n") or 1)

    def _text(self, body: dict[str, Any], i: int) -> str:
        structured = (body.get("structured_outputs") or {}) if self.honour_structured_outputs else {}
        if self.answers:
            return self.answers.pop(0)
        if "choice" in structured:
            return str(structured["choice"][0])
        return f"Hello from the fake GPT {i}"

    def _replies(self, body: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
        """Each choice's text and wire tool calls (scripted calls first, then texts)."""
        out: list[tuple[str, list[dict[str, Any]]]] = []
        for i in range(self._n(body)):
            scripted = self.calls.pop(0) if self.calls else []
            if scripted:
                made = []
                for k, (name, arguments) in enumerate(scripted):
                    function = {"name": name, "arguments": arguments}
                    call: dict[str, Any] = {"type": "function", "function": function}
                    if self.call_ids:
                        call["id"] = f"call_fake_{len(self.server.requests)}_{i}_{k}"
                    made.append(call)
                out.append(("", made))
            else:
                out.append((self._text(body, i), []))
        return out

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

    @staticmethod
    def _text_logprobs(text: str, top: int) -> dict[str, Any]:
        """The completions API's logprobs: parallel lists; each top holds `top` alternatives and
        the sampled token besides (vLLM's and llama.cpp's way), so it has top + 1 entries."""
        tokens = words(text)
        alternatives = [{**{f"alt{j}": -0.1 * (j + 1) for j in range(top)}, w: -0.5} for w in tokens]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [-0.5] * len(tokens),
            "top_logprobs": alternatives,
            "text_offset": offsets,
        }

    @staticmethod
    def _usage(prompt_tokens: int, texts: list[str]) -> dict[str, int]:
        completion_tokens = sum(len(words(t)) for t in texts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _completions(self, rec: Recorded) -> Json | Sse:
        """POST /v1/completions: the prompt as raw text, `text` choices, logprobs as a top count."""
        body: dict[str, Any] = rec.body
        texts = self._texts(body)
        usage = self._usage(len(str(body["prompt"]).split()), texts)
        top = body.get("logprobs")
        base = {"id": "cmpl-fake", "created": 1700000000, "model": body.get("model", "fake")}

        def choice(i: int, text: str, finish: str | None) -> dict[str, Any]:
            c: dict[str, Any] = {
                "index": i,
                "text": text,
                "finish_reason": finish,
                "logprobs": self._text_logprobs(text, top) if top is not None and text else None,
            }
            if finish is not None and self.stop_reason is not None:
                c["stop_reason"] = self.stop_reason
            return c

        if not body.get("stream"):
            choices = [choice(i, t, self.finish_reason) for i, t in enumerate(texts)]
            return Json({**base, "object": "text_completion", "choices": choices, "usage": usage})
        events: list[tuple[str | None, str]] = []

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> None:
            events.append(
                (None, json.dumps({**base, "object": "text_completion", "choices": choices, **extra}))
            )

        pieces = [words(t) for t in texts]
        for step in range(max(len(p) for p in pieces)):
            for i, p in enumerate(pieces):
                if step < len(p):
                    chunk([choice(i, p[step], None)])
        for i in range(len(texts)):
            chunk([choice(i, "", self.finish_reason)])
        if self.stream_usage and (body.get("stream_options") or {}).get("include_usage"):
            chunk([], usage=usage)
        events.append((None, "[DONE]"))
        return Sse(events)

    def _chat(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        prompt_tokens = sum(len(json.dumps(m.get("content")).split()) for m in body["messages"])
        replies = self._replies(body)
        texts = [t for t, _ in replies]
        said = [t or " ".join(c["function"]["arguments"] for c in calls) for t, calls in replies]
        usage = self._usage(prompt_tokens, said)
        want_logprobs = bool(body.get("logprobs"))
        top = body.get("top_logprobs")
        base = {"id": "chatcmpl-fake", "created": 1700000000, "model": body.get("model", "fake")}
        if not body.get("stream"):
            choices = []
            for i, (text, calls) in enumerate(replies):
                choice: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": None if self.refusal or calls else text},
                    "finish_reason": self.tool_finish_reason if calls else self.finish_reason,
                    "logprobs": self._logprobs(text, top) if want_logprobs else None,
                }
                if calls:
                    choice["message"]["tool_calls"] = calls
                if self.reasoning is not None:
                    choice["message"][self.reasoning_field] = self.reasoning
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
        for i in range(len(texts)):
            for w in words(self.reasoning or ""):
                chunk([{"index": i, "delta": {self.reasoning_field: w}, "finish_reason": None}])
        for i, (_, calls) in enumerate(replies):
            for k, call in enumerate(calls):
                first = {**call, "index": k, "function": {"name": call["function"]["name"], "arguments": ""}}
                chunk([{"index": i, "delta": {"tool_calls": [first]}, "finish_reason": None}])
                arguments = call["function"]["arguments"]
                for at in range(0, len(arguments), ARGUMENT_FRAGMENT):
                    piece = {"index": k, "function": {"arguments": arguments[at : at + ARGUMENT_FRAGMENT]}}
                    chunk([{"index": i, "delta": {"tool_calls": [piece]}, "finish_reason": None}])
        pieces = [words(t) for t in texts]
        for step in range(max(len(p) for p in pieces)):
            for i, p in enumerate(pieces):
                if step < len(p):
                    choice = {"index": i, "delta": {"content": p[step]}, "finish_reason": None}
                    if want_logprobs:
                        choice["logprobs"] = self._logprobs(p[step], top)
                    chunk([choice])
        for i, (_, calls) in enumerate(replies):
            finish = self.tool_finish_reason if calls else self.finish_reason
            end: dict[str, Any] = {"index": i, "delta": {}, "finish_reason": finish}
            if self.stop_reason is not None:
                end["stop_reason"] = self.stop_reason
            chunk([end])
        if self.stream_usage and (body.get("stream_options") or {}).get("include_usage"):
            chunk([], usage=usage)
        events.append((None, "[DONE]"))
        return Sse(events)


if __name__ == "__main__":  # bench/run serves this fake in a process of its own: `python fake_openai.py`
    import sys

    fake = FakeOpenAI()
    print(fake.start(), flush=True)  # the base URL; serves until stdin closes
    sys.stdin.read()
    fake.stop()
