"""RequestRun: one request's n generations on a batched engine's scheduler, turned into stream
events (transformers, MLX).

It owns the validation loop for VALIDATED constraints: such a generation's text is held back
until it validates, and one that does not is re-generated at once with the next attempt's seed
(engines/resampling.py; the other engines re-run failed generations in rounds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gengate import errors
from gengate.constraints import CompiledConstraint, validate_output
from gengate.constraints.retries import Attempts
from gengate.domain import (
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    StreamEvent,
    Timings,
    TokenLogprob,
    Usage,
)
from gengate.engines.batching.scheduler import (
    Admitted,
    BatchScheduler,
    Failed,
    Sequence,
    SequenceEvent,
    Stepped,
    asyncio_sink,
)
from gengate.engines.decoding import SequenceDecoder
from gengate.engines.options import NO_OPTIONS, EngineOptions
from gengate.engines.resampling import retry_seed


@dataclass
class Loaded:
    """What a batched engine's start() loads; the scheduler thread owns the model. `tokenizer` is
    the model's Hugging Face tokenizer."""

    tokenizer: Any
    scheduler: BatchScheduler
    compiler: Any
    eos_token_ids: frozenset[int]
    vocab_size: int
    context_length: int


@dataclass(eq=False)
class _Generation:
    """One generation index of a request, across its validation attempts."""

    index: int
    attempt: int = 0
    seq: Sequence | None = None
    decoder: SequenceDecoder | None = None
    tokens: int = 0
    pending_tokens: int = 0  # tokens not yet reported in a delta (their text was empty)
    admitted_at: float | None = None
    first_token_at: float | None = None
    held_text: list[str] = field(default_factory=list)
    held_logprobs: list[TokenLogprob] = field(default_factory=list)


class RequestRun:
    """Submits a request's generations and yields their deltas and ends as they come."""

    def __init__(
        self,
        loaded: Loaded,
        request: GenerationRequest,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        compiled: CompiledConstraint | None,
        arrived: float,
        options: EngineOptions = NO_OPTIONS,
        answer: Callable[[str], str] | None = None,
    ) -> None:
        self.loaded = loaded
        self.request = request
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.stopping = stopping
        self.compiled = compiled
        self.arrived = arrived
        self.options = options
        self.answer = answer  # the part of a text its constraint holds for (after a think block)
        self.validating = compiled is not None and compiled.enforcement is Enforcement.VALIDATED
        self._attempts = Attempts()
        self._queue: asyncio.Queue[tuple[Sequence, SequenceEvent]] = asyncio.Queue()
        self._sink = asyncio_sink(asyncio.get_running_loop(), self._queue)
        self._owners: dict[Sequence, _Generation] = {}
        self._generations = [_Generation(i) for i in range(request.n)]
        tokenizer = loaded.tokenizer

        def detokenize(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

        self._detokenize = detokenize

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Deltas and one end per generation; raises on a failed model step or validation."""
        for gen in self._generations:
            self._launch(gen)
        running = len(self._generations)
        while running:
            seq, event = await self._queue.get()
            owner = self._owners.get(seq)
            if owner is None or owner.seq is not seq:
                continue  # an attempt that was replaced or already ended
            for out in self._handle(owner, event):
                yield out
                running -= isinstance(out, GenerationEnd)

    def cancel(self) -> None:
        """Drops every generation still in flight (the scheduler frees them at its next step)."""
        for gen in self._generations:
            if gen.seq is not None:
                gen.seq.cancel()

    def _launch(self, gen: _Generation) -> None:
        seed = retry_seed(self.sampling.seed or 0, gen.attempt)
        gen.decoder = SequenceDecoder(
            index=gen.index,
            detokenize=self._detokenize,
            eos_token_ids=self.loaded.eos_token_ids,
            sampling=replace(self.sampling, seed=seed),
            stopping=self.stopping,
            logprobs=self.request.logprobs,
            matcher=self.compiled.new_matcher() if self.compiled is not None else None,
            prompt_token_ids=self.prompt_ids,
            vocab_size=self.loaded.vocab_size,
            options=self.options,
        )
        gen.seq = Sequence(
            prompt_ids=self.prompt_ids,
            decoder=gen.decoder,
            sink=self._sink,
            max_total_tokens=self.loaded.context_length,
            deadline=self.request.deadline,
        )
        gen.tokens = gen.pending_tokens = 0
        gen.held_text.clear()
        gen.held_logprobs.clear()
        self._owners[gen.seq] = gen
        self.loaded.scheduler.submit(gen.seq)

    def _handle(self, gen: _Generation, event: SequenceEvent) -> list[StreamEvent]:
        if isinstance(event, Admitted):
            gen.admitted_at = gen.admitted_at or event.at
            return []
        if isinstance(event, Failed):
            if isinstance(event.error, errors.GengateError):
                raise event.error
            raise errors.Internal(f"the model failed: {type(event.error).__name__}") from event.error
        stop: str | None = None
        logprob: TokenLogprob | None = None
        if isinstance(event, Stepped):
            result: Any = event.result
            if result.token_id is not None:
                gen.tokens += 1
                gen.pending_tokens += 1
                gen.first_token_at = gen.first_token_at or event.at
            text, logprob, reason, stop = (
                result.text_delta,
                result.logprob,
                result.finished,
                result.matched_stop,
            )
        else:
            assert gen.decoder is not None
            text, reason = gen.decoder.finalize(), event.reason
        out: list[StreamEvent] = []
        if self.validating:
            gen.held_text.append(text)
            if logprob is not None:
                gen.held_logprobs.append(logprob)
        elif text or logprob is not None:
            out.append(
                GenerationDelta(gen.index, text, gen.pending_tokens, None if logprob is None else (logprob,))
            )
            gen.pending_tokens = 0
        if reason is None:
            return out
        assert gen.seq is not None
        self._owners.pop(gen.seq, None)
        gen.seq = None
        if self.validating and not self._release_validated(gen, reason, out):
            return out  # re-generating
        out.append(self._end(gen, reason, stop))
        return out

    def _release_validated(self, gen: _Generation, reason: FinishReason, out: list[StreamEvent]) -> bool:
        """Validates a held generation: releases its text (True) or starts it again (False)."""
        text = "".join(gen.held_text)
        structured = self.request.structured_output
        assert structured is not None
        answer = self.answer(text) if self.answer else text
        problem = validate_output(structured, answer) if reason is FinishReason.STOP else None
        if problem is not None:
            if not self._attempts.failed(gen.index, problem):
                raise self._attempts.refusal(gen.index)
            gen.attempt += 1
            self._launch(gen)
            return False
        self._attempts.passed(gen.index)
        if text or gen.held_logprobs:
            logprobs = tuple(gen.held_logprobs) if gen.held_logprobs else None
            out.append(GenerationDelta(gen.index, text, gen.tokens, logprobs))
        return True

    def _end(self, gen: _Generation, reason: FinishReason, stop: str | None) -> GenerationEnd:
        def since(at: float | None) -> float | None:
            return None if at is None else at - self.arrived

        return GenerationEnd(
            index=gen.index,
            finish_reason=reason,
            usage=Usage(len(self.prompt_ids), gen.tokens),
            matched_stop=stop,
            timings=Timings(
                queue_s=since(gen.admitted_at),
                time_to_first_token_s=since(gen.first_token_at),
                total_s=time.monotonic() - self.arrived,
            ),
        )
