"""JSONSchemaBench sample: how many real-world schemas gengate serves, and whether any output is invalid.

Runs every schema of corpora/jsonschemabench through the tiny llama.cpp model (max 400 tokens)
and sorts each into: accepted (valid / cut at max_tokens / INVALID), refused up front (reasons
grouped), or failed validation after relaxation (no invalid result returned). With
`--llguidance-only` it only lowers and compiles (no generation): acceptance counts in seconds.

    .venv/bin/python bench/jsonschemabench.py [--limit N] [--llguidance-only]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gengate import errors
from gengate.constraints import ConstraintCompiler, lower, validate_output
from gengate.domain import (
    Enforcement,
    FinishReason,
    GenerationRequest,
    JsonSchemaConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from tqdm import tqdm

DEFAULT_CORPUS = Path(os.environ.get("GENGATE_SHARED", "/work/shared")) / "corpora" / "jsonschemabench"
PROMPT = "Answer with one JSON document that matches the schema.\n"


def load_schemas(corpus: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, schema) for every schema file, with the sample's `_meta` key dropped."""
    out = []
    for path in sorted(corpus.glob("*/*.json")):
        schema = json.loads(path.read_text())
        schema.pop("_meta", None)
        out.append((f"{path.parent.name}/{path.name}", schema))
    return out


def refusal_group(exc: errors.GengateError) -> str:
    """A short grouping key: the reason plus the first words of the description."""
    text = exc.violations[0].description if exc.violations else exc.message
    text = text.split(":", 1)[-1].strip() if text.startswith(("unsupported", "not supported")) else text
    return f"{exc.reason}: {text.splitlines()[0][:70]}"


async def run_compile_only(schemas: list[tuple[str, dict[str, Any]]]) -> int:
    from gengate.models.tiny import EOS_TOKEN, build_tiny_model, default_tiny_dir
    from llguidance import LLTokenizer
    from tokenizers import Tokenizer

    paths = build_tiny_model(default_tiny_dir())
    tokenizer = Tokenizer.from_file(str(paths.hf_dir / "tokenizer.json"))
    compiler = ConstraintCompiler(
        LLTokenizer(tokenizer.to_str(), eos_token=tokenizer.token_to_id(EOS_TOKEN)), "tiny"
    )
    counts: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()
    relaxations: collections.Counter[str] = collections.Counter()
    for _, schema in tqdm(schemas, desc="compile", unit="schema"):
        try:
            compiled = await compiler.compile(StructuredOutput(JsonSchemaConstraint(schema)))
        except errors.InvalidArgument as exc:
            counts["refused"] += 1
            refusals[refusal_group(exc)] += 1
            continue
        counts[f"compiled ({compiled.enforcement.value})"] += 1
        for relaxation in compiled.relaxations:
            relaxations[relaxation.split(" at ")[0]] += 1
    compiler.close()
    print_report(len(schemas), counts, refusals, relaxations)
    return 0


async def run_generation(schemas: list[tuple[str, dict[str, Any]]], max_tokens: int) -> int:
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    backend = LlamaCppBackend("tiny", LlamaCppOptions(tiny=True))
    await backend.start()
    counts: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()
    relaxations: collections.Counter[str] = collections.Counter()
    invalid: list[str] = []
    started = time.monotonic()
    try:
        for i, (name, schema) in enumerate(tqdm(schemas, desc="generate", unit="schema")):
            structured = StructuredOutput(JsonSchemaConstraint(schema))
            request = GenerationRequest(
                model="tiny",
                prompt=PROMPT,
                sampling=SamplingParams(seed=i),
                stopping=StoppingCriteria(max_tokens=max_tokens),
                structured_output=structured,
            )
            try:
                result = await backend.generate(request)
            except errors.InvalidArgument as exc:
                counts["refused"] += 1
                refusals[refusal_group(exc)] += 1
                continue
            except errors.Aborted as exc:
                counts["failed validation after relaxation (nothing invalid returned)"] += 1
                refusals[f"{exc.reason}: {name}"] += 1
                continue
            generation = result.generations[0]
            if result.enforcement is Enforcement.VALIDATED:
                counts["(served as validated: relaxed schema)"] += 1
                for relaxation in lower(structured).relaxations:
                    relaxations[relaxation.split(" at ")[0]] += 1
            if generation.finish_reason is FinishReason.LENGTH:
                counts["accepted: cut at max_tokens"] += 1
                continue
            reason = validate_output(structured, generation.text)
            if reason is None:
                counts["accepted: valid"] += 1
            else:
                counts["accepted: INVALID"] += 1
                invalid.append(f"{name}: {reason}")
    finally:
        await backend.aclose()
    print_report(len(schemas), counts, refusals, relaxations)
    for line in invalid:
        print("  invalid:", line)
    print(f"wall time {time.monotonic() - started:.1f} s")
    return 1 if invalid else 0


def print_report(
    total: int,
    counts: collections.Counter[str],
    refusals: collections.Counter[str],
    relaxations: collections.Counter[str],
) -> None:
    print(f"\n{total} schemas")
    for key in sorted(counts):
        print(f"  {key:<60} {counts[key]:>4}  ({100 * counts[key] / max(total, 1):.1f}%)")
    if relaxations:
        print("relaxations used:")
        for key, n in relaxations.most_common():
            print(f"  {n:>4}  {key}")
    if refusals:
        print("refusals:")
        for key, n in refusals.most_common():
            print(f"  {n:>4}  {key}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--llguidance-only", action="store_true", help="lower and compile only")
    args = parser.parse_args(argv)
    schemas = load_schemas(args.corpus)[: args.limit]
    if args.llguidance_only:
        return asyncio.run(run_compile_only(schemas))
    return asyncio.run(run_generation(schemas, args.max_tokens))


if __name__ == "__main__":
    sys.exit(main())
