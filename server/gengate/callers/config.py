"""The `callers:` section: who may call, with which credentials, models, quotas and priority.

    callers:
      - name: team-a
        token_env: TEAM_A_TOKEN        # or token_sha256: <hex>, or subject: "CN=team-a" (mTLS)
        models: [tiny, gpt]            # omitted: every model
        requests_per_minute: 600
        tokens_per_minute: 200000
        max_concurrency: 32
        priority: 10

Everything that can be checked without the environment is checked here, at start-up, and each
error names the caller; tokens read from variables are checked when the server starts
(callers/identity.py).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gengate.errors import ConfigError

# A caller's name goes into logs, spans and metric labels: short, and nothing to escape.
CALLER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The names gengate gives callers itself: no configured caller may take them.
ANONYMOUS_NAME = "anonymous"  # authentication off (gengate.caller.ANONYMOUS)
LEGACY_NAME = "default"  # the callers of server.auth_tokens_env
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
MAX_PRIORITY = 1000


class CallerConfig(BaseModel):
    """One caller: how it is recognised, and what it may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # Credentials: a bearer token (one or more, comma-separated, in this environment variable;
    # several allow rotation), or their SHA-256 (hex) so no plaintext token is stored, and/or the
    # subject of its client certificate under mutual TLS (RFC 4514: "CN=team-b,O=Acme").
    token_env: str | None = None
    # One digest or a list of them (the schema says so; validation makes a tuple of either).
    token_sha256: Annotated[
        tuple[str, ...] | None,
        WithJsonSchema(
            {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
        ),
    ] = None
    subject: str | None = None
    models: tuple[str, ...] | None = None
    requests_per_minute: StrictInt | None = Field(default=None, gt=0)
    tokens_per_minute: StrictInt | None = Field(default=None, gt=0)
    max_concurrency: StrictInt | None = Field(default=None, gt=0)
    priority: StrictInt = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not CALLER_NAME.fullmatch(value):
            raise ValueError("must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @field_validator("token_sha256", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("token_sha256")
    @classmethod
    def _digests(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("lists no digest")
        for digest in value:
            if not _SHA256.fullmatch(digest):
                raise ValueError("must be SHA-256 digests, 64 hex digits each (sha256sum of the token)")
        return tuple(d.lower() for d in value)

    @field_validator("token_env")
    @classmethod
    def _variable(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must name an environment variable")
        return value

    @field_validator("subject")
    @classmethod
    def _subject(cls, value: str | None) -> str | None:
        return None if value is None else normalize_subject(value)

    @field_validator("models")
    @classmethod
    def _models(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("lists no model (leave it out to allow every model)")
        repeated = sorted({m for m in value if value.count(m) > 1})
        if repeated:
            raise ValueError(f"lists {repeated} more than once")
        return value

    @model_validator(mode="after")
    def _credentials(self) -> CallerConfig:
        if self.token_env is not None and self.token_sha256 is not None:
            raise ValueError("give token_env or token_sha256, not both")
        if self.token_env is None and self.token_sha256 is None and self.subject is None:
            raise ValueError("has no token source: set token_env, token_sha256 or subject")
        return self

    @property
    def limited(self) -> bool:
        """Whether any quota applies to this caller."""
        return any(
            v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrency)
        )


def normalize_subject(text: str) -> str:
    """A distinguished name in one spelling (RFC 4514, as grpc reports a peer's `x509_subject`):
    attribute types upper-cased, spaces around separators dropped, escapes kept as written.
    "cn=team-b, O=Acme\\, Inc" and "CN=team-b,O=Acme\\, Inc" are the same subject."""
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text):
            current.append(text[i : i + 2])
            i += 2
            continue
        if char == ",":
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    parts.append("".join(current))
    out = []
    for part in parts:
        kind, sep, value = part.partition("=")
        if not sep or not kind.strip() or not value.strip():
            raise ValueError(f"{text!r} is not a distinguished name such as 'CN=team-b,O=Acme'")
        out.append(f"{kind.strip().upper()}={value.strip()}")
    return ",".join(out)


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<entry>'}: "
        + ("unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, "))
        for err in exc.errors()
    )


def parse_callers(
    raw: Any,
    *,
    models: Collection[str],
    source: str,
    legacy_tokens: bool = False,
    mutual_tls: bool = False,
) -> tuple[CallerConfig, ...]:
    """Validates the `callers:` list. Each error names the caller (`callers[1] (team-b): ...`).

    `models`: the configured model names (a caller may list only those); `legacy_tokens`:
    server.auth_tokens_env is set too (its callers are named "default"); `mutual_tls`: the server
    asks clients for certificates (server.tls_client_ca_file), without which no subject matches.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: 'callers' must be a non-empty list (leave it out for no callers)")
    callers: list[CallerConfig] = []
    for index, entry in enumerate(raw):
        where = f"{source}: callers[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: must be a mapping with at least 'name' and a token source")
        name = entry.get("name")
        if isinstance(name, str) and name:
            where = f"{where} ({name[:64]})"
        try:
            caller = CallerConfig.model_validate(entry)
        except ValidationError as exc:
            raise ConfigError(f"{where}: {_describe(exc)}") from exc
        _check_caller(caller, where, models, legacy_tokens=legacy_tokens, mutual_tls=mutual_tls)
        callers.append(caller)
    _check_unique(callers, source)
    return tuple(callers)


def _check_caller(
    caller: CallerConfig, where: str, models: Collection[str], *, legacy_tokens: bool, mutual_tls: bool
) -> None:
    reserved = {ANONYMOUS_NAME} | ({LEGACY_NAME} if legacy_tokens else set())
    if caller.name in reserved:
        why = "server.auth_tokens_env's callers" if caller.name == LEGACY_NAME else "calls without a caller"
        raise ConfigError(f"{where}: the name {caller.name!r} is taken by {why}")
    unknown = [m for m in caller.models or () if m not in models]
    if unknown:
        known = ", ".join(sorted(models))
        raise ConfigError(f"{where}: models {unknown} are not configured models (configured: {known})")
    if caller.subject is not None and not mutual_tls:
        raise ConfigError(
            f"{where}: subject needs mutual TLS (server.tls_client_ca_file), or no client certificate "
            "is ever asked for"
        )


def _check_unique(callers: list[CallerConfig], source: str) -> None:
    """No two callers share a name, a token (by digest or by variable) or a subject."""
    names = [c.name for c in callers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"{source}: more than one caller is named {repeated[0]!r}")
    seen: dict[tuple[str, str], str] = {}
    for caller in callers:
        keys = [("token", d) for d in caller.token_sha256 or ()]
        if caller.token_env is not None:
            keys.append(("token variable", caller.token_env))
        if caller.subject is not None:
            keys.append(("subject", caller.subject))
        for kind, value in keys:
            other = seen.setdefault((kind, value), caller.name)
            if other != caller.name:
                raise ConfigError(f"{source}: callers {other!r} and {caller.name!r} have the same {kind}")
