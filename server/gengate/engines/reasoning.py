"""Reasoning on the local engines: a think block at the start of a generation (`<think>...</think>`
by default) goes to Generation.reasoning, the rest to its text.

An engine's `reasoning_parser` option: `auto` (the default) parses where the chat template mentions
the open tag (Qwen3, DeepSeek-R1 and QwQ templates do), `think` always, `off` never. Only chat
requests are parsed. A generation starts inside the block when the rendered prompt ends with the open
tag (templates that open it for the model). With reasoning off for a request (reasoning.enabled
false, or enable_thinking false) nothing is parsed.

A grammar (structured_output, tools) applies to the answer after the block: the engine compiles
a think block first (free text up to the close tag, at most reasoning.budget_tokens tokens), then
the answer's grammar; budget_tokens alone gets the block and free text after it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from gengate import errors
from gengate.constraints.compiler import CompiledConstraint, constraint_key
from gengate.constraints.lowering import LoweredConstraint
from gengate.domain import (
    ConstraintKind,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    StreamEvent,
    StructuredOutput,
)
from gengate.engines.toolcalls import tag_prefix_length

ANSWER_GRAMMAR = "gengate_answer"
FREE_TEXT = "start: /(?s:.*)/"  # what follows a capped think block without a constraint


class ReasoningConfig(BaseModel):
    """The reasoning keys of a local engine's config."""

    reasoning_parser: Literal["auto", "think", "off"] = Field(
        default="auto",
        description="Split a leading think block into the generation's reasoning: auto = where the chat "
        "template mentions `think_open`, think = always, off = never.",
    )
    think_open: str = Field(default="<think>", min_length=1, description="The think block's open tag.")
    think_close: str = Field(default="</think>", min_length=1, description="The think block's close tag.")

    @model_validator(mode="after")
    def _distinct_tags(self) -> ReasoningConfig:
        if self.think_open == self.think_close:
            raise ValueError("`think_open` and `think_close` must differ")
        return self

    def tags_for(self, template: str) -> ThinkTags | None:
        """The tags to parse for a model with this chat template text ("" for none), or None."""
        if self.reasoning_parser == "off" or (
            self.reasoning_parser == "auto" and self.think_open not in template
        ):
            return None
        return ThinkTags(self.think_open, self.think_close)


@dataclass(frozen=True)
class ThinkTags:
    open: str
    close: str


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's generations are read: `inside` when the prompt opened the block."""

    tags: ThinkTags
    inside: bool = False
    budget_tokens: int | None = None

    def answer_of(self, text: str) -> str:
        """A finished generation's text without its think block (what a constraint validates)."""
        splitter = ThinkSplitter(self)
        _, answer = splitter.feed(text)
        return answer + splitter.finish()[1]


def reasoning_plan(
    request: GenerationRequest, tags: ThinkTags | None, prompt_text: str, thinking: bool
) -> ReasoningPlan | None:
    """The request's plan: None without a parser, for a raw prompt, or with thinking switched off."""
    if tags is None or request.messages is None or not thinking:
        return None
    if request.reasoning is not None and request.reasoning.enabled is False:
        return None
    budget = None if request.reasoning is None else request.reasoning.budget_tokens
    return ReasoningPlan(tags, prompt_text.rstrip().endswith(tags.open), budget)


class _State(Enum):
    START = 0  # before the open tag (whitespace or a part of it so far)
    THINK = 1
    AFTER = 2  # just after the close tag: whitespace is dropped
    ANSWER = 3


class ThinkSplitter:
    """Splits one generation's text, as it streams, into reasoning and answer.

    A part of a tag at the end of what came so far is held back (and the reasoning's trailing
    whitespace, which is dropped at the close tag), as toolcalls.CallSplitter holds a part of
    `<tool_call>`. Reasoning and answer are stripped of the whitespace around the tags; a text that
    does not begin with the open tag is all answer, unchanged.
    """

    def __init__(self, plan: ReasoningPlan) -> None:
        self._tags = plan.tags
        self._state = _State.THINK if plan.inside else _State.START
        self._pending = ""
        self._started = False  # some reasoning was released (leading whitespace is dropped)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that can be released now."""
        self._pending += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self._pending:
            if self._state is _State.START:
                head = self._pending.lstrip()
                if head.startswith(self._tags.open):
                    self._pending, self._state = head[len(self._tags.open) :], _State.THINK
                    continue
                if not head or self._tags.open.startswith(head):
                    break  # whitespace or a part of the open tag so far
                self._state = _State.ANSWER
            elif self._state is _State.THINK:
                end = self._pending.find(self._tags.close)
                if end >= 0:
                    reasoning.append(self._reasoning(self._pending[:end], last=True))
                    self._pending, self._state = self._pending[end + len(self._tags.close) :], _State.AFTER
                    continue
                keep = tag_prefix_length(self._pending, self._tags.close)
                head = self._pending[: len(self._pending) - keep]
                released = self._reasoning(head.rstrip(), last=False)
                reasoning.append(released)
                self._pending = head[len(head.rstrip()) :] + self._pending[len(head) :]
                break
            elif self._state is _State.AFTER:
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = _State.ANSWER
            else:
                answer.append(self._pending)
                self._pending = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is still held back at the end: reasoning when the block never closed."""
        pending, self._pending = self._pending, ""
        if self._state is _State.THINK:
            return self._reasoning(pending, last=True), ""
        return ("", pending) if self._state is _State.START else ("", "")

    def _reasoning(self, text: str, *, last: bool) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text.rstrip() if last else text


async def reasoning_events(
    events: AsyncIterator[StreamEvent], plan: ReasoningPlan | None
) -> AsyncGenerator[StreamEvent, None]:
    """An engine's stream with each generation's think block moved from `text` to `reasoning`
    (held-back text's tokens counted on the next delta). Unchanged without a plan."""
    if plan is None:
        async for event in events:
            yield event
        return
    splitters: dict[int, ThinkSplitter] = {}
    carried: dict[int, int] = {}
    async for event in events:
        if isinstance(event, GenerationDelta):
            splitter = splitters.setdefault(event.index, ThinkSplitter(plan))
            thought, text = splitter.feed(event.text)
            if thought or text or event.logprobs is not None:
                tokens = event.token_count + carried.pop(event.index, 0)
                yield replace(event, text=text, reasoning=event.reasoning + thought, token_count=tokens)
            else:
                carried[event.index] = carried.get(event.index, 0) + event.token_count
        elif isinstance(event, GenerationEnd):
            thought, text = splitters.pop(event.index, ThinkSplitter(plan)).finish()
            tokens = carried.pop(event.index, 0)
            if thought or text or tokens:
                yield GenerationDelta(event.index, text, tokens, reasoning=thought)
            yield event
        else:
            yield event


# -- grammars -----------------------------------------------------------------------------------


def think_grammar(plan: ReasoningPlan, answer: str | None) -> str:
    """An llguidance grammar (JSON) of a think block then `answer` (a lowered llguidance grammar, as
    ConstraintCompiler lowers one), or free text when None."""
    close = _regex(plan.tags.close)
    think = "think" if plan.budget_tokens is None else f"think[max_tokens={plan.budget_tokens}]"
    opening = "" if plan.inside else json.dumps(plan.tags.open) + " "
    grammars: list[dict[str, Any]] = []
    tail = "/(?s:.*)/"
    top: dict[str, Any] = {}
    if answer is not None:
        # llguidance takes a grammar as JSON (TopLevelGrammar) or as Lark text
        top = (
            json.loads(answer)
            if answer.lstrip().startswith("{")
            else {"grammars": [{"lark_grammar": answer}]}
        )
        grammars = [dict(g) for g in top["grammars"]]
        grammars[0]["name"] = grammars[0].get("name") or ANSWER_GRAMMAR
        tail = "@" + grammars[0]["name"]
    lark = (
        f"start: {opening}think {json.dumps(plan.tags.close)} SPACE {tail}\n"
        f"{think}: /(?s:.*)/ & ~/(?s:.*){close}(?s:.*)/\n"
        "SPACE: /[ \\t\\r\\n]*/\n"
    )
    out: dict[str, Any] = {"grammars": [{"name": "gengate_reasoning", "lark_grammar": lark}, *grammars]}
    if top.get("max_tokens") is not None:
        out["max_tokens"] = top["max_tokens"]
    return json.dumps(out)


def _regex(literal: str) -> str:
    """`literal` as a regex matching it exactly (every character not a letter or digit escaped)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in literal)


async def compile_with_reasoning(
    compiler: Any, structured: StructuredOutput | None, plan: ReasoningPlan | None, *, checked: bool
) -> CompiledConstraint | None:
    """The constraint compiled by `compiler` (a ConstraintCompiler), after a think block when the
    plan asks for one: with a constraint, or to cap the block at budget_tokens. `checked`: it is
    the request's own, checked by the server's sandbox (ConstraintCompiler.compile)."""
    if plan is None or (structured is None and plan.budget_tokens is None):
        return None if structured is None else await compiler.compile(structured, checked=checked)
    inner = None if structured is None else await compiler.compile(structured, checked=checked)
    vocab = compiler.ll_tokenizer.vocab_size

    def build() -> CompiledConstraint:
        from llguidance import LLMatcher

        from gengate.constraints.validation import quiet_limits

        grammar = think_grammar(plan, None if inner is None else inner.grammar)
        matcher = LLMatcher(compiler.ll_tokenizer, grammar, log_level=0, limits=quiet_limits())
        if matcher.is_error():
            raise errors.Internal(f"the think block's grammar did not compile: {matcher.get_error()}")
        if inner is None:
            free = StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, FREE_TEXT))
            lowered = LoweredConstraint(ConstraintKind.GRAMMAR, grammar)
            return CompiledConstraint(free, lowered, matcher, vocab)
        return CompiledConstraint(inner.structured, replace(inner.lowered, grammar=grammar), matcher, vocab)

    key = json.dumps(
        [
            "reasoning",
            plan.tags.open,
            plan.tags.close,
            plan.inside,
            plan.budget_tokens,
            None if structured is None else constraint_key(structured, grammar_only=True),
        ]
    )
    composed: CompiledConstraint = await compiler.compile_composed(key, build, structured)
    return composed


AnswerOf = Callable[[str], str]


def answer_function(plan: ReasoningPlan | None) -> AnswerOf | None:
    """What validation reads of a generation's text: its answer when a think block comes first."""
    return None if plan is None else plan.answer_of
