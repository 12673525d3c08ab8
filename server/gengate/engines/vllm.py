"""vLLM engine: an in-process AsyncLLM (vLLM v1) inside a gengate worker process.

vLLM does the hard parts itself: continuous batching of concurrent requests (and of
BatchGenerate items, which arrive as concurrent requests), prefix caching, tensor parallelism
over the GPUs placement gave this worker (`num_gpus` → CUDA_VISIBLE_DEVICES →
`tensor_parallel_size`), and structured outputs through `StructuredOutputsParams` (json,
regex, choice, grammar, json_object), enforced by its guidance (llguidance) backend by default.

vLLM is installed apart from the CPU stack (bench/gpu/requirements-vllm.txt: it pins its own
torch/transformers/llguidance) and shipped in its own GPU image (bench/gpu/Dockerfile.vllm); it is
imported only in `start()`. The
mapping from domain objects to vLLM's parameters, and from vLLM's outputs back to stream events,
are pure functions below, unit-tested without vLLM (tests/engines/test_vllm_logic.py).

Multi-node: a model larger than one node is vLLM's job, through its Ray executor. Start a Ray
cluster over the nodes (`ray start --head` on one, `ray start --address=HEAD:6379` on the
others, same image and model path everywhere), then configure the model with
`distributed_executor_backend: ray`, `tensor_parallel_size` = GPUs per node and
`pipeline_parallel_size` = number of nodes, and run gengate on the head node. gengate's
placement only reserves the head node's local GPUs; Ray places the remote workers.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gengate import errors
from gengate.backend import collect_stream
from gengate.constraints.compiler import constraint_key
from gengate.constraints.kinds import lower
from gengate.constraints.lowering import LoweredConstraint
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.domain import (
    SAMPLING_FIELDS,
    ChoiceConstraint,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ModelCapabilities,
    RegexConstraint,
    StoppingCriteria,
    StreamEvent,
    StructuredOutput,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    Whitespace,
)
from gengate.engines.base import engine_capabilities, output_room, special_tokens_of, stream_start
from gengate.engines.chat_vars import reads_thinking, template_text
from gengate.engines.options import ENGINE_OPTIONS, engine_options, refuse_own_keys
from gengate.engines.reasoning import ReasoningConfig, reasoning_events
from gengate.engines.resampling import all_generations, retry_seed
from gengate.engines.toolcalls import tool_events, tool_plan
from gengate.engines.vllm_prompt import chat_template_of, vllm_prompt
from gengate.lru import LruCache

StructuredBackend = Literal["guidance", "xgrammar", "outlines", "auto"]

# Grammar syntaxes each of vLLM's structured-output backends accepts in `grammar=`.
GRAMMAR_SYNTAXES: dict[str, frozenset[GrammarSyntax]] = {
    "guidance": frozenset({GrammarSyntax.LARK, GrammarSyntax.GBNF}),
    "xgrammar": frozenset({GrammarSyntax.GBNF, GrammarSyntax.EBNF}),
    "outlines": frozenset({GrammarSyntax.LARK}),
    "auto": frozenset({GrammarSyntax.GBNF}),
}


# vllm.AsyncEngineArgs fields gengate sets itself (engine_kwargs, start): not for
# extra_engine_args, so each setting has one place. field -> the option that sets it.
OWN_ENGINE_ARGS: dict[str, str] = {
    **{
        name: name
        for name in (
            "model",
            "tokenizer",
            "revision",
            "tokenizer_mode",
            "dtype",
            "quantization",
            "max_model_len",
            "gpu_memory_utilization",
            "pipeline_parallel_size",
            "distributed_executor_backend",
            "enable_prefix_caching",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enforce_eager",
            "trust_remote_code",
            "max_logprobs",
            "seed",
            "max_lora_rank",
            "max_loras",
        )
    },
    "tensor_parallel_size": "tensor_parallel_size (or the GPUs placed: num_gpus)",
    "enable_lora": "lora_adapters",
    "structured_outputs_config": "structured_outputs_backend",
}


class VLLMOptions(ReasoningConfig):
    """Config keys of a `vllm` model (engine arguments gengate passes on to vLLM)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Hugging Face model id or local folder.")
    tokenizer: str | None = None
    revision: str | None = Field(
        default=None, min_length=1, description="Hub branch, tag or commit of `model`."
    )
    tokenizer_mode: str | None = Field(
        default=None,
        min_length=1,
        description="vLLM's tokenizer_mode (auto, hf, slow, mistral, ... as the installed vLLM names "
        "them; it checks the name at start). Unset: vLLM's default.",
    )
    dtype: str = "auto"
    quantization: str | None = Field(
        default=None, min_length=1, description="vLLM's quantization method (awq, gptq, fp8, ...)."
    )
    max_model_len: int | None = Field(default=None, ge=16)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    tensor_parallel_size: int | None = Field(
        default=None, ge=1, description="Unset: the number of GPUs placement gave the worker."
    )
    pipeline_parallel_size: int = Field(default=1, ge=1, description="Nodes, with the Ray executor.")
    distributed_executor_backend: Literal["mp", "ray", "uni"] | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    enforce_eager: bool = False
    trust_remote_code: bool = False
    structured_outputs_backend: StructuredBackend = "guidance"
    cpu_kv_cache_gb: float | None = Field(
        default=None, gt=0, description="KV cache size on vLLM's CPU build (VLLM_CPU_KVCACHE_SPACE)."
    )
    cpu_threads_bind: str | None = Field(
        default=None,
        description="Cores for the CPU build's model runner (VLLM_CPU_OMP_THREADS_BIND), e.g. '0-6' on "
        "8 cores: its OpenMP threads spin, so leave cores to the serving processes.",
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served on this model: name -> folder (PEFT format); a request picks "
        "one with backend_options {lora: name}.",
    )
    max_lora_rank: int = Field(default=16, ge=1, description="Largest adapter rank (vLLM's max_lora_rank).")
    max_loras: int = Field(default=4, ge=1, description="Adapters in one batch at once (vLLM's max_loras).")
    max_n: int = Field(default=16, ge=1)
    max_logprobs: int = Field(default=20, ge=0)
    chat_template: str | None = None
    seed: int = 0
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More vllm.AsyncEngineArgs fields, passed as they are; the names are checked against "
        "AsyncEngineArgs at start, and those gengate sets from its own options are refused.",
    )

    @field_validator("extra_engine_args")
    @classmethod
    def _not_gengates_own(cls, value: dict[str, Any]) -> dict[str, Any]:
        return refuse_own_keys(value, OWN_ENGINE_ARGS)

    @model_validator(mode="after")
    def _revision_of_a_hub_id(self) -> VLLMOptions:
        if self.revision is not None and Path(self.model).expanduser().is_dir():
            raise ValueError("'revision' applies to a hub id; a local folder is loaded as it is on disk")
        return self


def engine_arg_names(engine_args: type) -> frozenset[str]:
    """The keyword arguments an engine-arguments class takes: its dataclass fields (vLLM's
    EngineArgs is a dataclass), else its constructor's named parameters."""
    if dataclasses.is_dataclass(engine_args):
        return frozenset(f.name for f in dataclasses.fields(engine_args) if f.init)
    parameters = inspect.signature(engine_args).parameters.values()
    return frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def checked_engine_args(extra: Mapping[str, Any], known: frozenset[str], *, model: str) -> dict[str, Any]:
    """`extra_engine_args` when every name is one of `known` (AsyncEngineArgs' fields); else
    ConfigError naming the unknown ones and the closest real names."""
    unknown = sorted(set(extra) - known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise errors.ConfigError(
            f"model {model!r}: extra_engine_args {', '.join(hints)} "
            f"{'is not a field' if len(unknown) == 1 else 'are not fields'} of the installed vLLM's "
            "AsyncEngineArgs"
        )
    return dict(extra)


# --- pure mapping, tested without vLLM -----------------------------------------------------------

# Backend options only vLLM takes (beyond engines/options.py's): the LoRA adapter to apply.
VLLM_OPTIONS = frozenset({"lora"})
# Per-request SamplingParams fields of vLLM's own, typed (sampling_options); BackendOptionValue
# holds no list, so stop_token_ids travels as one int or a comma-separated string ("2,7").
VLLM_SAMPLING_OPTIONS = frozenset({"stop_token_ids", "skip_special_tokens", "include_stop_str_in_output"})


def sampling_options(request: GenerationRequest, *, vocab_size: int | None = None) -> dict[str, Any]:
    """vllm.SamplingParams arguments for the request's vLLM sampling options; InvalidArgument
    naming `backend_options[key]` for a wrong type, a bad token id, or a misfit with the request."""
    given = request.backend_options
    out: dict[str, Any] = {}
    for key in ("skip_special_tokens", "include_stop_str_in_output"):
        if key in given:
            value = given[key]
            if type(value) is not bool:
                raise errors.InvalidArgument.field(
                    f"backend_options[{key}]", f"must be a bool, got {type(value).__name__}"
                )
            out[key] = value
    if out.get("include_stop_str_in_output") and request.structured_output is not None:
        raise errors.InvalidArgument.field(
            "backend_options[include_stop_str_in_output]",
            "does not go with structured_output (a stop string would become part of the structured text)",
        )
    if "stop_token_ids" in given:
        out["stop_token_ids"] = _token_ids(given["stop_token_ids"], vocab_size)
    return out


def _token_ids(value: object, vocab_size: int | None) -> list[int]:
    where = "backend_options[stop_token_ids]"
    if type(value) is int:
        ids = [value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if not all(p.isdigit() for p in parts):
            raise errors.InvalidArgument.field(
                where, f"must be token ids separated by commas (e.g. '128001,128009'), got {value[:64]!r}"
            )
        ids = [int(p) for p in parts]
    else:
        raise errors.InvalidArgument.field(
            where, f"must be an int or a comma-separated string of ints, got {type(value).__name__}"
        )
    for token in ids:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = f" (the vocabulary has {vocab_size})" if vocab_size is not None else ""
            raise errors.InvalidArgument.field(where, f"token id {token} is not in the vocabulary{limit}")
    return ids


def lora_choice(request: GenerationRequest, adapters: Mapping[str, str]) -> str | None:
    """The adapter a request names (backend_options {lora: name}), or None; InvalidArgument
    naming `backend_options[lora]` for a bad one."""
    name = request.backend_options.get("lora")
    if name is None:
        return None
    where = "backend_options[lora]"
    if not isinstance(name, str):
        raise errors.InvalidArgument.field(where, f"must be a string, got {type(name).__name__}")
    if name not in adapters:
        known = ", ".join(sorted(adapters)) or "none (set lora_adapters on the model)"
        raise errors.InvalidArgument.field(where, f"no adapter {name!r} on this model (adapters: {known})")
    return name


def lora_slots(adapters: Mapping[str, str]) -> dict[str, tuple[int, str]]:
    """Each configured adapter's vLLM integer id (by sorted name, from 1) and folder."""
    return {name: (i, str(Path(adapters[name]).expanduser())) for i, name in enumerate(sorted(adapters), 1)}


def sampling_kwargs(
    request: GenerationRequest, *, default_max_tokens: int, vocab_size: int | None = None
) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments for `request` (unset fields keep vLLM's defaults);
    InvalidArgument for bad backend options (engines/options.py, sampling_options)."""
    sampling = request.sampling
    kwargs: dict[str, Any] = {"n": request.n}
    for name in SAMPLING_FIELDS:
        value = getattr(sampling, name)
        if value is not None:
            kwargs[name] = value
    kwargs["max_tokens"] = (
        request.stopping.max_tokens if request.stopping.max_tokens is not None else default_max_tokens
    )
    if request.stopping.stop:
        kwargs["stop"] = list(request.stopping.stop)
        kwargs["include_stop_str_in_output"] = False
    if request.logprobs is not None:
        kwargs["logprobs"] = request.logprobs
    options = engine_options(request, also=VLLM_OPTIONS | VLLM_SAMPLING_OPTIONS)
    if options.min_tokens:
        kwargs["min_tokens"] = options.min_tokens
    if options.ignore_eos:
        kwargs["ignore_eos"] = True
    kwargs.update(sampling_options(request, vocab_size=vocab_size))
    return kwargs


def structured_outputs_kwargs(output: StructuredOutput) -> tuple[dict[str, Any], Enforcement]:
    """vllm.sampling_params.StructuredOutputsParams keyword arguments for one constraint, and how
    it is enforced.

    A JSON Schema goes through gengate's own lowering first, so vLLM generates what the other
    local engines do: closed objects unless the request says otherwise, ASCII `\\d`/`\\w` in
    patterns, and a relaxed schema (VALIDATED afterwards) where llguidance cannot enforce a keyword.
    A JSON object is sent as the schema `{"type": "object"}` so that it can carry whitespace too.

    Whitespace: vLLM's backends take it from the engine (`disable_any_whitespace`, which the
    per-request field of the same name does not override); gengate starts the engine compact and
    a request for flexible whitespace says so in the schema (`x-guidance`), which the guidance
    backend honours and the others ignore (their output stays compact, still valid JSON).
    """
    constraint = output.constraint
    kwargs: dict[str, Any]
    enforcement = Enforcement.ENGINE
    if isinstance(constraint, JsonSchemaConstraint | JsonObjectConstraint):
        lowered = _lowered(output)
        schema = lowered.generate_schema or {"type": "object"}
        if output.whitespace is Whitespace.FLEXIBLE:
            schema = {**schema, "x-guidance": {"whitespace_flexible": True}}
        kwargs = {"json": schema}
        enforcement = lowered.enforcement
    elif isinstance(constraint, RegexConstraint):
        kwargs = {"regex": ascii_shorthands(constraint.pattern)}
    elif isinstance(constraint, ChoiceConstraint):
        kwargs = {"choice": list(constraint.choices)}
    elif isinstance(constraint, GrammarConstraint):
        kwargs = {"grammar": constraint.definition}
    else:  # pragma: no cover - the Constraint union is closed
        raise errors.Unimplemented(f"constraint {constraint!r} is not supported by vLLM")
    return kwargs, enforcement


# vLLM refuses `disable_any_whitespace` on the backends that cannot do it.
COMPACT_WHITESPACE_BACKENDS = frozenset({"guidance", "xgrammar"})


_LOWERED: LruCache[str, LoweredConstraint] = LruCache(256)


def _lowered(output: StructuredOutput) -> LoweredConstraint:
    """gengate's lowering of a JSON Schema, cached by its canonical text: relaxing a schema runs
    llguidance's compiler, which a hot schema should not pay on every request."""
    key = constraint_key(output)
    lowered = _LOWERED.get(key)
    if lowered is None:
        lowered = lower(output)  # raises InvalidArgument for a bad schema; errors are not cached
        _LOWERED.put(key, lowered)
    return lowered


NO_LORA_NAME = "gengate-no-lora"


def no_lora_adapter(adapters: Mapping[str, str], dest: Path) -> Path:
    """An adapter that changes nothing (one of `adapters` with every B matrix zero), written to
    `dest`, for requests without an adapter on vLLM's CPU build.

    There, a request without an adapter that shares a batch with requests that have one gets the
    last adapter slot applied: the torch bgmv ops index the stacked weights with its slot -1
    (vllm/lora/ops/torch_ops). Found by tests/vllm/test_vllm_lora.py; CUDA kernels skip -1.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    name = sorted(adapters)[0]
    source = Path(adapters[name]).expanduser()
    weights = source / "adapter_model.safetensors"
    if not weights.is_file():
        raise errors.ConfigError(
            f"LoRA adapter {name!r}: {weights} not found (vLLM's CPU build needs adapters in safetensors)"
        )
    tensors = load_file(str(weights))
    for key, tensor in tensors.items():
        if "lora_B" in key or "lora_embedding_B" in key:
            tensor.zero_()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    shutil.copyfile(source / "adapter_config.json", dest / "adapter_config.json")
    return dest


def finish_reason_of(reason: str | None, stop_reason: int | str | None) -> tuple[FinishReason, str | None]:
    """Maps vLLM's finish_reason/stop_reason to ours; a string stop_reason is the matched stop."""
    if reason == "stop":
        if isinstance(stop_reason, str):
            return FinishReason.STOP_SEQUENCE, stop_reason
        return FinishReason.STOP, None
    if reason == "length":
        return FinishReason.LENGTH, None
    if reason == "abort":
        return FinishReason.CANCELLED, None
    return FinishReason.ERROR, None


def convert_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None, top: int
) -> tuple[TokenLogprob, ...] | None:
    """vLLM's per-token {token_id: Logprob(logprob, rank, decoded_token)} to typed logprobs."""
    if logprobs is None:
        return None
    out = []
    for token_id, candidates in zip(token_ids, logprobs, strict=False):
        chosen = candidates.get(token_id)
        ranked = sorted(
            ((tid, lp) for tid, lp in candidates.items()), key=lambda item: getattr(item[1], "rank", 0) or 0
        )
        out.append(
            TokenLogprob(
                token=(getattr(chosen, "decoded_token", None) or "") if chosen is not None else "",
                logprob=float(chosen.logprob) if chosen is not None else float("-inf"),
                token_id=token_id,
                top=tuple(
                    TopLogprob(token=lp.decoded_token or "", logprob=float(lp.logprob), token_id=tid)
                    for tid, lp in ranked[:top]
                ),
            )
        )
    return tuple(out)


@dataclass
class _Generation:
    tokens: int = 0
    first_token_at: float | None = None
    done: bool = False


@dataclass
class OutputTracker:
    """Turns vLLM's RequestOutputs into domain events, counting usage per generation.

    DELTA outputs (streams) carry the new tokens of each step; a FINAL_ONLY output (unary calls)
    carries each whole generation once, so no time to first token is known.
    """

    input_tokens: int
    top_logprobs: int
    arrived: float = field(default_factory=time.monotonic)
    final_only: bool = False
    generations: dict[int, _Generation] = field(default_factory=dict)
    cached_input_tokens: int = 0

    def feed(self, output: Any) -> Iterable[GenerationDelta | GenerationEnd]:
        now = time.monotonic()
        cached = getattr(output, "num_cached_tokens", None)  # prefix-cache hits, once known
        if cached:
            self.cached_input_tokens = max(self.cached_input_tokens, int(cached))
        for completion in output.outputs:
            state = self.generations.setdefault(completion.index, _Generation())
            if state.done:
                continue
            token_ids = list(completion.token_ids or ())
            if token_ids or completion.text:
                state.tokens += len(token_ids)
                state.first_token_at = state.first_token_at or now
                yield GenerationDelta(
                    index=completion.index,
                    text=completion.text or "",
                    token_count=len(token_ids),
                    logprobs=convert_logprobs(token_ids, completion.logprobs, self.top_logprobs),
                )
            if completion.finish_reason is not None:
                state.done = True
                reason, matched = finish_reason_of(completion.finish_reason, completion.stop_reason)
                yield GenerationEnd(
                    index=completion.index,
                    finish_reason=reason,
                    matched_stop=matched,
                    usage=Usage(self.input_tokens, state.tokens, self.cached_input_tokens),
                    timings=Timings(
                        time_to_first_token_s=None
                        if self.final_only
                        else (state.first_token_at or now) - self.arrived,
                        total_s=now - self.arrived,
                    ),
                )

    def finished(self, n: int) -> bool:
        return len(self.generations) >= n and all(g.done for g in self.generations.values())


def capabilities_for(
    options: VLLMOptions,
    *,
    context_length: int,
    chat: bool,
    special_tokens: frozenset[str] | None = None,
    template: Any = None,
) -> ModelCapabilities:
    return engine_capabilities(
        grammar_syntaxes=GRAMMAR_SYNTAXES[options.structured_outputs_backend],
        max_n=options.max_n,
        max_top_logprobs=options.max_logprobs,
        context_length=context_length,
        chat=chat,
        backend_options=ENGINE_OPTIONS
        | VLLM_SAMPLING_OPTIONS
        | (VLLM_OPTIONS if options.lora_adapters else frozenset()),
        special_tokens=special_tokens,
        # the tools grammar is llguidance Lark (`%json` rules): only the guidance backend reads it
        tools=Enforcement.ENGINE if options.structured_outputs_backend == "guidance" else None,
        chat_template_kwargs=bool(template),
        reasoning_control=reads_thinking(template),
        reasoning=options.tags_for(template_text(template)) is not None,
    )


def engine_kwargs(
    options: VLLMOptions, *, visible_devices: str | None, cpu_platform: bool = False
) -> dict[str, Any]:
    """vllm.AsyncEngineArgs keyword arguments; tensor parallelism follows the GPUs placed.

    `visible_devices` is the worker's CUDA_VISIBLE_DEVICES: None when gengate placed nothing
    (isolation: inline), "" for a CPU worker (`devices: cpu`). `cpu_platform` says the installed
    vLLM is its CPU build (vllm-cpu), which only a CPU worker may use.
    """
    gpus = None if visible_devices is None else len([d for d in visible_devices.split(",") if d.strip()])
    if cpu_platform and gpus:
        raise errors.ConfigError(
            f"the installed vLLM is its CPU build, but this worker was given GPUs {visible_devices}: "
            "set 'devices: cpu' on the model, or install vLLM's CUDA build"
        )
    if not cpu_platform and gpus == 0:
        raise errors.Unavailable(
            "vLLM needs a GPU and this worker was given none (CUDA_VISIBLE_DEVICES is empty); "
            "'devices: cpu' needs vLLM's CPU build (vllm-cpu)",
            reason="NO_GPU",
        )
    if cpu_platform:
        tp = 1
    else:
        # Not placed by gengate (isolation: inline): every GPU is visible; use one unless
        # tensor_parallel_size says otherwise.
        tp = options.tensor_parallel_size or max(1, (gpus or 1) // options.pipeline_parallel_size)
    kwargs: dict[str, Any] = {
        "model": options.model,
        "tokenizer": options.tokenizer,
        "revision": options.revision,
        "tokenizer_mode": options.tokenizer_mode,
        "dtype": options.dtype,
        "quantization": options.quantization,
        "max_model_len": options.max_model_len,
        "gpu_memory_utilization": None if cpu_platform else options.gpu_memory_utilization,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "distributed_executor_backend": options.distributed_executor_backend,
        "enable_prefix_caching": options.enable_prefix_caching,
        "max_num_seqs": options.max_num_seqs,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "enforce_eager": options.enforce_eager,
        "trust_remote_code": options.trust_remote_code,
        "max_logprobs": options.max_logprobs,
        "seed": options.seed,
    }
    if options.lora_adapters:
        # On the CPU build every request runs with an adapter (no_lora_adapter), which takes a slot.
        slots = options.max_loras + (1 if cpu_platform else 0)
        kwargs.update(enable_lora=True, max_lora_rank=options.max_lora_rank, max_loras=slots)
    return {key: value for key, value in kwargs.items() if value is not None}


# --- the backend -------------------------------------------------------------------------------


class VLLMBackend:
    """One model on vLLM's AsyncLLM; meant to run in a worker process pinned to its GPUs."""

    kind: ClassVar[str] = "vllm"
    Options: ClassVar[type[BaseModel]] = VLLMOptions

    def __init__(self, name: str, options: VLLMOptions) -> None:
        self.name = name
        self.options = options
        self.capabilities = capabilities_for(options, context_length=options.max_model_len or 0, chat=True)
        self._engine: Any = None
        self._tokenizer: Any = None
        self._vllm: Any = None
        self._context_length = options.max_model_len or 0
        self._vocab_size: int | None = None  # the tokenizer's, for stop_token_ids
        self._loras: dict[str, Any] = {}  # adapter name -> vLLM's LoRARequest, made at start
        self._no_lora: Any = None  # vLLM's CPU build: the adapter of requests without one
        self._scratch: Path | None = None

    async def start(self) -> None:
        if self.options.cpu_kv_cache_gb is not None:  # read by vLLM's engine-core process
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{self.options.cpu_kv_cache_gb:g}"
        if self.options.cpu_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.options.cpu_threads_bind
        try:
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise errors.ConfigError(
                f"model {self.name!r}: vLLM is not installed ({exc}); use the GPU image "
                "(bench/gpu/Dockerfile.vllm), pip install 'gengate[vllm]', or for CPU see README (vLLM)"
            ) from exc
        cpu_platform = bool(current_platform.is_cpu())
        kwargs = engine_kwargs(
            self.options, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), cpu_platform=cpu_platform
        )
        if cpu_platform and self.options.lora_adapters:
            import tempfile

            self._scratch = Path(tempfile.mkdtemp(prefix="gengate-vllm-"))
            path = no_lora_adapter(self.options.lora_adapters, self._scratch / NO_LORA_NAME)
            from vllm.lora.request import LoRARequest

            slot = len(self.options.lora_adapters) + 1
            self._no_lora = LoRARequest(lora_name=NO_LORA_NAME, lora_int_id=slot, lora_path=str(path))
        self._vllm = vllm
        backend = self.options.structured_outputs_backend
        structured_config: dict[str, Any] = {"backend": backend}
        if backend in COMPACT_WHITESPACE_BACKENDS:
            structured_config["disable_any_whitespace"] = True  # see structured_outputs_kwargs
        try:
            from vllm.config import StructuredOutputsConfig

            kwargs["structured_outputs_config"] = StructuredOutputsConfig(**structured_config)
        except ImportError:  # older layouts take a plain mapping
            kwargs["structured_outputs_config"] = structured_config
        extra = self.options.extra_engine_args
        kwargs.update(checked_engine_args(extra, engine_arg_names(AsyncEngineArgs), model=self.name))
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        tokenizer = self._engine.get_tokenizer()
        self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        self._vocab_size = len(self._tokenizer) if hasattr(self._tokenizer, "__len__") else None
        self._context_length = int(self._engine.model_config.max_model_len)
        template = chat_template_of(self._tokenizer, self.options.chat_template)
        self.capabilities = capabilities_for(
            self.options,
            context_length=self._context_length,
            chat=bool(template),
            special_tokens=special_tokens_of(self._tokenizer),
            template=template,
        )
        await self._load_adapters()

    async def _load_adapters(self) -> None:
        """Loads every configured LoRA adapter now, so a bad one fails the start, not a request."""
        from vllm.lora.request import LoRARequest

        self._loras = {
            name: LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
            for name, (lora_id, path) in lora_slots(self.options.lora_adapters).items()
        }
        for lora in [*self._loras.values(), *([self._no_lora] if self._no_lora is not None else [])]:
            try:
                await self._engine.add_lora(lora)
            except Exception as exc:
                raise errors.ConfigError(
                    f"model {self.name!r}: LoRA adapter {lora.lora_name!r} ({lora.lora_path}) did not load: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

    async def aclose(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()
        if self._scratch is not None:
            import shutil

            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        return vllm_prompt(self._tokenizer, request, self.options.chat_template, self.options)[0]

    def _sampling_params(
        self, request: GenerationRequest, prompt_len: int, *, stream: bool
    ) -> tuple[Any, Enforcement]:
        """vLLM's SamplingParams for `request`, and how its structured output is enforced.

        Deltas only for a stream whose text is not held back for validation; FINAL_ONLY otherwise,
        as vLLM's own server does for non-streaming calls (a RequestOutput per token costs its
        frontend time that nobody uses)."""
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        kwargs = sampling_kwargs(
            request, default_max_tokens=max(1, self._context_length - prompt_len), vocab_size=self._vocab_size
        )
        enforcement = Enforcement.NONE
        plan = tool_plan(request)
        if request.structured_output is not None:
            structured, enforcement = structured_outputs_kwargs(request.structured_output)
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        elif plan is not None and plan.grammar is not None:
            structured, _ = structured_outputs_kwargs(plan.grammar)
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
            enforcement = plan.enforcement
        deltas = stream and enforcement is not Enforcement.VALIDATED
        kind = RequestOutputKind.DELTA if deltas else RequestOutputKind.FINAL_ONLY
        return self._vllm.SamplingParams(output_kind=kind, **kwargs), enforcement

    def _lora_request(self, request: GenerationRequest) -> Any:
        """vLLM's LoRARequest for the adapter the request names, or None (on the CPU build with
        adapters configured: the adapter that changes nothing, see no_lora_adapter)."""
        name = lora_choice(request, self.options.lora_adapters)
        return self._no_lora if name is None else self._loras[name]

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await collect_stream(self._events(request, stream=False))

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        return self._events(request, stream=True)

    async def _events(self, request: GenerationRequest, *, stream: bool) -> AsyncIterator[StreamEvent]:
        if self._engine is None:
            raise errors.Unavailable(f"model {self.name!r} is not loaded")
        arrived = time.monotonic()
        prompt_ids, thinking = vllm_prompt(self._tokenizer, request, self.options.chat_template, self.options)
        output_room(request, len(prompt_ids), self._context_length)  # PROMPT_TOO_LONG when none is left
        params, enforcement = self._sampling_params(request, len(prompt_ids), stream=stream)
        lora = self._lora_request(request)
        engine_request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        stopping = StoppingCriteria(max_tokens=params.max_tokens, stop=request.stopping.stop)
        yield stream_start(request, self.name, len(prompt_ids), enforcement, request.sampling, stopping)

        def generations(indices: Sequence[int], attempt: int) -> AsyncGenerator[StreamEvent, None]:
            if attempt == 0:
                return self._run(prompt_ids, params, lora, engine_request_id, request, arrived, indices)
            seed = request.sampling.seed
            retry = replace(
                request,
                n=len(indices),
                sampling=replace(request.sampling, seed=None if seed is None else retry_seed(seed, attempt)),
            )
            retry_params, _ = self._sampling_params(retry, len(prompt_ids), stream=False)
            retry_id = f"{engine_request_id}-retry{attempt}"
            return self._run(prompt_ids, retry_params, lora, retry_id, retry, arrived, indices)

        async with (
            aclosing(all_generations(request, enforcement, generations)) as events,
            aclosing(reasoning_events(events, thinking)) as thought,
            aclosing(tool_events(thought, tool_plan(request))) as split,
        ):
            async for event in split:
                yield event

    async def _run(
        self,
        prompt_ids: list[int],
        params: Any,
        lora: Any,
        engine_request_id: str,
        request: GenerationRequest,
        arrived: float,
        indices: Sequence[int],
    ) -> AsyncGenerator[StreamEvent, None]:
        """One engine request's events, its generation j reported as generation `indices[j]`;
        the engine request is aborted if the caller stops early."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        tracker = OutputTracker(
            len(prompt_ids), request.logprobs or 0, arrived=arrived, final_only=final_only
        )
        try:
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, engine_request_id, lora_request=lora
            ):
                for event in tracker.feed(output):
                    index = indices[event.index]
                    yield event if index == event.index else replace(event, index=index)
        finally:
            if not tracker.finished(request.n) and self._engine is not None:
                await self._engine.abort(engine_request_id)
