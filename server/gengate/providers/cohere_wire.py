"""The Cohere v2 Chat wire format for tools and thinking, both directions, as pure functions:
tools, tool choice, tool turns and thinking items out; tool calls, tool plans and thinking items
in (unary messages and stream events alike: the plain JSON read by providers.rawhttp, or the
`cohere` SDK's objects, read by the same accessors).

Cohere has no named tool choice: a named tool is emulated exactly by offering only that tool
with `tool_choice: "REQUIRED"`. It has no parallel-calls switch either: the server's validation
enforces "at most one call" and re-asks. A `tool_plan` (what the model says before calling) is
the generation's text, and a turn's text goes back as its `tool_plan` beside its calls; the
generation's reasoning is the model's `thinking` content only, sent back as a thinking item.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gengate.domain import (
    ChatMessage,
    GenerationRequest,
    ImagePart,
    Reasoning,
    ReasoningControl,
    Role,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoiceMode,
)
from gengate.errors import FieldViolation
from gengate.providers import rawhttp as a
from gengate.providers.base import ChunkText, image_url
from gengate.tools import parameters_of

# --- out ----------------------------------------------------------------------------------------


def content(parts: Sequence[TextPart | ImagePart]) -> str | list[dict[str, Any]]:
    """Text parts as one string; with images, a list of text and image_url items."""
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
        else:
            out.append({"type": "image_url", "image_url": {"url": image_url(part)}})
    return out


def tool(t: Tool) -> dict[str, Any]:
    """A tool definition: `{type: function, function: {name, description, parameters}}`."""
    function: dict[str, Any] = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = parameters_of(t)
    return {"type": "function", "function": function}


def _strictable(t: Tool) -> bool:
    """Whether Cohere's strict mode takes the tool: strict asked, and one required parameter at
    least (Cohere's strict tools take no tool whose parameters are all optional)."""
    return t.strict and bool(parameters_of(t).get("required"))


def tool_params(req: GenerationRequest) -> dict[str, Any]:
    """`tools`, `tool_choice` and `strict_tools` for the request (empty: it offers no tools).

    Auto is Cohere's default (sent as nothing); a named tool is emulated by offering only that
    tool with REQUIRED; `strict_tools` (one switch for all tools) is set only when every tool
    offered is strict and strict mode takes it, otherwise the calls are only validated."""
    if not req.tools:
        return {}
    tools = req.tools
    choice = req.tool_choice
    params: dict[str, Any] = {}
    if choice is not None and choice.name is not None:
        tools = tuple(t for t in tools if t.name == choice.name)
        params["tool_choice"] = "REQUIRED"
    elif choice is not None and choice.mode is ToolChoiceMode.REQUIRED:
        params["tool_choice"] = "REQUIRED"
    elif choice is not None and choice.mode is ToolChoiceMode.NONE:
        params["tool_choice"] = "NONE"
    params["tools"] = [tool(t) for t in tools]
    if all(_strictable(t) for t in tools):
        params["strict_tools"] = True
    return params


def thinking(control: ReasoningControl | None) -> dict[str, Any] | None:
    """`thinking`: a budget as enabled with `token_budget`, enabled / disabled as they are;
    None: the model's default (Cohere's reasoning models think unless disabled)."""
    if control is None:
        return None
    if control.enabled is False:
        return {"type": "disabled"}
    if control.budget_tokens is not None:
        return {"type": "enabled", "token_budget": control.budget_tokens}
    if control.enabled is True:
        return {"type": "enabled"}
    return None


def _call(c: ToolCall) -> dict[str, Any]:
    """A call as a ToolCallV2 (arguments as JSON text; none as `{}`)."""
    return {
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments if c.arguments.strip() else "{}"},
    }


def _assistant(m: ChatMessage) -> dict[str, Any]:
    """An assistant turn: with calls, its text as the `tool_plan`; its reasoning as a thinking
    item before any text."""
    out: dict[str, Any] = {"role": "assistant"}
    items: list[dict[str, Any]] = []
    if m.reasoning is not None and m.reasoning.text:
        items.append({"type": "thinking", "thinking": m.reasoning.text})
    if m.tool_calls:
        out["tool_calls"] = [_call(c) for c in m.tool_calls]
        if m.text:
            out["tool_plan"] = m.text
    elif m.text or not items:
        items.append({"type": "text", "text": m.text})
    if items == [{"type": "text", "text": m.text}]:
        out["content"] = m.text
    elif items:
        out["content"] = items
    return out


def messages(chat: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The v2 Chat turns: tool results as `tool` turns with their `tool_call_id`, assistant turns
    with their calls, plan and thinking."""
    out: list[dict[str, Any]] = []
    for m in chat:
        if m.role is Role.TOOL:
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text})
        elif m.role is Role.ASSISTANT and (m.tool_calls or m.reasoning is not None):
            out.append(_assistant(m))
        else:
            out.append({"role": m.role.value, "content": content(m.content)})
    return out


def history_violations(chat: Sequence[ChatMessage]) -> list[FieldViolation]:
    """Tool results with images: Cohere's tool content is text and documents only."""
    return [
        FieldViolation(
            f"messages.messages[{i}].content",
            "a tool result to Cohere is text only (its tool content takes no images)",
        )
        for i, m in enumerate(chat)
        if m.role is Role.TOOL and m.has_images
    ]


# --- in -----------------------------------------------------------------------------------------


def message_parts(message: Any) -> tuple[str, tuple[ToolCall, ...], Reasoning | None]:
    """An assistant message (its JSON, or the SDK's AssistantMessageResponse): its text (the tool
    plan, then the text items), its calls and its thinking (None: it had none)."""
    if message is None:
        return "", (), None
    text = [a.text(message, "tool_plan")]
    thoughts: list[str] = []
    for item in a.objects(message, "content"):
        kind = a.field(item, "type")
        if kind == "text":
            text.append(a.text(item, "text"))
        elif kind == "thinking":
            thoughts.append(a.text(item, "thinking"))
    calls = tuple(
        ToolCall(a.text(c, "id"), _name(c), _arguments(c)) for c in a.objects(message, "tool_calls")
    )
    reasoning = Reasoning("".join(thoughts)) if thoughts else None
    return "".join(text), calls, reasoning


def _name(c: Any) -> str:
    """A tool call's function name ("" when absent)."""
    function = a.member(c, "function")
    return a.text(function, "name") if function is not None else ""


def _arguments(c: Any) -> str:
    """A tool call's arguments text ("" when absent)."""
    function = a.member(c, "function")
    return a.text(function, "arguments") if function is not None else ""


@dataclass
class StreamState:
    """One streamed answer's tool calls, by the event's index: their call index and whether any
    arguments came, so a call without any still ends as `{}` in fragments and end frame."""

    calls: dict[int, int] = field(default_factory=dict)
    argued: set[int] = field(default_factory=set)

    def chunks(self, event: Any) -> list[ChunkText]:
        """What a stream event other than message-end says: text (content or tool plan),
        thinking, or a call fragment; nothing for the events that carry none."""
        delta = a.member(event, "delta")
        message = a.member(delta, "message") if delta is not None else None
        index = a.integer(event, "index") or 0
        kind = a.field(event, "type")
        fragment: ToolCallDelta | None = None
        if kind == "content-delta":
            item = a.member(message, "content") if message is not None else None
            out = []
            if item is not None and (thought := a.text(item, "thinking")):
                out.append(ChunkText(0, "", reasoning=thought))
            if item is not None and (said := a.text(item, "text")):
                out.append(ChunkText(0, said))
            return out
        if kind == "tool-plan-delta":
            plan = a.text(message, "tool_plan") if message is not None else ""
            return [ChunkText(0, plan)] if plan else []
        call = a.member(message, "tool_calls") if message is not None else None
        if kind == "tool-call-start":
            fragment = self.start(index, call)
        elif kind == "tool-call-delta":
            fragment = self.arguments(index, _arguments(call) if call is not None else None)
        elif kind == "tool-call-end":
            fragment = self.end(index)
        return [ChunkText(0, "", tool_calls=(fragment,))] if fragment is not None else []

    def start(self, index: int, call: Any) -> ToolCallDelta | None:
        """A tool-call-start: the call's first fragment (id, name, first arguments)."""
        if call is None:
            return None
        at = self.calls.setdefault(index, len(self.calls))
        arguments = _arguments(call)
        if arguments:
            self.argued.add(index)
        return ToolCallDelta(at, a.text(call, "id"), _name(call), arguments)

    def arguments(self, index: int, fragment: str | None) -> ToolCallDelta | None:
        """A tool-call-delta's arguments fragment (None: empty or of no started call)."""
        if index not in self.calls or not fragment:
            return None
        self.argued.add(index)
        return ToolCallDelta(self.calls[index], arguments=fragment)

    def end(self, index: int) -> ToolCallDelta | None:
        """A tool-call-end: `{}` for a call that got no arguments at all."""
        if index in self.calls and index not in self.argued:
            self.argued.add(index)
            return ToolCallDelta(self.calls[index], arguments="{}")
        return None
