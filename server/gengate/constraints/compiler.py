"""ConstraintCompiler: lowers and compiles constraints for one tokenizer, off the event loop, cached."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from gengate import errors
from gengate.constraints import kinds
from gengate.constraints.lowering import LoweredConstraint
from gengate.constraints.matcher import ConstraintMatcher
from gengate.constraints.validation import quiet_limits
from gengate.domain import Enforcement, StructuredOutput
from gengate.lru import LruCache
from gengate.observation import note_compile

# What the compiled-constraint cache may hold, in constraint_weight units (~330 MB of grammar
# engine state at the worst, measured: ten `a{99999}` regexes), besides its entry count.
MAX_CACHED_WEIGHT = 1_000_000


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one tokenizer; `new_matcher()` gives each generation its own state."""

    structured: StructuredOutput
    lowered: LoweredConstraint
    _template: LLMatcher = field(repr=False)
    _vocab_size: int = field(repr=False)
    compile_s: float = field(default=0.0, compare=False)  # how long lowering and compiling took
    _tokenizer: LLTokenizer | None = field(default=None, repr=False, compare=False)  # plans forced runs

    @property
    def grammar(self) -> str:
        return self.lowered.grammar

    @property
    def enforcement(self) -> Enforcement:
        return self.lowered.enforcement

    @property
    def relaxations(self) -> tuple[str, ...]:
        return self.lowered.relaxations

    def new_matcher(self) -> ConstraintMatcher:
        """A fresh matcher at the start of the output (a copy of the compiled template)."""
        planner = self._tokenizer if self._plans else None
        return ConstraintMatcher(self._template.deep_copy(), self._vocab_size, planner=planner)

    @functools.cached_property
    def _plans(self) -> bool:
        """Whether forced runs may be planned: not when the grammar sets llguidance options
        (`%llguidance {...}` in Lark, the only place they are read: `no_forcing` there makes a
        forced state's mask more than its forced token). Looked for anywhere in the grammar's
        text, so a false alarm only turns plans off."""
        return "%llguidance" not in self.lowered.grammar


@dataclass
class CompilerStats:
    lowerings: int = 0
    hits: int = 0
    misses: int = 0


def constraint_key(structured: StructuredOutput, *, grammar_only: bool = False) -> str:
    """Canonical text of a structured-output request (constraint and options), for cache keys.

    Key order is kept (a schema's property order is the order it is generated in), and nothing is
    copied on the way (dataclasses.asdict would deep-copy a large schema first). `grammar_only`
    (compile caches): a JSON Schema's annotations (title, description, examples, ...) are left
    out, as they never change what the grammar allows; caches of checks that read them (the
    sandbox's metaschema verdicts) keep the whole schema.
    """
    fields = kinds.cache_fields(structured.constraint, grammar_only=grammar_only)
    payload = [fields, structured.whitespace, structured.additional_properties]

    def default(value: Any) -> Any:
        return sorted(value) if isinstance(value, frozenset | set) else str(value)

    text = json.dumps(payload, default=default, ensure_ascii=False)
    # A digest, not the text: a cache of 512 KB schemas must not hold their text a second time.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _for_request(compiled: CompiledConstraint, structured: StructuredOutput) -> CompiledConstraint:
    """A compile shared by schemas that differ only in annotations, carrying this request's own."""
    return (
        compiled
        if compiled.structured is structured
        else dataclasses.replace(compiled, structured=structured)
    )


class ConstraintCompiler:
    """Compiles constraints for one tokenizer; cached by (tokenizer_key, constraint).

    Compilation runs in a small thread pool with a timeout. A request's constraint reaches
    `compile` only after the server's sandbox checked and compiled it once
    (gengate.constraints.sandbox), so a compile here is bounded (the timeout is the last guard) and,
    with `checked`, skips what the sandbox checked already (the JSON Schema metaschema check: most
    of a cold compile). A compile that waited for a busy pool rather than
    running long is RESOURCE_EXHAUSTED with RetryInfo, never blamed on the caller's input.
    """

    def __init__(
        self,
        ll_tokenizer: LLTokenizer,
        tokenizer_key: str,
        *,
        timeout_s: float = 30.0,
        cache_size: int = 256,
        max_cached_weight: int = MAX_CACHED_WEIGHT,
        max_workers: int = 2,
        max_queued: int = 32,
    ) -> None:
        self.ll_tokenizer = ll_tokenizer
        self.tokenizer_key = tokenizer_key
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.stats = CompilerStats()
        self._cache: LruCache[tuple[str, str], CompiledConstraint] = LruCache(
            cache_size, max_weight=max_cached_weight
        )
        self._inflight: dict[tuple[str, str], asyncio.Future[CompiledConstraint]] = {}
        self._started: dict[tuple[str, str], float] = {}  # when each in-flight compile began running
        self.max_queued = max_queued
        self._max_workers = max_workers
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gengate-compile")

    async def compile(self, structured: StructuredOutput, *, checked: bool = False) -> CompiledConstraint:
        """The compiled constraint, or InvalidArgument naming the field and what is wrong.
        `checked`: the constraint is the request's own, which the server's sandbox checked (syntax,
        metaschema) before it reached the engine, so those checks are not made again; a constraint
        the engine composed itself (a tool plan's grammar) is checked in full."""
        key = (self.tokenizer_key, constraint_key(structured, grammar_only=True))
        hit = self._cache.get(key)
        if hit is not None:
            self.stats.hits += 1
            note_compile(hit=True)
            return _for_request(hit, structured)
        work = self._inflight.get(key)
        compiling = work is None  # else the same constraint is being compiled for another call
        if work is None:
            if len(self._inflight) >= self._max_workers + self.max_queued:  # running + queued
                raise self._busy()
            self.stats.misses += 1

            def run() -> CompiledConstraint:
                self._started[key] = time.monotonic()
                return self.compile_sync(structured, syntax_checked=checked)

            work = asyncio.get_running_loop().run_in_executor(self._executor, run)
            self._inflight[key] = work
            work.add_done_callback(lambda done: self._finished(key, done))
        try:
            compiled = await asyncio.wait_for(asyncio.shield(work), timeout=self.timeout_s)
        except TimeoutError:
            began = self._started.get(key)
            if began is None or time.monotonic() - began < self.timeout_s / 2:
                raise self._busy() from None
            raise errors.InvalidArgument.field(
                kinds.field_of(structured.constraint.kind),
                f"the constraint is too complex: it did not compile within {self.timeout_s:g} s",
                reason="CONSTRAINT_COMPILE_TIMEOUT",
            ) from None
        note_compile(hit=not compiling, seconds=compiled.compile_s if compiling else None)
        return _for_request(compiled, structured)

    async def compile_composed(
        self, key: str, build: Callable[[], CompiledConstraint], structured: StructuredOutput | None
    ) -> CompiledConstraint:
        """A constraint composed around another (a think block before a schema), cached by `key`
        beside plain compiles and built in the compile pool on a miss, so a repeat request pays a
        lookup, not a grammar compile. `structured`: the request's own, as a hit carries it."""
        full = (self.tokenizer_key, key)
        hit = self._cache.get(full)
        if hit is None:
            self.stats.misses += 1
            self.stats.lowerings += 1
            began = time.monotonic()
            hit = await asyncio.get_running_loop().run_in_executor(self._executor, build)
            weight = 1 if structured is None else kinds.constraint_weight(structured.constraint)
            self._cache.put(full, hit, weight)
            note_compile(hit=False, seconds=time.monotonic() - began)
        else:
            self.stats.hits += 1
            note_compile(hit=True)
        return hit if structured is None else _for_request(hit, structured)

    def _busy(self) -> errors.ResourceExhausted:
        return errors.ResourceExhausted(
            "the constraint compilers of this model are busy; try again shortly",
            reason="CONSTRAINT_COMPILERS_BUSY",
            retry_after_s=1.0,
        )

    def _finished(self, key: tuple[str, str], done: asyncio.Future[CompiledConstraint]) -> None:
        """Caches a successful compile; errors are not cached (they are cheap to find again)."""
        self._inflight.pop(key, None)
        self._started.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        compiled = done.result()
        self._cache.put(key, compiled, kinds.constraint_weight(compiled.structured.constraint))

    def warm(self, structured: StructuredOutput) -> None:
        """Compiles in the calling thread into the cache, as a first request would (`warm_constraints`:
        at load, before any request); raises what `compile_sync` raises."""
        key = (self.tokenizer_key, constraint_key(structured, grammar_only=True))
        if self._cache.get(key) is None:
            self._cache.put(
                key, self.compile_sync(structured), kinds.constraint_weight(structured.constraint)
            )

    def compile_sync(
        self, structured: StructuredOutput, *, syntax_checked: bool = False
    ) -> CompiledConstraint:
        """Lowers and compiles in the calling thread (no cache); raises InvalidArgument, whatever
        the library raised on the caller's constraint. `syntax_checked`: the sandbox checked its
        syntax and metaschema already (kinds.check_constraint_syntax), so they are not checked again."""
        self.stats.lowerings += 1
        field_name = kinds.field_of(structured.constraint.kind)
        began = time.monotonic()
        try:
            compiled = self._compile(structured, field_name, syntax_checked)
        except errors.GengateError:
            raise
        except RecursionError:
            raise errors.InvalidArgument.field(
                field_name,
                "the constraint is too complex: nested too deeply",
                reason="CONSTRAINT_TOO_COMPLEX",
            ) from None
        except Exception as exc:
            raise errors.InvalidArgument.field(
                field_name, f"cannot be compiled: {errors.brief(str(exc))}", reason="INVALID_CONSTRAINT"
            ) from None
        return dataclasses.replace(compiled, compile_s=time.monotonic() - began)

    def _compile(
        self, structured: StructuredOutput, field_name: str, syntax_checked: bool
    ) -> CompiledConstraint:
        lowered = kinds.lower(structured, syntax_checked=syntax_checked)
        reason = kinds.spec_of(lowered.kind).invalid_reason
        # The matcher reports what LLMatcher.validate_grammar would, without building the parser twice.
        template = LLMatcher(self.ll_tokenizer, lowered.grammar, log_level=0, limits=quiet_limits())
        if template.is_error():
            raise errors.InvalidArgument.field(
                field_name,
                f"not supported by the grammar engine: {errors.brief(template.get_error())}",
                reason=reason,
            )
        return CompiledConstraint(
            structured, lowered, template, self.ll_tokenizer.vocab_size, _tokenizer=self.ll_tokenizer
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
