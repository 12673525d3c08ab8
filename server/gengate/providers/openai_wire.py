"""The OpenAI chat-completions wire format, both directions, as pure functions: messages (tool
turns included) and tool choice out; a choice's text, refusal, finish reason, logprobs, tool
calls and reasoning in (unary messages and stream deltas alike, as the `openai` SDK types them).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from gengate.domain import (
    ChatMessage,
    FinishReason,
    Generation,
    GenerationRequest,
    Reasoning,
    Role,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    TopLogprob,
)
from gengate.providers import structured as so
from gengate.providers.base import ProviderCall, image_url, map_finish_reason
from gengate.tools import parameters_of


def finish(raw: str | None, stop_reason: Any, stops: tuple[str, ...]) -> tuple[FinishReason, str | None]:
    """Finish reason, and the stop string that ended it where the server says (vLLM `stop_reason`)."""
    reason = map_finish_reason(raw)
    if reason == FinishReason.STOP and isinstance(stop_reason, str) and stop_reason in stops:
        return FinishReason.STOP_SEQUENCE, stop_reason
    return reason, None


def choice_text(choice: Any) -> tuple[str, str | None]:
    """A choice's text and refusal: a chat choice's message (or a stream's delta), or a text
    completion's `text` (which has no refusal)."""
    body = getattr(choice, "message", None)
    if body is None:
        body = getattr(choice, "delta", None)
    if body is None:
        return getattr(choice, "text", None) or "", None
    return getattr(body, "content", None) or "", getattr(body, "refusal", None)


def tool_calls(message: Any) -> tuple[ToolCall, ...]:
    """A chat message's calls (`tool_calls`: function calls; any other kind keeps its name and
    input, and fails validation as no JSON arguments of an offered function would). Arguments
    given as a JSON value rather than text (older TGI) are serialized; a numeric id is text."""
    out: list[ToolCall] = []
    for call in getattr(message, "tool_calls", None) or ():
        function = getattr(call, "function", None) or getattr(call, "custom", None)
        name = getattr(function, "name", None) or ""
        arguments = getattr(function, "arguments", None)
        if arguments is None:
            arguments = getattr(function, "input", None) or ""
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        ident = getattr(call, "id", None)
        out.append(ToolCall("" if ident is None else str(ident), name, arguments))
    return tuple(out)


def chat_generation(choice: Any, reasoning: Reasoning | None = None) -> Generation:
    """A chat choice as a generation: its text, finish reason, calls, and `reasoning` or else the
    message's reasoning text (for the SDKs whose choices need no more: TGI's, LiteLLM's)."""
    message = choice.message
    if reasoning is None:
        thought = reasoning_text(message)
        reasoning = Reasoning(thought) if thought else None
    return Generation(
        index=choice.index,
        text=getattr(message, "content", None) or "",
        finish_reason=map_finish_reason(choice.finish_reason),
        tool_calls=tool_calls(message),
        reasoning=reasoning,
    )


def tool_call_deltas(delta: Any) -> tuple[ToolCallDelta, ...]:
    """A stream delta's call fragments (`delta.tool_calls[{index, id?, function{name?, arguments?}}]`)."""
    out: list[ToolCallDelta] = []
    for position, call in enumerate(getattr(delta, "tool_calls", None) or ()):
        function = getattr(call, "function", None)
        index = getattr(call, "index", None)
        out.append(
            ToolCallDelta(
                index if isinstance(index, int) else position,
                getattr(call, "id", None) or "",
                getattr(function, "name", None) or "",
                getattr(function, "arguments", None) or "",
            )
        )
    return tuple(out)


def reasoning_text(body: Any) -> str:
    """A message's or delta's reasoning, from the fields OpenAI's types lack: `reasoning_content`
    (vLLM, SGLang, DeepSeek, llama.cpp, LiteLLM) or `reasoning` (Ollama, newer vLLM, Hugging
    Face's types), as text: an extra field of an SDK model or an attribute of the SDK's own."""
    extra = getattr(body, "model_extra", None) or {}
    for key in ("reasoning_content", "reasoning"):
        value = extra.get(key, getattr(body, key, None))
        if isinstance(value, str) and value:
            return value
    return ""


def logprobs(raw: Any, top: int) -> tuple[TokenLogprob, ...] | None:
    """A choice's logprobs in whichever shape the server answers: chat's `content` list, or the
    completions API's parallel lists (`tokens`, `token_logprobs`, `top_logprobs` as {token:
    logprob}), whose top is cut to the `top` asked for, best first (vLLM and llama-cpp-python add
    the sampled token to it)."""
    if raw is None:
        return None
    content = getattr(raw, "content", None)
    if content:
        return tuple(
            TokenLogprob(
                token=item.token,
                logprob=item.logprob,
                top=tuple(TopLogprob(t.token, t.logprob) for t in (item.top_logprobs or ())),
            )
            for item in content
        )
    tokens = getattr(raw, "tokens", None)
    if not tokens:
        return None
    values = getattr(raw, "token_logprobs", None) or [None] * len(tokens)
    tops = getattr(raw, "top_logprobs", None) or [None] * len(tokens)
    out: list[TokenLogprob] = []
    for token, logprob, alternatives in zip(tokens, values, tops, strict=False):
        best = sorted((alternatives or {}).items(), key=lambda kv: kv[1], reverse=True)[:top]
        out.append(
            TokenLogprob(
                token=token,
                logprob=logprob if logprob is not None else 0.0,
                top=tuple(TopLogprob(t, lp) for t, lp in best),
            )
        )
    return tuple(out)


def tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    """`auto` / `none` / `required`, or the named function the model must call."""
    if choice.name is not None:
        return {"type": "function", "function": {"name": choice.name}}
    return {
        ToolChoiceMode.AUTO: "auto",
        ToolChoiceMode.NONE: "none",
        ToolChoiceMode.REQUIRED: "required",
    }[choice.mode]


def tool(t: Tool, strict_parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tool as a chat-completions function: its schema as it is, or `strict_parameters` (the
    schema already in the provider's strict form) with `strict` set."""
    function: dict[str, Any] = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = strict_parameters if strict_parameters is not None else parameters_of(t)
    if strict_parameters is not None:
        function["strict"] = True
    return {"type": "function", "function": function}


def strict_parameters(t: Tool) -> dict[str, Any] | None:
    """The tool's schema in OpenAI strict form when the tool asks for strict and the strict form
    loses nothing (else None: sent as it is, not strict)."""
    if not t.strict:
        return None
    strict, wrapped, relaxed = so.openai_strict_schema(dict(parameters_of(t)))
    return None if wrapped or relaxed else strict


def without_forced_nulls(
    request: GenerationRequest, call: ToolCall, strict_of: Callable[[Tool], dict[str, Any] | None]
) -> ToolCall:
    """`call` without the nulls strict mode forced into its optional fields, where its tool went
    strict (`strict_of` gives the strict schema sent, or None); arguments that are no JSON are
    left for validation to report."""
    tool = next((t for t in request.tools if t.name == call.name), None)
    if tool is None or strict_of(tool) is None:
        return call
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return call
    schema = dict(parameters_of(tool))
    stripped = so.strip_added_nulls(value, schema, schema)
    if stripped == value:
        return call
    return dataclasses.replace(call, arguments=json.dumps(stripped, ensure_ascii=False))


def _tool_turn(m: ChatMessage) -> dict[str, Any]:
    """A tool result (`role: tool` answering its call's id) or an assistant turn with its calls
    (content null when it said nothing, as OpenAI sends it)."""
    if m.role is Role.TOOL:
        return {"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text}
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in m.tool_calls
    ]
    entry: dict[str, Any] = {"role": "assistant", "content": m.text or None, "tool_calls": calls}
    if m.name:
        entry["name"] = m.name
    return entry


def messages(call: ProviderCall) -> list[dict[str, Any]]:
    """The call's chat as chat-completions messages (a message's reasoning is not sent)."""
    out: list[dict[str, Any]] = []
    for m in call.messages:
        if m.role is Role.TOOL or m.tool_calls:
            out.append(_tool_turn(m))
            continue
        content: str | list[dict[str, Any]]
        if m.has_images:
            content = [
                {"type": "text", "text": p.text}
                if isinstance(p, TextPart)
                else {"type": "image_url", "image_url": {"url": image_url(p)}}
                for p in m.content
            ]
        else:
            content = m.text
        entry: dict[str, Any] = {"role": m.role.value, "content": content}
        if m.name:
            entry["name"] = m.name
        out.append(entry)
    return out
