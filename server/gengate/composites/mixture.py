"""`mixture_of_agents`: proposers answer, an aggregator synthesises (Wang et al. 2024, "Mixture-of-
Agents Enhances Large Language Model Capabilities").

    - name: moa
      backend: mixture_of_agents
      proposers: [gpt, claude, qwen]   # served names; a name may repeat (its calls get other seeds)
      aggregator: gpt
      rounds: 1                        # >1: each round's proposers also see the previous answers
      proposer_max_tokens: 512         # default: the request's max_tokens

Proposers run concurrently on the request as plain text (n=1, no structured output). The
aggregator gets their answers in a system message ahead of the original input and the original
structured output, sampling, stopping and n: it enforces the constraint, so the composite has
the aggregator's capabilities (with chat, and only the input modalities every member takes).
Usage counts every call. A proposer that fails is left out (logged) unless all of them fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gengate.backend import Backend, aclose_stream
from gengate.composites.base import CompositeBackend, annotate, member_request
from gengate.domain import (
    ChatMessage,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    ModelCapabilities,
    Role,
    StreamEvent,
    StreamStart,
    TextPart,
    Usage,
)
from gengate.errors import ConfigError

log = logging.getLogger("gengate.composites")

RESPONSES = "{responses}"

# The aggregate-and-synthesize prompt of the MoA paper (Table 1), with a slot for the answers.
DEFAULT_AGGREGATOR_PROMPT = (
    "You have been provided with a set of responses from various models to the latest user query. "
    "Your task is to synthesize these responses into a single, high-quality response. It is crucial "
    "to critically evaluate the information provided in these responses, recognizing that some of it "
    "may be biased or incorrect. Your response should not simply replicate the given answers but should "
    "offer a refined, accurate, and comprehensive reply to the instruction. Ensure your response is "
    "well-structured, coherent, and adheres to the highest standards of accuracy and reliability.\n\n"
    "Responses from models:\n" + RESPONSES
)


class MixtureOptions(BaseModel):
    """Config keys of a `mixture_of_agents` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    proposers: list[str] = Field(min_length=1, description="Served model names that propose answers.")
    aggregator: str = Field(min_length=1, description="Served model name that writes the final answer.")
    rounds: int = Field(default=1, ge=1, le=8, description="Proposal rounds before aggregation.")
    proposer_max_tokens: int | None = Field(
        default=None, gt=0, description="max_tokens of each proposal; default: the request's."
    )
    aggregator_prompt: str = Field(
        default=DEFAULT_AGGREGATOR_PROMPT,
        description="System prompt ahead of the input; {responses} is replaced by the numbered answers.",
    )

    def members(self) -> list[str]:
        """The served models this one calls (checked against the config's names at load)."""
        return [*self.proposers, self.aggregator]

    @field_validator("aggregator_prompt")
    @classmethod
    def _has_slot(cls, value: str) -> str:
        if RESPONSES not in value:
            raise ValueError(f"must contain {RESPONSES} where the proposals go")
        return value


def inject_responses(
    request: GenerationRequest, template: str, responses: Sequence[str]
) -> tuple[ChatMessage, ...]:
    """The request's input as chat messages with the proposals in the (first) system message."""
    listed = "\n".join(f"{i}. {text}" for i, text in enumerate(responses, start=1))
    note = template.replace(RESPONSES, listed)
    if request.messages is None:
        messages: tuple[ChatMessage, ...] = (ChatMessage(Role.USER, (TextPart(request.prompt or ""),)),)
    else:
        messages = request.messages
    if messages and messages[0].role is Role.SYSTEM:
        first = messages[0]
        merged = dataclasses.replace(first, content=(*first.content, TextPart("\n\n" + note)))
        return (merged, *messages[1:])
    return (ChatMessage(Role.SYSTEM, (TextPart(note),)), *messages)


class MixtureOfAgentsBackend(CompositeBackend):
    """Proposers concurrently, then the aggregator on their answers."""

    kind: ClassVar[str] = "mixture_of_agents"
    Options: ClassVar[type[BaseModel]] = MixtureOptions

    def __init__(self, name: str, options: MixtureOptions) -> None:
        super().__init__(name)
        self.options = options

    def member_names(self) -> list[str]:
        return self.options.members()

    def derive_capabilities(self) -> ModelCapabilities:
        aggregator = self.member(self.options.aggregator).capabilities
        modalities = frozenset.intersection(
            *(self.member(m).capabilities.input_modalities for m in self.member_names())
        )
        return dataclasses.replace(aggregator, chat=True, input_modalities=modalities)

    async def start(self) -> None:
        """Refreshes capabilities; every member must take chat messages (the answers travel in one)."""
        await super().start()
        plain = [m for m in dict.fromkeys(self.member_names()) if not self.member(m).capabilities.chat]
        if plain:
            raise ConfigError(
                f"model {self.name!r} (mixture_of_agents): member(s) {plain} take only raw prompts; "
                "proposers and the aggregator must take chat messages"
            )

    def _proposer_request(
        self, proposer: Backend, index: int, round_: int, request: GenerationRequest, previous: Sequence[str]
    ) -> GenerationRequest:
        max_tokens = self.options.proposer_max_tokens or request.stopping.max_tokens
        context = proposer.capabilities.context_length
        if max_tokens is not None and context:
            max_tokens = min(max_tokens, context)
        seed = request.sampling.seed
        changes: dict[str, object] = {}
        if round_ > 0:
            changes = {
                "prompt": None,
                "messages": inject_responses(request, self.options.aggregator_prompt, previous),
            }
        return member_request(
            proposer,
            request,
            f"r{round_}p{index}",
            n=1,
            structured_output=None,
            logprobs=None,
            backend_options={},
            # The same model twice with one seed would propose the same answer twice.
            sampling=dataclasses.replace(request.sampling, seed=None if seed is None else seed + index),
            stopping=dataclasses.replace(request.stopping, max_tokens=max_tokens),
            **changes,
        )

    async def _propose(self, request: GenerationRequest) -> tuple[list[str], Usage]:
        """Runs every round; returns the last round's answers and the usage of all proposals."""
        usage = Usage()
        answers: list[str] = []
        for round_ in range(self.options.rounds):
            answers, round_usage = await self._round(request, round_, answers)
            usage = usage + round_usage
        annotate("gengate.moa.proposals", len(answers))
        return answers, usage

    async def _round(
        self, request: GenerationRequest, round_: int, previous: Sequence[str]
    ) -> tuple[list[str], Usage]:
        """One round: every proposer concurrently; failures are left out unless all fail."""
        proposers = [self.member(m) for m in self.options.proposers]

        async def propose(index: int, proposer: Backend) -> GenerationResult:
            return await proposer.generate(self._proposer_request(proposer, index, round_, request, previous))

        tasks = [asyncio.create_task(propose(i, p)) for i, p in enumerate(proposers)]
        try:
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            # Cancelled (caller gone, deadline): abort the proposals still running.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        answers: list[str] = []
        usage = Usage()
        failures: list[Exception] = []
        for proposer, outcome in zip(proposers, outcomes, strict=True):
            if isinstance(outcome, GenerationResult):
                answers.append(outcome.generations[0].text if outcome.generations else "")
                usage = usage + outcome.usage
            elif isinstance(outcome, Exception):
                failures.append(outcome)
                log.warning(
                    "mixture %s: proposer %s failed in round %d: %s",
                    self.name,
                    proposer.name,
                    round_ + 1,
                    type(outcome).__name__,
                )
            else:
                raise outcome
        if not answers:
            raise failures[0]
        if failures:
            annotate("gengate.moa.failed_proposals", len(failures))
        return answers, usage

    def _aggregator_request(self, request: GenerationRequest, answers: Sequence[str]) -> GenerationRequest:
        aggregator = self.member(self.options.aggregator)
        messages = inject_responses(request, self.options.aggregator_prompt, answers)
        return member_request(aggregator, request, "agg", prompt=None, messages=messages)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        began = time.monotonic()
        answers, usage = await self._propose(request)
        proposing_s = time.monotonic() - began
        result = await self.member(self.options.aggregator).generate(
            self._aggregator_request(request, answers)
        )
        return dataclasses.replace(
            result,
            request_id=request.request_id,
            model=self.name,
            usage=result.usage + usage,
            timings=result.timings.later(proposing_s),  # the proposals came first
        )

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """The aggregator's stream once the proposals are in. The proposals' usage is added to
        the start's input tokens and to the first generation end, so the ends sum to the total."""
        began = time.monotonic()
        answers, usage = await self._propose(request)
        proposing_s = time.monotonic() - began
        stream = self.member(self.options.aggregator).generate_stream(
            self._aggregator_request(request, answers)
        )
        pending: Usage | None = usage
        try:
            async for event in stream:
                if isinstance(event, StreamStart):
                    event = dataclasses.replace(
                        event,
                        request_id=request.request_id,
                        model=self.name,
                        input_tokens=event.input_tokens + usage.input_tokens,
                    )
                elif isinstance(event, GenerationEnd):
                    extra, pending = pending or Usage(), None
                    event = dataclasses.replace(
                        event, usage=event.usage + extra, timings=event.timings.later(proposing_s)
                    )
                yield event
        finally:
            await aclose_stream(stream)
