"""Every Mistral request body the tests send, serialized both ways: gengate's `request_json` and
the SDK's own `utils.serialize_request_body`, which must give the same bytes (a differential
check over every request shape the Mistral tests make: tools, tool turns, prefixes, reasoning,
structured output, images...)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gengate.providers import mistral


@pytest.fixture(autouse=True)
def same_bytes_as_the_sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Wraps request_json: each body it writes is compared with the SDK's own serialization."""
    from mistralai.client import utils

    written = mistral.request_json
    compared: list[str] = []

    def checked(model: Any) -> str:
        ours = written(model)
        sdk = utils.serialize_request_body(model, False, False, "json", type(model))
        assert sdk is not None and ours == sdk.content, "gengate's request JSON differs from the SDK's"
        compared.append(ours)
        return ours

    monkeypatch.setattr(mistral, "request_json", checked)
    yield compared
