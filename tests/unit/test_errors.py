"""Error values: field paths placed under an RPC's request message."""

from __future__ import annotations

from gengate.errors import Aborted, FieldViolation, InvalidArgument


def test_under_moves_the_field_paths_and_the_message_that_names_them() -> None:
    error = InvalidArgument.field("stopping.max_tokens", "must be at least 1")
    moved = error.under("requests[2].")
    assert moved.violations == (FieldViolation("requests[2].stopping.max_tokens", "must be at least 1"),)
    assert moved.message == str(moved) == "requests[2].stopping.max_tokens: must be at least 1"
    assert moved.reason == error.reason and type(moved) is InvalidArgument
    assert error.message == "stopping.max_tokens: must be at least 1"  # the original is untouched


def test_under_leaves_other_messages_and_errors_without_fields_alone() -> None:
    error = InvalidArgument("the request is too large", violations=[FieldViolation("prompt", "too long")])
    moved = error.under("request.")
    assert moved.message == "the request is too large"
    assert moved.violations[0].field == "request.prompt"
    plain = Aborted("failed")
    assert plain.under("request.") is plain
