"""The soak test's judge: which recorded outcomes count as failures (fast; runs in the default suite)."""

from __future__ import annotations

import random
from typing import Any, cast

from soak_load import EXPECTED, OPS, TINY, TINY_HF, Item, KillWindow, Soak


def judge(*items: Item, killed_at: float = 100.0, serving_again_at: float = 102.0) -> list[Item]:
    soak = Soak(
        client=cast(Any, None),
        stub=cast(Any, None),
        rng=random.Random(0),
        kill=KillWindow(TINY, killed_at, serving_again_at),
    )
    for item in items:
        soak.record(item)
    return soak.unexpected()


def test_expected_outcomes_pass() -> None:
    assert not judge(
        Item("unary", TINY_HF, "OK", 1, 2),
        Item("stream_cancel", TINY, "CANCELLED", 1, 2),
        Item("deadline_unary", TINY, "DEADLINE_EXCEEDED", 1, 2),
        Item("batch_item:n_zero", "echo", "INVALID_ARGUMENT", 1, 2),
        Item("structured_json", TINY, "TRUNCATED", 1, 2),
    )


def test_internal_hang_and_wrong_codes_fail() -> None:
    bad = [
        Item("unary", TINY, "INTERNAL", 1, 2),
        Item("stream_full", TINY_HF, "HANG", 1, 40),
        Item("bad_regex", TINY, "OK", 1, 2),  # a bad request must be refused
        Item("structured_regex", TINY, "INVALID_OUTPUT '12-AB'", 1, 2),
        Item("structured_regex", TINY, "TRUNCATED", 1, 2),
        Item("deadline_stream", TINY, "EXCEPTION RuntimeError: boom", 1, 2),
    ]
    assert judge(*bad) == bad


def test_unavailable_only_on_the_killed_model_around_its_restart() -> None:
    inside = [
        Item("unary", TINY, "UNAVAILABLE", 99.8, 100.01),  # in flight at the kill
        Item("unary", TINY, "UNAVAILABLE", 101.0, 101.01),  # while it restarts
        Item("batch_item:good", TINY, "UNAVAILABLE", 102.5, 102.6),  # just after (health lags)
    ]
    outside = [
        Item("unary", TINY, "UNAVAILABLE", 10.0, 10.1),
        Item("unary", TINY, "UNAVAILABLE", 105.0, 105.1),
        Item("unary", TINY_HF, "UNAVAILABLE", 100.5, 100.6),  # the other worker was not killed
    ]
    assert judge(*inside, *outside) == outside


def test_every_call_in_the_mix_has_expected_outcomes() -> None:
    assert {op.label for op in OPS} <= set(EXPECTED)
    assert all("INTERNAL" not in kinds and "HANG" not in kinds for kinds in EXPECTED.values())
