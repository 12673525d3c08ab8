"""What the provider batch APIs (providers/openai_batch.py, Anthropic's Message Batches in
providers/anthropic.py) share: one batch request per item (or per choice where the provider has
no `n`), custom ids that name the item, and turning the answers back into each item's result
through the same parsing and validation as the online call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gengate import errors
from gengate.backend import OFFLINE_BATCH_FAILED, BatchOutcome, BatchState, unanswered
from gengate.domain import GenerationRequest, Usage
from gengate.providers.base import Completion, ProviderBackend, ProviderCall

# Item index, then the choice where one request is sent per choice: "12" or "12-3"
# (Anthropic allows [A-Za-z0-9_-]{1,64}; OpenAI any string).
_CUSTOM_ID = re.compile(r"(\d{1,18})(?:-(\d{1,4}))?")


def custom_id(index: int, copy: int | None) -> str:
    return str(index) if copy is None else f"{index}-{copy}"


def parse_custom_id(value: object) -> tuple[int, int | None] | None:
    """(item index, choice copy or None) of a custom id gengate wrote; None for any other."""
    match = _CUSTOM_ID.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    return int(match[1]), None if match[2] is None else int(match[2])


def copies(backend: ProviderBackend, call: ProviderCall) -> int:
    """Requests one item takes: one, or one per choice where the provider has no native `n`."""
    return 1 if backend.native_n or call.n == 1 else call.n


def batch_requests(
    backend: ProviderBackend, items: Sequence[tuple[int, GenerationRequest]]
) -> Iterator[tuple[str, ProviderCall]]:
    """(custom id, call) of every provider request the items need, built as the online call
    would be (`_prepare`: messages, structured plan and instructions)."""
    for index, request in items:
        call = backend._prepare(request)
        count = copies(backend, call)
        if count == 1:
            yield custom_id(index, None), call
        else:
            single = replace(call, n=1)
            for k in range(count):
                yield custom_id(index, k), single


def expired(label: str) -> errors.GengateError:
    return unanswered(BatchState.EXPIRED, label)


def cancelled(label: str) -> errors.GengateError:
    return unanswered(BatchState.CANCELLED, label)


def missing(label: str) -> errors.GengateError:
    return unanswered(BatchState.ENDED, label)


# An answer to one provider request: how to read it (given the call it answers), or its error.
Answer = Callable[[ProviderCall], Completion] | errors.GengateError


@dataclass
class BatchCollector:
    """Gathers a provider batch's answers by item (a fanned-out item gets one per choice) and
    turns each complete item into its outcome: `backend.offline_result`, or the first error."""

    backend: ProviderBackend
    items: Mapping[int, GenerationRequest]
    _calls: dict[int, ProviderCall] = field(default_factory=dict)
    _parts: dict[int, dict[int, Completion | errors.GengateError]] = field(default_factory=dict)
    _done: set[int] = field(default_factory=set)

    def _call(self, index: int) -> ProviderCall:
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = self.backend._prepare(self.items[index])
        return call

    def add(self, raw_id: object, answer: Answer) -> BatchOutcome | None:
        """Takes one answer; returns the item's outcome once the item has all of its answers."""
        parsed = parse_custom_id(raw_id)
        if parsed is None or parsed[0] not in self.items or parsed[0] in self._done:
            return None  # not one of ours, or an item already stored
        index, copy = parsed
        call = self._call(index)
        count = copies(self.backend, call)
        if (copy is None) != (count == 1) or (copy is not None and copy >= count):
            return None
        part: Completion | errors.GengateError
        if isinstance(answer, errors.GengateError):
            part = answer
        else:
            try:
                part = answer(call if count == 1 else replace(call, n=1))
            except Exception as exc:  # an answer the SDK types cannot read is that item's error
                part = self.backend.normalize_error(exc)
        parts = self._parts.setdefault(index, {})
        parts[copy or 0] = part
        if len(parts) < count:
            return None
        return self._finish(index, call)

    def _finish(self, index: int, call: ProviderCall) -> BatchOutcome:
        parts = self._parts.pop(index)
        self._done.add(index)
        ordered = [parts[k] for k in sorted(parts)]
        failure = next((p for p in ordered if isinstance(p, errors.GengateError)), None)
        if failure is not None:
            return index, failure
        completions = [p for p in ordered if isinstance(p, Completion)]
        usages = [c.usage for c in completions]
        usage: Usage | None = None
        if all(u is not None for u in usages):
            usage = sum((u for u in usages if u is not None), Usage())
        merged = Completion([g for c in completions for g in c.generations], usage)
        try:
            return index, self.backend.offline_result(call, merged)
        except errors.GengateError as exc:
            return index, exc

    def unfinished(self) -> Iterator[BatchOutcome]:
        """Fanned-out items some of whose answers never came: each ends missing."""
        for index in sorted(self._parts):
            self._parts.pop(index)
            self._done.add(index)
            yield index, missing(self.backend.label)


def check_size(backend: ProviderBackend, items: Sequence[tuple[int, GenerationRequest]], limit: int) -> None:
    if not items:
        raise errors.InvalidArgument("a provider batch needs at least one item")
    if len(items) > limit:
        raise errors.InvalidArgument(
            f"{backend.label} takes at most {limit} items in one batch, not {len(items)}",
            reason=OFFLINE_BATCH_FAILED,
        )
