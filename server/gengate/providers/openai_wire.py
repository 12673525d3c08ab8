"""The OpenAI chat-completions wire format, both directions, as pure functions: messages (tool
turns included) and tool choice out; a choice's text, refusal, finish reason, logprobs, tool
calls and reasoning in (unary messages and stream deltas alike: the plain JSON read by
providers.rawhttp, or an SDK's objects where another SDK hands them, read by the same accessors).
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
    Usage,
)
from gengate.providers import rawhttp as a
from gengate.providers import structured as so
from gengate.providers.base import ProviderCall, image_url, map_finish_reason
from gengate.providers.errors import UnreadableAnswer
from gengate.tools import parameters_of


def finish(raw: str | None, stop_reason: Any, stops: tuple[str, ...]) -> tuple[FinishReason, str | None]:
    """Finish reason, and the stop string that ended it where the server says (vLLM `stop_reason`)."""
    reason = map_finish_reason(raw)
    if reason == FinishReason.STOP and isinstance(stop_reason, str) and stop_reason in stops:
        return FinishReason.STOP_SEQUENCE, stop_reason
    return reason, None


def choice_finish(choice: Any, stops: tuple[str, ...]) -> tuple[FinishReason, str | None] | None:
    """A choice's finish (reason, matched stop), or None while a streamed choice goes on."""
    raw = a.optional_text(choice, "finish_reason")
    if raw is None:
        return None
    return finish(raw, a.field(choice, "stop_reason"), stops)


def choice_body(choice: Any) -> Any:
    """A chat choice's message, or a stream choice's delta (None: a text completion's choice)."""
    body = a.member(choice, "message")
    return a.member(choice, "delta") if body is None else body


def choice_text(choice: Any) -> tuple[str, str | None]:
    """A choice's text and refusal: a chat choice's message (or a stream's delta), or a text
    completion's `text` (which has no refusal)."""
    body = choice_body(choice)
    if body is None:
        return a.text(choice, "text"), None
    return a.text(body, "content"), a.optional_text(body, "refusal")


def tool_calls(message: Any) -> tuple[ToolCall, ...]:
    """A chat message's calls (`tool_calls`: function calls; any other kind keeps its name and
    input, and fails validation as no JSON arguments of an offered function would). Arguments
    given as a JSON value rather than text (older TGI) are serialized; a numeric id is text."""
    out: list[ToolCall] = []
    for call in a.objects(message, "tool_calls") if message is not None else ():
        function = a.member(call, "function") or a.member(call, "custom")
        name = a.text(function, "name") if function is not None else ""
        arguments = a.field(function, "arguments") if function is not None else None
        if arguments is None and function is not None:
            arguments = a.field(function, "input") or ""
        arguments = _arguments_text(arguments)
        ident = a.field(call, "id")
        out.append(ToolCall("" if ident is None else str(ident), name, arguments))
    return tuple(out)


def _arguments_text(arguments: Any) -> str:
    """Arguments as text: a JSON value some servers send instead is serialized."""
    if arguments is None:
        return ""
    if not isinstance(arguments, str):
        return json.dumps(arguments, ensure_ascii=False)
    return arguments


def chat_generation(choice: Any, reasoning: Reasoning | None = None) -> Generation:
    """A chat choice as a generation: its text, finish reason, calls, and `reasoning` or else the
    message's reasoning text (for the SDKs whose choices need no more: TGI's, LiteLLM's)."""
    message = a.member(choice, "message")
    if reasoning is None:
        thought = reasoning_text(message)
        reasoning = Reasoning(thought) if thought else None
    return Generation(
        index=a.integer(choice, "index") or 0,
        text=a.text(message, "content") if message is not None else "",
        finish_reason=map_finish_reason(a.optional_text(choice, "finish_reason")),
        tool_calls=tool_calls(message),
        reasoning=reasoning,
    )


def tool_call_deltas(delta: Any) -> tuple[ToolCallDelta, ...]:
    """A stream delta's call fragments (`delta.tool_calls[{index, id?, function{name?, arguments?}}]`)."""
    out: list[ToolCallDelta] = []
    if delta is None:
        return ()
    for position, call in enumerate(a.objects(delta, "tool_calls")):
        function = a.member(call, "function")
        index = a.field(call, "index")
        ident = a.field(call, "id")
        out.append(
            ToolCallDelta(
                index if isinstance(index, int) and not isinstance(index, bool) else position,
                "" if ident is None else str(ident),
                a.text(function, "name") if function is not None else "",
                _arguments_text(a.field(function, "arguments")) if function is not None else "",
            )
        )
    return tuple(out)


def reasoning_text(body: Any) -> str:
    """A message's or delta's reasoning, from the fields OpenAI's types lack: `reasoning_content`
    (vLLM, SGLang, DeepSeek, llama.cpp, LiteLLM) or `reasoning` (Ollama, newer vLLM, Hugging
    Face's types), as text: a key of the plain answer, an extra field of an SDK model or an
    attribute of the SDK's own."""
    if body is None:
        return ""
    extra = {} if isinstance(body, dict) else getattr(body, "model_extra", None) or {}
    for key in ("reasoning_content", "reasoning"):
        value = extra.get(key, a.field(body, key))
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
    content = a.objects(raw, "content")
    if content:
        return tuple(
            TokenLogprob(
                token=a.text(item, "token"),
                logprob=a.number(item, "logprob") or 0.0,
                top=tuple(
                    TopLogprob(a.text(t, "token"), a.number(t, "logprob") or 0.0)
                    for t in a.objects(item, "top_logprobs")
                ),
            )
            for item in content
        )
    tokens = a.items(raw, "tokens")
    if not tokens:
        return None
    values = a.items(raw, "token_logprobs") or [None] * len(tokens)
    tops = a.items(raw, "top_logprobs") or [None] * len(tokens)
    out: list[TokenLogprob] = []
    for token, logprob, alternatives in zip(tokens, values, tops, strict=False):
        if not isinstance(token, str):
            raise UnreadableAnswer("an entry of `tokens` is not text")
        if alternatives is not None and not isinstance(alternatives, dict):
            raise UnreadableAnswer("an entry of `top_logprobs` is not an object")
        best = sorted(
            ((t, a.as_number(lp, "top_logprobs")) for t, lp in (alternatives or {}).items()),
            key=lambda kv: kv[1],
            reverse=True,
        )[:top]
        out.append(
            TokenLogprob(
                token=token,
                logprob=a.as_number(logprob, "token_logprobs") if logprob is not None else 0.0,
                top=tuple(TopLogprob(str(t), lp) for t, lp in best),
            )
        )
    return tuple(out)


def usage(answer: Any) -> Usage | None:
    """An answer's (or a stream chunk's) `usage` as prompt and completion tokens, or None."""
    raw = a.member(answer, "usage")
    if raw is None:
        return None
    return Usage(a.integer(raw, "prompt_tokens") or 0, a.integer(raw, "completion_tokens") or 0)


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
