"""Builds a small random Llama (head_dim 64, which vLLM's attention kernels accept) as an HF folder.

No download: the same seeded BPE tokenizer and random weights as gengate's tiny model, only
wider (`--shape small`, for GPU throughput) or just wide enough for vLLM (`--shape tiny`, the
TINY_VLLM shape the CPU vLLM tests use). Outputs are nonsense; throughput and constraint
enforcement are what is measured.
usage: python bench/gpu/make_model.py DEST [--shape small|tiny]  → prints the HF folder path
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gengate.models import tiny

SHAPES = {
    "small": tiny.TinyConfig(
        hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4
    ),
    "tiny": tiny.TINY_VLLM,
}


def build(dest: Path, shape: str = "small") -> Path:
    return tiny.build_tiny_model(dest, config=SHAPES[shape]).hf_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    args = parser.parse_args()
    print(build(args.dest.absolute(), args.shape))
