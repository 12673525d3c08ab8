"""domain.evolve: the per-request copy the core uses instead of dataclasses.replace."""

from __future__ import annotations

import dataclasses

import pytest
from gengate.domain import GenerationRequest, StoppingCriteria, Timings, evolve


def test_evolve_copies_like_replace_and_leaves_the_original() -> None:
    request = GenerationRequest(model="m", prompt="hi", stopping=StoppingCriteria(max_tokens=3))
    changed = evolve(request, model="other", request_id="r1")
    assert changed == dataclasses.replace(request, model="other", request_id="r1")
    assert (request.model, request.request_id) == ("m", request.request_id)
    assert changed.stopping is request.stopping and type(changed) is GenerationRequest
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.model = "x"  # type: ignore[misc]


def test_evolve_refuses_a_name_that_is_not_a_field() -> None:
    with pytest.raises(AssertionError, match="not fields"):
        evolve(Timings(), total=1.0)
