"""A loopback Mistral chat API (the OpenAI-style chat-completions wire): POST
/v1/chat/completions, JSON and SSE `data:` chunks ending in `data: [DONE]`, usage in the last
chunk, native `n`, bearer auth. LiteLLM's fake reuses it as a plain OpenAI-compatible server.

Tool calls: `calls` holds scripted calls, one list per choice (taken before `answers`; an empty
list answers with a text): `message.tool_calls` with Mistral's nine-character ids (`r0001c000`:
request 1, call 0), content "", finish_reason `tool_calls`; streamed whole, one delta per call
(`split_calls`: the arguments in pieces, id and name repeated on each). `object_arguments` sends
arguments as JSON objects. `thinking` puts thinking chunks (text, signature or "") first in every
answer's content, streamed as thinking-chunk deltas by words, a signature on a chunk's last
piece. FakeMistral also refuses, as Mistral does, any call id it is sent that is not nine letters
and digits."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "mistral-test-0123456789abcdef"
# Characters per streamed argument piece with `split_calls`.
ARGUMENT_FRAGMENT = 5
_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")


class FakeChatCompletions:
    """Answers scripted texts (or a greeting) in chat-completions shapes; records every request."""

    path = "/v1/chat/completions"
    greeting = "Hello from the fake Mistral"
    # Refuse (400, Mistral's message) call ids that are not nine letters and digits.
    checks_call_ids: ClassVar[bool] = False

    def __init__(self, api_key: str = API_KEY) -> None:
        self.api_key = api_key
        self.answers: list[str] = []
        self.calls: list[list[tuple[str, str]]] = []
        self.reset_quirks()
        self.server = FakeServer(auth=self._auth, unauthorized=self._unauthorized)
        self.server.add_route("POST", self.path, self._chat)

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
        self.finish_reason = "stop"
        self.thinking: list[tuple[str, str]] = []
        self.object_arguments = False
        self.split_calls = False

    def _auth(self, rec: Recorded) -> bool:
        return rec.headers.get("authorization") == f"Bearer {self.api_key}"

    @staticmethod
    def _unauthorized() -> Json:
        return Json({"message": "Unauthorized", "request_id": "r"}, status=401)

    def _bad_call_id(self, body: dict[str, Any]) -> Json | None:
        """Mistral's 400 for the first call id sent that is not nine letters and digits."""
        for m in body["messages"]:
            ids = [m.get("tool_call_id")] if m.get("role") == "tool" else []
            ids += [c.get("id") for c in m.get("tool_calls") or ()]
            for given in ids:
                if not _CALL_ID.fullmatch(str(given)):
                    message = f"Tool call id was {given} but must be a-z, A-Z, 0-9, with a length of 9."
                    error = {"object": "error", "message": message, "type": "invalid_request_error"}
                    return Json(dict(error, param=None, code="3280"), status=400)
        return None

    def _replies(self, n: int) -> list[tuple[str, list[dict[str, Any]]]]:
        """Each choice's text and wire tool calls (scripted calls first, then texts)."""
        out: list[tuple[str, list[dict[str, Any]]]] = []
        for i in range(n):
            scripted = self.calls.pop(0) if self.calls else []
            calls = [
                {
                    "id": f"r{len(self.server.requests):04d}c{k:03d}",
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": json.loads(arguments) if self.object_arguments else arguments,
                    },
                    "index": k,
                }
                for k, (name, arguments) in enumerate(scripted)
            ]
            text = "" if calls else self.answers.pop(0) if self.answers else f"{self.greeting} {i}"
            out.append((text, calls))
        return out

    def _thinking_chunk(self, text: str, signature: str) -> dict[str, Any]:
        chunk: dict[str, Any] = {"type": "thinking", "thinking": [{"type": "text", "text": text}]}
        if signature:
            chunk["signature"] = signature
        return chunk

    def _content(self, text: str) -> str | list[dict[str, Any]]:
        if not self.thinking:
            return text
        chunks = [self._thinking_chunk(t, s) for t, s in self.thinking]
        return [*chunks, *([{"type": "text", "text": text}] if text else [])]

    def _chat(self, rec: Recorded) -> Json | Sse:
        body: dict[str, Any] = rec.body
        refused = self._bad_call_id(body) if self.checks_call_ids else None
        if refused is not None:
            return refused
        n = int(body.get("n") or 1)
        replies = self._replies(n)
        input_tokens = sum(len(json.dumps(m).split()) for m in body["messages"])
        said = [
            " ".join([t for t, _ in self.thinking] + [text] + [json.dumps(c) for c in calls])
            for text, calls in replies
        ]
        out_tokens = sum(len(words(s)) for s in said)
        usage = {
            "prompt_tokens": input_tokens,
            "completion_tokens": out_tokens,
            "total_tokens": input_tokens + out_tokens,
        }
        base = {"id": "cmpl-fake", "object": "chat.completion", "created": 1700000000, "model": body["model"]}
        if not body.get("stream"):
            choices = []
            for i, (text, calls) in enumerate(replies):
                message: dict[str, Any] = {"role": "assistant", "content": self._content(text)}
                if calls:
                    message["tool_calls"] = calls
                finish = "tool_calls" if calls else self.finish_reason
                choices.append({"index": i, "message": message, "finish_reason": finish})
            return Json(dict(base, choices=choices, usage=usage))
        chunk = dict(base, object="chat.completion.chunk")
        events: list[tuple[str | None, str]] = []

        def send(i: int, delta: dict[str, Any]) -> None:
            events.append(
                (None, json.dumps(dict(chunk, choices=[{"index": i, "delta": delta, "finish_reason": None}])))
            )

        for i, (text, calls) in enumerate(replies):
            send(i, {"role": "assistant", "content": ""})
            for thought, signature in self.thinking:
                pieces = words(thought)
                for k, piece in enumerate(pieces):
                    last = signature if k == len(pieces) - 1 else ""
                    send(i, {"content": [self._thinking_chunk(piece, last)]})
            for piece in words(text):
                send(i, {"content": piece})
            for call in calls:
                if not self.split_calls:
                    send(i, {"content": "", "tool_calls": [call]})
                    continue
                arguments = call["function"]["arguments"]
                arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
                for at in range(0, len(arguments), ARGUMENT_FRAGMENT):
                    piece = dict(
                        call,
                        function=dict(call["function"], arguments=arguments[at : at + ARGUMENT_FRAGMENT]),
                    )
                    send(i, {"content": "", "tool_calls": [piece]})
        for i, (_, calls) in enumerate(replies):
            finish = "tool_calls" if calls else self.finish_reason
            last: dict[str, Any] = dict(
                chunk, choices=[{"index": i, "delta": {"content": ""}, "finish_reason": finish}]
            )
            if i == n - 1:
                last["usage"] = usage
            events.append((None, json.dumps(last)))
        events.append((None, "[DONE]"))
        return Sse(events)


class FakeMistral(FakeChatCompletions):
    """The Mistral fake proper: call ids it is sent are checked as Mistral checks them."""

    checks_call_ids: ClassVar[bool] = True
