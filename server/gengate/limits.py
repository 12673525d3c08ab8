"""Request limits checked before any work: sizes, counts, nesting and expansion of what a caller sends.

Every check here is linear in the request's size and uses no regex engine and no recursion, so
it is safe to run on the event loop for any input the gRPC message limit lets through. A request
over a limit is refused with INVALID_ARGUMENT naming the field, the limit and its value
(`server.limits.<name>` in the configuration), before tokenizing, compiling or validating.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gengate.domain import ChatMessage, GenerationRequest, MagpieInput, TextPart
from gengate.errors import FieldViolation

LIMIT_REASON = "LIMIT_EXCEEDED"


class RequestLimits(BaseModel):
    """The `server.limits` section. Defaults are safe for a public endpoint and roomy for real use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Input text: the prompt, or all text parts of all messages together (UTF-8 bytes).
    max_prompt_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    max_messages: int = Field(default=4096, gt=0)
    max_stop_sequences: int = Field(default=16, gt=0)
    max_stop_bytes: int = Field(default=1024, gt=0)
    # A constraint's own text: schema as JSON, regex, grammar definition, all choices together.
    max_constraint_bytes: int = Field(default=512 * 1024, gt=0)
    max_schema_depth: int = Field(default=64, gt=0)
    # $ref occurrences in a schema: reference chains are how a flat schema nests deeply
    # (llguidance overflows its stack on a chain of ~5,000).
    max_schema_refs: int = Field(default=1000, gt=0)
    # Lark/GBNF rules: a chain of ~3,000 rules overflows llguidance's stack.
    max_grammar_rules: int = Field(default=1000, gt=0)
    max_choices: int = Field(default=10_000, gt=0)
    max_regex_depth: int = Field(default=64, gt=0)
    # States a regex needs once its counted repetitions are expanded: `a{1000}` is 1,000,
    # `(a{100}){100}` is 10,000. Also applies to `pattern` and `patternProperties` in schemas.
    max_regex_expansion: int = Field(default=100_000, gt=0)
    # Constraint checking (metaschema, lowering, a trial compile) runs in sandbox processes.
    constraint_checkers: int = Field(default=2, gt=0, le=64)
    constraint_check_timeout_s: float = Field(default=10.0, gt=0)
    constraint_check_memory_mb: int = Field(default=2048, ge=256)
    # Constraint checks waiting for a free checker beyond this count: RESOURCE_EXHAUSTED.
    max_pending_constraint_checks: int = Field(default=64, ge=0)
    # Validation of a finished output against its constraint (off the event loop).
    validation_timeout_s: float = Field(default=10.0, gt=0)


def over_limit(field: str, what: str, value: int, name: str, limit: int) -> FieldViolation:
    """The violation for `what` (measured as `value`) over `server.limits.<name>`. A size known
    only from below (a text's length in characters, not encoded) is `at least` that value."""
    measured = f"is at least {int(value)}" if isinstance(value, AtLeast) else f"is {value}"
    return FieldViolation(field, f"{what} {measured}, over the limit of {limit} (server.limits.{name})")


# The most user turns one Magpie request writes (each is one or two model calls per generation).
MAX_MAGPIE_TURNS = 16


def _magpie_violations(magpie: MagpieInput, limits: RequestLimits) -> list[FieldViolation]:
    """A Magpie input's limits: its turns, its conversation's length and its texts' total size
    (template, system prompt and conversation count against max_prompt_bytes together)."""
    out: list[FieldViolation] = []
    if magpie.n_turns > MAX_MAGPIE_TURNS:
        out.append(
            FieldViolation("magpie.n_turns", f"is {magpie.n_turns}, over the most of {MAX_MAGPIE_TURNS}")
        )
    if len(magpie.conversation) > limits.max_messages:
        what = "the number of messages"
        out.append(
            over_limit(
                "magpie.conversation", what, len(magpie.conversation), "max_messages", limits.max_messages
            )
        )
    texts = [magpie.template or "", magpie.system_prompt or ""]
    parts = (p.text for m in magpie.conversation for p in m.content if isinstance(p, TextPart))
    size = texts_bytes(itertools.chain(texts, parts), limits.max_prompt_bytes)
    if size > limits.max_prompt_bytes:
        what = "the Magpie template, system prompt and conversation's size in bytes"
        out.append(over_limit("magpie", what, size, "max_prompt_bytes", limits.max_prompt_bytes))
    return out


def text_violations(request: GenerationRequest, limits: RequestLimits) -> list[FieldViolation]:
    """Every limit the request's texts exceed (prompt, messages, stop sequences; empty when none),
    cheap and linear in their size. A constraint's own limits are its kind's
    (gengate.constraints.kinds); gengate.checks.request_violations asks both."""
    out: list[FieldViolation] = []
    if request.prompt is not None:
        size = text_bytes(request.prompt, limits.max_prompt_bytes)
        if size > limits.max_prompt_bytes:
            out.append(
                over_limit(
                    "prompt", "the prompt's size in bytes", size, "max_prompt_bytes", limits.max_prompt_bytes
                )
            )
    if request.messages is not None:
        if len(request.messages) > limits.max_messages:
            out.append(
                over_limit(
                    "messages.messages",
                    "the number of messages",
                    len(request.messages),
                    "max_messages",
                    limits.max_messages,
                )
            )
        size = texts_bytes(
            itertools.chain.from_iterable(_message_texts(m) for m in request.messages),
            limits.max_prompt_bytes,
        )
        if size > limits.max_prompt_bytes:
            out.append(
                over_limit(
                    "messages",
                    "the messages' text size in bytes",
                    size,
                    "max_prompt_bytes",
                    limits.max_prompt_bytes,
                )
            )
    if request.magpie is not None:
        out += _magpie_violations(request.magpie, limits)
    stops = request.stopping.stop
    if len(stops) > limits.max_stop_sequences:
        out.append(
            over_limit(
                "stopping.stop",
                "the number of stop sequences",
                len(stops),
                "max_stop_sequences",
                limits.max_stop_sequences,
            )
        )
    for i, stop in enumerate(stops[: limits.max_stop_sequences]):
        size = text_bytes(stop, limits.max_stop_bytes)
        if size > limits.max_stop_bytes:
            out.append(
                over_limit(
                    f"stopping.stop[{i}]",
                    "the stop sequence's size in bytes",
                    size,
                    "max_stop_bytes",
                    limits.max_stop_bytes,
                )
            )
    return out


def _message_texts(message: ChatMessage) -> Iterator[str]:
    """Every text a message carries to the model: its text parts, and an assistant message's tool
    calls (ids, names, arguments) and reasoning (text and signatures)."""
    for part in message.content:
        if isinstance(part, TextPart):
            yield part.text
    for call in message.tool_calls:
        yield call.id
        yield call.name
        yield call.arguments
    yield message.tool_call_id
    if message.reasoning is not None:
        yield message.reasoning.text
        yield from message.reasoning.signatures


class AtLeast(int):
    """A size known only from below: over its limit by the text's length alone."""


def over_constraint_bytes(field: str, what: str, size: int, limits: RequestLimits) -> FieldViolation:
    """The violation for a constraint text (`what`, of `size` bytes) over max_constraint_bytes."""
    return over_limit(field, what, size, "max_constraint_bytes", limits.max_constraint_bytes)


def text_bytes(text: str, limit: int) -> int:
    """UTF-8 size of `text`, encoding it only when its length alone cannot tell against `limit`
    (encoding 45 MB is one long C call that holds the event loop): past the limit by length, the
    answer is AtLeast(length)."""
    return texts_bytes((text,), limit)


def texts_bytes(texts: Iterable[str], limit: int) -> int:
    """The UTF-8 size of several texts together, measured as text_bytes measures one."""
    texts = tuple(texts)
    length = sum(len(t) for t in texts)
    if length > limit:
        return AtLeast(length)
    if 4 * length <= limit:
        return length  # within the limit whatever the characters; the exact size is not needed
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


_RULE_START = re.compile(
    r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_.]*[ \t]*(?:\{[^}\n]*\}[ \t]*)?(?:\.-?[0-9]+[ \t]*)?(?::|::=)", re.M
)


_LARK_REPEAT = re.compile(r"~[ \t]*([0-9]{1,9})(?:[ \t]*\.\.[ \t]*([0-9]{1,9}))?")


# One token of a grammar for grammar_parts: a string literal, a comment, a regex terminal (Lark),
# a character class (GBNF/EBNF: `[^"]` holds no string), or a run of anything else.
_STRING = r"(?P<string>\"(?:[^\"\\\n]|\\.)*\"?|'(?:[^'\\\n]|\\.)*'?)"
_LARK_TOKEN = re.compile(
    _STRING + r"|(?P<comment>//[^\n]*)|(?P<regex>/(?:[^/\\\n]|\\.)+/)|(?P<other>[^\"'/]+|/)", re.S
)
_GBNF_TOKEN = re.compile(
    r"(?P<cls>\[(?:[^\]\\\n]|\\.)*\]?)|" + _STRING + r"|(?P<comment>#[^\n]*)|(?P<other>[^\"'\[#]+)", re.S
)


def grammar_parts(definition: str, *, lark: bool = True) -> tuple[str, list[str]]:
    """The grammar's rule text and its regex terminals (`/.../` in Lark), in one pass, for the
    expansion limit. In the rule text each string literal, regex terminal and character class is
    one `x`, Lark's `~ m..n` is `{m,n}`, and Lark's optional `[...]` a group `(...)`."""
    body: list[str] = []
    regexes: list[str] = []
    for token in (_LARK_TOKEN if lark else _GBNF_TOKEN).finditer(definition):
        kind = token.lastgroup
        if kind in ("string", "cls"):
            body.append("x")
        elif kind == "regex":
            regexes.append(token.group()[1:-1])
            body.append("x")
        elif kind == "other":
            text = token.group()
            body.append(text.replace("[", "(").replace("]", ")") if lark else text)
    text = _LARK_REPEAT.sub(
        lambda m: "{" + m.group(1) + ("," + m.group(2) if m.group(2) else "") + "}", "".join(body)
    )
    return text, regexes


def grammar_rule_count(definition: str) -> int:
    """Rules and terminals defined (`name:` in Lark, `name ::=` in GBNF/EBNF), one per line start."""
    return sum(1 for _ in _RULE_START.finditer(definition))


@dataclass
class JsonShape:
    """Size (about the bytes of its compact JSON text), nesting depth and `$ref` count of a value."""

    size: int = 0
    depth: int = 0
    refs: int = 0
    unreadable: bool = False


def json_shape(value: Any, *, stop_at_bytes: int | None = None) -> JsonShape:
    """Measures a JSON value in one walk, without recursion and without serialising it (a long C
    call such as json.dumps would hold the GIL, and so the event loop, for its whole length).
    Stops early once the size passes `stop_at_bytes`."""
    shape = JsonShape()
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            shape.depth = max(shape.depth, depth + 1)
            shape.size += 2 + 2 * len(node)
            for key, child in node.items():
                shape.size += len(key) + 3
                if key == "$ref":
                    shape.refs += 1
                pending.append((child, depth + 1))
        elif isinstance(node, list):
            shape.depth = max(shape.depth, depth + 1)
            shape.size += 2 + len(node)
            pending.extend((child, depth + 1) for child in node)
        elif isinstance(node, str):
            shape.size += len(node) + 2
        elif isinstance(node, bool) or node is None:
            shape.size += 5
        elif isinstance(node, int):
            if node.bit_length() > 1024:  # more digits than anything real (and than int() converts fast)
                shape.unreadable = True
            shape.size += 8
        elif isinstance(node, float):
            shape.size += 8
        else:
            shape.unreadable = True
        if stop_at_bytes is not None and shape.size > stop_at_bytes:
            break
    return shape


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0), without recursion."""
    return json_shape(value).depth


# Keywords whose values are data, not schemas: a `pattern` key inside them is not a regex.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def schema_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """(JSON pointer, regex) for every `pattern` value and `patternProperties` key, anywhere."""
    pending: list[tuple[Any, str]] = [(schema, "")]
    while pending:
        node, path = pending.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                yield f"{path}/pattern", pattern
            props = node.get("patternProperties")
            if isinstance(props, dict):
                for key in props:
                    yield f"{path}/patternProperties", key
            pending.extend((v, f"{path}/{_pointer(k)}") for k, v in node.items() if k not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            pending.extend((v, f"{path}/{i}") for i, v in enumerate(node))


def _pointer(key: str) -> str:
    """A key as a JSON Pointer reference token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def regex_violations(
    field: str, pattern: str, limits: RequestLimits, *, check_bytes: bool
) -> list[FieldViolation]:
    """The first limit a regex exceeds (its size in bytes when `check_bytes`, group nesting,
    expansion), as a one-item list; empty when none."""
    if check_bytes:
        size = text_bytes(pattern, limits.max_constraint_bytes)
        if size > limits.max_constraint_bytes:
            return [over_constraint_bytes(field, "the regex's size in bytes", size, limits)]
    shape = regex_shape(pattern, cap=max(limits.max_regex_expansion, limits.max_regex_depth) + 1)
    if shape.depth > limits.max_regex_depth:
        return [
            over_limit(
                field,
                "the regex's group nesting depth",
                shape.depth,
                "max_regex_depth",
                limits.max_regex_depth,
            )
        ]
    if shape.expansion > limits.max_regex_expansion:
        return [
            over_limit(
                field,
                "the regex's size with counted repetitions expanded",
                shape.expansion,
                "max_regex_expansion",
                limits.max_regex_expansion,
            )
        ]
    return []


class RegexShape:
    """Group nesting depth and expanded size (states once `{m,n}` repetitions are unrolled)."""

    __slots__ = ("depth", "expansion")

    def __init__(self, depth: int, expansion: int) -> None:
        self.depth = depth
        self.expansion = expansion


# One token of a regex: an escape, a class start, a group start (with its (?...: prefix), a group
# end, an alternation, a quantifier, a counted repetition, or a run of literal characters.
_REGEX_TOKEN = re.compile(
    r"(?P<escape>\\(?:[pPxu]\{[^}]*\}|.)?)"
    r"|(?P<cls>\[)"
    r"|(?P<flags>\(\?[A-Za-z-]*\))"
    r"|(?P<open>\((?:\?(?:<[=!]|P?<[A-Za-z_][A-Za-z0-9_]*>|[A-Za-z-]*:|[:=!])?)?)"
    r"|(?P<close>\))"
    r"|(?P<alt>\|)"
    r"|(?P<counted>\{(?P<low>[0-9]{1,9})(?:(?P<comma>,)(?P<high>[0-9]{0,9}))?\})"
    r"|(?P<quant>[*+?])"
    r"|(?P<run>[^\\\[()|*+?{]+|\{)",
    re.S,
)


def regex_shape(pattern: str, *, cap: int) -> RegexShape:
    """Measures a regex in one pass, without compiling it; sizes saturate at `cap`.

    Reads the syntax shared by Rust's regex (llguidance), RE2 and Python: escapes, classes
    (nested, POSIX `[:name:]`), groups and the quantifiers `* + ? {m} {m,} {m,n}`. A literal is
    one state; a group is the sum of its parts (alternatives added); a counted repetition
    multiplies its atom by its largest finite bound.
    """
    # Each frame: [total so far, size of the last atom (for a following quantifier)].
    frames: list[list[int]] = [[0, 0]]
    depth = 0
    i, n = 0, len(pattern)
    while i < n:
        token = _REGEX_TOKEN.match(pattern, i)
        assert token is not None  # every character starts some token
        kind = token.lastgroup
        frame = frames[-1]
        i = token.end()
        if kind == "escape":
            _atom(frame, 1, cap)
        elif kind == "cls":
            i = _skip_class(pattern, token.start())
            _atom(frame, 1, cap)
        elif kind == "open":
            frames.append([0, 0])
            depth = max(depth, len(frames) - 1)
        elif kind == "close":
            if len(frames) > 1:
                group = frames.pop()[0]
                _atom(frames[-1], max(group, 1), cap)
        elif kind == "alt":
            frame[1] = 0
        elif kind == "counted":
            low = int(token.group("low"))
            high = token.group("high")
            times = max(low, int(high)) if high else low
            last = frame[1]
            if times == 0:
                frame[0] -= last
                frame[1] = 0
            elif last:
                grown = min(last * times, cap)
                frame[0] = min(frame[0] - last + grown, cap)
                frame[1] = grown
        elif kind == "run":
            run = token.end() - token.start()
            frame[0] = min(frame[0] + run, cap)
            frame[1] = 1  # a quantifier applies to the run's last character
    total = 0
    for frame in frames:
        total = min(total + frame[0], cap)
    return RegexShape(depth, total)


def _atom(frame: list[int], size: int, cap: int) -> None:
    frame[0] = min(frame[0] + size, cap)
    frame[1] = size


def _skip_escape(pattern: str, i: int) -> int:
    """Index after the escape starting at `i` (`\\x`, `\\p{..}`, `\\x{..}`, `\\u{..}`)."""
    i += 2
    if i <= len(pattern) and pattern[i - 1 : i] in ("p", "P", "x", "u") and pattern.startswith("{", i):
        close = pattern.find("}", i)
        return len(pattern) if close == -1 else close + 1
    return i


def _skip_class(pattern: str, i: int) -> int:
    """Index after the bracket class starting at `i` (`[:name:]` inside it skipped whole).

    A `[` inside a class is read as a literal, as RE2 reads it: where an engine nests classes
    instead (Rust's `[a-z&&[^aeiou]]`), the class ends early here and the rest counts as
    literals, so the measure is never smaller than the pattern (the limit cannot be dodged).
    """
    n = len(pattern)
    i += 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):  # a leading ] is a literal
        i += 1
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i = _skip_escape(pattern, i)
        elif pattern.startswith("[:", i) and (close := pattern.find(":]", i + 2)) != -1:
            i = close + 2
        elif ch == "]":
            return i + 1
        else:
            i += 1
    return n
