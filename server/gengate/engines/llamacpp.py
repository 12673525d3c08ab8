"""llama.cpp engine: serves one GGUF model through llama-cpp-python's low-level API.

One llama context is not thread-safe, so every model call runs on one dedicated worker thread;
generations of a request (and of concurrent requests) take turns on it. The token loop feeds the
last position's logits to the shared SequenceDecoder (sampling, constraint mask, stop strings,
detokenization), so llama.cpp behaves exactly like the other local engines. Tokens the
constraint forces after a sampled one need no logits (SequenceDecoder.step_forced): they go into
the same forward pass as that token (jump-forward decoding).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gengate import errors
from gengate.backend import collect_stream
from gengate.constraints.warm import WarmConstraint, warm_compiler
from gengate.domain import (
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    GrammarSyntax,
    ModelCapabilities,
    SamplingParams,
    StoppingCriteria,
    StreamEvent,
    Timings,
    TokenLogprob,
    Usage,
    merge_deltas,
)
from gengate.engines.base import engine_capabilities, output_room, refuse_images, seeded, stream_start
from gengate.engines.chat_vars import (
    reads_thinking,
    refuse_unsupported_control,
    template_variables,
    thinking_enabled,
)
from gengate.engines.llamacpp_settings import (
    LOAD_LOG,
    ChatFormatter,
    LayerPlacement,
    chat_formatter,
    check_chat_format_name,
    check_offload,
    format_stops,
    gpu_layers,
    layer_placement,
)
from gengate.engines.options import EngineOptions, engine_options
from gengate.engines.reasoning import (
    ReasoningConfig,
    ReasoningPlan,
    compile_with_reasoning,
    reasoning_events,
    reasoning_plan,
)
from gengate.engines.resampling import all_generations, retry_seed
from gengate.engines.toolcalls import chat_prompt, template_speaks_tools, tool_events, tool_plan
from gengate.magpie import PRESET_TOKENS

if TYPE_CHECKING:
    from gengate.engines.decoding import LoopHandoff, SequenceDecoder

SplitMode = Literal["none", "layer", "row"]

MAX_N = 16
MAX_TOP_LOGPROBS = 20
# Prompts up to this many characters are tokenized on the event loop (a thread hop costs more).
INLINE_TOKENIZE_CHARS = 4096

log = logging.getLogger(__name__)


class LlamaCppOptions(ReasoningConfig):
    """Config keys of a `llamacpp` model: a GGUF file, or the built-in tiny model."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(default=None, description="GGUF file; `~` is expanded.")
    tiny: bool = Field(default=False, description="Serve the built-in tiny model (built on start).")
    n_ctx: int = Field(default=2048, ge=16, description="Context length in tokens.")
    n_threads: int | None = Field(
        default=None, ge=1, description="CPU threads; unset = the model's cpu_threads, else llama.cpp's."
    )
    chat_template: str | None = Field(default=None, description="Jinja chat template overriding the GGUF's.")
    warm_constraints: list[WarmConstraint] = Field(
        default_factory=list,
        description="Constraints compiled at start, so their first request hits the compile cache.",
    )
    chat_format: str | None = Field(
        default=None,
        min_length=1,
        description="A llama-cpp-python chat format (chatml, llama-2, llama-3, ...) rendering chat messages "
        "instead of the GGUF's template; its stop strings are added to chat requests.",
    )
    n_gpu_layers: int | None = Field(
        default=None,
        ge=-1,
        strict=True,
        description="Layers offloaded to the GPU: -1 = all, 0 = none. Unset: all when the worker has a GPU "
        "placed and llama-cpp-python is a GPU build, else none.",
    )
    split_mode: SplitMode = Field(
        default="layer", description="How a model spreads over several placed GPUs: none, layer or row."
    )
    n_batch: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description="Prompt tokens per llama.cpp batch; unset = min(512, n_ctx).",
    )
    flash_attn: bool = Field(default=False, strict=True, description="llama.cpp's flash attention.")

    @model_validator(mode="after")
    def _one_model(self) -> LlamaCppOptions:
        if (self.path is None) == (not self.tiny):
            raise ValueError("set exactly one of `path` (a GGUF file) or `tiny: true`")
        if self.chat_format is not None and self.chat_template is not None:
            raise ValueError("set at most one of `chat_format` and `chat_template`")
        if self.n_batch is not None and self.n_batch > self.n_ctx:
            raise ValueError(f"`n_batch` ({self.n_batch}) is larger than `n_ctx` ({self.n_ctx})")
        return self


@dataclass
class _Job:
    """One generation (one index, one attempt) for the worker thread."""

    index: int
    prompt: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    logprobs: int | None
    compiled: Any  # CompiledConstraint | None
    options: EngineOptions
    deadline: float | None
    handoff: LoopHandoff[object]
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Done:
    finish_reason: FinishReason
    matched_stop: str | None
    output_tokens: int
    started_at: float
    first_token_at: float | None


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class LlamaCppBackend:
    """A GGUF model served by llama.cpp, with every constraint kind enforced by llguidance."""

    kind: ClassVar[str] = "llamacpp"
    Options: ClassVar[type[BaseModel]] = LlamaCppOptions

    def __init__(self, name: str, options: LlamaCppOptions) -> None:
        self.name = name
        self.options = options
        self.capabilities = self._capabilities(chat=True)
        self.model_path: Path | None = Path(options.path).expanduser() if options.path else None
        self.tokens_generated = 0  # every sampled token, for tests and metrics
        self.forward_passes = 0  # decodes after the prompt: fewer than tokens where a constraint forces
        self._llm: Any = None
        self._compiler: Any = None
        self._chat_template: Any = None
        self._template_source: str | None = None  # the template's text, when it renders chats
        self._template_speaks_tools = False  # the template renders tools and calls itself
        self._chat_formatter: ChatFormatter | None = None  # chat_format's, instead of the template
        self._format_stops: tuple[str, ...] = ()
        # Where llama.cpp put the layers (read from its load log); None before start or if untold.
        self.layer_placement: LayerPlacement | None = None
        self._eog: frozenset[int] = frozenset()
        self._bos_text = ""
        self._eos_text = ""
        self._executor: ThreadPoolExecutor | None = None
        self._pieces: dict[int, bytes] = {}  # token -> its text, as llm.detokenize([token]) gives it
        self._logits_views: dict[int, np.ndarray[Any, np.dtype[np.float32]]] = {}  # address -> view

    def _capabilities(
        self,
        *,
        chat: bool,
        special_tokens: frozenset[str] | None = None,
        chat_continuation: bool | None = None,
        template: str | None = None,
    ) -> ModelCapabilities:
        tags = self.options.tags_for(template or "")
        return engine_capabilities(
            grammar_syntaxes=frozenset({GrammarSyntax.LARK, GrammarSyntax.GBNF, GrammarSyntax.EBNF}),
            max_n=MAX_N,
            max_top_logprobs=MAX_TOP_LOGPROBS,
            context_length=self.options.n_ctx,
            chat=chat,
            special_tokens=special_tokens,
            chat_continuation=chat_continuation,
            tools=Enforcement.ENGINE,
            chat_template_kwargs=template is not None,
            reasoning_control=reads_thinking(template) or tags is not None,
            reasoning=tags is not None,
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Builds the tiny model if asked, loads the GGUF and the constraint compiler off the loop."""
        if self._llm is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"llamacpp-{self.name}")
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    def _load(self) -> None:
        import llama_cpp

        from gengate.constraints import ConstraintCompiler, make_ll_tokenizer_from_llama

        if self.options.tiny:
            from gengate.models.tiny import build_tiny_model, default_tiny_dir

            self.model_path = build_tiny_model(default_tiny_dir()).gguf_path
        assert self.model_path is not None
        if not self.model_path.is_file():
            raise errors.ConfigError(f"model {self.name!r}: GGUF file not found: {self.model_path}")
        options = self.options
        if options.chat_format is not None:
            check_chat_format_name(options.chat_format, model=self.name)  # before a long load
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        n_gpu_layers = gpu_layers(
            options.n_gpu_layers,
            visible_devices=visible,
            supports_offload=bool(llama_cpp.llama_supports_gpu_offload()),
            model=self.name,
        )
        kwargs = load_kwargs(options, n_gpu_layers)
        with LOAD_LOG.capture() as load_log:
            llm = llama_cpp.Llama(model_path=str(self.model_path), **kwargs)
        try:
            self.layer_placement = layer_placement(load_log)
            check_offload(n_gpu_layers, self.layer_placement, model=self.name, visible=visible)
            if options.chat_format is not None:
                self._chat_formatter = chat_formatter(
                    options.chat_format, llm._chat_handlers, model=self.name
                )
                self._format_stops = format_stops(self._chat_formatter)
        except BaseException:
            llm.close()
            raise
        placed = "unknown" if self.layer_placement is None else self.layer_placement.describe()
        log.info(
            "model %r: n_gpu_layers %d, %s (CUDA_VISIBLE_DEVICES %s)",
            self.name,
            n_gpu_layers,
            placed,
            visible,
        )
        if options.n_gpu_layers is None and n_gpu_layers == 0 and visible:
            log.warning(
                "model %r runs on the CPU although GPU(s) %s were placed for it: this llama-cpp-python "
                "build has no GPU offload",
                self.name,
                visible,
            )
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._eog = frozenset(t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))
        self._bos_text = _special_text(llm, llm.token_bos())
        self._eos_text = _special_text(llm, llm.token_eos())
        template = options.chat_template or llm.metadata.get("tokenizer.chat_template")
        if self._chat_formatter is not None:
            template = None  # chat_format renders the messages
        self._chat_template = _compile_template(template) if template else None
        self._template_source = template or None
        self._template_speaks_tools = template_speaks_tools(template)
        chat = self._chat_template is not None or self._chat_formatter is not None
        self.capabilities = self._capabilities(
            chat=chat,
            special_tokens=_special_tokens(llm, PRESET_TOKENS),
            # a chat_format formatter always adds the generation prompt: no continuing from a text
            chat_continuation=self._chat_template is not None,
            template=self._template_source,
        )
        with warnings.catch_warnings():  # llguidance's helper calls a deprecated llama.cpp function
            warnings.simplefilter("ignore", DeprecationWarning)
            ll_tokenizer = make_ll_tokenizer_from_llama(llm)
        self._compiler = ConstraintCompiler(
            ll_tokenizer, tokenizer_key=f"llamacpp:{self.model_path.resolve()}"
        )
        warm_compiler(self._compiler, self.options.warm_constraints, self.name)
        self._pieces, self._logits_views = {}, {}
        self._llm = llm

    async def aclose(self) -> None:
        """Frees the llama context after the worker finishes what it is doing."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        await asyncio.get_running_loop().run_in_executor(executor, self._unload)
        executor.shutdown(wait=False)

    def _unload(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
        if self._llm is not None:
            self._llm.close()
        self._llm = self._compiler = None
        self._pieces, self._logits_views = {}, {}

    # -- requests -------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await collect_stream(self.generate_stream(request))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        arrived = time.monotonic()
        if self._llm is None or self._executor is None:
            raise errors.Unavailable(f"model {self.name!r} is not loaded", reason="MODEL_NOT_LOADED")
        options = engine_options(request)
        if _prompt_chars(request) <= INLINE_TOKENIZE_CHARS:
            prompt, thinking = self._prompt(request)
        else:
            prompt, thinking = await asyncio.to_thread(self._prompt, request)
        stopping = output_room(request, len(prompt), self.options.n_ctx)
        if self._format_stops and request.messages is not None:  # chat_format's, as llama-cpp-python adds
            stopping = replace(stopping, stop=tuple(dict.fromkeys((*stopping.stop, *self._format_stops))))
        enforcement = Enforcement.NONE
        plan = tool_plan(request)
        grammar = request.structured_output
        if grammar is None and plan is not None and plan.grammar is not None:
            grammar = plan.grammar
            enforcement = plan.enforcement
        own = grammar is request.structured_output  # else the tool plan's, composed here
        compiled = await compile_with_reasoning(self._compiler, grammar, thinking, checked=own)
        if request.structured_output is not None and compiled is not None:
            enforcement = compiled.enforcement
        sampling = seeded(request.sampling)
        seed = sampling.seed
        assert seed is not None
        yield stream_start(request, self.name, len(prompt), enforcement, sampling, stopping)

        def generations(indices: Sequence[int], attempt: int) -> AsyncGenerator[StreamEvent, None]:
            attempt_sampling = replace(sampling, seed=retry_seed(seed, attempt))
            return self._generations(
                request, indices, prompt, attempt_sampling, stopping, compiled, options, arrived
            )

        async with (
            aclosing(
                all_generations(
                    request, enforcement, generations, None if thinking is None else thinking.answer_of
                )
            ) as events,
            aclosing(reasoning_events(events, thinking)) as thought,
            aclosing(tool_events(thought, plan)) as split,
        ):
            async for event in split:
                yield event

    async def _generations(
        self,
        request: GenerationRequest,
        indices: Sequence[int],
        prompt: list[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        compiled: Any,
        options: EngineOptions,
        arrived: float,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Generations `indices`, one after another: their deltas as they come, then each end."""
        for index in indices:
            done: _Done | None = None
            run = self._run(request, index, prompt, sampling, stopping, compiled, options)
            async with aclosing(run) as items:
                async for item in items:
                    if isinstance(item, GenerationDelta):
                        yield item
                    else:
                        done = item
            assert done is not None
            first_token_s = None if done.first_token_at is None else done.first_token_at - arrived
            yield GenerationEnd(
                index=index,
                finish_reason=done.finish_reason,
                usage=Usage(len(prompt), done.output_tokens),
                matched_stop=done.matched_stop,
                timings=Timings(
                    queue_s=max(0.0, done.started_at - arrived),
                    time_to_first_token_s=first_token_s,
                    total_s=time.monotonic() - arrived,
                ),
            )

    async def _run(
        self,
        request: GenerationRequest,
        index: int,
        prompt: list[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        compiled: Any,
        options: EngineOptions,
    ) -> AsyncGenerator[GenerationDelta | _Done, None]:
        """Runs one generation on the worker thread, yielding its (coalesced) deltas, then _Done."""
        from gengate.engines.decoding import LoopHandoff

        loop = asyncio.get_running_loop()
        handoff: LoopHandoff[object] = LoopHandoff(loop, on_closed=lambda _: job.cancel.set())
        job = _Job(
            index=index,
            prompt=prompt,
            sampling=sampling,
            stopping=stopping,
            logprobs=request.logprobs,
            compiled=compiled,
            options=options,
            deadline=request.deadline,
            handoff=handoff,
        )
        assert self._executor is not None
        self._executor.submit(self._decode, job)  # no asyncio future: its completion would wake the loop
        try:
            while True:
                items = await handoff.take()
                deltas = [i for i in items if isinstance(i, GenerationDelta)]
                if deltas:
                    yield merge_deltas(deltas)
                for item in items:
                    if isinstance(item, _Failed):
                        raise item.error
                    if isinstance(item, _Done):
                        yield item
                        return
        finally:
            job.cancel.set()

    # -- worker thread --------------------------------------------------------------------

    def _decode(self, job: _Job) -> None:
        """The token loop of one generation; runs on the worker thread and never raises."""
        try:
            self._decode_unsafe(job)
        except BaseException as exc:
            job.handoff.put(
                _Failed(exc if isinstance(exc, errors.GengateError) else _internal(exc)), last=True
            )

    def _decode_unsafe(self, job: _Job) -> None:
        import llama_cpp

        from gengate.engines.decoding import SequenceDecoder

        started = time.monotonic()
        llm = self._llm
        if llm is None:
            raise errors.Unavailable(f"model {self.name!r} was closed", reason="MODEL_NOT_LOADED")
        n_vocab = llm.n_vocab()
        decoder = SequenceDecoder(
            index=job.index,
            detokenize=self._detokenize,
            eos_token_ids=self._eog,
            sampling=job.sampling,
            stopping=job.stopping,
            logprobs=job.logprobs,
            matcher=job.compiled.new_matcher() if job.compiled is not None else None,
            prompt_token_ids=job.prompt,
            vocab_size=n_vocab,
            options=job.options,
        )
        if job.cancel.is_set():  # cancelled while queued behind other generations
            job.handoff.put(_Done(FinishReason.CANCELLED, None, 0, started, None), last=True)
            return
        first_token_at: float | None = None
        # Tokens the constraint forces after a sampled one join its forward pass (jump-forward);
        # those it forces before the first one join the prompt's, their text sent with its.
        jumps = decoder.jumps_forward
        n_batch = llm.n_batch
        lead, held, finish = _take_forced(decoder, job, n_batch) if jumps else ([], "", None)
        self.tokens_generated += len(lead)
        pending_tokens = len(lead)
        pending_logprobs: list[TokenLogprob] = []
        if finish is None:
            self._load_prompt(llm, job.prompt + lead if lead else job.prompt)
        while finish is None:
            if job.cancel.is_set():
                finish = FinishReason.CANCELLED
                break
            if job.deadline is not None and time.monotonic() >= job.deadline:
                finish = FinishReason.TIME_LIMIT
                break
            logits = self._last_logits(llama_cpp.llama_get_logits_ith(llm.ctx, -1), n_vocab)
            step = decoder.step(logits)
            finish = step.finished
            text = held + step.text_delta if held else step.text_delta
            held = ""
            token = step.token_id
            if token is not None:
                self.tokens_generated += 1
                pending_tokens += 1
                first_token_at = first_token_at or time.monotonic()
            if step.logprob is not None:
                pending_logprobs.append(step.logprob)
            run: list[int] | None = None  # the token and those forced after it: one forward pass
            if jumps and finish is None and token is not None:
                more, more_text, finish = _take_forced(decoder, job, n_batch - 1)
                if more:
                    run = [token, *more]
                    text += more_text
                    self.tokens_generated += len(more)
                    pending_tokens += len(more)
            if text or (finish is not None and pending_tokens):
                delta = GenerationDelta(
                    index=job.index,
                    text=text,
                    token_count=pending_tokens,
                    logprobs=tuple(pending_logprobs) if job.logprobs is not None else None,
                )
                job.handoff.put(delta, more=finish is not None)  # _Done follows at once
                pending_tokens, pending_logprobs = 0, []
            if finish is None:
                assert token is not None
                self._eval_next(llm, [token] if run is None else run)
                self.forward_passes += 1
        tail = held if decoder.finished else held + decoder.finalize()  # (held: all forced, or cut)
        if tail or pending_tokens:
            first_token_at = first_token_at or time.monotonic()
            logprobs = tuple(pending_logprobs) if job.logprobs is not None else None
            job.handoff.put(GenerationDelta(job.index, tail, pending_tokens, logprobs), more=True)
        job.handoff.put(
            _Done(
                finish_reason=finish,
                matched_stop=decoder.matched_stop,
                output_tokens=len(decoder.output_token_ids),
                started_at=started,
                first_token_at=first_token_at,
            ),
            last=True,
        )

    def _detokenize(self, tokens: list[int]) -> bytes:
        """llm.detokenize, from a cache for the single tokens the decoder asks for each step."""
        if len(tokens) != 1:
            return bytes(self._llm.detokenize(tokens, special=False))
        piece = self._pieces.get(tokens[0])
        if piece is None:
            piece = self._pieces[tokens[0]] = bytes(self._llm.detokenize(tokens, special=False))
        return piece

    def _last_logits(self, pointer: Any, n_vocab: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """A numpy view of llama.cpp's logits at `pointer`; views are kept per address (cheaper
        than np.ctypeslib.as_array each token; the context reuses one buffer)."""
        address = ctypes.addressof(pointer.contents)
        view = self._logits_views.get(address)
        if view is None:
            array = (ctypes.c_float * n_vocab).from_address(address)
            view = self._logits_views[address] = np.ctypeslib.as_array(array)
        return view

    @staticmethod
    def _eval_next(llm: Any, tokens: list[int]) -> None:
        """llm.eval(tokens) for up to n_batch tokens appended after the prompt (a sampled one and
        those forced after it): the same batch, decode and bookkeeping, without its KV-cache trim
        (nothing lies past the end here) and its loop."""
        n_past, count = llm.n_tokens, len(tokens)
        llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=False)
        llm._ctx.decode(llm._batch)
        if count == 1:  # (a scalar store: a slice from a list costs ~1 µs, every free token)
            llm.input_ids[n_past] = tokens[0]
        else:
            llm.input_ids[n_past : n_past + count] = tokens
        llm.n_tokens = n_past + count

    @staticmethod
    def _load_prompt(llm: Any, prompt: Sequence[int]) -> None:
        """Evaluates the prompt, reusing the KV cache of the longest prefix already in the context."""
        cached = llm.input_ids[: llm.n_tokens]
        limit = min(len(cached), len(prompt) - 1)  # at least one token is evaluated for fresh logits
        common = 0
        if limit > 0:
            diff = np.flatnonzero(np.asarray(cached[:limit]) != np.asarray(prompt[:limit]))
            common = int(diff[0]) if diff.size else limit
        if common == 0 or not llm._ctx.kv_cache_seq_rm(-1, common, -1):
            llm.reset()
            common = 0
        llm.n_tokens = common
        llm.eval(list(prompt[common:]))

    # -- prompts --------------------------------------------------------------------------

    def _prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """Tokenizes the raw prompt, or the messages rendered with the model's chat template."""
        return self._prompt(request)[0]

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], ReasoningPlan | None]:
        """The prompt's tokens, and how its generations' think blocks are read."""
        llm = self._llm
        tags = self.options.tags_for(self._template_source or "")
        variables = template_variables(request, self._template_source, thinks=tags is not None)
        refuse_unsupported_control(request, budget=tags is not None)
        text = request.prompt if request.prompt is not None else self._render_chat(request, variables)
        thinking = reasoning_plan(request, tags, text, thinking_enabled(variables))
        tokens: list[int] = llm.tokenize(text.encode(), add_bos=True, special=True)
        bos = llm.token_bos()
        if len(tokens) > 1 and tokens[0] == tokens[1] == bos:
            tokens = tokens[
                1:
            ]  # the text began with BOS (a template's, a pre-query's) and the tokenizer added another
        if not tokens:
            if llm.token_bos() < 0:
                raise errors.InvalidArgument.field("prompt", "the prompt is empty")
            tokens = [llm.token_bos()]
        return tokens, thinking

    def _render_chat(self, request: GenerationRequest, variables: Mapping[str, Any] | None = None) -> str:
        """The messages as the model reads them: rendered by its chat template (with the request's
        template variables) or by llama-cpp-python's chat_format formatter."""
        refuse_images(request, self.name)
        if self._chat_formatter is not None:
            return self._format_chat(request)
        if self._chat_template is None:
            raise errors.InvalidArgument.field(
                "messages",
                f"model {self.name!r} has no chat template; send a prompt",
                reason="NO_CHAT_TEMPLATE",
            )
        prompt = chat_prompt(request, native=self._template_speaks_tools)
        try:
            rendered: str = self._chat_template.render(
                **(variables or {}),
                messages=prompt.messages,
                **prompt.template_kwargs(),
                bos_token=self._bos_text,
                eos_token=self._eos_text,
                add_generation_prompt=request.continuation is None,
            )
        except Exception as exc:  # template errors (raise_exception, bad roles) are the caller's
            raise errors.InvalidArgument.field(
                "messages", f"chat template refused the messages: {exc}"
            ) from exc
        return rendered + (request.continuation or "")

    def _format_chat(self, request: GenerationRequest) -> str:
        """The messages rendered with llama-cpp-python's formatter of `chat_format` (tools in the
        generic form: its formatters take no tools)."""
        assert self._chat_formatter is not None
        try:
            response = self._chat_formatter(messages=chat_prompt(request, native=False).messages)
        except Exception as exc:  # a format that refuses a role or an order
            raise errors.InvalidArgument.field(
                "messages", f"chat format {self.options.chat_format!r} refused the messages: {exc}"
            ) from exc
        return str(response.prompt)


def _special_tokens(llm: Any, candidates: frozenset[str]) -> frozenset[str]:
    """The candidate texts the GGUF's vocabulary reads as one special token."""
    found = set()
    for text in candidates:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        if len(ids) == 1 and llm.tokenize(text.encode(), add_bos=False, special=False) != ids:
            found.add(text)
    return frozenset(found)


def _compile_template(source: str) -> Any:
    """A Jinja chat template in the sandbox Hugging Face uses, with its helper functions."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _take_forced(
    decoder: SequenceDecoder, job: _Job, room: int
) -> tuple[list[int], str, FinishReason | None]:
    """The tokens the constraint forces next (at most `room`, while the job is neither cancelled
    nor past its deadline), their text, and the end one of them reached."""
    tokens: list[int] = []
    text = ""
    for taken in decoder.forced_steps(room, lambda: _going(job)):
        assert taken.token_id is not None  # (a forced step always takes a token)
        tokens.append(taken.token_id)
        text += taken.text_delta
        if taken.finished is not None:
            return tokens, text, taken.finished
    return tokens, text, None


def _going(job: _Job) -> bool:
    return not job.cancel.is_set() and (job.deadline is None or time.monotonic() < job.deadline)


def load_kwargs(options: LlamaCppOptions, n_gpu_layers: int) -> dict[str, Any]:
    """llama_cpp.Llama's keyword arguments for `options`, with the offload gpu_layers resolved.
    main_gpu is 0: placement's CUDA_VISIBLE_DEVICES numbers the worker's GPUs from 0, so the
    first one placed is the one llama.cpp uses for split_mode none (and for row's small tensors)."""
    import llama_cpp

    kwargs: dict[str, Any] = {
        "n_ctx": options.n_ctx,
        "n_gpu_layers": n_gpu_layers,
        "main_gpu": 0,
        "split_mode": getattr(llama_cpp, f"LLAMA_SPLIT_MODE_{options.split_mode.upper()}"),
        "flash_attn": options.flash_attn,
        "verbose": False,
    }
    if options.n_batch is not None:
        kwargs["n_batch"] = options.n_batch
    if options.chat_format is not None:
        kwargs["chat_format"] = options.chat_format
    threads = compute_threads(options.n_threads)
    if threads is not None:
        kwargs["n_threads"] = kwargs["n_threads_batch"] = threads
    return kwargs


def compute_threads(n_threads: int | None, env: Mapping[str, str] = os.environ) -> int | None:
    """llama.cpp's thread count: `n_threads`, else OMP_NUM_THREADS (what a worker's `cpu_threads`
    sets, and what torch follows too), else None for llama.cpp's own default."""
    if n_threads is not None:
        return n_threads
    value = env.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _special_text(llm: Any, token: int) -> str:
    if token < 0:
        return ""
    return str(llm.detokenize([token], special=True).decode("utf-8", errors="replace"))


def _prompt_chars(request: GenerationRequest) -> int:
    if request.prompt is not None:
        return len(request.prompt)
    return sum(len(m.text) for m in request.messages or ())


def _internal(exc: BaseException) -> errors.GengateError:
    return errors.Internal(f"llama.cpp generation failed: {type(exc).__name__}: {exc}", reason="ENGINE_ERROR")
