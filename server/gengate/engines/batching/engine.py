"""BatchedEngine: what the continuously batched local engines (transformers, MLX) share once the
model is loaded: capabilities, start/close, the prompt's token ids (a Hugging Face tokenizer and
its chat template), request checks, and the stream of a request's generations (RequestRun)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any, ClassVar

from gengate import errors
from gengate.domain import (
    Enforcement,
    GenerationRequest,
    GenerationResult,
    GrammarSyntax,
    ModelCapabilities,
    StreamEvent,
)
from gengate.engines.base import (
    engine_capabilities,
    output_room,
    refuse_images,
    seeded,
    special_tokens_of,
    stream_start,
)
from gengate.engines.batching.request import Loaded
from gengate.engines.chat_vars import (
    reads_thinking,
    refuse_unsupported_control,
    template_text,
    template_variables,
    thinking_enabled,
)
from gengate.engines.options import engine_options
from gengate.engines.reasoning import (
    ReasoningPlan,
    ThinkTags,
    compile_with_reasoning,
    reasoning_events,
    reasoning_plan,
)
from gengate.engines.toolcalls import chat_prompt, template_speaks_tools, tool_events, tool_plan

MAX_TOP_LOGPROBS = 20
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class BatchedEngine:
    """Base of a batched engine backend; a subclass sets `kind`, `Options` and loads in `_load`."""

    max_top_logprobs: ClassVar[int] = MAX_TOP_LOGPROBS

    def __init__(self, name: str, *, max_n: int, context_length: int) -> None:
        self.name = name
        self.max_n = max_n
        self._loaded: Loaded | None = None
        self._start_lock = asyncio.Lock()
        self.capabilities = self._capabilities(context_length)

    def _capabilities(
        self,
        context_length: int,
        chat: bool = True,
        special_tokens: frozenset[str] | None = None,
        template: Any = None,
    ) -> ModelCapabilities:
        return engine_capabilities(
            grammar_syntaxes=frozenset(GrammarSyntax),
            max_n=self.max_n,
            max_top_logprobs=self.max_top_logprobs,
            context_length=context_length,
            chat=chat,
            special_tokens=special_tokens,
            tools=Enforcement.ENGINE,
            chat_template_kwargs=template is not None,
            reasoning_control=reads_thinking(template) or self._tags(template) is not None,
            reasoning=self._tags(template) is not None,
        )

    def _tags(self, template: Any) -> ThinkTags | None:
        """The think tags this engine parses for a model with `template` (None: no parsing)."""
        options = getattr(self, "options", None)
        return None if options is None else options.tags_for(template_text(template))

    def _load(self) -> Loaded:
        """Loads the model and starts its scheduler (runs in a thread)."""
        raise NotImplementedError

    @property
    def stats(self) -> Any:
        """The scheduler's counters (SchedulerStats); None before start()."""
        return None if self._loaded is None else self._loaded.scheduler.stats

    async def start(self) -> None:
        async with self._start_lock:
            if self._loaded is None:
                self._loaded = await asyncio.to_thread(self._load)
                tokenizer = self._loaded.tokenizer
                self.capabilities = self._capabilities(
                    self._loaded.context_length,
                    chat=tokenizer.chat_template is not None,
                    special_tokens=special_tokens_of(tokenizer),
                    template=tokenizer.chat_template,
                )

    async def aclose(self) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            await asyncio.to_thread(loaded.scheduler.stop)
            loaded.compiler.close()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        from gengate.backend import collect_stream

        return await collect_stream(self.generate_stream(request))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        arrived = time.monotonic()
        loaded = self._loaded
        if loaded is None:
            raise errors.Unavailable(f"model {self.name!r} is not started", reason="NOT_STARTED")
        self._check(request)
        options = engine_options(request)
        prompt_ids, thinking = self._prompt(loaded, request)
        stopping = output_room(request, len(prompt_ids), loaded.context_length)
        sampling = seeded(request.sampling)
        enforcement = Enforcement.NONE
        plan = tool_plan(request)
        grammar = request.structured_output
        if grammar is None and plan is not None and plan.grammar is not None:
            grammar = plan.grammar
            enforcement = plan.enforcement
        own = grammar is request.structured_output  # else the tool plan's, composed here
        compiled = await compile_with_reasoning(loaded.compiler, grammar, thinking, checked=own)
        if request.structured_output is not None and compiled is not None:
            enforcement = compiled.enforcement
        yield stream_start(
            request, request.model or self.name, len(prompt_ids), enforcement, sampling, stopping
        )

        from gengate.engines.batching.request import RequestRun

        answer = None if thinking is None else thinking.answer_of
        run = RequestRun(loaded, request, prompt_ids, sampling, stopping, compiled, arrived, options, answer)
        try:
            async with (
                aclosing(reasoning_events(run.events(), thinking)) as split,
                aclosing(tool_events(split, plan)) as events,
            ):
                async for event in events:
                    yield event
        finally:
            run.cancel()

    def _check(self, request: GenerationRequest) -> None:
        """Refuses what the capabilities do not cover (the router normally did already)."""
        if not 1 <= request.n <= self.max_n:
            raise errors.InvalidArgument.field("n", f"must be between 1 and {self.max_n}")
        if request.logprobs is not None and not 0 <= request.logprobs <= self.max_top_logprobs:
            raise errors.InvalidArgument.field("logprobs", f"must be between 0 and {self.max_top_logprobs}")

    def _prompt_ids(self, loaded: Loaded, request: GenerationRequest) -> list[int]:
        """Token ids of the raw prompt, or of the messages rendered by the chat template."""
        return self._prompt(loaded, request)[0]

    def _prompt(self, loaded: Loaded, request: GenerationRequest) -> tuple[list[int], ReasoningPlan | None]:
        """The prompt's token ids, and how its generations' think blocks are read."""
        tokenizer = loaded.tokenizer
        tags = self._tags(tokenizer.chat_template)
        variables = template_variables(request, tokenizer.chat_template, thinks=tags is not None)
        refuse_unsupported_control(request, budget=tags is not None)
        text = ""
        if request.messages is not None:
            refuse_images(request, self.name)
            if tokenizer.chat_template is None:
                raise errors.InvalidArgument.field(
                    "messages",
                    f"model {self.name!r} has no chat template; send a prompt",
                    reason="NO_CHAT_TEMPLATE",
                )
            prompt = chat_prompt(request, native=template_speaks_tools(tokenizer.chat_template))
            text = tokenizer.apply_chat_template(
                prompt.messages,
                **variables,
                tools=prompt.tools,
                add_generation_prompt=request.continuation is None,
                tokenize=False,
            )
            text += request.continuation or ""
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(tokenizer(request.prompt or "")["input_ids"])
            bos = tokenizer.bos_token_id
            if len(ids) > 1 and ids[0] == ids[1] == bos:
                ids = ids[1:]  # the prompt began with BOS (a pre-query's) and the tokenizer added one
        if not ids:
            bos = tokenizer.bos_token_id
            if bos is None:
                raise errors.InvalidArgument.field(
                    "prompt", "is empty and the model has no BOS token to start from"
                )
            ids = [bos]
        return ids, reasoning_plan(request, tags, text, thinking_enabled(variables))


def hf_eos_token_ids(tokenizer: Any, generation_config: Any) -> frozenset[int]:
    """EOS ids from the tokenizer and the model's generation config (an int or a list each)."""
    eos: set[int] = set()
    for candidate in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(candidate, int):
            eos.add(candidate)
        elif isinstance(candidate, list | tuple):
            eos.update(int(t) for t in candidate)
    return frozenset(eos)


def context_length_of(config: Any) -> int:
    """The context length in a model config (a transformers config object or a config.json dict),
    looking into `text_config` for multimodal configs; 2048 when it names none."""

    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    for key in _CONTEXT_KEYS:
        value = get(key)
        if isinstance(value, int) and value > 0:
            return value
    text_config = get("text_config")
    return context_length_of(text_config) if text_config is not None else 2048


def context_length_from_folder(model: str | None) -> int:
    """Context length from a local folder's config.json, read without importing the engine; the
    tiny model's for None (`tiny: true`); 0 for a hub id (known after start())."""
    if model is None:
        from gengate.models.tiny import TINY

        return TINY.context_length
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return context_length_of(config) if isinstance(config, dict) else 0


def model_source(model: str | None, tiny: bool) -> tuple[str, bool]:
    """Where a batched engine loads its model from: (folder or hub id, whether it is a local
    folder). `tiny: true` builds (or reuses) the tiny test model's Hugging Face folder."""
    if tiny:
        from gengate.models.tiny import build_tiny_model, default_tiny_dir

        return str(build_tiny_model(default_tiny_dir()).hf_dir), True
    assert model is not None
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path), True
    return model, False
