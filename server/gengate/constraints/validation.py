"""Validation helpers: a finished output checked against the ORIGINAL constraint, independently
of the grammar engine. Each kind's `validate` is its spec's (gengate.constraints.kinds), built
from these.

No backtracking matcher runs anywhere: regexes (constraints, and `pattern` / `patternProperties`
in schemas) are matched by RE2, linear in the text, whose syntax is closest to llguidance's Rust
regex dialect (Unicode classes `\\p{L}`, POSIX classes `[[:alpha:]]`); a pattern RE2 cannot read
is checked by walking llguidance (also linear) over the bytes.
JSON Schema: jsonschema with the schema's own draft ($schema, else Draft 2020-12) and format
checking for the formats jsonschema knows, its regex keywords answered by RE2.
Lark grammars: parsed by the `lark` package (Earley); GBNF/EBNF and Lark text using llguidance
extensions lark cannot read are checked with an llguidance byte walk.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import lark
import re2
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from gengate.constraints.lowering import choice_lark, effective_schema, grammar_to_lark
from gengate.constraints.regex_dialect import ascii_shorthands, class_set_operations
from gengate.domain import GrammarConstraint, GrammarSyntax, JsonSchemaConstraint, StructuredOutput
from gengate.lru import LruCache

_MAX_REASON = 300


# Outputs up to this size are validated inline (on the caller's thread) when the work is
# provably small, as each kind's spec says (a regex matched by RE2, a choice, any JSON object;
# gengate.constraints.kinds.cheap_to_validate). Everything else (schemas, whose cost grows with
# output x schema; grammars) goes to a thread pool with a time budget (service.OutputValidator).
CHEAP_TEXT_CHARS = 4096


def _build_validator(schema: dict[str, Any]) -> Validator:
    draft = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls = _linear_validator_class(draft)
    validator: Validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return validator


@functools.lru_cache(maxsize=16)
def _linear_validator_class(cls: Any) -> Any:
    """`cls` with its regex keywords matched by RE2 instead of Python's backtracking `re`."""
    return jsonschema.validators.extend(  # type: ignore[no-untyped-call]
        cls,
        {
            "pattern": _pattern_keyword,
            "patternProperties": _pattern_properties_keyword,
            "additionalProperties": _additional_properties_keyword,
        },
    )


def _search(pattern: str, text: str) -> bool:
    compiled = compile_regex(pattern)
    if compiled is None:  # refused before generation (syntax checks); never matches here
        return False
    return compiled.search(text) is not None


def _pattern_keyword(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{short(instance)} does not match {short(pattern)}")


def _pattern_properties_keyword(
    validator: Any, properties: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in properties.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties_keyword(
    validator: Any, allowed: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    listed = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [k for k in instance if k not in listed and not any(_search(p, k) for p in patterns)]
    if validator.is_type(allowed, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], allowed, path=extra)
    elif not allowed and extras:
        # jsonschema's own wording, with the names cut (an output's keys can be long)
        names = sorted(extras)
        joined = ", ".join(short(k, 40) for k in names[:5]) + (", ..." if len(names) > 5 else "")
        if patterns:
            verb = "does" if len(names) == 1 else "do"
            regexes = ", ".join(short(p, 40) for p in sorted(patterns))
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {regexes}")
        else:
            verb = "was" if len(names) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({joined} {verb} unexpected)")


@functools.lru_cache(maxsize=1)
def any_object_validator() -> Validator:
    return _build_validator({"type": "object"})


# Weighed by the schema's JSON size: a validator holds its schema (a 512 KB one is ~5 MB of objects).
_validators: LruCache[str, Validator] = LruCache(256, max_weight=16 << 20)


def schema_validator(c: JsonSchemaConstraint, structured: StructuredOutput) -> Validator:
    """Validators by schema text (the schema and additional_properties as JSON, key order kept):
    building one, and the schema copy it holds, cost more than validating a small output."""
    try:
        key = json.dumps([c.schema, structured.additional_properties])
    except (TypeError, ValueError):  # not JSON text: build it every time
        return _build_validator(effective_schema(c, structured))
    validator = _validators.get(key)
    if validator is None:
        validator = _build_validator(effective_schema(c, structured))
        _validators.put(key, validator, weight=len(key))
    return validator


def validate_json(text: str, validator: Validator) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not valid JSON: {exc}"
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/" + "/".join(str(p) for p in error.absolute_path)
    return _clip(f"does not match the schema at {where}: {error.message}")


CLASS_SET_OPERATIONS = (
    "character class set operations (&&, --, ~~) are not supported here: RE2 and the grammar engine "
    "read them differently; write the class out"
)
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.max_mem = 64 << 20  # a pattern whose automaton needs more is refused, not built
_RE2_OPTIONS.log_errors = False


@functools.lru_cache(maxsize=1)
def quiet_limits() -> LLParserLimits:
    """llguidance's default resource limits, with errors that do not echo parser state or grammar."""
    return LLParserLimits(verbose_errors=False)


@functools.lru_cache(maxsize=256)
def compile_regex(pattern: str) -> Any:
    """The RE2 program for a pattern (ASCII `\\d \\w`, as everywhere), or None if RE2 cannot read it
    or would read it otherwise than the grammar engine (class set operations)."""
    if class_set_operations(pattern):
        return None
    try:
        return re2.compile(ascii_shorthands(pattern), _RE2_OPTIONS)
    except re2.error:
        return None


def linear_regex_error(pattern: str) -> str | None:
    """None when RE2 (linear-time) reads the pattern as the grammar engine does, else why not, one
    short line."""
    if class_set_operations(pattern):
        return CLASS_SET_OPERATIONS
    try:
        re2.compile(ascii_shorthands(pattern), _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else "not a regular expression"
        text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        return _clip(text.splitlines()[0] if text else "not a regular expression", 200)
    return None


def validate_regex(pattern: str, text: str) -> str | None:
    compiled = compile_regex(pattern)
    if compiled is not None:
        ok = compiled.fullmatch(text) is not None
    else:
        ok = _llguidance_accepts(LLMatcher.grammar_from_regex(ascii_shorthands(pattern)), text)
    return None if ok else f"{short(text)} does not fully match the pattern"


@functools.lru_cache(maxsize=64)
def _lark_parser(definition: str) -> lark.Lark | None:
    try:
        return lark.Lark(definition, parser="earley", lexer="dynamic", start="start")
    except Exception:  # lark raises many types for grammars it cannot read (llguidance extensions)
        return None


def validate_grammar(c: GrammarConstraint, text: str, *, field: str) -> str | None:
    """Lark text parsed by the `lark` package where it reads the grammar, else an llguidance walk."""
    if c.syntax is GrammarSyntax.LARK:
        parser = _lark_parser(c.definition)
        if parser is not None:
            try:
                parser.parse(text)
            except lark.exceptions.LarkError as exc:
                return _clip(f"does not match the grammar: {exc}")
            return None
    grammar = LLMatcher.grammar_from_lark(grammar_to_lark(c.syntax, c.definition, field=field))
    return None if _llguidance_accepts(grammar, text) else "does not match the grammar"


def choice_grammar(choices: tuple[str, ...]) -> str:
    """The llguidance grammar for a choice list (shared with lowering for tests)."""
    return LLMatcher.grammar_from_lark(choice_lark(choices))


@functools.lru_cache(maxsize=1)
def byte_tokenizer() -> LLTokenizer:
    """A tokenizer whose tokens are the 256 single bytes (plus EOS): a canonical byte walker."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return LLTokenizer(tok.to_str(), eos_token=vocab["<eos>"])


def _llguidance_accepts(grammar: str, text: str) -> bool:
    """Walks an llguidance matcher over the text's bytes; True when it ends in an accepting state."""
    tokenizer = byte_tokenizer()
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=quiet_limits())
    if matcher.is_error():
        return False
    tokens = tokenizer.tokenize_bytes(text.encode("utf-8"))
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def _clip(message: str, limit: int = _MAX_REASON) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def short(text: str, limit: int = 80) -> str:
    """`text` quoted for a reason, cut at `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."
