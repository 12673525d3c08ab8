"""Tool calls on the provider side: settling the calls a provider returned (ids, finish reason),
assembling streamed fragments into calls, judging them against the request's tools and writing
the feedback a re-ask sends. The loop that re-asks lives in providers.base.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gengate import errors
from gengate.domain import (
    ChatMessage,
    FinishReason,
    Generation,
    GenerationRequest,
    Role,
    TextPart,
    ToolCall,
    ToolCallDelta,
)
from gengate.tools import REASONING_UNSUPPORTED, TOOLS_UNSUPPORTED, ToolSet, first_tool_field, new_call_id

# A provider's last word on one call before it is validated (e.g. nulls strict mode forced in).
FinalCall = Callable[[GenerationRequest, ToolCall], ToolCall]

# Finish reasons that say why there is no answer: reported as they are, not judged as tool calls.
_NO_ANSWER = (FinishReason.REFUSAL, FinishReason.CONTENT_FILTER)


def uses_tools(request: GenerationRequest) -> bool:
    """Whether the request offers tools, sets a tool field or carries a tool-call turn."""
    return first_tool_field(request) is not None


def tools_refused(request: GenerationRequest, provider: str) -> errors.Unimplemented:
    """UNIMPLEMENTED TOOLS_UNSUPPORTED naming the first tool field the request uses."""
    where = first_tool_field(request) or "tools"
    return errors.Unimplemented(
        f"{provider} does not take tool calls",
        reason=TOOLS_UNSUPPORTED,
        violations=[errors.FieldViolation(where, f"tool calling is not supported by {provider}")],
    )


def reasoning_refused(provider: str, field_name: str, why: str) -> errors.Unimplemented:
    """UNIMPLEMENTED REASONING_UNSUPPORTED for one field of the request's reasoning control."""
    return errors.Unimplemented(
        f"{field_name}: {why}",
        reason=REASONING_UNSUPPORTED,
        violations=[errors.FieldViolation(field_name, why)],
        metadata={"provider": provider},
    )


def settle(
    request: GenerationRequest,
    finish: FinishReason,
    calls: tuple[ToolCall, ...],
    final: FinalCall | None = None,
) -> tuple[FinishReason, tuple[ToolCall, ...]]:
    """The finish reason and calls as gengate returns them: every call has an id, TOOL_CALLS
    exactly when the model stopped on calls (OpenAI says `stop` when a named tool was forced)."""
    if not calls:
        return (FinishReason.STOP if finish is FinishReason.TOOL_CALLS else finish), ()
    done = tuple(replace(c, id=c.id or new_call_id()) for c in calls)
    if final is not None:
        done = tuple(final(request, c) for c in done)
    if finish is FinishReason.STOP:
        finish = FinishReason.TOOL_CALLS
    return finish, done


def settled(request: GenerationRequest, g: Generation, final: FinalCall | None = None) -> Generation:
    """`g` with its calls and finish reason settled (see `settle`)."""
    if not g.tool_calls and g.finish_reason is not FinishReason.TOOL_CALLS:
        return g
    finish, calls = settle(request, g.finish_reason, g.tool_calls, final)
    return replace(g, finish_reason=finish, tool_calls=calls)


def problem(toolset: ToolSet, finish: FinishReason, calls: tuple[ToolCall, ...]) -> str | None:
    """Why one generation's calls are not what the request allows (None: they are). A refusal or
    a filtered output without calls is left to its finish reason."""
    if finish in _NO_ANSWER and not calls:
        return None
    return toolset.call_errors(calls)


def reask_message(error: str, *, called: bool) -> str:
    """The feedback text of a re-ask: to each call made (a tool message), or to an answer that
    should have been a call (a user message)."""
    if called:
        return (
            f"This tool call was not run because it is not valid: {error}\n"
            "Call the tools again, with names and arguments exactly as their definitions require."
        )
    return f"That answer is not valid: {error}\nAnswer again, as the tool choice requires."


def reask_feedback(bad: Generation, error: str) -> tuple[ChatMessage, ...]:
    """The turns appended to the chat to re-ask after `bad`: its message, calls included, then a
    tool message answering each call with the error (every call must be answered), or a user
    message when it made none. Its reasoning goes back with it, for the providers that require
    a call's thinking beside it (Anthropic)."""
    said = (TextPart(bad.text),) if bad.text else ()
    assistant = ChatMessage(Role.ASSISTANT, said, tool_calls=bad.tool_calls, reasoning=bad.reasoning)
    if not bad.tool_calls:
        return assistant, ChatMessage(Role.USER, (TextPart(reask_message(error, called=False)),))
    text = (TextPart(reask_message(error, called=True)),)
    return assistant, *(ChatMessage(Role.TOOL, text, tool_call_id=c.id) for c in bad.tool_calls)


@dataclass
class _Pending:
    id: str
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class CallAssembly:
    """Streamed call fragments of one upstream stream, by generation and call index, joined into
    complete calls for the end frames. A call's id is settled on its first fragment (made when
    the provider gives none), so the deltas sent and the end frame's call agree."""

    calls: dict[int, dict[int, _Pending]] = field(default_factory=dict)

    def add(self, index: int, fragment: ToolCallDelta) -> ToolCallDelta:
        """Records a fragment of generation `index`; returns it as it goes out (id settled)."""
        pending = self.calls.setdefault(index, {})
        call = pending.get(fragment.index)
        if call is None:
            call = pending[fragment.index] = _Pending(fragment.id or new_call_id())
            fragment = replace(fragment, id=call.id)
        elif fragment.id:
            fragment = replace(fragment, id="")  # the id went out with the first fragment
        if fragment.name and not call.name:
            call.name = fragment.name
        elif fragment.name:
            fragment = replace(fragment, name="")  # repeated on every fragment (llama-cpp-python)
        call.arguments.append(fragment.arguments)
        return fragment

    def of(self, index: int) -> tuple[ToolCall, ...]:
        """Generation `index`'s calls, in call-index order."""
        pending = self.calls.get(index, {})
        return tuple(ToolCall(c.id, c.name, "".join(c.arguments)) for _, c in sorted(pending.items()))
