"""Two teams with tokens in the environment (and one known only by its token's digest)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

TOKEN_A = "team-a-token-5Jq2Vw9Lx"
TOKEN_B = "team-b-token-8Rm4Tz1Kp"
TOKEN_C = "team-c-token-3Hs7Yc6Nd"  # configured only by its SHA-256
SHA_C = hashlib.sha256(TOKEN_C.encode()).hexdigest()
TOKENS = {"TEAM_A_TOKEN": TOKEN_A, "TEAM_B_TOKEN": TOKEN_B}


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def with_callers(
    models: list[dict[str, Any]], callers: list[dict[str, Any]], **server: Any
) -> dict[str, Any]:
    return {"models": models, "callers": callers, "server": server}


def record_calls(server: Any, model: str, release: asyncio.Event) -> list[str]:
    """The prompts in the order `model` is called; the call with prompt "holder" keeps its slot
    until `release` is set (order observed where the model is called: no timing)."""
    backend: Any = server.router.route(model).backend
    original = backend.generate_stream
    seen: list[str] = []

    async def generate_stream(request: Any) -> AsyncIterator[Any]:
        seen.append(request.prompt or "")
        if request.prompt == "holder":
            await release.wait()
        async for event in original(request):
            yield event

    backend.generate_stream = generate_stream
    return seen
