"""Each remote provider's own SDK calling its fake directly: the peer `provider_path.py --provider`
measures gengate's added latency against (as the openai SDK is for OpenAI).

Every peer makes the request gengate makes for bench/sections.py's MESSAGES and MAX_TOKENS,
through the SDK's public calls, retries off, and reads the answer (or the whole stream) the way
an application would: the SDK's own objects.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common import Call
from sections import MAX_TOKENS, MESSAGES


def _calls(send: Callable[[], Awaitable[Any]], open_stream: Callable[[], Any]) -> tuple[Call, Call]:
    """(unary, stream) from an SDK's answer call and its stream call (awaited or not), read whole."""

    async def unary(i: int) -> int:
        await send()
        return 0

    async def stream(i: int) -> int:
        events = open_stream()
        if inspect.isawaitable(events):
            events = await events
        async for _ in events:
            pass
        return 0

    return unary, stream


@contextlib.asynccontextmanager
async def direct_calls(provider: str, entry: dict[str, Any]) -> AsyncIterator[tuple[Call, Call]]:
    """(unary, stream) calls of `provider`'s SDK on the fake that gengate's model `entry` uses."""
    url, key, model = entry["base_url"], entry["api_key"], entry["model"]
    ask: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    if provider == "anthropic":
        import anthropic

        claude = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)
        try:
            create = claude.messages.create
            yield _calls(lambda: create(**ask), lambda: create(**ask, stream=True))
        finally:
            await claude.close()
    elif provider == "mistral":
        from mistralai.client import Mistral

        async with Mistral(api_key=key, server_url=url) as mistral:
            yield _calls(lambda: mistral.chat.complete_async(**ask), lambda: mistral.chat.stream_async(**ask))
    elif provider == "cohere":
        import cohere

        # The SDK's default HTTP client: with httpx-aiohttp installed (gengate's cohere extra) it
        # sends on aiohttp, as gengate's backend does.
        co = cohere.AsyncClientV2(api_key=key, base_url=url)
        try:
            yield _calls(lambda: co.chat(**ask), lambda: co.chat_stream(**ask))
        finally:
            await co._client_wrapper.httpx_client.httpx_client.aclose()
    elif provider == "gemini":
        from google import genai
        from google.genai import types

        gemini = genai.Client(api_key=key, http_options=types.HttpOptions(base_url=url))
        content: dict[str, Any] = {
            "model": model,
            "contents": [{"role": "user", "parts": [{"text": m["content"]}]} for m in MESSAGES],
            "config": types.GenerateContentConfig(max_output_tokens=MAX_TOKENS),
        }
        try:
            yield _calls(
                lambda: gemini.aio.models.generate_content(**content),
                lambda: gemini.aio.models.generate_content_stream(**content),
            )
        finally:
            await gemini.aio.aclose()
    elif provider == "tgi":
        from huggingface_hub import AsyncInferenceClient

        tgi = AsyncInferenceClient(model=url, token=key)
        chat = {"messages": MESSAGES, "max_tokens": MAX_TOKENS}
        try:
            complete = tgi.chat_completion
            yield _calls(lambda: complete(**chat), lambda: complete(**chat, stream=True))
        finally:
            await tgi.close()
    else:
        raise ValueError(f"no direct peer for {provider!r}")
