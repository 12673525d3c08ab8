"""Tool calling: tools derived from pydantic models and typed functions, and helpers to answer calls.

`tools=` takes `Tool` values, pydantic model classes and plain typed functions, each made a Tool
by `tool()`:

- a pydantic model: name = the class name (as OpenAI's `pydantic_function_tool` does),
  description = its docstring, parameters = `model_json_schema()`; a call parses into an instance;
- a function: name = the function's name, description = the docstring's first paragraph,
  parameters = the signature (annotations, defaults) through pydantic, each parameter described
  by its entry in a Google-style `Args:` section or a NumPy-style `Parameters` section; a call
  parses into the keyword arguments, validated, and `call.invoke()` calls the function.

Then `with_results(messages, generation, {call.id: result})` continues the conversation.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pydantic
import pydantic_core
from gengate_proto.v1 import types_pb2

from gengate_client.types import Generation, Message, MessageLike, Response, Tool, ToolCall, ToolLike

_MODES = {
    "auto": types_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": types_pb2.TOOL_CHOICE_MODE_NONE,
    "required": types_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
# A docstring section that lists parameters: Google ("Args:") or NumPy ("Parameters" + dashes).
_GOOGLE_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
_NUMPY_SECTION = re.compile(r"^\s*(Parameters|Arguments)\s*$")
_GOOGLE_ENTRY = re.compile(r"^\s*\**(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_NUMPY_ENTRY = re.compile(r"^\s*(\w+)\s*(:.*)?$")
_SECTION_HEAD = re.compile(r"^\s*\w[\w ]*:\s*$")


def tool(
    value: ToolLike,
    *,
    name: str | None = None,
    description: str | None = None,
    strict: bool | None = None,
) -> Tool:
    """The Tool for `value` (a Tool, a pydantic model class or a typed function), with any of
    name, description and strict replaced."""
    base = value if isinstance(value, Tool) else _derived(value)
    changes: dict[str, Any] = {}
    if name is not None:
        changes["name"] = name
    if description is not None:
        changes["description"] = description
    if strict is not None:
        changes["strict"] = strict
    return replace(base, **changes) if changes else base


def _derived(value: Any) -> Tool:
    is_model = isinstance(value, type) and issubclass(value, pydantic.BaseModel)
    if not (is_model or inspect.isfunction(value) or inspect.ismethod(value)):
        raise TypeError(
            f"a tool must be a Tool, a pydantic model class or a function, not {type(value).__name__}"
        )
    try:
        hash(value)
    except TypeError:  # a method of an unhashable object: derived each time
        return _cached.__wrapped__(value)
    return _cached(value)


@functools.lru_cache(maxsize=256)
def _cached(value: Any) -> Tool:
    """Derivation is cached: a request built in a loop derives its tools once."""
    if isinstance(value, type):
        return _model_tool(value)
    return function_tool(value)


def _strip_titles(schema: dict[str, Any]) -> dict[str, Any]:
    """The top level's title and description say what Tool.name and .description already say."""
    return {k: v for k, v in schema.items() if k not in ("title", "description")}


def _model_tool(model: type[pydantic.BaseModel]) -> Tool:
    schema = model.model_json_schema()
    return Tool(
        name=model.__name__,
        description=str(schema.get("description", "")),
        parameters=_strip_titles(schema),
        arguments_type=model,
    )


def function_tool(function: Callable[..., Any]) -> Tool:
    """A Tool from a function's signature and docstring (see the module docstring for the rules)."""
    doc = inspect.getdoc(function) or ""
    described = parameter_descriptions(doc)
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except NameError as exc:  # a string annotation naming a type the function's module lacks
        raise TypeError(
            f"tool function {function.__name__}: an annotation does not resolve ({exc}); "
            "define its types at module level"
        ) from exc
    fields: dict[str, Any] = {}
    for param in inspect.signature(function).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool function {function.__name__}: *{param.name} cannot be a tool parameter")
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(f"tool function {function.__name__}: {param.name} is positional-only")
        annotation = hints.get(param.name, Any)
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, pydantic.Field(default, description=described.get(param.name)))
    try:
        arguments: type[pydantic.BaseModel] = pydantic.create_model(function.__name__, **fields)
        schema = arguments.model_json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError) as exc:
        raise TypeError(f"tool function {function.__name__}: {exc}") from exc
    return Tool(
        name=function.__name__,
        description=first_paragraph(doc),
        parameters=_strip_titles(schema),
        arguments_type=arguments,
        function=function,
    )


def first_paragraph(doc: str) -> str:
    """The docstring's text up to its first blank line or section heading, on one line."""
    kept: list[str] = []
    for line in doc.strip().splitlines():
        if not line.strip() or _GOOGLE_SECTION.match(line) or _NUMPY_SECTION.match(line):
            break
        kept.append(line.strip())
    return " ".join(kept)


def parameter_descriptions(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style `Args:` or a NumPy-style `Parameters` section."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if _GOOGLE_SECTION.match(line):
            return _google_entries(lines[i + 1 :], _indent(line))
        if _NUMPY_SECTION.match(line) and i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}:
            return _numpy_entries(lines[i + 2 :])
    return {}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _google_entries(lines: Sequence[str], section_indent: int) -> dict[str, str]:
    """`name (type): text` lines, continued by more-indented lines, until the section ends."""
    out: dict[str, list[str]] = {}
    entry_indent: int | None = None
    current: str | None = None
    for line in lines:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= section_indent:
            break  # the next section (Returns:, Raises:) or the end of the list
        if entry_indent is None:
            entry_indent = indent
        match = _GOOGLE_ENTRY.match(line)
        if indent == entry_indent and match:
            current = match.group(1)
            out[current] = [match.group(3).strip()]
        elif current is not None and indent > entry_indent:
            out[current].append(line.strip())
    return {k: " ".join(p for p in v if p) for k, v in out.items()}


def _numpy_entries(lines: Sequence[str]) -> dict[str, str]:
    """`name : type` lines with their description indented below, until a blank-then-heading."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for j, line in enumerate(lines):
        if not line.strip():
            continue
        if j + 1 < len(lines) and set(lines[j + 1].strip()) == {"-"}:
            break  # the next NumPy section ("Returns" over dashes)
        if _indent(line) == 0:
            match = _NUMPY_ENTRY.match(line)
            if match is None or _SECTION_HEAD.match(line):
                break
            current = match.group(1)
            out[current] = []
        elif current is not None:
            out[current].append(line.strip())
    return {k: " ".join(v) for k, v in out.items() if v}


def resolve_tools(tools: Sequence[ToolLike] | None) -> list[Tool]:
    """`tools=` as Tool values, in order."""
    return [tool(t) for t in tools or ()]


def build_tool(value: Tool) -> types_pb2.Tool:
    """The proto Tool; parameters travel as JSON text (keeps property order and exact integers)."""
    parameters = "" if value.parameters is None else pydantic_core.to_json(value.parameters).decode()
    return types_pb2.Tool(
        name=value.name, description=value.description, parameters_json=parameters, strict=value.strict
    )


def build_tool_choice(choice: Any) -> types_pb2.ToolChoice:
    """ "auto" | "none" | "required" as modes; any other text, a Tool, model class or function as that
    tool's name (so a tool named "auto" is chosen by passing the Tool itself)."""
    if isinstance(choice, str):
        if choice in _MODES:
            return types_pb2.ToolChoice(mode=_MODES[choice])
        return types_pb2.ToolChoice(name=choice)
    try:
        return types_pb2.ToolChoice(name=tool(choice).name)
    except TypeError:
        raise TypeError(
            f"tool_choice must be 'auto', 'none', 'required', a tool name or a tool, not {choice!r}"
        ) from None


def result_text(result: Any) -> str:
    """A tool result as message content: text as is, anything else as JSON (pydantic models too)."""
    if isinstance(result, str):
        return result
    return pydantic_core.to_json(result).decode()


def _generation_of(result: Generation | Response) -> Generation:
    if isinstance(result, Response):
        if not result.generations:
            raise ValueError("the response has no generation to continue from")
        return result.generations[0]
    return result


def with_results(
    messages: Sequence[MessageLike],
    generation: Generation | Response,
    results: Mapping[str, Any],
) -> list[MessageLike]:
    """The conversation continued: `messages`, the assistant turn that made the calls (its text,
    tool calls and reasoning with signatures) and one "tool" message per call, in call order.

    `results` maps each call id to its result (text as is; other values JSON-encoded); every call
    needs one, and an id that names no call is refused, so a mistake never reaches the model.
    """
    made = _generation_of(generation)
    ids = [call.id for call in made.tool_calls]
    unknown = sorted(set(results) - set(ids))
    if unknown:
        raise ValueError(f"results for ids that name no tool call of the generation: {unknown}")
    missing = [f"{call.id} ({call.name})" for call in made.tool_calls if call.id not in results]
    if missing:
        raise ValueError(f"no result for tool calls {missing}")
    assistant = Message("assistant", made.text, tool_calls=made.tool_calls, reasoning=made.reasoning)
    answers = [Message("tool", result_text(results[call_id]), tool_call_id=call_id) for call_id in ids]
    return [*messages, assistant, *answers]


def run_tool_calls(generation: Generation | Response) -> dict[str, Any]:
    """Each call's result by call id, from invoking its function tool (`ToolCall.invoke`): ready for
    `with_results`. Async functions give coroutines; await them first."""
    calls: Sequence[ToolCall] = _generation_of(generation).tool_calls
    return {call.id: call.invoke() for call in calls}
