"""Who is calling: the configured callers, looked up by bearer token (by its SHA-256) or by the
subject of the client certificate (mutual TLS).

Tokens are read once at start-up and registered for redaction, so no log line, span or error
can carry one; a token configured only by its digest is registered the first time a caller
presents it. A presented token is hashed and looked up by digest: nothing about a configured
token can be learned from how long a wrong one takes (the values already identified are kept in a
dict whose string hashes are randomized per process, so a wrong value misses it at the same speed).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gengate.callers.config import LEGACY_NAME, CallerConfig, normalize_subject
from gengate.errors import ConfigError, Unauthenticated
from gengate.redaction import MIN_SECRET_LENGTH, register_secret

Metadata = Iterable[tuple[str, str | bytes]]
AuthContext = Mapping[str, Iterable[bytes]]
_MAX_SUBJECTS_CACHED = 1024
# Authorization values already identified (each a configured caller's token): a call presenting
# one again skips parsing and hashing. Only known tokens enter, so its size is bounded by theirs
# and by the spellings callers use ("Bearer x", "bearer x"); cleared when full.
_MAX_KNOWN_VALUES = 1024


@dataclass(frozen=True, slots=True)
class Caller:
    """A caller as the server serves it: its name, models, quotas and priority."""

    name: str
    priority: int = 0
    models: frozenset[str] | None = None  # None: every model
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    # Whether any quota applies: read on every call, so worked out once (not a property).
    limited: bool = field(init=False, compare=False, default=False)

    def __post_init__(self) -> None:
        limited = (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or self.max_concurrency is not None
        )
        object.__setattr__(self, "limited", limited)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    @classmethod
    def of(cls, config: CallerConfig) -> Caller:
        return cls(
            name=config.name,
            priority=config.priority,
            models=None if config.models is None else frozenset(config.models),
            requests_per_minute=config.requests_per_minute,
            tokens_per_minute=config.tokens_per_minute,
            max_concurrency=config.max_concurrency,
        )


def digest(token: str | bytes) -> str:
    data = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(data).hexdigest()


def _tokens(variable: str, what: str, env: Mapping[str, str], *, min_length: int = 1) -> list[str]:
    raw = env.get(variable)
    if raw is None:
        raise ConfigError(f"{what} names {variable}, which is not set")
    tokens = [t.strip() for t in raw.split(",") if t.strip()]
    if not tokens:
        raise ConfigError(f"{what} names {variable}, which holds no token")
    if any(len(t) < min_length for t in tokens):
        raise ConfigError(
            f"{what}: a token in {variable} is shorter than {min_length} characters (too short to keep "
            "out of logs reliably)"
        )
    return tokens


class CallerDirectory:
    """Every configured caller, by token digest and by certificate subject."""

    def __init__(self) -> None:
        self._by_digest: dict[str, Caller] = {}
        self._by_subject: dict[str, Caller] = {}
        self._by_name: dict[str, Caller] = {}
        self._subjects_seen: dict[bytes, str | None] = {}
        self._known_values: dict[str | bytes, Caller] = {}
        self._registered: set[str] = set()  # digests whose plaintext is registered for redaction

    @classmethod
    def from_config(
        cls,
        callers: Sequence[CallerConfig],
        *,
        legacy_tokens_env: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CallerDirectory | None:
        """The directory of the configured callers (tokens read from `env`), or None when no
        caller is configured (authentication off). server.auth_tokens_env's tokens are one
        caller, "default", with every model and no quota."""
        env = os.environ if env is None else env
        if not callers and not legacy_tokens_env:
            return None
        directory = cls()
        if legacy_tokens_env:
            tokens = _tokens(legacy_tokens_env, "server.auth_tokens_env", env)
            directory._add(Caller(LEGACY_NAME), [digest(t) for t in tokens], None)
            directory._register(tokens)
        for config in callers:
            digests = list(config.token_sha256 or ())
            if config.token_env is not None:
                what = f"callers ({config.name}): token_env"
                tokens = _tokens(config.token_env, what, env, min_length=MIN_SECRET_LENGTH)
                digests += [digest(t) for t in tokens]
                directory._register(tokens)
            directory._add(Caller.of(config), digests, config.subject)
        return directory

    def _register(self, tokens: Iterable[str]) -> None:
        for token in tokens:
            register_secret(token)
            self._registered.add(digest(token))

    def _add(self, caller: Caller, digests: Iterable[str], subject: str | None) -> None:
        for token_digest in digests:
            other = self._by_digest.setdefault(token_digest, caller)
            if other.name != caller.name:
                raise ConfigError(f"callers {other.name!r} and {caller.name!r} have the same token")
        if subject is not None:
            self._by_subject[subject] = caller
        self._by_name[caller.name] = caller

    @property
    def callers(self) -> list[Caller]:
        return list(self._by_name.values())

    @property
    def by_certificate(self) -> bool:
        """Whether some caller is known by its client certificate's subject."""
        return bool(self._by_subject)

    def by_name(self, name: str) -> Caller | None:
        return self._by_name.get(name)

    def identify(self, metadata: Metadata | None, auth_context: AuthContext | None = None) -> Caller:
        """The caller a call's bearer token (else its client certificate) names; Unauthenticated
        (MISSING_CREDENTIALS / INVALID_CREDENTIALS) otherwise. A wrong token is refused even
        when the certificate would name a caller."""
        for key, value in metadata or ():
            # Keys arrive lowercase: HTTP/2 header names are, and grpc refuses any other.
            if key == "authorization":
                known = self._known_values.get(value)
                if known is not None:
                    return known
                found = self._by_token(value)
                if len(self._known_values) >= _MAX_KNOWN_VALUES:
                    self._known_values.clear()
                self._known_values[value] = found
                return found
        if self._by_subject and auth_context:
            caller = self._by_certificate(auth_context)
            if caller is not None:
                return caller
            raise Unauthenticated(
                "no bearer token in the authorization metadata, and the client certificate's subject "
                "is no configured caller's",
                reason="MISSING_CREDENTIALS",
            )
        raise Unauthenticated(
            "missing bearer token in the authorization metadata", reason="MISSING_CREDENTIALS"
        )

    def _by_token(self, value: str | bytes) -> Caller:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, token = text.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("invalid bearer token", reason="INVALID_CREDENTIALS")
        token_digest = digest(token)
        caller = self._by_digest.get(token_digest)
        if caller is None:
            raise Unauthenticated("invalid bearer token", reason="INVALID_CREDENTIALS")
        if token_digest not in self._registered:  # configured by digest: the plaintext is seen now
            self._registered.add(token_digest)
            register_secret(token)
        return caller

    def _by_certificate(self, auth_context: AuthContext) -> Caller | None:
        for raw in auth_context.get("x509_subject", ()):
            subject = self._subjects_seen.get(raw, "")
            if subject == "":
                try:
                    subject = normalize_subject(raw.decode(errors="replace"))
                except ValueError:
                    subject = None
                if len(self._subjects_seen) >= _MAX_SUBJECTS_CACHED:
                    self._subjects_seen.clear()
                self._subjects_seen[raw] = subject
            if subject is not None and subject in self._by_subject:
                return self._by_subject[subject]
        return None
