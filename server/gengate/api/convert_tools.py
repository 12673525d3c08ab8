"""Tool calling and reasoning between protobuf and domain objects (convert.py's other half, split
out to keep each module small; convert.py is the one entry point that uses it).

JSON carried as text (`Tool.parameters_json`, `chat_template_kwargs_json`) is bounded before it
is parsed and must be a JSON object; every error is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from gengate_proto.v1 import generation_pb2 as gpb
from gengate_proto.v1 import types_pb2 as pb

from gengate import domain as d
from gengate.errors import InvalidArgument, brief

# chat_template_kwargs_json is a handful of template variables: 64 KiB is roomy.
MAX_CHAT_TEMPLATE_KWARGS_BYTES = 64 * 1024

_CHOICE_FROM_PB = {
    pb.TOOL_CHOICE_MODE_AUTO: d.ToolChoiceMode.AUTO,
    pb.TOOL_CHOICE_MODE_NONE: d.ToolChoiceMode.NONE,
    pb.TOOL_CHOICE_MODE_REQUIRED: d.ToolChoiceMode.REQUIRED,
}
_CHOICE_TO_PB = {v: k for k, v in _CHOICE_FROM_PB.items()}
_EFFORT_FROM_PB = {
    pb.REASONING_EFFORT_LOW: d.ReasoningEffort.LOW,
    pb.REASONING_EFFORT_MEDIUM: d.ReasoningEffort.MEDIUM,
    pb.REASONING_EFFORT_HIGH: d.ReasoningEffort.HIGH,
}
_EFFORT_TO_PB = {v: k for k, v in _EFFORT_FROM_PB.items()}


def json_object(
    text: str,
    where: str,
    *,
    max_bytes: int | None,
    limit_name: str = "",
    what: str = "the schema's size in bytes",
    reason: str = "INVALID_SCHEMA",
) -> dict[str, Any]:
    """`text` parsed as a JSON object (order and big integers kept), refused over `max_bytes`
    characters before it is read (`limit_name`: the configuration key of that limit, if any);
    errors name `where`."""
    if max_bytes is not None and len(text) > max_bytes:
        key = f" ({limit_name})" if limit_name else ""
        raise InvalidArgument.field(
            where,
            f"{what} is at least {len(text)}, over the limit of {max_bytes}{key}",
            reason="LIMIT_EXCEEDED",
        )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument.field(
            where, f"not valid JSON: {exc.msg} at character {exc.pos}", reason=reason
        ) from None
    except RecursionError:
        raise InvalidArgument.field(where, "nested too deeply", reason="LIMIT_EXCEEDED") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise InvalidArgument.field(where, f"cannot be read: {brief(str(exc))}", reason=reason) from None
    if not isinstance(value, dict):
        raise InvalidArgument.field(where, "must be a JSON object", reason=reason)
    return value


# ---- requests: proto → domain -------------------------------------------------------------


def tools_from_pb(
    msg: gpb.GenerateRequest, prefix: str, max_json_bytes: int | None
) -> tuple[tuple[d.Tool, ...], d.ToolChoice | None, bool | None]:
    """The request's tools, tool choice (None: not set) and parallel_tool_calls (None: not set).
    The tools' count is not checked here (gengate.tools.limit_violations does, after conversion):
    each schema is bounded on its own before it is parsed."""
    tools = tuple(
        d.Tool(
            name=tool.name,
            description=tool.description,
            parameters=json_object(
                tool.parameters_json,
                f"{prefix}tools[{i}].parameters_json",
                max_bytes=max_json_bytes,
                limit_name="server.limits.max_constraint_bytes",
            )
            if tool.parameters_json
            else {},
            strict=tool.strict,
        )
        for i, tool in enumerate(msg.tools)
    )
    choice = (
        tool_choice_from_pb(msg.tool_choice, f"{prefix}tool_choice") if msg.HasField("tool_choice") else None
    )
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else None
    return tools, choice, parallel


def tool_choice_from_pb(msg: pb.ToolChoice, where: str) -> d.ToolChoice | None:
    """A tool choice; an empty one (no mode, or TOOL_CHOICE_MODE_UNSPECIFIED) is not set."""
    which = msg.WhichOneof("choice")
    if which == "name":
        return d.ToolChoice(name=msg.name)
    if which is None or msg.mode == pb.TOOL_CHOICE_MODE_UNSPECIFIED:
        return None
    mode = _CHOICE_FROM_PB.get(msg.mode)
    if mode is None:
        raise InvalidArgument.field(
            f"{where}.mode",
            f"unknown value {msg.mode}: use TOOL_CHOICE_MODE_AUTO, _NONE or _REQUIRED",
            reason="INVALID_ENUM",
        )
    return d.ToolChoice(mode=mode)


def reasoning_control_from_pb(msg: pb.ReasoningControl, where: str) -> d.ReasoningControl:
    effort: d.ReasoningEffort | None = None
    if msg.effort != pb.REASONING_EFFORT_UNSPECIFIED:
        effort = _EFFORT_FROM_PB.get(msg.effort)
        if effort is None:
            raise InvalidArgument.field(
                f"{where}.effort",
                f"unknown value {msg.effort}: use REASONING_EFFORT_LOW, _MEDIUM or _HIGH",
                reason="INVALID_ENUM",
            )
    return d.ReasoningControl(
        enabled=msg.enabled if msg.HasField("enabled") else None,
        effort=effort,
        budget_tokens=msg.budget_tokens if msg.HasField("budget_tokens") else None,
    )


def chat_template_kwargs_from_pb(text: str, where: str) -> dict[str, Any]:
    """The extra chat-template variables ({} when the field is empty)."""
    if not text:
        return {}
    return json_object(
        text,
        where,
        max_bytes=MAX_CHAT_TEMPLATE_KWARGS_BYTES,
        what="its size in bytes",
        reason="INVALID_JSON",
    )


def tool_call_from_pb(msg: pb.ToolCall) -> d.ToolCall:
    return d.ToolCall(id=msg.id, name=msg.name, arguments=msg.arguments_json)


def reasoning_from_pb(msg: pb.Reasoning) -> d.Reasoning:
    return d.Reasoning(text=msg.text, signatures=tuple(msg.signatures))


def message_extras_from_pb(msg: pb.ChatMessage) -> dict[str, Any]:
    """A chat message's tool calls, tool_call_id and reasoning, as ChatMessage keyword arguments."""
    return {
        "tool_calls": tuple(tool_call_from_pb(c) for c in msg.tool_calls),
        "tool_call_id": msg.tool_call_id,
        "reasoning": reasoning_from_pb(msg.reasoning) if msg.HasField("reasoning") else None,
    }


# ---- domain → proto -------------------------------------------------------------------------


def tools_to_pb(req: d.GenerationRequest, msg: gpb.GenerateRequest) -> None:
    """Sets the request's tool and reasoning fields on `msg`."""
    for tool in req.tools:
        msg.tools.add(
            name=tool.name,
            description=tool.description,
            parameters_json=json.dumps(tool.parameters) if tool.parameters else "",
            strict=tool.strict,
        )
    if req.tool_choice is not None:
        if req.tool_choice.name is not None:
            msg.tool_choice.name = req.tool_choice.name
        else:
            msg.tool_choice.mode = _CHOICE_TO_PB[req.tool_choice.mode]
    if req.parallel_tool_calls is not None:
        msg.parallel_tool_calls = req.parallel_tool_calls
    if req.reasoning is not None:
        msg.reasoning.CopyFrom(reasoning_control_to_pb(req.reasoning))
    if req.chat_template_kwargs:
        msg.chat_template_kwargs_json = json.dumps(req.chat_template_kwargs)


def reasoning_control_to_pb(r: d.ReasoningControl) -> pb.ReasoningControl:
    msg = pb.ReasoningControl()
    if r.enabled is not None:
        msg.enabled = r.enabled
    if r.effort is not None:
        msg.effort = _EFFORT_TO_PB[r.effort]
    if r.budget_tokens is not None:
        msg.budget_tokens = r.budget_tokens
    return msg


def tool_call_to_pb(c: d.ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments)


def reasoning_to_pb(r: d.Reasoning) -> pb.Reasoning:
    return pb.Reasoning(text=r.text, signatures=list(r.signatures))


def message_extras_to_pb(m: d.ChatMessage, out: pb.ChatMessage) -> None:
    """Sets a chat message's tool calls, tool_call_id and reasoning on `out`."""
    out.tool_calls.extend(tool_call_to_pb(c) for c in m.tool_calls)
    out.tool_call_id = m.tool_call_id
    if m.reasoning is not None:
        out.reasoning.CopyFrom(reasoning_to_pb(m.reasoning))


def tool_call_delta_to_pb(c: d.ToolCallDelta) -> pb.ToolCallDelta:
    return pb.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments_fragment=c.arguments)


def tool_call_delta_from_pb(msg: pb.ToolCallDelta) -> d.ToolCallDelta:
    return d.ToolCallDelta(index=msg.index, id=msg.id, name=msg.name, arguments=msg.arguments_fragment)
