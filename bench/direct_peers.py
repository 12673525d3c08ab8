"""Each remote provider's own SDK calling its fake directly: the peer `provider_path.py --provider`
measures gengate's added latency against (as the openai SDK is for OpenAI).

Every peer makes the request gengate makes for bench/sections.py's MESSAGES and MAX_TOKENS,
through the SDK's public calls, retries off, and reads the answer (or the whole stream) the way
an application would: the SDK's own objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from common import Call
from sections import MAX_TOKENS, MESSAGES


@contextlib.asynccontextmanager
async def direct_calls(provider: str, entry: dict[str, Any]) -> AsyncIterator[tuple[Call, Call]]:
    """(unary, stream) calls of `provider`'s SDK on the fake that gengate's model `entry` uses."""
    url, key, model = entry["base_url"], entry["api_key"], entry["model"]
    if provider == "anthropic":
        import anthropic

        client = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)

        async def unary(i: int) -> int:
            await client.messages.create(model=model, max_tokens=MAX_TOKENS, messages=MESSAGES)  # type: ignore[arg-type]
            return 0

        async def stream(i: int) -> int:
            events = await client.messages.create(
                model=model,
                max_tokens=MAX_TOKENS,
                messages=MESSAGES,
                stream=True,  # type: ignore[arg-type]
            )
            async for _ in events:
                pass
            return 0

        try:
            yield unary, stream
        finally:
            await client.close()
    elif provider == "mistral":
        from mistralai.client import Mistral

        mistral = Mistral(api_key=key, server_url=url)

        async def unary(i: int) -> int:
            await mistral.chat.complete_async(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
            return 0

        async def stream(i: int) -> int:
            events = await mistral.chat.stream_async(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
            async for _ in events:
                pass
            return 0

        yield unary, stream
    elif provider == "cohere":
        import cohere

        co = cohere.AsyncClientV2(api_key=key, base_url=url)

        async def unary(i: int) -> int:
            await co.chat(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
            return 0

        async def stream(i: int) -> int:
            async for _ in co.chat_stream(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS):  # type: ignore[arg-type]
                pass
            return 0

        yield unary, stream
    elif provider == "gemini":
        from google import genai
        from google.genai import types

        gemini = genai.Client(api_key=key, http_options=types.HttpOptions(base_url=url))
        contents = [{"role": "user", "parts": [{"text": m["content"]}]} for m in MESSAGES]
        config = types.GenerateContentConfig(max_output_tokens=MAX_TOKENS)

        async def unary(i: int) -> int:
            await gemini.aio.models.generate_content(model=model, contents=contents, config=config)  # type: ignore[arg-type]
            return 0

        async def stream(i: int) -> int:
            chunks = await gemini.aio.models.generate_content_stream(
                model=model,
                contents=contents,
                config=config,  # type: ignore[arg-type]
            )
            async for _ in chunks:
                pass
            return 0

        try:
            yield unary, stream
        finally:
            await gemini.aio.aclose()
    elif provider == "tgi":
        from huggingface_hub import AsyncInferenceClient

        tgi = AsyncInferenceClient(model=url, token=key)

        async def unary(i: int) -> int:
            await tgi.chat_completion(messages=MESSAGES, max_tokens=MAX_TOKENS)
            return 0

        async def stream(i: int) -> int:
            async for _ in await tgi.chat_completion(messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True):
                pass
            return 0

        try:
            yield unary, stream
        finally:
            await tgi.close()  # type: ignore[no-untyped-call]
    else:
        raise ValueError(f"no direct peer for {provider!r}")
