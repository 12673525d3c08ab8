"""What the mlx engine costs and what constraints cost on it, each against a peer in the same run.

(1) gengate's MlxBackend (`tiny: true`, in-process) vs mlx-lm called directly on the same model
    folder: at c=1 `mlx_lm.generate_step` + its streaming detokenizer (stream_generate's loop
    without its EOS stop), one at a time on one thread; at c=4 mlx-lm's own continuous batching,
    `mlx_lm.generate.BatchGenerator`, fed 4 concurrent calls by one driver thread. gengate's
    requests set `ignore_eos` and mlx-lm's stop on length only, so every request makes exactly
    `max_tokens` tokens on both sides. Ratio = gengate tok/s ÷ mlx-lm tok/s.
(2) the mlx engine with a JSON Schema vs the same requests unconstrained, at c=1 and c=4.
    Ratio = constrained ÷ unconstrained tok/s (llguidance's per-token mask on this engine; the
    schema is compiled once and cached, its first compile is timed on its own).

    .venv/bin/python bench/mlx_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common import (
    PROMPT,
    SCHEMA,
    Call,
    Pair,
    RunStats,
    print_ratios,
    print_table,
    run_concurrent,
    run_interleaved,
)

MAX_TOKENS = 32
TEMPERATURE = 1.0
CONCURRENCY = (1, 4)


# -- gengate --------------------------------------------------------------------------------


async def start_engine() -> Any:
    """gengate's MlxBackend on the tiny model, in this process, started."""
    from gengate.engines.mlx import MlxBackend, MlxOptions

    backend = MlxBackend("tiny-mlx", MlxOptions(tiny=True, max_batch_size=16))
    await backend.start()
    return backend


def engine_call(backend: Any, *, schema: dict[str, Any] | None = None, ignore_eos: bool = False) -> Call:
    """One generate() on the in-process backend; returns its output tokens."""
    from gengate.domain import (
        GenerationRequest,
        JsonSchemaConstraint,
        SamplingParams,
        StoppingCriteria,
        StructuredOutput,
    )

    structured = None if schema is None else StructuredOutput(JsonSchemaConstraint(schema))
    options: dict[str, Any] = {"ignore_eos": True} if ignore_eos else {}

    async def call(i: int) -> int:
        request = GenerationRequest(
            model=backend.name,
            prompt=PROMPT,
            sampling=SamplingParams(seed=i, temperature=TEMPERATURE),
            stopping=StoppingCriteria(max_tokens=MAX_TOKENS),
            structured_output=structured,
            backend_options=options,
        )
        return int((await backend.generate(request)).usage.output_tokens)

    return call


# -- mlx-lm directly ------------------------------------------------------------------------


class DirectMlxLm:
    """The tiny model loaded by `mlx_lm.load` from the folder the engine loads; the peer."""

    def __init__(self) -> None:
        import mlx.core as mx
        from gengate.models.tiny import build_tiny_model, default_tiny_dir
        from mlx_lm import load
        from mlx_lm.sample_utils import make_sampler

        loaded: Any = load(str(build_tiny_model(default_tiny_dir()).hf_dir))
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.prompt_ids: list[int] = list(self.tokenizer.encode(PROMPT))
        self.sampler = make_sampler(temp=TEMPERATURE)
        self.mx = mx
        # One thread for every c=1 call, as the engine has one model thread.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-lm")

    def generate(self, seed: int) -> int:
        """stream_generate's loop (generate_step + streaming detokenizer), stopping on length only."""
        from mlx_lm.generate import generate_step

        self.mx.random.seed(seed)
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        tokens = 0
        prompt = self.mx.array(self.prompt_ids)
        for token, _ in generate_step(prompt, self.model, max_tokens=MAX_TOKENS, sampler=self.sampler):
            detokenizer.add_token(int(token))
            tokens += 1
        detokenizer.finalize()
        _ = detokenizer.text
        return tokens

    def call(self) -> Call:
        async def call(i: int) -> int:
            return await asyncio.get_running_loop().run_in_executor(self.executor, self.generate, i)

        return call

    def close(self) -> None:
        self.executor.shutdown()


class BatchPeer:
    """mlx-lm's continuous batching (BatchGenerator) on one driver thread: concurrent calls join the
    running batch as they arrive, as in gengate's scheduler; text is decoded when a sequence ends,
    as `batch_generate` does."""

    def __init__(self, direct: DirectMlxLm, loop: asyncio.AbstractEventLoop) -> None:
        from mlx_lm.generate import BatchGenerator

        direct.mx.random.seed(0)
        # No stop tokens: every sequence runs to max_tokens, as gengate's do with ignore_eos.
        self.generator = BatchGenerator(
            direct.model,
            max_tokens=MAX_TOKENS,
            sampler=direct.sampler,
            completion_batch_size=16,
            prefill_batch_size=16,
        )
        self.direct = direct
        self.loop = loop
        self.inbox: queue.SimpleQueue[asyncio.Future[int] | None] = queue.SimpleQueue()
        self.passes = 0
        self.max_batch = 0
        self.thread = threading.Thread(target=self._drive, name="mlx-lm-batch", daemon=True)
        self.thread.start()

    def _drive(self) -> None:
        """Takes new calls in, steps the batch once, hands finished sequences back; until closed."""
        running: dict[int, tuple[asyncio.Future[int], list[int]]] = {}
        while True:
            new: list[asyncio.Future[int]] = []
            try:
                while True:
                    item = self.inbox.get(block=not running and not new)
                    if item is None:
                        self.generator.close()
                        return
                    new.append(item)
            except queue.Empty:
                pass
            if new:
                uids = self.generator.insert([self.direct.prompt_ids] * len(new), [MAX_TOKENS] * len(new))
                running.update((uid, (future, [])) for uid, future in zip(uids, new, strict=True))
            responses = self.generator.next_generated()
            self.passes += 1
            self.max_batch = max(self.max_batch, len(responses))
            for response in responses:
                future, tokens = running[response.uid]
                tokens.append(response.token)
                if response.finish_reason is not None:
                    del running[response.uid]
                    self.direct.tokenizer.decode(tokens)
                    self.loop.call_soon_threadsafe(future.set_result, len(tokens))

    def call(self) -> Call:
        async def call(i: int) -> int:
            future: asyncio.Future[int] = self.loop.create_future()
            self.inbox.put(future)
            return await future

        return call

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join()


# -- the runs -------------------------------------------------------------------------------


async def interleaved(variants: list[tuple[str, Call]], requests: int, concurrency: int, rounds: int) -> Pair:
    """run_interleaved after an unmeasured warm-up of each variant at this concurrency: MLX builds
    (and mlx-lm compiles) per batch shape, which a one-at-a-time warm-up does not reach."""
    for name, call in variants:
        await run_concurrent(f"{name} warm-up", call, 2 * concurrency, concurrency)
    measured, peer = await run_interleaved(variants, requests, concurrency, rounds, warmup=0)
    return measured, peer


async def run_direct(backend: Any, requests: int, rounds: int) -> tuple[list[Pair], list[RunStats], str]:
    """gengate ÷ mlx-lm at c=1 (generate_step) and c=4 (BatchGenerator), taking turns."""
    direct = DirectMlxLm()
    batch = BatchPeer(direct, asyncio.get_running_loop())
    ours = engine_call(backend, ignore_eos=True)
    pairs: list[Pair] = []
    rows: list[RunStats] = []
    try:
        for concurrency in CONCURRENCY:
            peer = (
                ("mlx-lm generate_step", direct.call())
                if concurrency == 1
                else ("mlx-lm BatchGenerator", batch.call())
            )
            pair = await interleaved([("gengate MlxBackend", ours), peer], requests, concurrency, rounds)
            pairs.append(pair)
            rows += pair
        stats = backend.stats
        passes, stats.max_batch_size = stats.forward_passes, 0
        batch_passes, batch.max_batch = batch.passes, 0
        tokens = sum(await asyncio.gather(*(ours(i) for i in range(4))))
        peer_tokens = sum(await asyncio.gather(*(batch.call()(i) for i in range(4))))
        note = (
            f"batching proof, one round of 4 concurrent requests: gengate {stats.forward_passes - passes} "
            f"forward passes for {tokens} tokens (largest batch {stats.max_batch_size}); "
            f"BatchGenerator {batch.passes - batch_passes} steps for {peer_tokens} tokens "
            f"(largest batch {batch.max_batch}); prompt tokens: {len(direct.prompt_ids)} on both"
        )
    finally:
        batch.close()
        direct.close()
    return pairs, rows, note


async def run_constraints(
    backend: Any, requests: int, rounds: int
) -> tuple[list[Pair], list[RunStats], float]:
    """JSON Schema ÷ unconstrained on the engine at c=1 and c=4, taking turns."""
    constrained = engine_call(backend, schema=SCHEMA)
    started = time.perf_counter()
    await constrained(0)  # compiles the schema; later requests hit the compiler's cache
    first_s = time.perf_counter() - started
    pairs: list[Pair] = []
    rows: list[RunStats] = []
    for concurrency in CONCURRENCY:
        variants = [("mlx JSON schema", constrained), ("mlx unconstrained", engine_call(backend))]
        pair = await interleaved(variants, requests, concurrency, rounds)
        pairs.append(pair)
        rows += pair
    return pairs, rows, first_s


async def run(args: argparse.Namespace) -> None:
    rounds = 1 if args.quick else 3
    requests = 8 if args.quick else 32
    summary: list[str] = []
    backend = await start_engine()
    try:
        pairs, rows, note = await run_direct(backend, requests, rounds)
        print_table(
            f"mlx tiny: gengate vs mlx-lm directly, {requests} requests, max_tokens {MAX_TOKENS}", rows
        )
        print(f"  {note}")
        summary += print_ratios(pairs)
        pairs, rows, first_s = await run_constraints(backend, requests, rounds)
        print_table(f"mlx tiny engine: JSON schema vs none, max_tokens {MAX_TOKENS}", rows)
        print(f"  first JSON-schema request (compiles the grammar): {1000 * first_s:.1f} ms")
        summary += print_ratios(pairs)
    finally:
        await backend.aclose()
    print(f"\nSUMMARY throughput ratios: {', '.join(summary)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one round of 8 requests each (a smoke run)")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
