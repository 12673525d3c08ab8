"""How many forward passes jump-forward saves on outputs a trained model would write.

The benchmark models have random weights: under a JSON Schema they write long nonsense strings,
so few of their tokens are forced (10% on tiny, 4% at 32k in `constrained_step.py`'s runs). A real
model writes short values between the keys and punctuation its schema forces. This replays
realistic documents through the engines' own decoder (SequenceDecoder, the llguidance matcher,
the grammar compiled by ConstraintCompiler) on both benchmark tokenizers: a stand-in model whose
logits favour the longest token that spells the document on (greedy), and counts the steps that
needed logits: the forward passes with jump-forward, the prompt's included (tokens forced before
the first sampled one join it); without, every token needs one. The document must come out
byte for byte, or the row says so.

    .venv/bin/python bench/forced_share.py
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from common import EXTRACTION, SCHEMA

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "country": {"enum": ["France", "Germany", "Japan", "United States"]},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "email", "country", "languages"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DOCUMENTS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "bench schema (story card)",
        SCHEMA,
        {
            "title": "The Painter of Gears",
            "tags": ["robot", "art", "friendship"],
            "rating": 4,
            "summary": "A maintenance robot in a quiet town finds a box of paints and learns to see.",
        },
    ),
    (
        "person record",
        PERSON,
        {
            "name": "Ada Lovelace",
            "age": 36,
            "email": "ada@example.org",
            "country": "United States",
            "languages": ["English", "French"],
        },
    ),
    (
        "review extraction",
        EXTRACTION,
        {
            "sentiment": "negative",
            "confidence": 0.87,
            "topics": ["delivery", "support"],
            "needs_follow_up": True,
        },
    ),
    (
        "tool call",
        TOOL_CALL,
        {"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius", "days": 3}},
    ),
]


def replay(compiled: Any, ll: Any, text: bytes) -> tuple[int, int, bool]:
    """(tokens, steps that needed logits, whether the output is `text`) for a greedy stand-in
    model that favours the longest token spelling `text` on from what is written so far."""
    from gengate.domain import SamplingParams, StoppingCriteria
    from gengate.engines.decoding import SequenceDecoder

    vocab = ll.vocab_size
    pieces = [ll.decode_bytes([t]) for t in range(vocab)]
    decoder = SequenceDecoder(
        index=0,
        detokenize=ll.decode_bytes,
        eos_token_ids=frozenset({ll.eos_token}),
        sampling=SamplingParams(seed=0, temperature=0.0),
        stopping=StoppingCriteria(max_tokens=4 * len(text) + 8),
        logprobs=None,
        matcher=compiled.new_matcher(),
        prompt_token_ids=(1,),
        vocab_size=vocab,
    )
    written = b""
    tokens = asked = 0

    def logits() -> np.ndarray:
        rest = text[len(written) :]
        out = np.full(vocab, -50.0, dtype=np.float32)
        if not rest:
            out[ll.eos_token] = 50.0
            return out
        for token, piece in enumerate(pieces):
            if piece and rest.startswith(piece):
                out[token] = float(len(piece))
        return out

    forced = decoder.step_forced()  # those before the first sampled token join the prompt's pass
    while forced is not None or decoder.finished is None:
        if forced is None:
            asked += 1
        step = forced if forced is not None else decoder.step(logits())
        if step.token_id is not None:
            tokens += 1
            if step.token_id != ll.eos_token:
                written += pieces[step.token_id]
        forced = decoder.step_forced() if step.finished is None else None
    return tokens, asked, written == text


def main() -> int:
    from gengate.constraints.compiler import ConstraintCompiler
    from gengate.domain import JsonSchemaConstraint, StructuredOutput
    from gengate.models.tiny import BENCH_32K, build_tiny_model, default_tiny_dir
    from llguidance import LLTokenizer
    from tokenizers import Tokenizer

    folders = {
        "tiny (1k)": build_tiny_model(default_tiny_dir()).hf_dir,
        "32k": build_tiny_model(default_tiny_dir().parent / "bench-32k", config=BENCH_32K).hf_dir,
    }
    print("| document | tokenizer | tokens | passes with jump-forward | passes saved | exact |")
    print("|---|---|---|---|---|---|")
    totals: dict[str, list[int]] = {}
    for label, folder in folders.items():
        hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
        eos = hf.token_to_id("<eos>")
        ll = LLTokenizer(hf.to_str(), eos_token=eos)
        compiler = ConstraintCompiler(ll, label)
        for name, schema, document in DOCUMENTS:
            compiled = compiler.compile_sync(StructuredOutput(JsonSchemaConstraint(schema)))
            text = json.dumps(document, separators=(",", ":")).encode()
            tokens, passes, exact = replay(compiled, ll, text)
            total = totals.setdefault(label, [0, 0])
            total[0] += tokens
            total[1] += passes
            print(f"| {name} | {label} | {tokens} | {passes} | {1 - passes / tokens:.0%} | {exact} |")
        compiler.close()
    for label, (tokens, passes) in totals.items():
        print(f"{label}: {tokens} tokens, {passes} passes: {1 - passes / tokens:.0%} of passes saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
