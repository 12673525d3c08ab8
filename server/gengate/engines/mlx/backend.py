"""MlxBackend: a model loaded by mlx-lm (Apple's MLX; Metal on Apple silicon, MLX's CPU build on
Linux), served with continuous batching like the transformers engine.

Configured like distilabel's MlxLLM: `model` (path_or_hf_repo), `tokenizer_config`,
`model_config`, `adapter_path` (LoRA adapters in mlx-lm's format), `chat_template`. mlx-lm loads
the model and runs its forward passes (MlxBatch); token choice is the shared SequenceDecoder's,
so sampling, seeds, stop strings, logprobs and every constraint kind (llguidance masks) behave
exactly as on the other local engines. mlx-lm's own samplers and logits processors are not used:
they would give this engine a second, different set of sampling semantics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gengate import errors
from gengate.constraints.warm import WarmConstraint, warm_compiler
from gengate.engines.batching.engine import (
    BatchedEngine,
    context_length_from_folder,
    context_length_of,
    model_source,
)
from gengate.engines.batching.request import Loaded
from gengate.engines.reasoning import ReasoningConfig


class MlxOptions(ReasoningConfig):
    """Config keys of a `backend: mlx` model entry."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None,
        description="A local model folder (safetensors + config.json + tokenizer), or a hub id where "
        "the machine can reach the Hugging Face hub (MlxLLM's path_or_hf_repo).",
    )
    tiny: bool = False
    tokenizer_config: dict[str, Any] = Field(
        default_factory=dict, description="Extra arguments for the tokenizer (mlx-lm's tokenizer_config)."
    )
    model_config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        alias="model_config",
        description="Overrides of the model's config.json (mlx-lm's model_config).",
    )
    adapter_path: str | None = Field(
        default=None, min_length=1, description="A folder of LoRA adapters in mlx-lm's format."
    )
    chat_template: str | None = None
    warm_constraints: list[WarmConstraint] = Field(
        default_factory=list,
        description="Constraints compiled at start, so their first request hits the compile cache.",
    )
    revision: str | None = Field(default=None, min_length=1, description="Branch, tag or commit of a hub id.")
    trust_remote_code: bool = Field(default=False, strict=True)
    max_batch_size: int = Field(
        default=16, ge=1, description="Generations stepped together in one forward pass at most."
    )
    max_n: int = Field(default=16, ge=1)

    @model_validator(mode="after")
    def _one_source(self) -> MlxOptions:
        if (self.model is None) == (not self.tiny):
            raise ValueError("set exactly one of 'model' (a local folder or a hub id) or 'tiny: true'")
        if self.revision is not None and (self.tiny or Path(self.model or "").expanduser().is_dir()):
            raise ValueError("'revision' applies to a hub id; a local folder is loaded as it is on disk")
        return self


class MlxBackend(BatchedEngine):
    """An mlx-lm model, batched across requests and generations."""

    kind: ClassVar[str] = "mlx"
    Options: ClassVar[type[BaseModel]] = MlxOptions

    def __init__(self, name: str, options: MlxOptions) -> None:
        self.options = options
        super().__init__(name, max_n=options.max_n, context_length=context_length_from_folder(options.model))

    def _load(self) -> Loaded:
        import mlx.core as mx
        from mlx_lm import load

        from gengate.constraints import ConstraintCompiler, make_ll_tokenizer_from_hf
        from gengate.engines.batching.scheduler import BatchScheduler
        from gengate.engines.mlx.batch import MlxBatch

        options = self.options
        source, _ = model_source(options.model, options.tiny)
        if options.adapter_path is not None and not Path(options.adapter_path).expanduser().is_dir():
            raise errors.ConfigError(
                f"model {self.name!r}: adapter_path {options.adapter_path!r} is not a folder"
            )
        with self._loading(source):
            loaded: Any = load(
                source,
                tokenizer_config=options.tokenizer_config or None,
                model_config=options.model_config_overrides or None,
                adapter_path=None
                if options.adapter_path is None
                else str(Path(options.adapter_path).expanduser()),
                return_config=True,
                revision=options.revision,
                trust_remote_code=options.trust_remote_code,
            )
        model, wrapper, config = loaded
        # mx.load reads adapters lazily, bound to this thread's stream: materialize every weight here,
        # before the model thread (another thread, its own stream) computes with them.
        mx.eval(model.parameters())
        tokenizer = wrapper._tokenizer  # the Hugging Face tokenizer mlx-lm wraps
        if options.chat_template is not None:
            tokenizer.chat_template = options.chat_template
        bos = tokenizer.bos_token_id
        probe = model(mx.array([[bos if bos is not None else 0]]))
        mx.eval(probe)
        logits_size = int(probe.shape[-1])
        vocab_size = min(logits_size, len(tokenizer))
        eos = frozenset(int(t) for t in wrapper.eos_token_ids)
        ll_tokenizer = make_ll_tokenizer_from_hf(tokenizer, n_vocab=max(logits_size, len(tokenizer)))
        compiler = ConstraintCompiler(ll_tokenizer, f"mlx:{source}")
        warm_compiler(compiler, options.warm_constraints, self.name)
        scheduler = BatchScheduler(MlxBatch(model), max_batch_size=options.max_batch_size, engine="mlx")
        return Loaded(
            tokenizer=tokenizer,
            scheduler=scheduler,
            compiler=compiler,
            eos_token_ids=eos,
            vocab_size=vocab_size,
            context_length=context_length_of(config),
        )

    @contextmanager
    def _loading(self, source: str) -> Iterator[None]:
        """Turns an mlx-lm load failure into a one-line ConfigError naming the model and what it was
        given (adapters, config overrides)."""
        try:
            yield
        except Exception as exc:
            given = [
                k
                for k in ("adapter_path", "model_config_overrides", "tokenizer_config")
                if getattr(self.options, k)
            ]
            with_what = f" (with {', '.join(g.replace('_overrides', '') for g in given)})" if given else ""
            detail = " ".join(str(exc).split())[:300]
            raise errors.ConfigError(
                f"model {self.name!r}: mlx-lm could not load {source!r}{with_what}: "
                f"{type(exc).__name__}: {detail}"
            ) from exc
