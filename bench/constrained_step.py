"""Per-token cost of llama.cpp's decode loop, JSON Schema constrained vs not, without the event loop.

Runs the engine's own worker loop (LlamaCppBackend._decode) on this thread for seeded requests
(bench/common.py's PROMPT and SCHEMA, or with `--schema extraction` its EXTRACTION,
whose enums and boolean are mostly forced; temperature 1, max_tokens 32; llama.cpp on one
thread, so the 2-core machine's noise stays out) and reports one of:

  time       µs per token, constrained and not, rounds interleaved, and their ratio
  steps      µs per token inside SequenceDecoder.step alone, and in the rest of the loop
  profile    cProfile of the constrained loop: where a token's time goes, per call
  callgrind  instructions per token (deterministic); run it under callgrind, which this
             switches on only around the timed loop:
                 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg.out \\
                     .venv/bin/python bench/constrained_step.py callgrind [--32k]
             cg.out.1 holds the unconstrained run, cg.out.2 the constrained one (the same
             seeds); `callgrind_annotate cg.out.2` splits it by function.

Old and new code are compared in one sitting by switching PYTHONPATH to the other tree's server/.

    .venv/bin/python bench/constrained_step.py time [--32k] [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import subprocess
import sys
import time
from typing import Any

from common import EXTRACTION, PROMPT, SCHEMA

MAX_TOKENS = 32


class _Sink:
    """Stands in for LoopHandoff: keeps the worker's items, counts its tokens."""

    def __init__(self) -> None:
        self.tokens = 0

    def put(self, item: Any, *, last: bool = False, more: bool = False) -> None:
        from gengate.engines.llamacpp import _Done, _Failed

        if isinstance(item, _Failed):
            raise item.error
        if isinstance(item, _Done):
            self.tokens = item.output_tokens


class Loop:
    """The llama.cpp backend's worker loop for one model, driven on the calling thread."""

    def __init__(self, gguf: str | None, schema: dict[str, Any] = SCHEMA) -> None:
        from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

        options = (
            LlamaCppOptions(tiny=True, n_threads=1)
            if gguf is None
            else LlamaCppOptions(path=gguf, n_threads=1)
        )
        self.backend = LlamaCppBackend("bench", options)
        asyncio.run(self.backend.start())
        from gengate.domain import GenerationRequest, JsonSchemaConstraint, StructuredOutput

        self.structured = StructuredOutput(JsonSchemaConstraint(schema))
        self.compiled = self.backend._compiler.compile_sync(self.structured)
        self.prompt = self.backend._prompt(GenerationRequest(model="bench", prompt=PROMPT))[0]

    def run(self, seed: int, constrained: bool) -> int:
        """One generation; returns its output tokens."""
        from gengate.domain import SamplingParams, StoppingCriteria
        from gengate.engines.llamacpp import _Job
        from gengate.engines.options import NO_OPTIONS

        sink = _Sink()
        job = _Job(
            index=0,
            prompt=self.prompt,
            sampling=SamplingParams(seed=seed, temperature=1.0),
            stopping=StoppingCriteria(max_tokens=MAX_TOKENS),
            logprobs=None,
            compiled=self.compiled if constrained else None,
            options=NO_OPTIONS,
            deadline=None,
            handoff=sink,  # type: ignore[arg-type]
        )
        self.backend._decode(job)
        return sink.tokens

    def many(self, seeds: range, constrained: bool) -> tuple[int, float]:
        started = time.perf_counter()
        tokens = sum(self.run(s, constrained) for s in seeds)
        return tokens, time.perf_counter() - started


def _callgrind(on: bool) -> None:
    subprocess.run(
        ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("mode", choices=["time", "steps", "profile", "callgrind"])
    parser.add_argument("--32k", dest="big", action="store_true", help="the 32k-vocabulary model")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--which", choices=["both", "constrained", "free"], default="both")
    parser.add_argument(
        "--schema",
        choices=["story", "extraction"],
        default="story",
        help="bench/common.py's SCHEMA, or its EXTRACTION (enums, a boolean: mostly forced)",
    )
    args = parser.parse_args(argv)
    gguf = None
    if args.big:
        from batching import bench_32k_gguf

        gguf = bench_32k_gguf()
    loop = Loop(gguf, EXTRACTION if args.schema == "extraction" else SCHEMA)
    seeds = range(1, args.requests + 1)
    loop.many(range(1, 4), True)  # warm-up: caches, first-call costs
    loop.many(range(1, 4), False)
    if args.mode == "time":
        totals = {True: [0, 0.0], False: [0, 0.0]}
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.rounds):
            for constrained in (False, True):
                tokens, wall = loop.many(seeds, constrained)
                totals[constrained][0] += tokens
                totals[constrained][1] += wall
                best[constrained] = min(best[constrained], wall / tokens)
        us = {k: 1e6 * v[1] / v[0] for k, v in totals.items()}
        print(f"tokens: free {totals[False][0]}, constrained {totals[True][0]}")
        print(
            f"µs/token mean: free {us[False]:.2f}, constrained {us[True]:.2f}, "
            f"ratio (tok/s) {us[False] / us[True]:.3f}"
        )
        print(
            f"µs/token best round: free {1e6 * best[False]:.2f}, constrained {1e6 * best[True]:.2f}, "
            f"ratio {best[False] / best[True]:.3f}"
        )
    elif args.mode == "steps":
        from gengate.engines import decoding

        spent = [0]
        plain = decoding.SequenceDecoder.step

        def timed(self: Any, logits: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return plain(self, logits)
            finally:
                spent[0] += time.perf_counter_ns() - began

        decoding.SequenceDecoder.step = timed  # type: ignore[method-assign]
        rows: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                spent[0] = 0
                tokens, wall = loop.many(seeds, constrained)
                rows[constrained].append(spent[0] / 1e3 / tokens)
                rows[constrained].append(1e6 * wall / tokens)
        for constrained in (False, True):
            step_us = min(rows[constrained][0::2])
            total_us = min(rows[constrained][1::2])
            print(
                f"{'constrained' if constrained else 'free':12s} step {step_us:7.2f} µs/token, "
                f"whole loop {total_us:7.2f} µs/token (best of {args.rounds})"
            )
    elif args.mode == "profile":
        profile = cProfile.Profile()
        profile.enable()
        tokens, _ = loop.many(seeds, True)
        profile.disable()
        print(f"{tokens} constrained tokens")
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    else:
        results = []
        for constrained in (False, True):
            if args.which != "both" and constrained != (args.which == "constrained"):
                continue
            _callgrind(True)
            tokens, _ = loop.many(seeds, constrained)
            _callgrind(False)
            results.append((constrained, tokens))
            subprocess.run(
                ["callgrind_control", "-d", f"{'constrained' if constrained else 'free'}", str(os.getpid())],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        for constrained, tokens in results:
            print(f"{'constrained' if constrained else 'free'}: {tokens} tokens")
    asyncio.run(loop.backend.aclose())
    return 0


if __name__ == "__main__":
    sys.exit(main())
