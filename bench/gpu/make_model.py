"""Builds a small random Llama (head_dim 64, which vLLM's attention kernels accept) as an HF folder.

No download: the same seeded BPE tokenizer and random weights as gengate's tiny model, only
wider. Outputs are nonsense; throughput and constraint enforcement are what is measured.
usage: python bench/gpu/make_model.py DEST  → prints the HF folder path
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from gengate.models import tiny


def build(dest: Path) -> Path:
    config = tiny.TinyConfig(
        hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4
    )
    hf_dir = dest / tiny.HF_DIR_NAME
    if (hf_dir / "config.json").is_file():
        return hf_dir
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    tiny._write_model(dest, seed=0, config=config)
    return hf_dir


if __name__ == "__main__":
    print(build(Path(sys.argv[1]).absolute()))
