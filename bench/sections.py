"""bench/run's sections: each measures gengate and its peer in the same sitting, taking turns, and
returns a JSON-ready dict with `status` ("ok" or why not), `rows` and `ratios`."""

from __future__ import annotations

import contextlib
import copy
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import PROMPT, SCHEMA, Call, RunStats, gengate_server, run_interleaved
from peers import (
    LITELLM_MASTER_KEY,
    SKIPPED_NO_VENV,
    UPSTREAM_KEY,
    UPSTREAM_MODEL,
    bench_venv,
    fake_upstream,
    litellm_proxy,
    llamacpp_server,
    upstream_model,
)

MAX_TOKENS = 32
# The GGUF section's schema: SCHEMA with bounds on `rating`, which llama-cpp-python's
# schema → GBNF conversion ignores (FINDINGS.md), so its outputs can break them.
# Strings and the array are bounded so that an object fits in GGUF_SCHEMA_MAX_TOKENS on random weights.
GGUF_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 32},
    },
    "required": ["title", "tags", "rating", "summary"],
    "additionalProperties": False,
}
GGUF_SCHEMA_MAX_TOKENS = 256
PEER_KEY = "sk-bench-llamacpp-peer-0123456789"
# llama-cpp-python's sampler defaults (top_k 40, min_p 0.05, repeat_penalty 1.1) off: the same
# sampling work as gengate's request (temperature 1 over the whole vocabulary).
PEER_SAMPLING: dict[str, Any] = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}


@dataclass(frozen=True)
class Sizes:
    """How much each section does: --quick is a smoke run, full a measurement."""

    rounds: int
    gateway_c1: int
    gateway_c32: int
    gguf: int
    constraints: int
    compiles: int

    @staticmethod
    def of(quick: bool) -> Sizes:
        if quick:
            return Sizes(rounds=1, gateway_c1=30, gateway_c32=96, gguf=8, constraints=8, compiles=3)
        return Sizes(rounds=3, gateway_c1=150, gateway_c32=320, gguf=32, constraints=48, compiles=10)


def row(stats: RunStats, **extra: Any) -> dict[str, Any]:
    """One run's numbers, JSON-ready."""
    return {
        "variant": stats.name,
        "concurrency": stats.concurrency,
        "requests": stats.requests,
        "tokens": stats.tokens,
        "req_s": round(stats.requests_per_s, 2),
        "tok_s": round(stats.tokens_per_s, 1),
        "p50_ms": round(stats.latency_ms(50), 3),
        "p99_ms": round(stats.latency_ms(99), 3),
        **extra,
    }


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


# -- gateway: gengate vs LiteLLM's proxy vs the openai SDK direct, on one fake upstream ---------------

MESSAGES = [{"role": "user", "content": PROMPT}]


def openai_calls(client: Any, model: str) -> tuple[Call, Call]:
    """Unary and streaming chat completions through the openai SDK (direct or via LiteLLM)."""

    async def unary(i: int) -> int:
        await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS)
        return 0

    async def stream(i: int) -> int:
        chunks = await client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for _ in chunks:
            pass
        return 0

    return unary, stream


def gengate_calls(client: Any, model: str) -> tuple[Call, Call]:
    """Unary and streaming calls through gengate's AsyncClient."""

    async def unary(i: int) -> int:
        await client.generate(model, messages=MESSAGES, max_tokens=MAX_TOKENS)
        return 0

    async def stream(i: int) -> int:
        async for _ in client.generate_stream(model, messages=MESSAGES, max_tokens=MAX_TOKENS):
            pass
        return 0

    return unary, stream


async def gateway(sizes: Sizes) -> dict[str, Any]:
    """Added p50/p99 over direct and req/s ÷ direct, unary and stream, c=1 and c=32."""
    import openai
    from gengate_client import AsyncClient

    venv = bench_venv()
    result: dict[str, Any] = {"status": "ok", "litellm": "ok" if venv else SKIPPED_NO_VENV, "rows": []}
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(fake_upstream())
        model = upstream_model(upstream)
        address = stack.enter_context(gengate_server([model]))
        proxy = stack.enter_context(litellm_proxy(venv, upstream)) if venv else None
        async with contextlib.AsyncExitStack() as clients:
            direct = openai.AsyncOpenAI(base_url=upstream + "/v1", api_key=UPSTREAM_KEY, max_retries=0)
            clients.push_async_callback(direct.close)
            gengate = await clients.enter_async_context(AsyncClient(address))
            variants: list[tuple[str, tuple[Call, Call]]] = [
                ("direct", openai_calls(direct, UPSTREAM_MODEL)),
                ("gengate", gengate_calls(gengate, "gpt")),
            ]
            if proxy is not None:
                via = openai.AsyncOpenAI(base_url=proxy + "/v1", api_key=LITELLM_MASTER_KEY, max_retries=0)
                clients.push_async_callback(via.close)
                variants.append(("litellm", openai_calls(via, UPSTREAM_MODEL)))
            for mode, pick in (("unary", 0), ("stream", 1)):
                for concurrency, requests in ((1, sizes.gateway_c1), (32, sizes.gateway_c32)):
                    runs = [(name, calls[pick]) for name, calls in variants]
                    rows = await run_interleaved(runs, requests, concurrency, sizes.rounds)
                    result["rows"] += _added_over_direct(rows, mode)
    result["ratios"] = {
        f"{r['variant']} {r['mode']} c={r['concurrency']} req/s ÷ direct": r["req_s_ratio"]
        for r in result["rows"]
        if r["variant"] != "direct"
    }
    return result


def _added_over_direct(rows: list[RunStats], mode: str) -> list[dict[str, Any]]:
    direct = rows[0]
    out = []
    for stats in rows:
        added = {
            "mode": mode,
            "added_p50_ms": round(stats.latency_ms(50) - direct.latency_ms(50), 3),
            "added_p99_ms": round(stats.latency_ms(99) - direct.latency_ms(99), 3),
            "req_s_ratio": ratio(stats.requests_per_s, direct.requests_per_s),
        }
        out.append(row(stats, **added))
    return out


# -- gguf: gengate vs llama-cpp-python's server on the same GGUF ------------------------------------


def eos_token(gguf: Path) -> int:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        return int(llm.token_eos())
    finally:
        llm.close()


class Validity:
    """Counts each variant's schema outputs that parse and validate against GGUF_SCHEMA."""

    def __init__(self) -> None:
        import jsonschema

        self._validator = jsonschema.Draft202012Validator(GGUF_SCHEMA)
        self.reset()

    def reset(self) -> None:
        self.valid: dict[str, int] = {}
        self.answered: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def check(self, variant: str, text: str | None) -> None:
        import json

        if text is None:
            self.errors[variant] = self.errors.get(variant, 0) + 1
            return
        self.answered[variant] = self.answered.get(variant, 0) + 1
        try:
            ok = self._validator.is_valid(json.loads(text))
        except ValueError:
            ok = False
        self.valid[variant] = self.valid.get(variant, 0) + int(ok)


async def gguf(sizes: Sizes) -> dict[str, Any]:
    """tok/s and p50 of gengate serve vs llama-cpp-python's server, plain and under GGUF_SCHEMA;
    how many schema outputs validate. One thread each; plain runs force max_tokens (EOS masked
    on both) so both make the same tokens."""
    import openai
    from gengate.models.tiny import build_tiny_model, default_tiny_dir
    from gengate_client import AsyncClient, GengateError, JsonSchema, OutputError

    path = build_tiny_model(default_tiny_dir()).gguf_path
    no_eos = {str(eos_token(path)): -100}
    validity = Validity()
    entry = {"name": "tiny", "backend": "llamacpp", "tiny": True, "n_threads": 1, "n_ctx": 2048}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gengate-bench-gguf-")))
        peer_url = stack.enter_context(llamacpp_server(path, tmp / "peer.log", PEER_KEY, n_ctx=2048))
        address = stack.enter_context(gengate_server([entry]))
        async with contextlib.AsyncExitStack() as clients:
            # Any: its create() overloads do not take llama-cpp-python's response_format schema
            peer: Any = openai.AsyncOpenAI(
                base_url=peer_url + "/v1", api_key=PEER_KEY, max_retries=0, timeout=120
            )
            clients.push_async_callback(peer.close)
            gengate = await clients.enter_async_context(AsyncClient(address))

            async def gengate_plain(i: int) -> int:
                response = await gengate.generate(
                    "tiny", PROMPT, max_tokens=MAX_TOKENS, seed=i, temperature=1.0,
                    backend_options={"ignore_eos": True},
                )  # fmt: skip
                return int(response.usage.output_tokens)

            async def peer_plain(i: int) -> int:
                response = await peer.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, seed=i, temperature=1.0,
                    logit_bias=no_eos, extra_body=PEER_SAMPLING,
                )  # fmt: skip
                return int(response.usage.completion_tokens if response.usage else 0)

            schema_type = JsonSchema(GGUF_SCHEMA)

            async def gengate_schema(i: int) -> int:
                try:
                    response = await gengate.generate(
                        "tiny", messages=MESSAGES, max_tokens=GGUF_SCHEMA_MAX_TOKENS, seed=i,
                        temperature=1.0, output_type=schema_type,
                    )  # fmt: skip
                except (GengateError, OutputError):  # refused or cut short at max_tokens: said, not invalid
                    validity.check("gengate", None)
                    return 0
                validity.check("gengate", response.text)
                return int(response.usage.output_tokens)

            async def peer_schema(i: int) -> int:
                response = await peer.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=GGUF_SCHEMA_MAX_TOKENS, seed=i,
                    temperature=1.0, response_format={"type": "json_object", "schema": GGUF_SCHEMA},
                    extra_body=PEER_SAMPLING,
                )  # fmt: skip
                validity.check("llama-cpp-python", response.choices[0].message.content)
                return int(response.usage.completion_tokens if response.usage else 0)

            plain = await run_interleaved(
                [("gengate", gengate_plain), ("llama-cpp-python", peer_plain)], sizes.gguf, 1, sizes.rounds
            )
            for warm in (gengate_schema, peer_schema):  # compiles the schema on both sides
                await warm(1_000_000)
            validity.reset()  # warm-ups are not counted
            schema = await run_interleaved(
                [("gengate", gengate_schema), ("llama-cpp-python", peer_schema)],
                sizes.gguf,
                1,
                sizes.rounds,
                warmup=0,
            )
    rows = [row(s, output="plain") for s in plain]
    for stats in schema:
        name = stats.name
        rows.append(
            row(
                stats,
                output="json_schema",
                valid=validity.valid.get(name, 0),
                answered=validity.answered.get(name, 0),
                refused=validity.errors.get(name, 0),
            )
        )
    return {
        "status": "ok",
        "model": "tiny (models.tiny.TINY)",
        "rows": rows,
        "ratios": {
            "gengate ÷ llama-cpp-python tok/s, plain": ratio(plain[0].tokens_per_s, plain[1].tokens_per_s),
            "gengate ÷ llama-cpp-python tok/s, JSON Schema": ratio(
                schema[0].tokens_per_s, schema[1].tokens_per_s
            ),
            "gengate ÷ llama-cpp-python p50, plain": ratio(plain[0].latency_ms(50), plain[1].latency_ms(50)),
            "gengate ÷ llama-cpp-python p50, JSON Schema": ratio(
                schema[0].latency_ms(50), schema[1].latency_ms(50)
            ),
        },
    }


# -- constraints: constrained ÷ unconstrained tok/s (bench/batching.py's runs) -----------------------


async def constraints(sizes: Sizes) -> dict[str, Any]:
    """JSON Schema (bench SCHEMA, and the mostly forced EXTRACTION) vs unconstrained on the llama.cpp
    engine in-process, tiny and BENCH_32K."""
    from batching import bench_32k_gguf, run_constraints

    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    for model, gguf_path in (("tiny", None), ("32k", bench_32k_gguf())):
        runs, first_s = await run_constraints(sizes.constraints, sizes.rounds, gguf_path)
        free, constrained, forced = runs
        value = ratio(constrained.tokens_per_s, free.tokens_per_s)
        mostly_forced = ratio(forced.tokens_per_s, free.tokens_per_s)
        ratios[f"constrained ÷ unconstrained tok/s, {model}"] = value
        ratios[f"mostly forced schema ÷ unconstrained tok/s, {model}"] = mostly_forced
        extra = {"model": model, "first_compile_ms": round(1000 * first_s, 2)}
        rows += [row(free, **extra), row(constrained, ratio=value, **extra)]
        rows.append(row(forced, ratio=mostly_forced, **extra))
    return {"status": "ok", "rows": rows, "ratios": ratios}


# -- compile: cold vs cached vs annotation-only change (ConstraintCompiler) ------------------------


def _schemas(k: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A schema no earlier compile saw (a new property name), and it with annotations changed."""
    schema = copy.deepcopy(SCHEMA)
    schema["properties"][f"extra_{time.monotonic_ns()}_{k}"] = {"type": "string"}
    annotated = copy.deepcopy(schema)
    annotated["title"] = f"Review {k}"
    annotated["description"] = f"annotation-only change {k}"
    annotated["properties"]["title"]["examples"] = [f"example {k}"]
    return schema, annotated


async def compile_times(sizes: Sizes) -> dict[str, Any]:
    """ms to compile a new schema, the same schema again, and it with only annotations changed."""
    import llama_cpp
    from batching import bench_32k_gguf
    from gengate.constraints import ConstraintCompiler, make_ll_tokenizer_from_llama
    from gengate.domain import JsonSchemaConstraint, StructuredOutput
    from gengate.models.tiny import build_tiny_model, default_tiny_dir

    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    for model, path in (
        ("tiny", build_tiny_model(default_tiny_dir()).gguf_path),
        ("32k", Path(bench_32k_gguf())),
    ):
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        compiler = ConstraintCompiler(make_ll_tokenizer_from_llama(llm), f"bench:{path}")
        cold: list[float] = []
        cached: list[float] = []
        annotated: list[float] = []
        try:
            for k in range(sizes.compiles):
                schema, changed = _schemas(k)
                for times, which in ((cold, schema), (cached, schema), (annotated, changed)):
                    started = time.perf_counter()
                    await compiler.compile(StructuredOutput(JsonSchemaConstraint(which)), checked=True)
                    times.append(1000 * (time.perf_counter() - started))
            stats = compiler.stats
        finally:
            compiler.close()
            llm.close()
        medians = {n: round(statistics.median(t), 3) for n, t in (("cold", cold), ("cached", cached))}
        medians["annotation_only"] = round(statistics.median(annotated), 3)
        rows.append(
            {
                "model": model,
                "compiles": sizes.compiles,
                "cold_ms": medians["cold"],
                "cached_ms": medians["cached"],
                "annotation_only_ms": medians["annotation_only"],
                "cold_max_ms": round(max(cold), 3),
                "hits": stats.hits,
                "misses": stats.misses,
            }
        )
        ratios[f"cold ÷ cached compile, {model}"] = ratio(medians["cold"], medians["cached"])
    return {"status": "ok", "rows": rows, "ratios": ratios}


SECTIONS: dict[str, Callable[[Sizes], Awaitable[dict[str, Any]]]] = {
    "gateway": gateway,
    "gguf": gguf,
    "constraints": constraints,
    "compile": compile_times,
}
