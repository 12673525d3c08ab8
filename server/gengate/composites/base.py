"""What every composite shares: member binding, per-member request preparation, capability algebra."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from opentelemetry import trace
from pydantic import BaseModel

from gengate.backend import Backend, MemberLookup
from gengate.checks import prepare
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    GenerationRequest,
    GenerationResult,
    ModelCapabilities,
    StreamEvent,
)
from gengate.errors import ConfigError, GengateError, Internal, StatusCode

# The router's lookup: another configured model's backend by its served name.

# Weakest first: a composite promises only what its weakest member guarantees.
_STRENGTH = {Enforcement.NONE: 0, Enforcement.VALIDATED: 1, Enforcement.NATIVE: 2, Enforcement.ENGINE: 3}


def weakest(enforcements: Sequence[Enforcement]) -> Enforcement:
    return min(enforcements, key=_STRENGTH.__getitem__)


def common_capabilities(members: Sequence[ModelCapabilities]) -> ModelCapabilities:
    """What every member can do, so a request accepted here is acceptable to each of them.

    Constraint kinds all members enforce (at the weakest member's enforcement), common grammar
    syntaxes, input modalities and backend options, the smallest n and top-logprobs, the
    smallest known context length (0 = unknown), chat, logprobs and seed only if all have them.
    """
    kinds = set.intersection(*(set(c.constraints) for c in members))
    contexts = [c.context_length for c in members if c.context_length > 0]
    logprobs = all(c.logprobs for c in members)
    return ModelCapabilities(
        constraints={k: weakest([c.constraints[k] for c in members]) for k in ConstraintKind if k in kinds},
        grammar_syntaxes=frozenset.intersection(*(c.grammar_syntaxes for c in members)),
        max_n=min(c.max_n for c in members),
        logprobs=logprobs,
        max_top_logprobs=min(c.max_top_logprobs for c in members) if logprobs else 0,
        input_modalities=frozenset.intersection(*(c.input_modalities for c in members)),
        context_length=min(contexts) if contexts else 0,
        seed=all(c.seed for c in members),
        chat=all(c.chat for c in members),
        backend_options=frozenset.intersection(*(c.backend_options for c in members)),
    )


def error_code(exc: BaseException) -> str:
    """The status code name an exception ends a call with (anything unexpected is INTERNAL)."""
    return exc.code.value if isinstance(exc, GengateError) else StatusCode.INTERNAL.value


def member_request(
    member: Backend, request: GenerationRequest, tag: str, **changes: Any
) -> GenerationRequest:
    """`request` re-addressed to `member`, checked against its capabilities with its defaults filled.

    `tag` suffixes the request id so each member call can be told apart in logs and traces.
    """
    request_id = f"{request.request_id}.{tag}" if request.request_id else ""
    addressed = dataclasses.replace(request, model=member.name, request_id=request_id, **changes)
    return prepare(addressed, member.capabilities)


def annotate(key: str, value: str | int | list[str]) -> None:
    """Sets an attribute on the current span (the service's span around this composite's call)."""
    trace.get_current_span().set_attribute(key, value)


class CompositeBackend(abc.ABC):
    """A backend served by other configured models: members are resolved in `bind`, capabilities
    derived in `bind` and again in `start` (engines declare their final capabilities when loaded)."""

    kind: ClassVar[str]
    Options: ClassVar[type[BaseModel]]

    def __init__(self, name: str) -> None:
        self.name = name
        self.capabilities = ModelCapabilities()
        self._members: dict[str, Backend] = {}

    @abc.abstractmethod
    def member_names(self) -> list[str]:
        """The served names this composite calls, in its options' order (duplicates allowed)."""

    @abc.abstractmethod
    def derive_capabilities(self) -> ModelCapabilities:
        """This composite's capabilities from its bound members' current ones."""

    def bind(self, lookup: MemberLookup) -> None:
        """Resolves every member through the router; ConfigError names this model and the member."""
        for name in dict.fromkeys(self.member_names()):
            if name == self.name:
                raise ConfigError(f"model {self.name!r} ({self.kind}) names itself as a member")
            self._members[name] = lookup(name)
        self.capabilities = self.derive_capabilities()

    def member(self, name: str) -> Backend:
        try:
            return self._members[name]
        except KeyError:
            raise Internal(
                f"model {self.name!r} ({self.kind}) was called before its members were bound",
                reason="COMPOSITE_UNBOUND",
            ) from None

    async def start(self) -> None:
        """Members are started by the router before this; only the capabilities need refreshing."""
        self.capabilities = self.derive_capabilities()

    async def aclose(self) -> None:
        """Members are closed by the router, which owns them."""
        return None

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    @abc.abstractmethod
    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]: ...
