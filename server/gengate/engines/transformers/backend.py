"""TransformersBackend: a Hugging Face causal LM served with continuous batching on one thread.

Requests become one sequence per generation; the BatchScheduler (engines/batching) steps every
live sequence of every request together through TorchBatch. Token choice (sampling, constraints,
stop strings, logprobs) is the shared SequenceDecoder's job, so this engine behaves exactly like the
llama.cpp one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gengate import errors
from gengate.constraints.warm import WarmConstraint, warm_compiler
from gengate.engines.batching.engine import (
    BatchedEngine,
    context_length_from_folder,
    context_length_of,
    hf_eos_token_ids,
    model_source,
)
from gengate.engines.batching.request import Loaded
from gengate.engines.options import refuse_own_keys
from gengate.engines.reasoning import ReasoningConfig

# from_pretrained arguments gengate sets from its own options (or from where the model lives):
# not for model_kwargs, so each setting has one place. key -> the option that sets it.
OWN_FROM_PRETRAINED_ARGS = {
    "pretrained_model_name_or_path": "model",
    "dtype": "dtype",
    "torch_dtype": "dtype",
    "device_map": "device_map",
    "revision": "revision",
    "trust_remote_code": "trust_remote_code",
    "local_files_only": "model (a local folder loads offline, a hub id does not)",
}


class TransformersOptions(ReasoningConfig):
    """Config keys of a `backend: transformers` model entry."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tiny: bool = False
    dtype: str = "auto"
    device: str = "cpu"
    max_batch_size: int = 16
    max_n: int = 16
    trust_remote_code: bool = Field(
        default=False, strict=True, description="Run the model repository's own code (its modeling files)."
    )
    chat_template: str | None = None
    warm_constraints: list[WarmConstraint] = Field(
        default_factory=list,
        description="Constraints compiled at start, so their first request hits the compile cache.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        description="Branch, tag or commit of a hub-id `model` (transformers ignores it for a local folder).",
    )
    model_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More from_pretrained arguments for the model (attn_implementation, quantization_config, "
        "config overrides, ...); not those gengate sets (OWN_FROM_PRETRAINED_ARGS).",
    )
    device_map: str | dict[str, int | str] | None = Field(
        default=None,
        description="from_pretrained's device_map (needs accelerate): 'auto' spreads the model over the "
        "worker's GPUs; instead of `device`.",
    )

    @field_validator("model_kwargs")
    @classmethod
    def _not_gengates_own(cls, value: dict[str, Any]) -> dict[str, Any]:
        return refuse_own_keys(value, OWN_FROM_PRETRAINED_ARGS)

    @model_validator(mode="after")
    def _one_source(self) -> TransformersOptions:
        if (self.model is None) == (not self.tiny):
            raise ValueError("set exactly one of 'model' (a local folder or a hub id) or 'tiny: true'")
        if self.max_batch_size < 1 or self.max_n < 1:
            raise ValueError("'max_batch_size' and 'max_n' must be at least 1")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError("'dtype' must be one of auto, float32, float16, bfloat16")
        if self.revision is not None and (self.tiny or _local_folder(self.model)):
            raise ValueError(
                "'revision' applies to a hub id; a local folder (or tiny: true) is loaded as it is on disk"
            )
        if self.device_map is not None and "device" in self.model_fields_set:
            raise ValueError("set one of 'device' and 'device_map'")
        return self


class TransformersBackend(BatchedEngine):
    """A Hugging Face transformers model, batched across requests and generations."""

    kind: ClassVar[str] = "transformers"
    Options: ClassVar[type[BaseModel]] = TransformersOptions

    def __init__(self, name: str, options: TransformersOptions) -> None:
        self.options = options
        super().__init__(name, max_n=options.max_n, context_length=context_length_from_folder(options.model))

    def _load(self) -> Loaded:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from gengate.constraints import ConstraintCompiler, make_ll_tokenizer_from_hf
        from gengate.engines.batching.scheduler import BatchScheduler
        from gengate.engines.transformers.batch import TorchBatch

        options = self.options
        source, local = model_source(self.options.model, self.options.tiny)
        common: dict[str, Any] = {"trust_remote_code": options.trust_remote_code, "local_files_only": local}
        if options.revision is not None:
            common["revision"] = options.revision
        with self._loading(source, "the tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(source, **common)
        if options.chat_template is not None:
            tokenizer.chat_template = options.chat_template
        dtype: Any = options.dtype
        on_cpu = options.device == "cpu" if options.device_map is None else options.device_map == "cpu"
        if dtype == "auto" and on_cpu:
            dtype = torch.float32  # half precision matmuls are slow or missing on most CPUs
        elif dtype != "auto":
            dtype = getattr(torch, dtype)
        placement: dict[str, Any] = {} if options.device_map is None else {"device_map": options.device_map}
        with self._loading(source, "the model"):
            model: Any = AutoModelForCausalLM.from_pretrained(
                source, **options.model_kwargs, **placement, dtype=dtype, **common
            )
        if options.device_map is None:
            model.to(options.device)
        model.eval()
        # With a device_map, accelerate placed the layers; inputs go where the embeddings are.
        device = options.device if options.device_map is None else str(model.device)

        logits_size = int(model.get_output_embeddings().weight.shape[0])
        vocab_size = min(logits_size, len(tokenizer))
        eos = hf_eos_token_ids(tokenizer, model.generation_config)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
        ll_tokenizer = make_ll_tokenizer_from_hf(tokenizer, n_vocab=max(logits_size, len(tokenizer)))
        compiler = ConstraintCompiler(ll_tokenizer, f"hf:{source}")
        warm_compiler(compiler, options.warm_constraints, self.name)
        batch = TorchBatch(model, pad_token_id=pad, device=device)
        scheduler = BatchScheduler(batch, max_batch_size=options.max_batch_size, engine="transformers")
        return Loaded(
            tokenizer=tokenizer,
            scheduler=scheduler,
            compiler=compiler,
            eos_token_ids=eos,
            vocab_size=vocab_size,
            context_length=context_length_of(model.config),
        )

    @contextmanager
    def _loading(self, source: str, what: str) -> Iterator[None]:
        """Turns a from_pretrained failure into a ConfigError naming the model, its revision and
        the settings that went into it (a missing revision is an OSError deep in the hub client)."""
        try:
            yield
        except (OSError, ValueError, TypeError) as exc:
            at = f" at revision {self.options.revision!r}" if self.options.revision is not None else ""
            given = [k for k in ("model_kwargs", "device_map") if getattr(self.options, k)]
            hint = f" (with {' and '.join(given)})" if given and what == "the model" else ""
            raise errors.ConfigError(
                f"model {self.name!r}: could not load {what} of {source!r}{at}{hint}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def _local_folder(model: str | None) -> bool:
    return model is not None and Path(model).expanduser().is_dir()
