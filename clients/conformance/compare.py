"""Prints each language's conformance results and checks that the languages agree.

    python compare.py OUT/python OUT/go ... --suffix .json

Exits 1 when a vector failed in any language, a language lacks a vector, or the `observed`
values (texts of seeded requests, error codes and fields) differ between languages.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main() -> int:
    args = sys.argv[1:]
    suffix = args[args.index("--suffix") + 1] if "--suffix" in args else ""
    paths = [Path(a + suffix) for a in args if not a.startswith("--") and a != suffix]
    runs: dict[str, dict[str, Any]] = {}
    failed = 0
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"FAIL {path.stem}: no results ({exc})")
            failed += 1
            continue
        runs[doc["language"]] = {r["name"]: r for r in doc["results"]}
    names = sorted({n for results in runs.values() for n in results})
    passed = 0
    for name in names:
        problems = []
        for lang, results in runs.items():
            r = results.get(name)
            if r is None:
                problems.append(f"{lang}: missing")
            elif not r["ok"]:
                problems.append(f"{lang}: " + "; ".join(r["failures"]))
        observed = {
            lang: json.dumps(results[name]["observed"], sort_keys=True)
            for lang, results in runs.items()
            if name in results
        }
        if len(set(observed.values())) > 1:
            problems.append("languages disagree: " + "; ".join(f"{k}={v[:300]}" for k, v in observed.items()))
        if problems:
            failed += 1
            print(f"FAIL {name}")
            for p in problems:
                print(f"     {p}")
        else:
            passed += 1
            print(f"ok   {name}")
    print(f"languages: {', '.join(runs)}")
    print(f"conformance: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
