"""The Mistral chat wire format for tools and thinking, both directions, as pure functions:
messages (tool turns and thinking chunks included), tools and tool choice out; a message's text,
tool calls and thinking in (unary messages and stream deltas alike: the plain JSON read by
providers.rawhttp, or the `mistralai` SDK's objects, read by the same accessors).

Tool call ids: Mistral takes only nine letters and digits as a call's id (`tool_calls[].id` and
`tool_call_id`). An id already so (Mistral's own) goes as it is; any other (gengate's `call_…`,
another provider's) is mapped to nine characters by its SHA-256, the same on every turn, so a
call and the tool message answering it still pair up upstream. Calls come back with the ids
Mistral gave them.

Thinking: a `thinking` content chunk is one thought; a turn's thoughts become one `Reasoning`
(texts joined). Signed chunks keep their signatures in Anthropic's entry encoding
(providers.anthropic_wire: one entry per chunk, sized when there are several), so each chunk's
text goes back with its own signature. An assistant turn's reasoning is sent back as thinking
chunks before its text, as Mistral asks for its reasoning models.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gengate.domain import (
    ChatMessage,
    ImagePart,
    Reasoning,
    Role,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
)
from gengate.providers import anthropic_wire, openai_wire
from gengate.providers import rawhttp as a
from gengate.providers.anthropic_wire import Thought
from gengate.providers.base import image_url
from gengate.providers.errors import UnreadableAnswer
from gengate.tools import parameters_of

# The tool call ids Mistral accepts.
CALL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ID_ALPHABET = string.digits + string.ascii_letters

# --- out ----------------------------------------------------------------------------------------


def call_id(given: str) -> str:
    """`given` as a Mistral call id: kept when it is one, else its stable nine-character digest."""
    if CALL_ID.fullmatch(given):
        return given
    number = int.from_bytes(hashlib.sha256(given.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        number, digit = divmod(number, len(_ID_ALPHABET))
        out.append(_ID_ALPHABET[digit])
    return "".join(out)


def content(parts: Sequence[TextPart | ImagePart]) -> str | list[dict[str, Any]]:
    """Text parts as one string; with images, a list of text and image_url chunks."""
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return [
        {"type": "text", "text": p.text}
        if isinstance(p, TextPart)
        else {"type": "image_url", "image_url": image_url(p)}
        for p in parts
    ]


def tool(t: Tool) -> dict[str, Any]:
    """A function tool; a strict tool asks Mistral's strict mode for its schema, sent as it is."""
    function: dict[str, Any] = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = parameters_of(t)
    if t.strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    """`auto` / `none` / `any` (Mistral's word for required), or the named function."""
    if choice.name is None and choice.mode is ToolChoiceMode.REQUIRED:
        return "any"
    return openai_wire.tool_choice(choice)


def thinking_chunks(reasoning: Reasoning | None) -> list[dict[str, Any]]:
    """A turn's reasoning as thinking chunks: one per signature entry (each with its signature),
    or one chunk of the whole text when it is unsigned."""
    if reasoning is None or not (reasoning.text or reasoning.signatures):
        return []
    if not reasoning.signatures:
        return [_thinking(reasoning.text, "")]
    blocks = anthropic_wire.thinking_blocks(reasoning)
    return [_thinking(b["thinking"], b["signature"]) for b in blocks if b["type"] == "thinking"]


def _thinking(text: str, signature: str) -> dict[str, Any]:
    chunk: dict[str, Any] = {"type": "thinking", "thinking": [{"type": "text", "text": text}]}
    if signature:
        chunk["signature"] = signature
    return chunk


def _assistant(m: ChatMessage) -> dict[str, Any]:
    """An assistant turn: its thinking chunks then its text, and its calls (ids mapped)."""
    entry: dict[str, Any] = {"role": "assistant"}
    thoughts = thinking_chunks(m.reasoning)
    if thoughts:
        said = content(m.content)
        if isinstance(said, str):
            said = [{"type": "text", "text": said}] if said else []
        entry["content"] = [*thoughts, *said]
    else:
        entry["content"] = content(m.content)
    if m.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call_id(c.id),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
                "index": k,  # the SDK would say 0 for every call
            }
            for k, c in enumerate(m.tool_calls)
        ]
    return entry


def messages(chat: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The chat as Mistral messages: tool results as `tool` messages carrying their call's
    (mapped) id and the called function's name, looked up in the chat when the message has none."""
    names = {c.id: c.name for m in chat for c in m.tool_calls}
    out: list[dict[str, Any]] = []
    for m in chat:
        if m.role is Role.TOOL:
            entry: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": call_id(m.tool_call_id),
                "content": content(m.content),
            }
            name = m.name or names.get(m.tool_call_id, "")
            if name:
                entry["name"] = name
            out.append(entry)
        elif m.role is Role.ASSISTANT:
            out.append(_assistant(m))
        else:
            out.append({"role": m.role.value, "content": content(m.content)})
    return out


# --- in -----------------------------------------------------------------------------------------


def parts(body: Any) -> tuple[str, list[Thought]]:
    """A message's or delta's content: its text, and its thinking chunks as thoughts."""
    given = a.field(body, "content") if body is not None else None
    if not given:
        return "", []
    if isinstance(given, str):
        return given, []
    text: list[str] = []
    thoughts: list[Thought] = []
    for chunk in a.objects(body, "content"):
        if a.field(chunk, "type") == "thinking":
            said = "".join(a.text(t, "text") for t in a.objects(chunk, "thinking"))
            thoughts.append(Thought(said, a.text(chunk, "signature")))
        else:
            text.append(a.text(chunk, "text"))
    return "".join(text), thoughts


def reasoning(thoughts: Sequence[Thought]) -> Reasoning | None:
    """A turn's thoughts as one Reasoning: signed ones keep their entries (module docstring)."""
    if not thoughts:
        return None
    if not any(t.signature for t in thoughts):
        return Reasoning("".join(t.text for t in thoughts))
    return anthropic_wire.reasoning(thoughts)


def _id(raw: Any) -> str:
    """A call's id; none (the SDK reads a missing one as "null") is empty: the base makes one."""
    return raw if isinstance(raw, str) and raw not in ("", "null") else ""


def arguments(raw: Any) -> str:
    """A call's arguments as JSON text (Mistral may send an object)."""
    return raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)


def _function(call: Any) -> tuple[str, str]:
    """A call's function name and arguments (as JSON text)."""
    function = a.member(call, "function")
    if function is None:
        raise UnreadableAnswer("a tool call has no `function`")
    return a.text(function, "name"), arguments(a.field(function, "arguments"))


def _wire_index(call: Any) -> int | None:
    """The index a call says it has (None: none given; the SDK defaults it to 0 when absent)."""
    if isinstance(call, dict):
        given = call.get("index")
    else:
        given = call.index if "index" in call.model_fields_set else None
    return given if isinstance(given, int) and not isinstance(given, bool) else None


def tool_calls(message: Any) -> tuple[ToolCall, ...]:
    """A message's function calls, arguments as JSON text."""
    out = []
    for c in a.objects(message, "tool_calls") if message is not None else ():
        name, args = _function(c)
        out.append(ToolCall(_id(a.field(c, "id")), name, args))
    return tuple(out)


@dataclass
class StreamState:
    """One stream's calls and thinking by choice. Mistral streams each call whole in one delta;
    a delta repeating a known call's wire index without a new id continues that call, and a new
    id at a known index is the next call. Thinking chunks join into one thought until one is
    signed or text comes between."""

    calls: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    thoughts: dict[int, list[Thought]] = field(default_factory=dict)
    spoke: set[int] = field(default_factory=set)

    def fragments(self, choice: int, delta: Any) -> tuple[ToolCallDelta, ...]:
        """The delta's calls as fragments of the choice's calls (index, and id and name first)."""
        out: list[ToolCallDelta] = []
        for position, call in enumerate(a.objects(delta, "tool_calls") if delta is not None else ()):
            given = _wire_index(call)
            wire_index = position if given is None else given
            made = _id(a.field(call, "id"))
            known = self.calls.get((choice, wire_index))
            name, args = _function(call)
            if known is not None and made in ("", known[0]):
                out.append(ToolCallDelta(known[1], "", name, args))
                continue
            index = self.counts.get(choice, 0)
            self.counts[choice] = index + 1
            self.calls[(choice, wire_index)] = (made, index)
            out.append(ToolCallDelta(index, made, name, args))
        return tuple(out)

    def said(self, choice: int) -> None:
        """Text came for the choice: its next thinking chunk starts a new thought."""
        self.spoke.add(choice)

    def think(self, choice: int, thought: Thought) -> None:
        thoughts = self.thoughts.setdefault(choice, [])
        if thoughts and not thoughts[-1].signature and choice not in self.spoke:
            thoughts[-1] = Thought(thoughts[-1].text + thought.text, thought.signature)
        else:
            thoughts.append(thought)
        self.spoke.discard(choice)

    def signatures(self, choice: int) -> tuple[str, ...]:
        got = reasoning(self.thoughts.get(choice, ()))
        return got.signatures if got is not None else ()
