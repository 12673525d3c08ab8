"""The Anthropic Messages wire format for tools and thinking, both directions, as pure functions:
tools, tool choice, tool turns and thinking blocks out; tool_use and thinking blocks in (unary
content and stream events alike: the plain JSON read by providers.rawhttp, or the `anthropic`
SDK's objects where a batch hands them, read by the same accessors).

A turn's thinking becomes one `Reasoning`: the blocks' texts joined, one signature entry per
block in order. A thinking block's entry is its signature (prefixed `thinking:<chars>:` when the
turn has several, so each block's text can be cut out again: a signature covers exactly its own
text), a redacted block's is `redacted_thinking:<data>`. Sent back, the entries rebuild the same
blocks in the same order, as Anthropic requires beside the tool use they preceded.
"""

from __future__ import annotations

import base64
import json
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
from gengate.errors import FieldViolation
from gengate.providers import rawhttp as a
from gengate.tools import parameters_of

REDACTED = "redacted_thinking:"
SIZED = "thinking:"


@dataclass(frozen=True)
class Thought:
    """One thinking block: its text and signature, or (redacted) its opaque data alone."""

    text: str
    signature: str
    redacted: bool = False


def content(parts: Sequence[TextPart | ImagePart]) -> list[dict[str, Any]]:
    """Text and image parts as content blocks (an image by URL or as base64 data)."""
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
        elif part.url:
            out.append({"type": "image", "source": {"type": "url", "url": part.url}})
        else:
            data = base64.b64encode(part.data or b"").decode()
            media = part.mime_type or "image/png"
            out.append({"type": "image", "source": {"type": "base64", "media_type": media, "data": data}})
    return out


# --- out ----------------------------------------------------------------------------------------


def tool(t: Tool, strict_schema: dict[str, Any] | None) -> dict[str, Any]:
    """A tool definition; `strict_schema` (the schema adapted for strict mode) turns strict on."""
    entry: dict[str, Any] = {"name": t.name}
    if t.description:
        entry["description"] = t.description
    entry["input_schema"] = strict_schema if strict_schema is not None else parameters_of(t)
    if strict_schema is not None:
        entry["strict"] = True
    return entry


def tool_choice(choice: ToolChoice | None, parallel: bool | None) -> dict[str, Any] | None:
    """auto / any (required) / tool (named) / none, with `disable_parallel_tool_use` when
    parallel calls are forbidden (none takes no such flag); None: the API's default."""
    if choice is None and parallel is None:
        return None
    if choice is not None and choice.name is not None:
        out: dict[str, Any] = {"type": "tool", "name": choice.name}
    else:
        mode = ToolChoiceMode.AUTO if choice is None else choice.mode
        out = {
            "type": {
                ToolChoiceMode.AUTO: "auto",
                ToolChoiceMode.REQUIRED: "any",
                ToolChoiceMode.NONE: "none",
            }[mode]
        }
    if parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object `tool_use.input` takes (empty text: no arguments);
    ValueError when they are not a JSON object."""
    if not arguments.strip():
        return {}
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError("is not a JSON object")
    return value


def history_violations(messages: Sequence[ChatMessage]) -> list[FieldViolation]:
    """Assistant calls whose arguments are no JSON object: Anthropic's `tool_use.input` is one."""
    out: list[FieldViolation] = []
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls):
            try:
                arguments_object(call.arguments)
            except ValueError:
                out.append(
                    FieldViolation(
                        f"messages.messages[{i}].tool_calls[{j}].arguments_json",
                        "must be a JSON object (Anthropic sends a call's input as one)",
                    )
                )
    return out


def thinking_blocks(reasoning: Reasoning | None) -> list[dict[str, Any]]:
    """A turn's thinking and redacted-thinking blocks rebuilt from its signature entries (see the
    module docstring); none without entries: unsigned thinking cannot be sent back."""
    if reasoning is None:
        return []
    out: list[dict[str, Any]] = []
    text, at = reasoning.text, 0
    for entry in reasoning.signatures:
        if entry.startswith(REDACTED):
            out.append({"type": "redacted_thinking", "data": entry[len(REDACTED) :]})
            continue
        size, signature = _sized(entry)
        end = len(text) if size is None else at + size
        out.append({"type": "thinking", "thinking": text[at:end], "signature": signature})
        at = end
    return out


def _sized(entry: str) -> tuple[int | None, str]:
    if entry.startswith(SIZED):
        size, sep, signature = entry[len(SIZED) :].partition(":")
        if sep and size.isdigit():
            return int(size), signature
    return None, entry


def _tool_result(m: ChatMessage) -> dict[str, Any]:
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id}
    result["content"] = content(m.content) if m.has_images else m.text
    return result


def _assistant(m: ChatMessage) -> list[dict[str, Any]]:
    """Thinking first (the API requires it there), then what it said, then its calls."""
    calls = [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": arguments_object(c.arguments)}
        for c in m.tool_calls
    ]
    said = [block for block in content(m.content) if block.get("text") != ""]
    return [*thinking_blocks(m.reasoning), *said, *calls]


def messages(chat: Sequence[ChatMessage]) -> tuple[str, list[dict[str, Any]]]:
    """The system text and the Messages API turns: tool results as user turns of tool_result
    blocks, adjacent turns of one role merged (the API takes alternating roles)."""
    system = "\n\n".join(m.text for m in chat if m.role is Role.SYSTEM)
    out: list[dict[str, Any]] = []
    for m in chat:
        if m.role is Role.SYSTEM:
            continue
        if m.role is Role.TOOL:
            role, blocks = "user", [_tool_result(m)]
        elif m.role is Role.ASSISTANT and (m.tool_calls or m.reasoning is not None):
            role, blocks = "assistant", _assistant(m)
        else:
            role, blocks = m.role.value, content(m.content)
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    return system, out


# --- in -----------------------------------------------------------------------------------------


def reasoning(thoughts: Sequence[Thought]) -> Reasoning | None:
    """A turn's thinking blocks as one Reasoning (None: it had none)."""
    if not thoughts:
        return None
    several = sum(not t.redacted for t in thoughts) > 1
    entries = []
    for t in thoughts:
        if t.redacted:
            entries.append(REDACTED + t.signature)
        elif several:
            entries.append(f"{SIZED}{len(t.text)}:{t.signature}")
        else:
            entries.append(t.signature)
    return Reasoning("".join(t.text for t in thoughts if not t.redacted), tuple(entries))


def message_parts(blocks: Sequence[Any]) -> tuple[str, tuple[ToolCall, ...], Reasoning | None]:
    """A Message's content: its text, its tool calls (input as JSON text) and its thinking.
    Blocks of other kinds (server tools' own) are not the caller's and are left out."""
    text: list[str] = []
    calls: list[ToolCall] = []
    thoughts: list[Thought] = []
    for block in blocks:
        kind = a.field(block, "type")
        if kind == "text":
            text.append(a.text(block, "text"))
        elif kind == "tool_use":
            given = json.dumps(a.field(block, "input"), ensure_ascii=False)
            calls.append(ToolCall(a.text(block, "id"), a.text(block, "name"), given))
        elif kind == "thinking":
            thoughts.append(Thought(a.text(block, "thinking"), a.text(block, "signature")))
        elif kind == "redacted_thinking":
            thoughts.append(Thought("", a.text(block, "data"), redacted=True))
    return "".join(text), tuple(calls), reasoning(thoughts)


@dataclass
class StreamBlocks:
    """Content blocks of one streamed Message, by the event's block index: which are tool calls
    (and their call index), and the thinking blocks' texts and signatures as they arrive."""

    calls: dict[int, int] = field(default_factory=dict)
    argued: set[int] = field(default_factory=set)
    thoughts: dict[int, Thought] = field(default_factory=dict)

    def start(self, index: int, block: Any) -> ToolCallDelta | None:
        """A content_block_start: a tool call's first fragment (id and name), or None."""
        kind = a.field(block, "type")
        if kind == "tool_use":
            call = self.calls[index] = len(self.calls)
            given = a.field(block, "input")
            arguments = json.dumps(given, ensure_ascii=False) if given else ""
            if arguments:
                self.argued.add(index)
            return ToolCallDelta(call, a.text(block, "id"), a.text(block, "name"), arguments)
        if kind == "thinking":
            self.thoughts[index] = Thought(a.text(block, "thinking"), a.text(block, "signature"))
        elif kind == "redacted_thinking":
            self.thoughts[index] = Thought("", a.text(block, "data"), redacted=True)
        return None

    def arguments(self, index: int, partial: str) -> ToolCallDelta | None:
        """An input_json_delta's fragment of the call at block `index` (None: empty)."""
        if index not in self.calls or not partial:
            return None
        self.argued.add(index)
        return ToolCallDelta(self.calls[index], arguments=partial)

    def think(self, index: int, text: str) -> None:
        t = self.thoughts.get(index, Thought("", ""))
        self.thoughts[index] = Thought(t.text + text, t.signature)

    def sign(self, index: int, signature: str) -> None:
        t = self.thoughts.get(index, Thought("", ""))
        self.thoughts[index] = Thought(t.text, t.signature + signature)

    def stop(self, index: int) -> ToolCallDelta | None:
        """A content_block_stop: `{}` for a call that got no input at all (a tool without
        parameters), so the fragments sent and the end frame's arguments agree."""
        if index in self.calls and index not in self.argued:
            self.argued.add(index)
            return ToolCallDelta(self.calls[index], arguments="{}")
        return None

    def signatures(self) -> tuple[str, ...]:
        got = reasoning([self.thoughts[i] for i in sorted(self.thoughts)])
        return got.signatures if got is not None else ()
