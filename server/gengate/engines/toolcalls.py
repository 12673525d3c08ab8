"""Tool calls on the local engines: one call format, the grammar that enforces it, and the parser
that turns a generation's text back into text and calls.

The format is Hermes / Qwen2.5's, used by every local engine whatever its chat template:

    free text (auto only), then one or more blocks, one per call, separated by a newline:
    <tool_call>
    {"name": "<an offered tool>", "arguments": {<that tool's arguments>}}
    </tool_call>

A chat template that speaks this format itself (it reads `tools` and writes `<tool_call>`, as
Qwen2.5's and Hermes' do) is given the tools and the conversation's calls in its own variables.
Any other template gets the generic form: the same instructions Qwen2.5 renders, as a paragraph of
the first system message, and the conversation's calls and results written as call blocks and
`<tool_response>` user turns. Either way the model answers in the format above, so one grammar and
one parser serve llama.cpp, transformers and MLX.

The grammar (llguidance Lark; each tool's arguments a `%json` rule of its lowered schema) gives
tool_choice auto: free text, or text then calls; required: calls only; a named tool: calls of that
tool only; none: no grammar (plain text, and the tools are left out of the prompt).
parallel_tool_calls false allows one call. The engine's stream goes through `tool_events`, which
holds back what may open a call, streams each call (its id and name, then its arguments' fragments
as they are generated), and puts the complete calls on the generation's end (finish reason
TOOL_CALLS).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gengate.constraints.lowering import lower_json_schema
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    Role,
    StreamEvent,
    StructuredOutput,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoiceMode,
)
from gengate.lru import LruCache
from gengate.tools import ToolSet, new_call_id, parameters_of, tool_structured

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
CALL_SEPARATOR = "\n"

# Qwen2.5's own words for its tools paragraph: the generic form prompts exactly as that template.
_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
# Tool sets' grammars by (tools, choice): lowering each schema costs milliseconds, and a client
# offers the same tools request after request.
_GRAMMARS: LruCache[str, tuple[str, tuple[str, ...]]] = LruCache(128)


# -- the request's tools ------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of a local engine: the grammar of its answer (None for
    tool_choice none) and how far the engine enforces the arguments' schemas."""

    toolset: ToolSet
    grammar: StructuredOutput | None
    enforcement: Enforcement
    relaxations: tuple[str, ...] = ()

    @property
    def parses_calls(self) -> bool:
        """Whether the answer is read for calls (not with tool_choice none: its text is text)."""
        return self.grammar is not None


def tool_plan(request: GenerationRequest) -> ToolPlan | None:
    """The request's tool plan, or None when it offers no tools."""
    if not request.tools:
        return None
    toolset = ToolSet(request)
    if toolset.mode is ToolChoiceMode.NONE:
        return ToolPlan(toolset, None, Enforcement.NONE)
    grammar, relaxations = tool_grammar(toolset)
    enforcement = Enforcement.VALIDATED if relaxations else Enforcement.ENGINE
    return ToolPlan(
        toolset,
        StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, grammar)),
        enforcement,
        relaxations,
    )


def tool_grammar(toolset: ToolSet) -> tuple[str, tuple[str, ...]]:
    """The Lark grammar of an answer to `toolset` (not tool_choice none), and the relaxations its
    arguments' schemas needed (keywords the grammar engine cannot enforce, validated afterwards)."""
    assert toolset.mode is not ToolChoiceMode.NONE
    key = _grammar_key(toolset)
    hit = _GRAMMARS.get(key)
    if hit is None:
        hit = _tool_grammar(toolset)
        _GRAMMARS.put(key, hit)
    return hit


def _grammar_key(toolset: ToolSet) -> str:
    tools = [(t.name, t.parameters, t.strict) for t in toolset.by_name.values()]
    return json.dumps([tools, toolset.mode, toolset.required_name, toolset.parallel], default=str)


def _tool_grammar(toolset: ToolSet) -> tuple[str, tuple[str, ...]]:
    bodies: list[str] = []
    rules: list[str] = []
    relaxations: list[str] = []
    for i, tool in enumerate(toolset.by_name.values()):
        if toolset.required_name is not None and tool.name != toolset.required_name:
            continue
        schema, relaxed = _arguments_schema(tool, i)
        relaxations += relaxed
        head = "\n" + json.dumps({"name": tool.name})[:-1] + ', "arguments": '
        rules.append(f"body_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + chr(10) + CALL_CLOSE)}")
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        bodies.append(f"body_{i}")
    more = f" ({json.dumps(CALL_SEPARATOR + CALL_OPEN)} body)*" if toolset.parallel else ""
    if toolset.mode is ToolChoiceMode.AUTO and toolset.required_name is None:
        # Text, or text ending at the first call's open tag (a lexeme of its own: the lexer does
        # not backtrack out of free text once it has taken `<tool_call` in).
        start = f"start: TEXT | TEXT_OPEN body{more}"
        lexemes = [
            f"TEXT: /(?s:.)+/ & ~/(?s:.*){_regex(CALL_OPEN)}(?s:.*)/",
            f"TEXT_OPEN: /(?s:.*){_regex(CALL_OPEN)}/ & ~/(?s:.*){_regex(CALL_OPEN)}(?s:.)+/",
        ]
    else:
        start = f"start: {json.dumps(CALL_OPEN)} body{more}"
        lexemes = []
    lines = [start, "body: " + " | ".join(bodies), *rules, *lexemes]
    return "\n".join(lines) + "\n", tuple(relaxations)


def _arguments_schema(tool: Tool, index: int) -> tuple[dict[str, Any], list[str]]:
    """A tool's arguments schema as the grammar generates it (lowered like structured_output's:
    closed objects, relaxed where needed), with llguidance's compact whitespace."""
    structured = tool_structured(tool)
    constraint = structured.constraint
    assert isinstance(constraint, JsonSchemaConstraint)
    lowered = lower_json_schema(
        constraint, structured, field=f"tools[{index}].parameters_json", metaschema=False
    )
    schema = dict(lowered.generate_schema or parameters_of(tool))
    schema["x-guidance"] = {"whitespace_flexible": False}
    return schema, [f"{tool.name}: {r}" for r in lowered.relaxations]


def _regex(literal: str) -> str:
    """`literal` escaped for a Lark regex (the tags are plain ASCII with `<`, `/`, `>` and `_`)."""
    return "".join("\\" + c if c in "/\\.^$*+?()[]{}|" else c for c in literal)


# -- the prompt ---------------------------------------------------------------------------------


def template_speaks_tools(template: str | Mapping[str, str] | None) -> bool:
    """Whether a chat template renders tools and calls in this module's format itself (Qwen2.5,
    Hermes): it reads `tools` and writes `<tool_call>`."""
    if isinstance(template, Mapping):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template and CALL_OPEN in template


def tool_declarations(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates (and OpenAI) take them: `{"type": "function", "function": ...}`."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": parameters_of(tool),
            },
        }
        for tool in tools
    ]


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat template renders: the messages as dicts, and `tools` for a template that takes
    them (None otherwise: the generic form has put them into the messages)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the template beside `messages` (only what is set)."""
        return {} if self.tools is None else {"tools": self.tools}


def chat_prompt(request: GenerationRequest, *, native: bool) -> ChatPrompt:
    """The request's messages (and tools) for a chat template; `native`: the template speaks the
    call format itself (`template_speaks_tools`), else the generic form is written into the text."""
    messages = request.messages or ()
    offered = request.tools if tool_plan_mode(request) is not ToolChoiceMode.NONE else ()
    if native:
        return ChatPrompt(
            [_native_message(m) for m in messages], tool_declarations(offered) if offered else None
        )
    out = _generic_messages(messages)
    if offered:
        paragraph = tools_paragraph(request)
        if out and out[0]["role"] == Role.SYSTEM.value:
            first = out[0]
            out[0] = {
                **first,
                "content": f"{first['content']}\n\n{paragraph}" if first["content"] else paragraph,
            }
        else:
            out.insert(0, {"role": Role.SYSTEM.value, "content": paragraph})
    return ChatPrompt(out)


def tool_plan_mode(request: GenerationRequest) -> ToolChoiceMode:
    """The request's tool choice mode (auto when unset)."""
    return ToolChoiceMode.AUTO if request.tool_choice is None else request.tool_choice.mode


def tools_paragraph(request: GenerationRequest) -> str:
    """The generic form's system paragraph: the tools, the call format and what the choice demands."""
    lines = "".join("\n" + json.dumps(d, ensure_ascii=False) for d in tool_declarations(request.tools))
    toolset = ToolSet(request)
    demand = ""
    if toolset.required_name is not None:
        demand = f'\n\nCall the function "{toolset.required_name}".'
    elif toolset.mode is ToolChoiceMode.REQUIRED:
        demand = "\n\nCall at least one function."
    if not toolset.parallel:
        demand += "\n\nCall at most one function."
    return _TOOLS_HEAD + lines + _TOOLS_TAIL + demand


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role.value, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments_value(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _generic_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages with calls written as call blocks and tool results as `<tool_response>` user turns
    (consecutive results in one turn, as Qwen2.5 renders them)."""
    out: list[dict[str, Any]] = []
    previous_tool = False
    for message in messages:
        if message.role is Role.TOOL:
            response = f"{RESPONSE_OPEN}\n{message.text}\n{RESPONSE_CLOSE}"
            if previous_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": Role.USER.value, "content": response})
            previous_tool = True
            continue
        previous_tool = False
        text = message.text
        if message.tool_calls:
            blocks = CALL_SEPARATOR.join(call_block(c.name, c.arguments) for c in message.tool_calls)
            text = f"{text}\n{blocks}" if text else blocks
        out.append({"role": message.role.value, "content": text})
    return out


def call_block(name: str, arguments: str) -> str:
    """One call in the format, as the grammar writes it."""
    value = _arguments_value(arguments)
    inner = (
        json.dumps(value, ensure_ascii=False, separators=(",", ":")) if not isinstance(value, str) else value
    )
    return f'{CALL_OPEN}\n{json.dumps({"name": name})[:-1]}, "arguments": {inner}}}\n{CALL_CLOSE}'


def _arguments_value(arguments: str) -> Any:
    """A call's arguments as JSON data (templates write them with `tojson`); the text itself when
    it is not JSON."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


# -- reading calls back -------------------------------------------------------------------------


def parse_call(body: str) -> ToolCall:
    """The call a block's body (between the tags) holds, with a fresh id. A body that is not
    `{"name": ..., "arguments": {...}}` still becomes a call (name and arguments as found), so the
    call checks refuse it rather than it vanishing."""
    try:
        value = json.loads(body)
    except ValueError:
        return ToolCall(new_call_id(), "", body.strip())
    if not isinstance(value, dict):
        return ToolCall(new_call_id(), "", body.strip())
    name = value.get("name")
    arguments = value.get("arguments", {})
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return ToolCall(new_call_id(), name if isinstance(name, str) else "", text)


# What the grammar writes before a call's arguments: `\n{"name": "<name>", "arguments": `.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class _OpenCall:
    """The call whose block is open: its id, and once its head is read, its name and how much of
    its arguments went out."""

    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    head_end: int = 0  # where the arguments begin in the block's body
    sent: list[str] = field(default_factory=list)


@dataclass
class CallSplitter:
    """Splits one generation's text, as it streams, into free text and calls.

    Text that may begin a call's open tag is held back, and so is whitespace just before it (a
    call's text ends where its first call begins); once a call opens, anything that is not a call
    block is dropped (the grammar allows only separators there). A call streams as the grammar
    writes it: a ToolCallDelta with its id and name once its head is read, then its arguments as
    they come (what may be the block's end held back); the complete call's arguments are those
    fragments joined. A block not in the format goes out whole when it closes.
    """

    _pending: str = ""
    _in_call: bool = False
    _searched: int = 0  # how far into an open call's body the close tag was looked for
    _after_call: bool = False
    _open: _OpenCall | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Free text that can be released now, and the calls that closed in `text`."""
        released, _, closed = self._split(text)
        return released, closed

    def stream(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Free text that can be released now, and the calls' fragments that can go out."""
        released, deltas, _ = self._split(text)
        return released, deltas

    def _split(self, text: str) -> tuple[str, list[ToolCallDelta], list[ToolCall]]:
        self._pending += text
        released: list[str] = []
        deltas: list[ToolCallDelta] = []
        new: list[ToolCall] = []
        while True:
            if self._in_call:
                call = self._call_step(deltas)
                if call is None:
                    break
                self.calls.append(call)
                new.append(call)
                self._in_call, self._after_call, self._open = False, True, None
                continue
            start = self._pending.find(CALL_OPEN)
            if start >= 0:
                if not self._after_call:
                    released.append(self._pending[:start].rstrip())
                self._pending = self._pending[start + len(CALL_OPEN) :]
                self._in_call, self._searched = True, 0
                self._open = _OpenCall(len(self.calls))
                continue
            keep = _open_prefix_length(self._pending)
            head = self._pending[: len(self._pending) - keep]
            free = head.rstrip()
            if not self._after_call:
                released.append(free)
            self._pending = (head[len(free) :] if not self._after_call else "") + self._pending[len(head) :]
            break
        return "".join(released), deltas, new

    def _call_step(self, deltas: list[ToolCallDelta]) -> ToolCall | None:
        """Reads the open block: its fragments into `deltas`, and the call once it closes (its
        text taken out of the pending text), else None."""
        call = self._open
        assert call is not None
        end = self._pending.find(CALL_CLOSE, self._searched)
        if call.name is None:
            head = _HEAD.match(self._pending)
            if head is not None:
                call.name, call.head_end = json.loads(head.group(1)), head.end()
                deltas.append(ToolCallDelta(index=call.index, id=call.id, name=call.name))
            elif end >= 0:  # not the grammar's format: the whole block, as parse_call reads it
                parsed = replace(parse_call(self._pending[:end]), id=call.id)
                deltas.append(_call_delta(call.index, parsed))
                self._pending = self._pending[end + len(CALL_CLOSE) :]
                return parsed
        sent = sum(len(f) for f in call.sent)
        if call.name is not None and not sent:  # the arguments begin at their first non-space
            start = self._pending[call.head_end :]
            call.head_end += len(start) - len(start.lstrip())
        if call.name is not None and end >= 0:
            body = self._pending[call.head_end : end].rstrip()
            arguments = body[:-1].rstrip() if body.endswith("}") else body  # the `}` closing the call
            rest = arguments[sent:]
            if rest:
                call.sent.append(rest)
                deltas.append(ToolCallDelta(index=call.index, arguments=rest))
            self._pending = self._pending[end + len(CALL_CLOSE) :]
            return ToolCall(call.id, call.name, "".join(call.sent))
        if call.name is not None:
            available = self._pending[call.head_end :]
            fragment = available[sent : max(sent, len(available) - _end_hold_length(available))]
            if fragment:
                call.sent.append(fragment)
                deltas.append(ToolCallDelta(index=call.index, arguments=fragment))
        self._searched = max(0, len(self._pending) - len(CALL_CLOSE) + 1)
        return None

    def finish(self) -> str:
        """The free text still held back at the end (none once a call opened)."""
        pending, self._pending = self._pending, ""
        return "" if self._in_call or self._after_call else pending


def _end_hold_length(arguments: str) -> int:
    """How much of the end of an open call's arguments text may be the block's end (`}`, the
    separator and a part of the close tag), so is held back."""
    kept = arguments[: len(arguments) - tag_prefix_length(arguments, CALL_CLOSE)].rstrip()
    if kept.endswith("}"):
        kept = kept[:-1]
    return len(arguments) - len(kept)


def _open_prefix_length(text: str) -> int:
    """The length of the longest end of `text` that begins the open tag."""
    return tag_prefix_length(text, CALL_OPEN)


def tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_calls(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    """A finished generation's text without its call blocks, and its calls."""
    splitter = CallSplitter()
    free, _ = splitter.feed(text)
    return free + splitter.finish(), tuple(splitter.calls)


async def tool_events(
    events: AsyncIterator[StreamEvent], plan: ToolPlan | None
) -> AsyncGenerator[StreamEvent, None]:
    """An engine's stream with each generation's calls taken out of its text: free text deltas,
    each call's id and name then its arguments' fragments, and the complete calls on the generation's end
    (finish reason TOOL_CALLS when it ended there). Unchanged without a plan that parses calls."""
    if plan is None or not plan.parses_calls:
        async for event in events:
            yield event
        return
    splitters: dict[int, CallSplitter] = {}
    carried: dict[int, int] = {}  # tokens of deltas whose text is held back, for the next delta
    async for event in events:
        if isinstance(event, GenerationDelta):
            splitter = splitters.setdefault(event.index, CallSplitter())
            text, deltas = splitter.stream(event.text)
            if text or deltas or event.reasoning or event.logprobs is not None:
                yield replace(
                    event,
                    text=text,
                    token_count=event.token_count + carried.pop(event.index, 0),
                    tool_calls=tuple(deltas),
                )
            else:
                carried[event.index] = carried.get(event.index, 0) + event.token_count
        elif isinstance(event, GenerationEnd):
            splitter = splitters.pop(event.index, CallSplitter())
            tail = splitter.finish()
            tokens = carried.pop(event.index, 0)
            if tail or tokens:
                yield GenerationDelta(event.index, tail, tokens)
            calls = tuple(splitter.calls)
            finish = event.finish_reason
            if calls and finish is FinishReason.STOP:
                finish = FinishReason.TOOL_CALLS
            yield replace(event, finish_reason=finish, tool_calls=calls)
        else:
            yield event


def _call_delta(index: int, call: ToolCall) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=call.id, name=call.name, arguments=call.arguments)
