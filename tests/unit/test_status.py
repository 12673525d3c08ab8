"""GengateError → google.rpc.Status: redacted, bounded in UTF-8 bytes, retry delays sane."""

from __future__ import annotations

import math

from gengate.api.status import (
    MAX_MESSAGE_BYTES,
    MAX_PUSHBACK_S,
    MAX_STATUS_BYTES,
    retry_metadata,
    to_rpc_status,
)
from gengate.errors import FieldViolation, InvalidArgument, ResourceExhausted
from gengate.redaction import register_secret
from google.rpc import error_details_pb2


def _unpacked(status: object, kind: type) -> list:  # type: ignore[type-arg]
    out = []
    for detail in status.details:  # type: ignore[attr-defined]
        if detail.Is(kind.DESCRIPTOR):  # type: ignore[attr-defined]
            message = kind()
            detail.Unpack(message)
            out.append(message)
    return out


def test_non_ascii_echoes_are_bounded_in_bytes_and_excess_violations_counted() -> None:
    violations = [FieldViolation(f"backend_options[{'ключ' * 40}{i}]", "неизвестно " * 60) for i in range(40)]
    error = InvalidArgument("🙂" * 5000, violations=violations, metadata={"model": "🙂" * 5000})
    status = to_rpc_status(error)
    assert len(status.message.encode()) <= MAX_MESSAGE_BYTES
    assert status.ByteSize() <= MAX_STATUS_BYTES + 200
    [bad] = _unpacked(status, error_details_pb2.BadRequest)
    shown = [v for v in bad.field_violations if v.field]
    assert 0 < len(shown) < 40
    assert bad.field_violations[-1].description == f"and {40 - len(shown)} more violations"
    for text in [status.message, *(v.field for v in shown), *(v.description for v in shown)]:
        text.encode("utf-8")  # cut on character boundaries: still valid UTF-8


def test_secrets_are_redacted_before_the_cut() -> None:
    secret = "qq83JfhwUe0vXk2mT9ab"
    register_secret(secret)
    text = "x" * (MAX_MESSAGE_BYTES - 10) + secret
    status = to_rpc_status(InvalidArgument(text, violations=[FieldViolation("f", text)]))
    assert secret[:6] not in status.message
    [bad] = _unpacked(status, error_details_pb2.BadRequest)
    assert secret[:6] not in bad.field_violations[0].description


def test_infinite_or_negative_retry_delays_are_bounded() -> None:
    for delay, expected in ((math.inf, 3600), (-5.0, 0), (math.nan, None), (2.5, 2.5)):
        status = to_rpc_status(ResourceExhausted("busy", retry_after_s=delay))
        infos = _unpacked(status, error_details_pb2.RetryInfo)
        if expected is None:
            assert infos == []
            continue
        assert infos[0].retry_delay.ToTimedelta().total_seconds() == expected
        if not math.isnan(delay):
            headers = dict(retry_metadata(delay))
            pushback = round(expected * 1000) if expected <= MAX_PUSHBACK_S else -1
            assert int(headers["grpc-retry-pushback-ms"]) == pushback


def test_pushback_stops_a_clients_retry_it_could_not_wait_for() -> None:
    """A client's gRPC retry waits the pushback: past the cap, or past the caller's own deadline,
    the server says -1 (gRFC A6: do not retry) so the caller gets RetryInfo at once."""
    assert dict(retry_metadata(0.25))["grpc-retry-pushback-ms"] == "250"
    assert dict(retry_metadata(0.25, time_remaining_s=5.0))["grpc-retry-pushback-ms"] == "250"
    assert dict(retry_metadata(2.0, time_remaining_s=1.5))["grpc-retry-pushback-ms"] == "-1"
    assert dict(retry_metadata(MAX_PUSHBACK_S + 1))["grpc-retry-pushback-ms"] == "-1"
    assert dict(retry_metadata(MAX_PUSHBACK_S + 1))["retry-after"] == str(int(MAX_PUSHBACK_S) + 1)
