"""One regex dialect for every client: `\\d` and `\\w` mean ASCII, as in ECMA-262 (JSON Schema's
`pattern`), Go's RE2 and JavaScript.

llguidance and Python's `re` read them as Unicode classes, so a Go or TypeScript client would
reject a fullwidth digit the server accepted. Patterns are rewritten before compiling and
validating, so what is generated and what is checked agree with what clients check.
"""

from __future__ import annotations

_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}
_INSIDE = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_shorthands(pattern: str) -> str:
    """Rewrites `\\d \\D \\w \\W` to explicit ASCII classes; every other escape is kept as written.

    Inside a bracket class `\\D` and `\\W` cannot be spelled as ranges and keep their meaning.
    """
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            table = _INSIDE if in_class else _OUTSIDE
            out.append(table.get(nxt, ch + nxt))
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            i += 1
            # a leading ^ and a leading ] are literal parts of the class syntax
            if i < len(pattern) and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < len(pattern) and pattern[i] == "]":
                out.append("]")
                i += 1
            continue
        if ch == "]" and in_class:
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)


_SET_OPERATORS = ("&&", "--", "~~")


def class_set_operations(pattern: str) -> bool:
    """True when a bracket class uses a set operation (`[a-z&&[^aeiou]]`, `--`, `~~`).

    llguidance (Rust regex syntax) reads these as intersection, difference and symmetric
    difference; RE2 reads the same text as literal characters and a class that ends early. The
    grammar engine and the validator would disagree, so such a pattern is never given to RE2.
    """
    depth = 0
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            depth += 1
            i += 1
            if i < len(pattern) and pattern[i] == "^":
                i += 1
            if i < len(pattern) and pattern[i] == "]":  # a leading ] is a literal
                i += 1
            continue
        if depth and ch == "]":
            depth -= 1
        elif depth and pattern[i : i + 2] in _SET_OPERATORS:
            return True
        i += 1
    return False
