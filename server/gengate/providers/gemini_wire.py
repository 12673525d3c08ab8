"""The Gemini wire format for chat turns, tools and thinking, both directions: out as
`google-genai` types (the SDK builds the request), function declarations, the function-calling
config and the thinking config; in as the answer's own JSON (gengate reads it, providers.rawhttp),
the parts of a candidate (text, thoughts, function calls, thought signatures), unary and streamed.

Thought signatures: Gemini puts an opaque `thoughtSignature` on some parts of a turn (the first
functionCall part of every turn that calls, a thought part, the last text part) and requires the
one on a functionCall part back on that same part when the turn is sent back. A turn's
signatures become its Reasoning's `signatures`, one entry per signed part, in part order, naming
the part it came on: `call:<i>:<sig>` (the turn's i-th function call), `thought:<sig>` (a
thought part), `text:<sig>` (a text part); `<sig>` is the signature's bytes in URL-safe base64,
as the SDK sends them. Sent back, each call gets its entry's signature, one thought part carries
the reasoning text with the last thought entry (unsigned thought text is not sent back: Gemini
reads nothing from it), and the last text part gets the last text entry. Entries of other
shapes (another provider's) are ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from google.genai import types

from gengate.domain import (
    ChatMessage,
    ImagePart,
    Reasoning,
    ReasoningControl,
    Role,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
)
from gengate.errors import FieldViolation
from gengate.providers import rawhttp
from gengate.providers.anthropic_wire import arguments_object
from gengate.providers.errors import UnreadableAnswer

CALL = "call:"
THOUGHT = "thought:"
TEXT = "text:"
# ThinkingConfig.thinking_budget meaning "as much as the model decides" (dynamic thinking).
DYNAMIC_BUDGET = -1


def parts(content: Sequence[TextPart | ImagePart]) -> list[types.Part]:
    """Text and image parts (an image by URI as file data, else inline bytes)."""
    out: list[types.Part] = []
    for part in content:
        if isinstance(part, TextPart):
            out.append(types.Part(text=part.text))
        elif part.url:
            out.append(
                types.Part(file_data=types.FileData(file_uri=part.url, mime_type=part.mime_type or None))
            )
        else:
            out.append(
                types.Part(inline_data=types.Blob(data=part.data, mime_type=part.mime_type or "image/png"))
            )
    return out


# --- out ----------------------------------------------------------------------------------------


def tools(offered: Sequence[Tool]) -> list[types.Tool]:
    """One Tool of function declarations, each with its full JSON Schema as
    `parametersJsonSchema` (a tool without parameters declares none)."""
    declarations = [
        types.FunctionDeclaration(
            name=t.name,
            description=t.description or None,
            parameters_json_schema=t.parameters or None,
        )
        for t in offered
    ]
    return [types.Tool(function_declarations=declarations)]


def tool_config(choice: ToolChoice | None) -> types.ToolConfig | None:
    """`functionCallingConfig`: AUTO, NONE, ANY (required), a named tool as ANY limited to it by
    `allowedFunctionNames`; None: the API's default (AUTO). Gemini has no parallel-calls switch."""
    if choice is None:
        return None
    if choice.name is not None:
        config = types.FunctionCallingConfig(
            mode=types.FunctionCallingConfigMode.ANY, allowed_function_names=[choice.name]
        )
    else:
        mode = {
            ToolChoiceMode.AUTO: types.FunctionCallingConfigMode.AUTO,
            ToolChoiceMode.REQUIRED: types.FunctionCallingConfigMode.ANY,
            ToolChoiceMode.NONE: types.FunctionCallingConfigMode.NONE,
        }[choice.mode]
        config = types.FunctionCallingConfig(mode=mode)
    return types.ToolConfig(function_calling_config=config)


def thinking_config(control: ReasoningControl | None) -> types.ThinkingConfig | None:
    """`thinkingConfig`: enabled false as budget 0 (off); a budget as `thinkingBudget`, an effort
    as `thinkingLevel`, enabled alone as the dynamic budget (-1); thought summaries asked for
    (`includeThoughts`) whenever thinking is on. None: the model's default."""
    if control is None:
        return None
    if control.enabled is False:
        return types.ThinkingConfig(thinking_budget=0)
    if control.budget_tokens is not None:
        return types.ThinkingConfig(thinking_budget=control.budget_tokens, include_thoughts=True)
    if control.effort is not None:
        level = types.ThinkingLevel(control.effort.value.upper())
        return types.ThinkingConfig(thinking_level=level, include_thoughts=True)
    if control.enabled is True:
        return types.ThinkingConfig(thinking_budget=DYNAMIC_BUDGET, include_thoughts=True)
    return None


def history_violations(messages: Sequence[ChatMessage]) -> list[FieldViolation]:
    """What Gemini cannot take back: call arguments that are no JSON object (`functionCall.args`
    is one), a tool message answering no earlier call (its `functionResponse` needs the name)."""
    out: list[FieldViolation] = []
    names = set()
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls):
            names.add(call.id)
            try:
                arguments_object(call.arguments)
            except ValueError:
                out.append(
                    FieldViolation(
                        f"messages.messages[{i}].tool_calls[{j}].arguments_json",
                        "must be a JSON object (Gemini sends a call's args as one)",
                    )
                )
        if m.role is Role.TOOL and m.tool_call_id not in names:
            out.append(
                FieldViolation(
                    f"messages.messages[{i}].tool_call_id", "answers no earlier assistant tool call"
                )
            )
    return out


def _signature(encoded: str) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(encoded)
    except (binascii.Error, ValueError):
        return None


@dataclass
class _Signed:
    """A turn's signature entries sorted by the part they go back on."""

    calls: dict[int, bytes] = field(default_factory=dict)
    thought: bytes | None = None
    text: bytes | None = None

    @classmethod
    def of(cls, reasoning: Reasoning | None) -> _Signed:
        out = cls()
        for entry in reasoning.signatures if reasoning is not None else ():
            if entry.startswith(CALL):
                index, sep, encoded = entry[len(CALL) :].partition(":")
                signature = _signature(encoded)
                if sep and index.isdigit() and signature is not None:
                    out.calls[int(index)] = signature
            elif entry.startswith(THOUGHT):
                out.thought = _signature(entry[len(THOUGHT) :]) or out.thought
            elif entry.startswith(TEXT):
                out.text = _signature(entry[len(TEXT) :]) or out.text
        return out


def _model_turn(m: ChatMessage) -> list[types.Part]:
    """A signed thought first, then what it said, then its calls (each with its signature)."""
    signed = _Signed.of(m.reasoning)
    out: list[types.Part] = []
    if signed.thought is not None and m.reasoning is not None:
        out.append(types.Part(text=m.reasoning.text, thought=True, thought_signature=signed.thought))
    said = [p for p in parts(m.content) if p.text != ""]
    if said and signed.text is not None:
        said[-1].thought_signature = signed.text
    out.extend(said)
    for i, c in enumerate(m.tool_calls):
        call = types.FunctionCall(id=c.id or None, name=c.name, args=arguments_object(c.arguments))
        out.append(types.Part(function_call=call, thought_signature=signed.calls.get(i)))
    return out


def _response(text: str) -> dict[str, Any]:
    """A tool result as `functionResponse.response` (an object): JSON object text as it is,
    anything else under `output`, as Gemini reads a function's output."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"output": text}


def _media(part: ImagePart) -> types.FunctionResponsePart:
    if part.url:
        data = types.FunctionResponseFileData(file_uri=part.url, mime_type=part.mime_type or None)
        return types.FunctionResponsePart(file_data=data)
    blob = types.FunctionResponseBlob(data=part.data, mime_type=part.mime_type or "image/png")
    return types.FunctionResponsePart(inline_data=blob)


def _function_response(m: ChatMessage, name: str) -> types.Part:
    media = [_media(p) for p in m.content if isinstance(p, ImagePart)]
    response = types.FunctionResponse(
        id=m.tool_call_id or None, name=name, response=_response(m.text), parts=media or None
    )
    return types.Part(function_response=response)


def contents(chat: Sequence[ChatMessage]) -> list[types.Content]:
    """The chat's turns (system messages left out: they are the system instruction); a tool
    message as a functionResponse part named after the call it answers, consecutive ones in one
    user turn (a turn's parallel calls are answered together)."""
    names: dict[str, str] = {}
    out: list[types.Content] = []
    answering = False
    for m in chat:
        if m.role is Role.SYSTEM:
            continue
        if m.role is Role.TOOL:
            part = _function_response(m, names.get(m.tool_call_id, ""))
            if answering:
                out[-1].parts = [*(out[-1].parts or ()), part]
            else:
                out.append(types.Content(role="user", parts=[part]))
            answering = True
            continue
        answering = False
        if m.role is Role.ASSISTANT:
            names.update((c.id, c.name) for c in m.tool_calls)
            out.append(types.Content(role="model", parts=_model_turn(m)))
        else:
            out.append(types.Content(role="user", parts=parts(m.content)))
    return out


# --- in -----------------------------------------------------------------------------------------


def _encoded(signature: bytes | None) -> str:
    return base64.urlsafe_b64encode(signature).decode("ascii") if signature else ""


_URL_SAFE = str.maketrans("-_", "+/")


def b64_bytes(obj: Any, name: str) -> bytes | None:
    """A bytes field of an answer (base64 in JSON, either alphabet, padding optional, as the SDK
    reads it); None when absent or empty. Not base64: UnreadableAnswer naming the field."""
    value = rawhttp.text(obj, name)
    if not value:
        return None
    try:
        return base64.b64decode(value.translate(_URL_SAFE) + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise UnreadableAnswer(f"`{name}` is no base64") from None


def _arguments(call: Any) -> str:
    """A functionCall's `args` (an object; absent: none) as JSON text, as gengate carries them."""
    args = rawhttp.member(call, "args")
    return json.dumps(args or {}, ensure_ascii=False)


@dataclass
class CandidateParts:
    """The parts of one candidate, fed in order (a unary content at once, or chunk by chunk, and
    across continuation hops): text, thought text, function calls numbered across the turn, and
    the signature entries. Contents are the answer's JSON (`content` objects, camelCase)."""

    text: list[str] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)

    def add(self, content: Any) -> tuple[str, str, tuple[ToolCallDelta, ...]]:
        """One content's parts recorded; returns its text, thought text and calls (each whole,
        as Gemini sends them, as one fragment). A field of the wrong kind: UnreadableAnswer."""
        text: list[str] = []
        thought: list[str] = []
        deltas: list[ToolCallDelta] = []
        for part in rawhttp.objects(content, "parts") if content is not None else ():
            signature = _encoded(b64_bytes(part, "thoughtSignature"))
            fc = rawhttp.member(part, "functionCall")
            if fc is not None:
                index = len(self.calls)
                call = ToolCall(rawhttp.text(fc, "id"), rawhttp.text(fc, "name"), _arguments(fc))
                self.calls.append(call)
                deltas.append(ToolCallDelta(index, call.id, call.name, call.arguments))
                if signature:
                    self.entries.append(f"{CALL}{index}:{signature}")
            elif rawhttp.flag(part, "thought"):
                thought.append(rawhttp.text(part, "text"))
                if signature:
                    self.entries.append(THOUGHT + signature)
            elif (said := rawhttp.optional_text(part, "text")) is not None:
                text.append(said)
                if signature:
                    self.entries.append(TEXT + signature)
        self.text.extend(text)
        self.thoughts.extend(thought)
        return "".join(text), "".join(thought), tuple(deltas)

    def reasoning(self) -> Reasoning | None:
        """The turn's thought text and signature entries (None: neither came)."""
        thought = "".join(self.thoughts)
        if not thought and not self.entries:
            return None
        return Reasoning(thought, tuple(self.entries))
