"""The caller on every log line: each record gets a `caller` attribute (the current caller's
name, "anonymous" outside a call or with authentication off), which `gengate serve`'s format
prints. Only names, never tokens."""

from __future__ import annotations

import logging

from gengate.caller import current_caller


class CallerFilter(logging.Filter):
    """Sets `record.caller` to the caller of the call that logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "caller"):
            record.caller = current_caller()
        return True


_FILTER = CallerFilter()


def install_caller_logging(logger: logging.Logger | None = None) -> None:
    """Adds the caller filter to every handler of `logger` (the root logger by default).
    Idempotent; handlers added later are not covered."""
    target = logger if logger is not None else logging.getLogger()
    for handler in target.handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
