"""Tool calling as structured output: a request's tools checked before any work, and every call a
backend returns checked against them before it reaches the caller.

A tool's `parameters` is a JSON Schema constraint like any other (the same limits, syntax checks
and validator as `structured_output.json_schema`), so a returned call is valid exactly when its
name is an offered tool's, its arguments are a JSON object that validates against that tool's
schema, and together the calls honour `tool_choice` and `parallel_tool_calls`. Every backend, in
any enforcement level, goes through `call_errors`: a call that fails it is never a success.
"""

from __future__ import annotations

import copy
import re
import secrets
from collections.abc import Sequence
from functools import cached_property

from gengate.constraints.kinds import check_constraint_syntax, constraint_violations, validate_output
from gengate.domain import (
    GenerationRequest,
    JsonSchemaConstraint,
    Role,
    StructuredOutput,
    Tool,
    ToolCall,
    ToolChoiceMode,
)
from gengate.errors import FieldViolation, GengateError, echo
from gengate.limits import AtLeast, RequestLimits, json_shape, over_limit

# The most tools one request offers (OpenAI's own limit is 128).
MAX_TOOLS = 128
# Tool names as every provider accepts them (OpenAI's rule, the strictest).
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The schema of a tool given no parameters: a call takes an empty object (and nothing else).
NO_PARAMETERS: dict[str, object] = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_CALL_ID_PREFIX = "call_"
# Why a request is refused (UNIMPLEMENTED) by a model that takes no tools / no reasoning control.
TOOLS_UNSUPPORTED = "TOOLS_UNSUPPORTED"
REASONING_UNSUPPORTED = "REASONING_UNSUPPORTED"


def first_tool_field(request: GenerationRequest) -> str | None:
    """The first field that needs tool support (tools, their choice, or a conversation with tool
    calls or results in it), or None: what a model without tools refuses, naming it."""
    if request.tools:
        return "tools"
    for i, message in enumerate(request.messages or ()):
        if message.tool_calls:
            return f"messages.messages[{i}].tool_calls"
        if message.role is Role.TOOL:
            return f"messages.messages[{i}].role"
    if request.tool_choice is not None:
        return "tool_choice"
    if request.parallel_tool_calls is not None:
        return "parallel_tool_calls"
    return None


def new_call_id() -> str:
    """An id for a call whose backend gave none (local engines, providers without ids)."""
    return TOOL_CALL_ID_PREFIX + secrets.token_hex(12)


def parameters_of(tool: Tool) -> dict[str, object]:
    """The tool's arguments schema (NO_PARAMETERS when it declares none)."""
    return tool.parameters or NO_PARAMETERS


def tool_structured(tool: Tool) -> StructuredOutput:
    """A tool's arguments as a JSON Schema constraint: checked, lowered and validated by the same
    code as `structured_output.json_schema`."""
    return StructuredOutput(
        JsonSchemaConstraint(dict(parameters_of(tool)), name=tool.name, strict=tool.strict)
    )


def limit_violations(request: GenerationRequest, limits: RequestLimits) -> list[FieldViolation]:
    """The tools' sizes, counts and nesting (cheap, linear; before anything reads a schema's
        meaning). Each schema counts against max_constraint_bytes on its own, and all of them with
    their descriptions together (_total_violations); an assistant message
        carries at most MAX_TOOLS calls (their text counts against max_prompt_bytes, gengate.limits)."""
    out: list[FieldViolation] = []
    for i, message in enumerate(request.messages or ()):
        if len(message.tool_calls) > MAX_TOOLS:
            out.append(
                FieldViolation(
                    f"messages.messages[{i}].tool_calls",
                    f"has {len(message.tool_calls)} calls, over the most of {MAX_TOOLS}",
                )
            )
    if len(request.tools) > MAX_TOOLS:
        return [
            *out,
            FieldViolation("tools", f"has {len(request.tools)} tools, over the most of {MAX_TOOLS}"),
        ]
    for i, tool in enumerate(request.tools):
        if len(tool.description) > limits.max_constraint_bytes:
            out.append(
                over_limit(
                    f"tools[{i}].description",
                    "the description's size in characters",
                    len(tool.description),
                    "max_constraint_bytes",
                    limits.max_constraint_bytes,
                )
            )
        constraint = JsonSchemaConstraint(dict(parameters_of(tool)))
        for v in constraint_violations(constraint, limits):
            out.append(FieldViolation(f"tools[{i}].parameters_json" + _after_field(v.field), v.description))
    if not out and request.tools:
        out += _total_violations(request.tools, limits)
    return out


def _total_violations(offered: tuple[Tool, ...], limits: RequestLimits) -> list[FieldViolation]:
    """All tools together, schemas and descriptions, count against max_constraint_bytes: a local
    engine compiles them into one grammar, so 128 tools each at the limit must not pass."""
    limit = limits.max_constraint_bytes
    total = 0
    for tool in offered:
        total += len(tool.description) + json_shape(parameters_of(tool), stop_at_bytes=limit - total).size
        if total > limit:
            what = "the size of the tools' schemas and descriptions together in bytes"
            return [over_limit("tools", what, AtLeast(total), "max_constraint_bytes", limit)]
    return []


def _after_field(field: str) -> str:
    """A constraint violation's path below its schema (`structured_output.json_schema.schema.x` -> `.x`)."""
    head = "structured_output.json_schema.schema"
    return field[len(head) :] if field.startswith(head) else ""


def shape_violations(request: GenerationRequest) -> list[FieldViolation]:
    """What is wrong with the request's tools, choice and tool messages on their face: names,
    duplicates, a choice naming no offered tool, tools beside structured_output or Magpie, a tool
    message answering no earlier call."""
    out: list[FieldViolation] = []
    names: set[str] = set()
    for i, tool in enumerate(request.tools):
        if TOOL_NAME.fullmatch(tool.name) is None:
            out.append(
                FieldViolation(
                    f"tools[{i}].name", f"{echo(tool.name, 64)} is not 1-64 characters of A-Z a-z 0-9 _ -"
                )
            )
        elif tool.name in names:
            out.append(FieldViolation(f"tools[{i}].name", f"{echo(tool.name)} is offered twice"))
        names.add(tool.name)
        schema_type = tool.parameters.get("type") if tool.parameters else "object"
        if schema_type != "object":
            out.append(
                FieldViolation(f"tools[{i}].parameters_json", 'must be an object schema ("type": "object")')
            )
    choice = request.tool_choice
    if choice is not None:
        if not request.tools:
            out.append(FieldViolation("tool_choice", "is set but no tools are given"))
        elif choice.name is not None and choice.name not in names:
            out.append(
                FieldViolation("tool_choice.name", f"{echo(choice.name, 64)} is not one of the offered tools")
            )
    if request.parallel_tool_calls is not None and not request.tools:
        out.append(FieldViolation("parallel_tool_calls", "is set but no tools are given"))
    if request.tools and request.structured_output is not None:
        out.append(
            FieldViolation(
                "structured_output",
                "cannot be combined with tools: a tool's parameters already constrain its call; "
                "ask for a structured answer as a tool (tool_choice naming it)",
            )
        )
    if request.tools and request.magpie is not None:
        out.append(FieldViolation("tools", "cannot be combined with magpie"))
    out += message_violations(request)
    return out


def message_violations(request: GenerationRequest) -> list[FieldViolation]:
    """Tool messages answer a call an earlier assistant message made; tool fields only where
    their role carries them."""
    out: list[FieldViolation] = []
    made: set[str] = set()
    for i, message in enumerate(request.messages or ()):
        where = f"messages.messages[{i}]"
        if message.tool_calls and message.role is not Role.ASSISTANT:
            out.append(FieldViolation(f"{where}.tool_calls", "only an assistant message carries tool calls"))
        for j, call in enumerate(message.tool_calls):
            if not call.id:
                out.append(FieldViolation(f"{where}.tool_calls[{j}].id", "is required"))
            if TOOL_NAME.fullmatch(call.name) is None:
                out.append(
                    FieldViolation(
                        f"{where}.tool_calls[{j}].name", f"{echo(call.name, 64)} is not a tool name"
                    )
                )
            made.add(call.id)
        if message.role is Role.TOOL:
            if not message.tool_call_id:
                out.append(FieldViolation(f"{where}.tool_call_id", "is required on a tool message"))
            elif message.tool_call_id not in made:
                out.append(
                    FieldViolation(
                        f"{where}.tool_call_id",
                        f"{echo(message.tool_call_id, 64)} answers no earlier assistant tool call",
                    )
                )
        elif message.tool_call_id:
            out.append(FieldViolation(f"{where}.tool_call_id", "only a tool message carries tool_call_id"))
    return out


def check_syntax(request: GenerationRequest) -> None:
    """Each tool's schema checked like a json_schema constraint (in the sandbox: InvalidArgument
    naming `tools[i].parameters_json`)."""
    for i, tool in enumerate(request.tools):
        try:
            check_constraint_syntax(tool_structured(tool))
        except GengateError as exc:
            raise at_tool(exc, i) from None


def at_tool(exc: GengateError, index: int) -> GengateError:
    """A refusal of tool `index`'s schema as a json_schema constraint (its fields under
    `structured_output.json_schema.schema`), with its fields under `tools[index].parameters_json`."""
    where = f"tools[{index}].parameters_json"
    violations = [FieldViolation(where + _after_field(v.field), v.description) for v in exc.violations] or [
        FieldViolation(where, exc.message)
    ]
    moved = copy.copy(exc)
    moved.violations = tuple(violations)
    moved.message = "; ".join(f"{v.field}: {v.description}" for v in violations)
    moved.args = (moved.message,)
    return moved


class ToolSet:
    """A request's tools by name, with what its choice demands of the calls returned."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.by_name = {tool.name: tool for tool in request.tools}
        choice = request.tool_choice
        self.mode = ToolChoiceMode.AUTO if choice is None else choice.mode
        self.required_name = None if choice is None else choice.name
        self.parallel = request.parallel_tool_calls is not False

    @cached_property
    def constraints(self) -> dict[str, StructuredOutput]:
        return {name: tool_structured(tool) for name, tool in self.by_name.items()}

    def call_errors(self, calls: Sequence[ToolCall]) -> str | None:
        """None when `calls` (one generation's) are what the request allows, else why not."""
        if self.mode is ToolChoiceMode.NONE and calls:
            return "tool_choice is none but the model called a tool"
        if not calls:
            if self.mode is ToolChoiceMode.REQUIRED or self.required_name is not None:
                return "a tool call is required but the model made none"
            return None
        if not self.parallel and len(calls) > 1:
            return f"parallel_tool_calls is false but the model made {len(calls)} calls"
        ids: dict[str, int] = {}
        for i, call in enumerate(calls):
            if call.id and ids.setdefault(call.id, i) != i:
                return f"tool_calls[{i}] has the id of tool_calls[{ids[call.id]}]: call ids must be unique"
            if call.name not in self.by_name:
                return (
                    f"tool_calls[{i}]: the model called {echo(call.name, 64)}, which is not an offered tool"
                )
            if self.required_name is not None and call.name != self.required_name:
                return f"tool_calls[{i}]: the model called {echo(call.name, 64)}, not {self.required_name!r}"
            reason = validate_output(self.constraints[call.name], call.arguments)
            if reason is not None:
                return f"tool_calls[{i}] ({call.name}): arguments {reason}"
        return None
