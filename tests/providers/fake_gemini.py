"""A loopback Gemini API (generativelanguage v1 / v1beta): POST models/{model}:generateContent and
:streamGenerateContent?alt=sse, camelCase JSON, usageMetadata, candidateCount, x-goog-api-key
auth answered like Google does (HTTP 400 "API key not valid", status INVALID_ARGUMENT).

Function calls: `calls` holds scripted calls, one list per candidate (taken before `answers`;
an empty list answers with a text): functionCall parts (`args` the arguments parsed, an `id`
unless `call_ids` is off), finishReason STOP as Gemini sends it, the first call's part carrying
`call_signature` as its thoughtSignature; streamed whole, all of a turn's calls in one chunk.
`thinking` puts thought parts (text, signature or "") first when the request asks for them
(thinkingConfig.includeThoughts), streamed a word a chunk; `text_signature` signs the last text
part (streamed on an empty text part of the final chunk, as Gemini does). Thinking is counted
apart from the answer in `thoughtsTokenCount`, whether its text is shown or not.

Continuation, as the API does it past its per-request token limit: with `hop_words` set, each
request serves at most that many words of each candidate's (text) answer; a hop that leaves some
unsaid ends with finishReason CONTINUATION and a `continuationToken` on the first candidate, and
the next request must send that token back (top-level `continuationToken`; an unknown one is a
400). Each hop bills the prompt again. Streamed, `checkpoints` also puts a resumable token on
each of the first candidate's chunks (no finish reason), as long decodes do mid-hop; `endless`
asks to continue forever (a hostile upstream), each time with a new token."""

from __future__ import annotations

import base64
import json
from typing import Any

from fake_anthropic import words
from fakehttp import FakeServer, Json, Recorded, Sse

API_KEY = "AIzaSyFakeKey0123456789abcdefghijk"


def camel(value: Any) -> Any:
    """A request body with every key in lowerCamelCase: the SDK writes some nested messages
    (function declarations, thinking config, function responses) with their proto field names
    (`include_thoughts`), which Google's JSON parser takes like `includeThoughts`."""
    if isinstance(value, list):
        return [camel(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, v in value.items():
        head, *rest = str(key).split("_")
        out[head + "".join(w[:1].upper() + w[1:] for w in rest) if head else key] = camel(v)
    return out


class FakeGemini:
    """Answers scripted texts (or a greeting) with Gemini shapes; records every request."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.calls: list[list[tuple[str, str]]] = []
        self.reset_quirks()
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
        self.calls.clear()
        self.reset_quirks()

    def reset_quirks(self) -> None:
        self.finish_reason = "STOP"
        self.call_ids = True
        self.call_signature: str | None = None  # base64, on each turn's first functionCall part
        self.thinking: list[tuple[str, str]] = []  # (text, signature or "") of each thought part
        self.text_signature: str | None = None
        self.served = 0
        self.hop_words: int | None = None
        self.checkpoints = False
        self.endless = False
        self.bad_chunk: int | None = None  # streamed: this chunk's text is a number (malformed)
        self.held: dict[int, list[list[str]]] = {}  # answer id -> each candidate's words

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

    def _turn(self, i: int, thoughts: bool) -> list[dict[str, Any]]:
        """Candidate `i`'s parts: thoughts (when asked for), then scripted calls or a text."""
        parts: list[dict[str, Any]] = []
        if thoughts:
            for text, signature in self.thinking:
                parts.append(
                    {"text": text, "thought": True} | ({"thoughtSignature": signature} if signature else {})
                )
        scripted = self.calls.pop(0) if self.calls else []
        for j, (name, arguments) in enumerate(scripted):
            call: dict[str, Any] = {"name": name, "args": json.loads(arguments) if arguments else {}}
            if self.call_ids:
                call = {"id": f"fc_fake_{self.served}_{i}_{j}"} | call
            part: dict[str, Any] = {"functionCall": call}
            if j == 0 and self.call_signature:
                part["thoughtSignature"] = self.call_signature
            parts.append(part)
        if not scripted:
            text = self.answers.pop(0) if self.answers else f"Hello from the fake Gemini {i}"
            parts.append(
                {"text": text} | ({"thoughtSignature": self.text_signature} if self.text_signature else {})
            )
        return parts

    @staticmethod
    def _said(parts: list[dict[str, Any]]) -> str:
        return " ".join(p.get("text") or json.dumps(p.get("functionCall", {}).get("args", "")) for p in parts)

    def _dispatch(self, rec: Recorded) -> Json | Sse:
        model, _, method = rec.path.rsplit("/", 1)[-1].partition(":")
        body: dict[str, Any] = camel(rec.body)
        config = body.get("generationConfig", {})
        n = int(config.get("candidateCount") or 1)
        thoughts = bool(config.get("thinkingConfig", {}).get("includeThoughts"))
        self.served += 1
        if self.hop_words or self.endless or "continuationToken" in body:
            return self._hop(body, method, model, n)
        turns = [self._turn(i, thoughts) for i in range(n)]
        prompt_tokens = sum(len(json.dumps(c).split()) for c in body["contents"])
        output_tokens = sum(len(words(self._said(t))) for t in turns)
        thought_tokens = n * sum(len(words(text)) for text, _ in self.thinking)  # shown or not
        usage = {
            "promptTokenCount": prompt_tokens,
            "candidatesTokenCount": output_tokens - (thought_tokens if thoughts else 0),
            "totalTokenCount": prompt_tokens + output_tokens + (0 if thoughts else thought_tokens),
        } | ({"thoughtsTokenCount": thought_tokens} if thought_tokens else {})
        if method == "generateContent":
            candidates = [
                {"content": {"parts": t, "role": "model"}, "finishReason": self.finish_reason, "index": i}
                for i, t in enumerate(turns)
            ]
            return Json({"candidates": candidates, "usageMetadata": usage, "modelVersion": model})
        if method != "streamGenerateContent":
            return Json({"error": {"code": 404, "message": "no such method", "status": "NOT_FOUND"}}, 404)
        chunks = [self._chunks(t) for t in turns]
        events: list[tuple[str | None, str]] = []
        for step in range(max(len(c) for c in chunks)):
            candidates = [
                {"content": {"parts": c[step], "role": "model"}, "index": i}
                for i, c in enumerate(chunks)
                if step < len(c)
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
                "content": {"parts": [{"text": ""} | self._signed_end(t)], "role": "model"},
                "finishReason": self.finish_reason,
                "index": i,
            }
            for i, t in enumerate(turns)
        ]
        events.append(
            (None, json.dumps({"candidates": final, "usageMetadata": usage, "modelVersion": model}))
        )
        return Sse(events)

    @staticmethod
    def _chunks(parts: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """A turn's parts as streamed: thoughts and text a word a chunk (signatures held for the
        end), all calls in one chunk."""
        out: list[list[dict[str, Any]]] = []
        calls = [p for p in parts if "functionCall" in p]
        for p in parts:
            if "text" in p:
                flags = {"thought": True} if p.get("thought") else {}
                out.extend([{"text": w} | flags] for w in words(p["text"]))
                if p.get("thought") and p.get("thoughtSignature"):
                    out.append([{"text": "", "thought": True, "thoughtSignature": p["thoughtSignature"]}])
        if calls:
            out.append(calls)
        return out

    @staticmethod
    def _signed_end(parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The text part's signature, sent on the final chunk's empty text part."""
        for p in parts:
            if "text" in p and not p.get("thought") and p.get("thoughtSignature"):
                return {"thoughtSignature": p["thoughtSignature"]}
        return {}

    # --- continuation ---------------------------------------------------------------------------

    @staticmethod
    def token(answer: int, at: int) -> str:
        """A continuation token (standard base64, as Google sends bytes): resume `answer` at word `at`."""
        return base64.b64encode(json.dumps([answer, at]).encode()).decode()

    def _hop(self, body: dict[str, Any], method: str, model: str, n: int) -> Json | Sse:
        """One request of a continued answer: the words from the token's offset on, at most
        `hop_words` of them (all of them without), then CONTINUATION or the finish reason."""
        token = body.get("continuationToken")
        if self.endless:
            answer, at, held = 0, 0, [["more "] * 2] * n
        elif token is None:
            answer, at = self.served, 0
            texts = [
                self.answers.pop(0) if self.answers else f"Hello from the fake Gemini {i}" for i in range(n)
            ]
            held = self.held[answer] = [words(t) for t in texts]
        else:
            try:
                answer, at = json.loads(base64.urlsafe_b64decode(token))
                held = self.held[answer]
            except (ValueError, KeyError, TypeError):
                error = {"code": 400, "message": "Invalid continuation token.", "status": "INVALID_ARGUMENT"}
                return Json({"error": error}, 400)
        step = 1 if self.endless else self.hop_words or max(len(w) for w in held)
        end = at + step
        done = not self.endless and all(end >= len(w) for w in held)
        pieces = [w[at:end] for w in held]
        prompt_tokens = sum(len(json.dumps(c).split()) for c in body["contents"])
        usage = {
            "promptTokenCount": prompt_tokens,
            "candidatesTokenCount": sum(len(p) for p in pieces),
            "totalTokenCount": prompt_tokens + sum(len(p) for p in pieces),
        }
        resume = self.token(0, self.served) if self.endless else self.token(answer, end)

        def ending(i: int) -> dict[str, Any]:
            if done:
                return {"finishReason": self.finish_reason}
            return {"finishReason": "CONTINUATION", "continuationToken": resume} if i == 0 else {}

        if method == "generateContent":
            candidates = [
                {"content": {"parts": [{"text": "".join(p)}], "role": "model"}, "index": i} | ending(i)
                for i, p in enumerate(pieces)
            ]
            return Json({"candidates": candidates, "usageMetadata": usage, "modelVersion": model})
        events: list[tuple[str | None, str]] = []
        for k in range(max(len(p) for p in pieces)):
            candidates = []
            for i, p in enumerate(pieces):
                if k < len(p):
                    candidate: dict[str, Any] = {
                        "content": {"parts": [{"text": p[k]}], "role": "model"},
                        "index": i,
                    }
                    if i == 0 and self.checkpoints and not self.endless:
                        candidate["continuationToken"] = self.token(answer, at + k + 1)
                    if i == 0 and k == self.bad_chunk:
                        candidate["content"]["parts"][0]["text"] = 7
                    candidates.append(candidate)
            chunk = {"candidates": candidates, "usageMetadata": {"promptTokenCount": prompt_tokens}}
            events.append((None, json.dumps(chunk)))
        final = [
            {"content": {"parts": [{"text": ""}], "role": "model"}, "index": i} | ending(i)
            for i in range(len(pieces))
            if done or i == 0
        ]
        events.append(
            (None, json.dumps({"candidates": final, "usageMetadata": usage, "modelVersion": model}))
        )
        return Sse(events)
