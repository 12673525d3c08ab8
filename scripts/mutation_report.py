"""The end of scripts/mutation: the score per module and every surviving mutant with its line and diff.

Run from .mutation/ (where mutmut ran) with the same mutant names scripts/mutation gave mutmut (none:
every mutant). Reads mutmut's results (mutants/**/*.meta) and the diffs through mutmut's own API.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
from collections import Counter
from pathlib import Path

from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.mutation.trampoline_templates import CLASS_NAME_SEPARATOR
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

KILLED = {"killed", "caught by type check"}


def function_start_lines(source: str) -> dict[tuple[str | None, str], int]:
    """(class, function) -> the first line of its text as mutmut diffs it (the first decorator, else def)."""
    starts: dict[tuple[str | None, str], int] = {}

    def visit(body: list[ast.stmt], cls: str | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, node.name)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                starts.setdefault((cls, node.name), first)

    visit(ast.parse(source).body, None)
    return starts


def split_name(mutant: str) -> tuple[str | None, str]:
    """'gengate.service.xǁGenerationCoreǁgenerate__mutmut_3' -> ('GenerationCore', 'generate')."""
    mangled = mutant.rpartition(".")[2].partition("__mutmut_")[0]
    if mangled.startswith("x" + CLASS_NAME_SEPARATOR):
        _, cls, func = mangled.split(CLASS_NAME_SEPARATOR)
        return cls, func
    return None, mangled.removeprefix("x_")


def changed_line(diff: str, start: int) -> tuple[int, list[str]]:
    """The source line of the first change in a function-relative unified diff, and its -/+ lines."""
    lines = diff.splitlines()
    offset, line_no = 0, None
    changes: list[str] = []
    for text in lines:
        hunk = re.match(r"@@ -(\d+)", text)
        if hunk:
            offset = int(hunk.group(1))
            continue
        if text.startswith(("---", "+++")):
            continue
        if text.startswith(("-", "+")):
            if line_no is None:
                line_no = start + offset - 1
            changes.append(text)
        elif line_no is None:
            offset += 1
    return (line_no or start), changes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=0)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()

    rows: list[tuple[str, Counter[str]]] = []
    survivors: list[tuple[str, int, str, str, list[str]]] = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        counts: Counter[str] = Counter()
        starts = function_start_lines(Path(path).read_text())
        for mutant, code in sorted(data.exit_code_by_key.items()):
            if args.names and not any(fnmatch.fnmatch(mutant, n) for n in args.names):
                continue
            status = status_by_exit_code[code]
            counts[status] += 1
            if status in ("survived", "no tests", "suspicious"):
                line, changes = changed_line(
                    get_diff_for_mutant(mutant, path=path), starts.get(split_name(mutant), 1)
                )
                survivors.append((str(path), line, mutant, status, changes))
        if counts:
            rows.append((str(path), counts))

    print()
    print(f"== mutation score ({args.seconds // 60} min {args.seconds % 60} s)")
    print(f"{'module':36} {'mutants':>7} {'killed':>7} {'survived':>8} {'timeout':>7} {'no test':>7}  score")
    total: Counter[str] = Counter()
    for module, counts in rows:
        total.update(counts)
        print(line_for(module, counts))
    if len(rows) > 1:
        print(line_for("all", total))
    unchecked = total["not checked"]
    if unchecked:
        print(f"({unchecked} mutants not checked: the run was interrupted)")
    print()
    print(f"== surviving mutants ({len(survivors)}); review: tests/mutation/SURVIVORS.md")
    for module, line, mutant, status, changes in sorted(survivors, key=lambda s: (s[0], s[1], s[2])):
        tag = "" if status == "survived" else f" [{status}]"
        print(f"{module}:{line}  {mutant.rpartition('.')[2]}{tag}")
        for change in changes:
            print(f"    {change.strip()[:1]} {change[1:].strip()}")


def line_for(path: str, counts: Counter[str]) -> str:
    checked = sum(n for status, n in counts.items() if status != "not checked")
    killed = sum(counts[s] for s in KILLED)
    timeout = counts["timeout"]
    # A timeout is a kill (the mutant made a test hang), shown apart.
    score = f"{100 * (killed + timeout) / checked:.1f}%" if checked else "-"
    return (
        f"{path:36} {checked:>7} {killed:>7} {counts['survived']:>8} {timeout:>7} "
        f"{counts['no tests']:>7}  {score}"
    )


if __name__ == "__main__":
    main()
