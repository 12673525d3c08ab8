"""Per-token cost of gengate's SequenceDecoder (sampling: temperature, top-p, top-k, repetition
penalty, a stop string) against the least a sampler does: a numpy softmax and one draw over the
same logits. Moved here from the tests (performance is measured, never asserted).

    .venv/bin/python bench/decoding.py [--tokens 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gengate.domain import SamplingParams, StoppingCriteria
from gengate.engines.decoding import SequenceDecoder


def decoder_per_token(vocab: int, tokens: int) -> float:
    decoder = SequenceDecoder(
        index=0,
        detokenize=lambda ids: b"x",
        eos_token_ids=frozenset({0}),
        sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1, repetition_penalty=1.1),
        stopping=StoppingCriteria(max_tokens=None, stop=("END",)),
        logprobs=None,
        matcher=None,
        prompt_token_ids=list(range(100)),
        vocab_size=vocab,
    )
    logits = np.random.default_rng(0).normal(size=vocab).astype(np.float32)
    logits[0] = -100
    start = time.perf_counter()
    for _ in range(tokens):
        decoder.step(logits)
    return (time.perf_counter() - start) / tokens


def peer_per_token(vocab: int, tokens: int) -> float:
    rng = np.random.default_rng(1)
    logits = np.random.default_rng(0).normal(size=vocab).astype(np.float32)
    start = time.perf_counter()
    for _ in range(tokens):
        scaled = logits / 0.8
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        rng.choice(vocab, p=probs)
    return (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for vocab in (2048, 32_000, 128_000):
        ours = min(decoder_per_token(vocab, args.tokens) for _ in range(args.rounds))
        peer = min(peer_per_token(vocab, args.tokens) for _ in range(args.rounds))
        print(
            f"vocab {vocab:>7}: decoder {ours * 1e6:8.1f} us/token, numpy softmax+draw {peer * 1e6:8.1f}"
            f" us/token, ratio {ours / peer:.2f}"
        )


if __name__ == "__main__":
    main()
