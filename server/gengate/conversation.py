"""Magpie conversations, written turn by turn through one route.

A user turn is the model continuing the conversation from the pre-query text (gengate.magpie);
an assistant turn is an ordinary chat call. The first user turn of all n conversations is one
call with n generations (they share the same start); after that each conversation goes on with
its own calls, all n at once. Usage is the sum of every call; each turn keeps its token count.
"""

from __future__ import annotations

import asyncio

from gengate import errors
from gengate.domain import (
    ChatMessage,
    ConversationTurn,
    Enforcement,
    FinishReason,
    Generation,
    GenerationRequest,
    GenerationResult,
    MagpieInput,
    ModelCapabilities,
    Role,
    StoppingCriteria,
    TextPart,
    Timings,
    Usage,
    evolve,
)
from gengate.engines.resampling import retry_seed
from gengate.magpie import PRESETS, ChatFormat, end_of_turn_stop
from gengate.router import Route


def turn_roles(magpie: MagpieInput) -> list[Role]:
    """The roles of the turns to write, in order."""
    if magpie.only_instruction:
        return [Role.USER]
    roles = [Role.USER, Role.ASSISTANT] * magpie.n_turns
    return roles[:-1] if magpie.end_with_user else roles


class _Conversation:
    """One of the request's n conversations, as it grows."""

    def __init__(self, magpie: MagpieInput) -> None:
        self.messages: list[ChatMessage] = list(magpie.conversation)
        self.turns: list[ConversationTurn] = [ConversationTurn(m.role, m.text) for m in magpie.conversation]
        self.finish = FinishReason.STOP
        self.matched_stop: str | None = None

    def add(self, role: Role, generation: Generation, end_of_turn: str | None) -> None:
        text = generation.text.strip()
        self.messages.append(ChatMessage(role, (TextPart(text),)))
        self.turns.append(ConversationTurn(role, text, generation.output_tokens))
        self.finish, self.matched_stop = generation.finish_reason, generation.matched_stop
        if end_of_turn is not None and self.matched_stop == end_of_turn:
            self.finish, self.matched_stop = FinishReason.STOP, None  # the turn ended as the format ends it

    def written_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)


class MagpieWriter:
    """Writes a checked Magpie request's conversations through `route`."""

    def __init__(
        self, route: Route, request: GenerationRequest, *, bounded: bool = True, background: bool = False
    ) -> None:
        assert request.magpie is not None
        self.route = route
        self.request = request
        self.magpie = request.magpie
        self.caps: ModelCapabilities = route.backend.capabilities
        self.format: ChatFormat | None = PRESETS[self.magpie.preset] if self.magpie.preset else None
        self.bounded = bounded
        self.background = background
        self.usage = Usage()
        self._end_of_turn = end_of_turn_stop(self.format) if self.format is not None else None

    async def write(self) -> GenerationResult:
        conversations = [_Conversation(self.magpie) for _ in range(self.request.n)]
        for step, role in enumerate(turn_roles(self.magpie)):
            if step == 0:  # every conversation starts the same: one call for all n
                result = await self._call(self._turn_request(role, conversations[0], self.request.n, 0))
                for conversation, generation in zip(conversations, result.generations, strict=True):
                    conversation.add(role, generation, self._end_of_turn)
                continue
            results = await asyncio.gather(
                *(self._call(self._turn_request(role, c, 1, step * len(conversations) + i))
                  for i, c in enumerate(conversations))
            )  # fmt: skip
            for conversation, result in zip(conversations, results, strict=True):
                conversation.add(role, result.generations[0], self._end_of_turn)
        generations = tuple(
            Generation(
                index=i,
                text=c.turns[-1].text,
                finish_reason=c.finish,
                output_tokens=c.written_tokens(),
                matched_stop=c.matched_stop,
                conversation=tuple(c.turns),
            )
            for i, c in enumerate(conversations)
        )
        return GenerationResult(
            request_id=self.request.request_id,
            model=self.route.name,
            generations=generations,
            usage=self.usage,
            enforcement=Enforcement.NONE,
            effective_sampling=self.request.sampling,
            effective_stopping=self.request.stopping,
            timings=Timings(),
        )

    async def _call(self, request: GenerationRequest) -> GenerationResult:
        result = await self.route.generate(request, bounded=self.bounded, background=self.background)
        self.usage = self.usage + result.usage
        return result

    def _history(self, conversation: _Conversation) -> list[ChatMessage]:
        system = self.magpie.system_prompt
        head = [ChatMessage(Role.SYSTEM, (TextPart(system),))] if system else []
        return head + conversation.messages

    def _turn_request(
        self, role: Role, conversation: _Conversation, n: int, call_number: int
    ) -> GenerationRequest:
        """The plain request that writes the next `role` turn of `conversation`."""
        history = self._history(conversation)
        sampling = self.request.sampling
        if sampling.seed is not None and call_number:
            sampling = evolve(sampling, seed=retry_seed(sampling.seed, call_number))  # far apart
        stopping = self.request.stopping
        prompt: str | None = None
        messages: tuple[ChatMessage, ...] | None = None
        continuation: str | None = None
        if role is Role.USER:
            stopping = self._stopping_at_end_of_turn(stopping)
            pre_query = self._pre_query(after_conversation=bool(history))
            if not history:
                prompt = pre_query
            elif self.caps.chat_continuation:
                messages, continuation = tuple(history), pre_query
            else:
                assert self.format is not None  # checks.prepare refused a custom template here
                prompt = self.format.render(history) + pre_query
        elif self.caps.chat:
            messages = tuple(history)
        elif self.format is not None:
            stopping = self._stopping_at_end_of_turn(stopping)
            prompt = self.format.render(history) + self.format.assistant_prompt()
        else:
            raise errors.Unimplemented(
                "this model has no chat template to answer the written turn with; use a preset",
                reason="MAGPIE_UNSUPPORTED",
            )
        return evolve(
            self.request,
            magpie=None,
            prompt=prompt,
            messages=messages,
            continuation=continuation,
            n=n,
            sampling=sampling,
            stopping=stopping,
        )

    def _pre_query(self, *, after_conversation: bool) -> str:
        if self.format is not None:
            return self.format.pre_query(after_conversation=after_conversation)
        assert self.magpie.template is not None
        return self.magpie.template

    def _stopping_at_end_of_turn(self, stopping: StoppingCriteria) -> StoppingCriteria:
        """The stopping criteria with the format's end-of-turn text as a stop string (a model
        that prints it instead of ending ends there)."""
        if self.format is None:
            return stopping
        stop = end_of_turn_stop(self.format)
        return stopping if stop in stopping.stop else evolve(stopping, stop=(*stopping.stop, stop))
