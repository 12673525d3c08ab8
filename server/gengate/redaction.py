"""Secrets never leave the process: one registry of secret values, and `redact` for outgoing text.

Providers register the API keys they resolve and the server registers its callers' bearer
tokens; `redact` replaces every registered value (exact match) and credential-shaped tokens
(`sk-…`, `hf_…`, `AIza…`, `Bearer …`) with "[REDACTED]". Text is always redacted *before* it is
cut to a length, so a key straddling the cut cannot leave its first half behind.
`RedactingFilter` applies the same to every log record, and bounds each log message's length.
"""

from __future__ import annotations

import logging
import re
import threading

REDACTED = "[REDACTED]"
# Shorter values are too likely to be ordinary words or numbers to replace everywhere.
MIN_SECRET_LENGTH = 8
# The longest log message kept; the rest is replaced by "... [N more characters]".
MAX_LOG_MESSAGE = 4000
# The longest traceback kept with a record (deep stacks run past MAX_LOG_MESSAGE legitimately).
MAX_LOG_TRACEBACK = 20_000
# Beyond a cut, this much more text is redacted too: a credential-shaped token that starts before
# the cut is matched whole (or at least its first MIN_SECRET_LENGTH characters after its prefix).
_CUT_MARGIN = 256

# Token shapes that look like credentials even when we were never told the value.
_TOKEN_PATTERNS = (
    re.compile(r"\b(?:sk|pk|rk|ak)-[A-Za-z0-9_\-]{8,}"),
    re.compile(r"\bhf_[A-Za-z0-9]{8,}"),
    re.compile(r"\bAIza[0-9A-Za-z_\-]{20,}"),
    # Adjacent repeats match disjoint characters, so no input makes this backtrack (linear time).
    re.compile(r"(?i)\b(bearer\s*|api[-_ ]?key[\"']?[ \t]*[:=][\s\"']*)[A-Za-z0-9._\-]{8,}"),
)


class SecretRegistry:
    """The secret values of this process, matched by one regular expression (longest first)."""

    def __init__(self) -> None:
        self._secrets: set[str] = set()
        self._lock = threading.Lock()
        self._pattern: re.Pattern[str] | None = None
        self.longest = 0

    def register(self, value: str | None) -> None:
        """Remembers `value` so that `redact` removes it; short or empty values are ignored."""
        if not value or len(value) < MIN_SECRET_LENGTH:
            return
        with self._lock:
            if value in self._secrets:
                return
            self._secrets.add(value)
            ordered = sorted(self._secrets, key=len, reverse=True)
            self._pattern = re.compile("|".join(map(re.escape, ordered)))
            self.longest = len(ordered[0])

    def redact(self, text: str) -> str:
        pattern = self._pattern
        if pattern is not None:
            text = pattern.sub(REDACTED, text)
        for token in _TOKEN_PATTERNS:
            if token.groups:
                text = token.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
            else:
                text = token.sub(REDACTED, text)
        return text


SECRETS = SecretRegistry()


def register_secret(value: str | None) -> None:
    """Registers a secret value (an API key, a caller token) with the process-wide registry."""
    SECRETS.register(value)


def redact(text: str) -> str:
    """`text` with every registered secret and credential-shaped token replaced by [REDACTED]."""
    return SECRETS.redact(text)


def redact_and_cut(text: str, limit: int, suffix: str = "…") -> str:
    """`text` redacted, then cut to `limit` characters plus `suffix` when longer.

    Only the part that can survive the cut is redacted (a huge text costs no more than a short
    one), with a margin so that a secret starting before the cut is replaced whole first."""
    if len(text) <= limit:
        return redact(text)
    head = text[: limit + max(_CUT_MARGIN, SECRETS.longest)]
    window = redact(head)
    if len(window) <= limit and len(head) == len(text):
        return window
    return window[:limit] + suffix


def bounded_log_text(text: str, limit: int = MAX_LOG_MESSAGE) -> str:
    """`text` redacted and cut for a log line, saying how many characters were dropped."""
    if len(text) <= limit:
        return redact(text)
    return redact_and_cut(text, limit, f"... [{len(text) - limit} more characters]")


_DONE = "gengate_redacted"


class RedactingFilter(logging.Filter):
    """Rewrites each record's final message (and traceback) without secrets, cut to a bounded
    length. Installed on handlers, so it sees records from every logger that reaches them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _DONE, False):  # already rewritten, for another handler
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging would print the args in its error report
            message = f"{record.msg} (log arguments that do not fit the format: {record.args!r})"
        setattr(record, _DONE, True)
        record.msg = bounded_log_text(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = bounded_log_text(record.exc_text, MAX_LOG_TRACEBACK)
        if record.stack_info:
            record.stack_info = bounded_log_text(record.stack_info, MAX_LOG_TRACEBACK)
        return True


_FILTER = RedactingFilter()


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Adds the redacting filter to every handler of `logger` (the root logger by default).

    Idempotent; call it after logging is configured (handlers added later are not covered)."""
    target = logger if logger is not None else logging.getLogger()
    for handler in target.handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
