"""What batching and constraints buy or cost, each against a peer measured in the same run.

(1) transformers engine (`tiny: true`, in-process): 16 concurrent requests, which its scheduler
    steps together, vs the same 16 one after another. Ratio = batched / sequential tokens/s.
(2) the same through a `gengate serve` subprocess and `gengate_client.AsyncClient`.
(3) llama.cpp tiny engine, then the 32k-vocabulary benchmark model (models.tiny.BENCH_32K, where
    the mask over the vocabulary costs what it does on real models): a JSON Schema request vs
    the same unconstrained request.
    Ratio = constrained / unconstrained tokens/s (the grammar engine's per-token cost; the
    schema is compiled once and cached, its first compile is timed on its own).
(4) transformers engine, the same JSON Schema request vs unconstrained, one at a time and BATCH
    at once: tokens the schema forces join their row's next pass (jump-forward).

    .venv/bin/python bench/batching.py [--quick] [--skip-server] [--only-constraints]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from common import (
    EXTRACTION,
    PROMPT,
    SCHEMA,
    Call,
    RunStats,
    gengate_server,
    print_ratios,
    print_table,
    run_interleaved,
)

MAX_TOKENS = 32
BATCH = 16


def engine_call(backend: Any, *, schema: dict[str, Any] | None = None) -> Call:
    """One generate() on an in-process gengate backend; returns its output tokens."""
    from gengate.domain import (
        GenerationRequest,
        JsonSchemaConstraint,
        SamplingParams,
        StoppingCriteria,
        StructuredOutput,
    )

    structured = None if schema is None else StructuredOutput(JsonSchemaConstraint(schema))

    async def call(i: int) -> int:
        request = GenerationRequest(
            model=backend.name,
            prompt=PROMPT,
            sampling=SamplingParams(seed=i, temperature=1.0),
            stopping=StoppingCriteria(max_tokens=MAX_TOKENS),
            structured_output=structured,
        )
        return int((await backend.generate(request)).usage.output_tokens)

    return call


def client_call(client: Any, model: str) -> Call:
    async def call(i: int) -> int:
        response = await client.generate(model, PROMPT, max_tokens=MAX_TOKENS, seed=i, temperature=1.0)
        return int(response.usage.output_tokens)

    return call


async def batching_pairs(call: Call, rounds: int, where: str) -> list[RunStats]:
    """The same BATCH requests, all at once and one after another, taking turns."""
    variants = [(f"{where} concurrent", call), (f"{where} sequential", call)]
    return await run_interleaved(variants, BATCH, (BATCH, 1), rounds, warmup=2)


async def run_transformers_engine(rounds: int) -> tuple[list[RunStats], str]:
    from gengate.engines.transformers import TransformersBackend
    from gengate.engines.transformers.backend import TransformersOptions

    backend = TransformersBackend("tiny-hf", TransformersOptions(tiny=True, max_batch_size=BATCH))
    await backend.start()
    try:
        call = engine_call(backend)
        await call(1_000_000)  # the first forward pass is slow
        stats = backend.stats
        passes, stats.max_batch_size = stats.forward_passes, 0
        tokens = sum(await asyncio.gather(*(call(i) for i in range(BATCH))))
        note = (
            f"scheduler proof: one round of {BATCH} concurrent requests took "
            f"{stats.forward_passes - passes} forward passes for {tokens} tokens, largest batch "
            f"{stats.max_batch_size}"
        )
        rows = await batching_pairs(call, rounds, "engine")
    finally:
        await backend.aclose()
    return rows, note


async def run_transformers_constraints(requests: int, rounds: int) -> tuple[list[RunStats], str]:
    """JSON Schema vs unconstrained on the transformers tiny engine, at c=1 and c=BATCH."""
    from gengate.engines.transformers import TransformersBackend
    from gengate.engines.transformers.backend import TransformersOptions

    backend = TransformersBackend("tiny-hf", TransformersOptions(tiny=True, max_batch_size=BATCH))
    await backend.start()
    try:
        constrained = engine_call(backend, schema=SCHEMA)
        await constrained(0)  # compiles the schema
        stats = backend.stats
        passes, tokens = stats.decode_passes, stats.tokens_generated
        for i in range(requests):
            await constrained(i)
        note = (
            f"one at a time, {requests} JSON Schema requests took {stats.decode_passes - passes} decode "
            f"passes for {stats.tokens_generated - tokens} tokens"
        )
        rows = []
        for concurrency in (1, BATCH):
            variants = [
                (f"transformers unconstrained c={concurrency}", engine_call(backend)),
                (f"transformers JSON schema c={concurrency}", constrained),
            ]
            rows += await run_interleaved(variants, requests, concurrency, rounds)
    finally:
        await backend.aclose()
    return rows, note


async def run_transformers_server(rounds: int) -> list[RunStats]:
    from gengate_client import AsyncClient

    models = [{"name": "tiny-hf", "backend": "transformers", "tiny": True, "max_batch_size": BATCH}]
    with gengate_server(models) as address:
        async with AsyncClient(address) as client:
            return await batching_pairs(client_call(client, "tiny-hf"), rounds, "server")


def bench_32k_gguf() -> str:
    """The 32k-vocabulary benchmark model (models.tiny.BENCH_32K), built once beside the tiny one."""
    from gengate.models.tiny import BENCH_32K, build_tiny_model, default_tiny_dir

    return str(build_tiny_model(default_tiny_dir().parent / "bench-32k", config=BENCH_32K).gguf_path)


async def run_constraints(
    requests: int, rounds: int, gguf: str | None = None
) -> tuple[list[RunStats], float]:
    """Unconstrained, JSON Schema (SCHEMA) and a mostly forced one (EXTRACTION) on llama.cpp: the
    tiny model, or the GGUF at `gguf`."""
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    vocab = "tiny" if gguf is None else "32k"
    options = LlamaCppOptions(tiny=True) if gguf is None else LlamaCppOptions(path=gguf)
    backend = LlamaCppBackend(vocab, options)
    await backend.start()
    try:
        constrained = engine_call(backend, schema=SCHEMA)
        started = time.perf_counter()
        await constrained(0)  # compiles the schema; later requests hit the compiler's cache
        first_s = time.perf_counter() - started
        variants = [
            (f"llama.cpp {vocab} unconstrained", engine_call(backend)),
            (f"llama.cpp {vocab} JSON schema", constrained),
            (f"llama.cpp {vocab} JSON schema, mostly forced", engine_call(backend, schema=EXTRACTION)),
        ]
        rows = await run_interleaved(variants, requests, 1, rounds)
    finally:
        await backend.aclose()
    return rows, first_s


async def run(args: argparse.Namespace) -> None:
    rounds = 1 if args.quick else 3
    summary: list[str] = []
    requests = 16 if args.quick else 48
    rows, note = await run_transformers_constraints(requests, rounds)
    print_table(f"transformers tiny engine: JSON schema vs none, max_tokens {MAX_TOKENS}", rows)
    print(f"  {note}")
    summary += print_ratios([(rows[1], rows[0]), (rows[3], rows[2])])
    if args.only_constraints:
        print(f"\nSUMMARY throughput ratios: {', '.join(summary)}")
        return
    engine_rows, note = await run_transformers_engine(rounds)
    print_table(f"transformers tiny engine: {BATCH} requests, max_tokens {MAX_TOKENS}", engine_rows)
    print(f"  {note}")
    summary += print_ratios([(engine_rows[0], engine_rows[1])])
    if not args.skip_server:
        server_rows = await run_transformers_server(rounds)
        print_table("transformers tiny through server + client (worker process)", server_rows)
        summary += print_ratios([(server_rows[0], server_rows[1])])
    constraint_rows, first_s = await run_constraints(requests, rounds)
    print_table(f"llama.cpp tiny engine: JSON schema vs none, max_tokens {MAX_TOKENS}", constraint_rows)
    print(f"  first JSON-schema request (compiles the grammar): {1000 * first_s:.1f} ms")
    summary += print_ratios([(row, constraint_rows[0]) for row in constraint_rows[1:]])
    rows_32k, first_32k = await run_constraints(requests, rounds, bench_32k_gguf())
    print_table(f"llama.cpp 32k-vocabulary model: JSON schema vs none, max_tokens {MAX_TOKENS}", rows_32k)
    print(f"  first JSON-schema request (compiles the grammar): {1000 * first_32k:.1f} ms")
    summary += print_ratios([(row, rows_32k[0]) for row in rows_32k[1:]])
    print(f"\nSUMMARY throughput ratios: {', '.join(summary)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one round each (a smoke run)")
    parser.add_argument("--skip-server", action="store_true", help="skip the server + client run")
    parser.add_argument(
        "--only-constraints", action="store_true", help="only (4): transformers JSON Schema vs none"
    )
    parser.add_argument(
        "--torch-threads",
        default="1",
        help="OMP_NUM_THREADS for torch here and in the server (1: spinning thread pools on a "
        "shared, oversubscribed CPU turn noise into multi-second stalls)",
    )
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = args.torch_threads  # before torch is imported; servers inherit it
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
