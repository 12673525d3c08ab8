"""distilabel 1.5 LLM served by gengate: `GengateLLM` works in any distilabel task or pipeline.

    from distilabel.pipeline import Pipeline
    from distilabel.steps import LoadDataFromDicts
    from distilabel.steps.tasks import TextGeneration
    from gengate_client.distilabel import GengateLLM

    with Pipeline(name="haiku") as pipeline:
        rows = LoadDataFromDicts(data=[{"instruction": "A haiku about the sea."}])
        llm = GengateLLM(model="tiny", address="localhost:50051")
        rows >> TextGeneration(llm=llm, num_generations=2)
    distiset = pipeline.run(use_cache=False)

Each distilabel generation kwarg maps onto one gengate request field (`num_generations` is `n`, in
one call); `structured_output` in distilabel's form becomes a constraint the server enforces;
Magpie asks the server to write the next user turn; offline batch generation is a durable
gengate batch job. Needs the `distilabel` extra: `pip install gengate-client[distilabel]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pydantic
from distilabel.exceptions import DistilabelOfflineBatchGenerationNotFinishedException
from distilabel.mixins.runtime_parameters import RuntimeParameter
from distilabel.models.llms.base import AsyncLLM
from distilabel.models.mixins.magpie import MAGPIE_PRE_QUERY_TEMPLATES, MagpieChatTemplateMixin
from distilabel.typing import FormattedInput, GenerateOutput, OutlinesStructuredOutputType
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, field_validator

from gengate_client.aio import AsyncClient
from gengate_client.errors import OutputError
from gengate_client.jobs import BatchJob
from gengate_client.output_types import JsonSchema, OutputSpec, Regex, resolve_output_type
from gengate_client.types import (
    Enforcement,
    FinishReason,
    ItemResult,
    Magpie,
    Request,
    Response,
    TokenLogprob,
)

__all__ = ["GENGATE_FIELDS", "GenerationKwargs", "GengateCall", "GengateLLM", "output_type_of"]

# distilabel's generation kwarg -> the gengate request field it sets (logprobs/top_logprobs together
# set gengate's `logprobs` count; num_generations is `n`).
GENGATE_FIELDS: dict[str, str] = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop_sequences": "stop",
    "seed": "seed",
    "backend_options": "backend_options",
}

# Names other distilabel LLMs take, with what to use here instead.
_HINTS = {
    "max_tokens": "use max_new_tokens",
    "max_completion_tokens": "use max_new_tokens",
    "stop": "use stop_sequences",
    "n": "set the task's num_generations (sent as gengate's n, in one call)",
    "response_format": "use structured_output, on the LLM or per row with StructuredGeneration",
    "extra_body": "backend-specific options go in backend_options (each model lists its keys)",
    "echo": "gengate returns the generated text only",
    "do_sample": "use temperature=0 for greedy decoding",
}

# distilabel resolves its preset names to the pre-query text; gengate takes the preset names.
_MAGPIE_PRESETS = {text: name for name, text in MAGPIE_PRE_QUERY_TEMPLATES.items()}

_STRUCTURED_KEYS = {"format", "schema"}
_INSTRUCTOR_KEYS = {"mode", "max_retries"}


@dataclasses.dataclass(frozen=True)
class GenerationKwargs:
    """distilabel's generation kwargs as `GengateLLM.agenerate` takes them, defaults included."""

    max_new_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_sequences: str | Sequence[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    backend_options: Mapping[str, str | int | float | bool] | None = None

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> GenerationKwargs:
        """Checks the names (an unknown one is refused, with what to use instead) and fills defaults."""
        known = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in known:
                hint = _HINTS.get(name, "gengate has no such request field")
                raise ValueError(
                    f"GengateLLM does not take the generation kwarg {name!r}: {hint}. "
                    f"It takes: {', '.join(sorted(known))}."
                )
        return cls(**kwargs)

    def gengate_fields(self) -> dict[str, Any]:
        """The gengate request fields these set (unset ones left to the server's defaults)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        fields: dict[str, Any] = {}
        for name, gengate_name in GENGATE_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                fields[gengate_name] = value
        if isinstance(self.stop_sequences, str):
            fields["stop"] = [self.stop_sequences]
        elif self.stop_sequences is not None:
            fields["stop"] = list(self.stop_sequences)
        if self.backend_options is not None:
            fields["backend_options"] = dict(self.backend_options)
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return fields


def output_type_of(structured_output: Mapping[str, Any]) -> Any:
    """distilabel's `structured_output` (`{"format": "json", "schema": Model | dict | str}` or
    `{"format": "regex", "schema": pattern}`) as the gengate output type the server enforces."""
    keys = set(structured_output)
    if keys & _INSTRUCTOR_KEYS:
        raise ValueError(
            f"structured_output keys {sorted(keys & _INSTRUCTOR_KEYS)} are instructor options: gengate "
            "enforces the schema on the server, with no client-side re-asking"
        )
    if structured_output.get("whitespace_pattern") is not None:
        raise ValueError(
            "structured_output whitespace_pattern is not supported: the gengate server sets JSON whitespace"
        )
    unknown = keys - _STRUCTURED_KEYS - {"whitespace_pattern"}
    if unknown:
        raise ValueError(f"structured_output takes format and schema, not {sorted(unknown)}")
    kind = structured_output.get("format") or "json"
    schema = structured_output.get("schema")
    if schema is None:
        raise ValueError("structured_output needs a schema")
    if kind == "regex":
        if not isinstance(schema, str):
            raise ValueError("structured_output with format 'regex' needs the pattern (a str) as schema")
        return Regex(schema)
    if kind != "json":
        raise ValueError(f"structured_output format must be 'json' or 'regex', not {kind!r}")
    if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
        return schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_output schema is a str but not JSON: {exc}") from exc
    if not isinstance(schema, Mapping):
        raise ValueError(
            f"structured_output schema must be a pydantic model, a JSON Schema dict or its JSON text, "
            f"not {type(schema).__name__}"
        )
    return JsonSchema(dict(schema))


def _text_only(spec: OutputSpec) -> OutputSpec:
    """The same constraint without client-side parsing: results stay text (distilabel's form), and a
    generation cut at max_new_tokens or failing to parse becomes that generation's None, not an
    error for the whole call."""
    return OutputSpec(spec.structured, lambda text: text)


@dataclasses.dataclass(frozen=True)
class GengateCall:
    """One distilabel input as one gengate call: `generate(model, **kwargs)`, or with `magpie`
    the fields of the `Magpie` input that asks the server to write the next user turn."""

    kwargs: dict[str, Any]
    spec: OutputSpec | None = None  # the structured output and its parser, to check each generation
    magpie: dict[str, Any] | None = None

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `AsyncClient.generate` (a `Magpie` built from `magpie`)."""
        if self.magpie is None:
            return dict(self.kwargs)
        return {**self.kwargs, "magpie": Magpie(**self.magpie)}

    def request(self, model: str) -> Request:
        """The call as a batch-job item."""
        return Request(model=model, **self.generate_kwargs())


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": message["role"], "content": message["content"]}


def _logprobs(tokens: Sequence[TokenLogprob]) -> list[list[dict[str, Any]]]:
    """distilabel's shape: per position, the chosen token first, then its alternatives."""
    positions = []
    for token in tokens:
        candidates = [{"token": token.token, "logprob": token.logprob}]
        for alt in token.top:
            same = (alt.token_id == token.token_id) if alt.token_id is not None else alt.token == token.token
            if not same:
                candidates.append({"token": alt.token, "logprob": alt.logprob})
        positions.append(candidates)
    return positions


def _empty_output(n: int) -> dict[str, Any]:
    return {"generations": [None] * n, "statistics": {"input_tokens": [0] * n, "output_tokens": [0] * n}}


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ValueError(f"GengateLLM {what} {path}: cannot read it ({exc.strerror})") from None


class GengateLLM(AsyncLLM, MagpieChatTemplateMixin):
    """A distilabel LLM served by a gengate server: one `AsyncClient`, made in `load()`.

    Attributes:
        model: the served model name, as gengate's ListModels lists it.
        address: the gengate server, HOST:PORT (default $GENGATE_ADDRESS, else 127.0.0.1:50051).
        api_key: a bearer token for servers with `auth_tokens_env`, sent as `authorization:
            Bearer ...` (default $GENGATE_API_KEY). Never dumped with the pipeline, never logged.
        tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name: TLS (system roots unless
            a CA file; a client certificate and key for mutual TLS).
        metadata: more gRPC metadata sent with every call.
        timeout: deadline of each call in seconds.
        structured_output: distilabel's structured output, enforced by the server for every input.
        batch_job_offline: with `use_offline_batch_generation`, create the gengate job `offline`
            (items go to the model's provider batch API: openai, azure_openai, anthropic models).

    Runtime parameters: address, api_key, tls, tls_ca_file, tls_cert_file, tls_key_file,
    tls_server_name, metadata, timeout, structured_output, batch_job_offline.
    """

    # A refused value (a token in metadata, a bad api_key) is never echoed in the error.
    model_config = ConfigDict(hide_input_in_errors=True)

    model: str
    address: RuntimeParameter[str] | None = Field(
        default_factory=lambda: os.getenv("GENGATE_ADDRESS", "127.0.0.1:50051"),
        description="The gengate server, HOST:PORT.",
    )
    api_key: RuntimeParameter[SecretStr] | None = Field(
        default_factory=lambda: os.getenv("GENGATE_API_KEY"),
        description="Bearer token for the gengate server (default $GENGATE_API_KEY).",
    )
    tls: RuntimeParameter[bool] = Field(default=False, description="Connect with TLS.")
    tls_ca_file: RuntimeParameter[str] | None = Field(
        default=None, description="PEM root certificates to trust (implies TLS)."
    )
    tls_cert_file: RuntimeParameter[str] | None = Field(
        default=None, description="PEM client certificate, for mutual TLS."
    )
    tls_key_file: RuntimeParameter[str] | None = Field(
        default=None, description="PEM client private key, for mutual TLS."
    )
    tls_server_name: RuntimeParameter[str] | None = Field(
        default=None, description="The name the server's certificate must carry, if not the host's."
    )
    metadata: RuntimeParameter[dict[str, str]] | None = Field(
        default=None, description="More gRPC metadata sent with every call."
    )
    timeout: RuntimeParameter[float] = Field(default=120.0, description="Deadline of each call in seconds.")
    structured_output: RuntimeParameter[OutlinesStructuredOutputType] | None = Field(
        default=None, description="The structured output every generation must have, enforced by the server."
    )
    batch_job_offline: RuntimeParameter[bool] = Field(
        default=False,
        description="Offline batch generation through the model's provider batch API (gengate job offline).",
    )

    _client: AsyncClient | None = PrivateAttr(default=None)

    @field_validator("metadata")
    @classmethod
    def _no_token_in_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value and any(key.lower() == "authorization" for key in value):
            raise ValueError(
                "put the token in api_key, not in metadata: api_key is kept out of pipeline dumps and logs"
            )
        return value

    def __del__(self) -> None:
        # distilabel's AsyncLLM.__del__ fails on an instance whose validation failed (no private
        # attributes yet): noise at garbage collection, after the real error was raised.
        if getattr(self, "__pydantic_private__", None) is not None:
            super().__del__()

    @property
    def model_name(self) -> str:
        """The served model name."""
        return self.model

    def load(self) -> None:
        """Opens the client on the loop distilabel runs `agenerate` on (a second load replaces it)."""
        if self._client is not None:
            self.unload()
        super().load()
        if not self.address:
            raise ValueError("GengateLLM needs the server's address, HOST:PORT (or $GENGATE_ADDRESS)")
        self.event_loop  # noqa: B018 (sets the loop current, so the channel binds to it)
        self._client = AsyncClient(
            self.address,
            credentials=self._credentials(),
            metadata=self._metadata(),
            timeout=self.timeout,
            options=self._channel_options(),
        )

    def unload(self) -> None:
        """Closes the client (distilabel pickles unloaded LLMs; a channel does not pickle)."""
        client, self._client = self._client, None
        if client is not None:
            loop = self.event_loop
            if loop.is_running():
                loop.create_task(client.close())
            elif not loop.is_closed():
                loop.run_until_complete(client.close())
        super().unload()

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls or self.tls_ca_file or self.tls_cert_file or self.tls_key_file):
            return None
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("GengateLLM tls_cert_file and tls_key_file go together (mutual TLS)")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca_file, "tls_ca_file"),
            private_key=_read(self.tls_key_file, "tls_key_file"),
            certificate_chain=_read(self.tls_cert_file, "tls_cert_file"),
        )

    def _metadata(self) -> list[tuple[str, str]]:
        pairs = [(key.lower(), value) for key, value in (self.metadata or {}).items()]
        if self.api_key is not None and self.api_key.get_secret_value():
            pairs.append(("authorization", f"Bearer {self.api_key.get_secret_value()}"))
        return pairs

    def _channel_options(self) -> list[tuple[str, Any]] | None:
        if self.tls_server_name is None:
            return None
        return [("grpc.ssl_target_name_override", self.tls_server_name)]

    def _require_client(self) -> AsyncClient:
        if self._client is None:
            raise RuntimeError("GengateLLM is not loaded: call load() first")
        return self._client

    def build_call(
        self, input: FormattedInput, num_generations: int = 1, generation: GenerationKwargs | None = None
    ) -> GengateCall:
        """The gengate call for one distilabel input: a prompt (str), chat messages, or messages
        with the row's structured output (StructuredGeneration); Magpie when the template is on and
        the conversation does not end with a user turn."""
        fields = (generation or GenerationKwargs()).gengate_fields()
        fields["n"] = num_generations
        row_structured = None
        if isinstance(input, tuple):
            input, row_structured = input
        if row_structured is not None and self.structured_output is not None:
            raise ValueError(
                "structured_output is set on GengateLLM and in the input row too: give one of them"
            )
        structured = row_structured if row_structured is not None else self.structured_output
        spec = None
        if structured is not None:
            spec = resolve_output_type(output_type_of(structured))
            assert spec is not None
            fields["output_type"] = _text_only(spec)
        if isinstance(input, str):
            return GengateCall({"prompt": input, **fields}, spec)
        messages = [_message(m) for m in input]
        if self.use_magpie_template and (not messages or messages[-1]["role"] != "user"):
            if spec is not None:
                raise ValueError("Magpie writes free-text user turns: it takes no structured_output")
            return GengateCall(fields, None, self.magpie_fields(messages))
        return GengateCall({"messages": messages, **fields}, spec)

    def magpie_fields(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The `Magpie` input for the next user turn of `messages`: distilabel asks one turn at a
        time, so one turn and only the instruction; a leading system message is the system prompt."""
        conversation = [_message(m) for m in messages]
        system_prompt = None
        if conversation and conversation[0]["role"] == "system":
            system_prompt = conversation.pop(0)["content"]
        template = self.magpie_pre_query_template
        return {
            "template": _MAGPIE_PRESETS.get(template, template),
            "system_prompt": system_prompt,
            "conversation": conversation,
            "n_turns": 1,
            "only_instruction": True,
        }

    def generate(
        self, inputs: list[FormattedInput], num_generations: int = 1, **kwargs: Any
    ) -> list[GenerateOutput]:
        """As distilabel's AsyncLLM.generate, refusing an unknown generation kwarg by name first."""
        GenerationKwargs.of(kwargs)
        outputs: list[GenerateOutput] = super().generate(
            inputs=inputs, num_generations=num_generations, **kwargs
        )
        return outputs

    async def agenerate(
        self,
        input: FormattedInput,
        num_generations: int = 1,
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        repetition_penalty: float | None = None,
        stop_sequences: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        backend_options: dict[str, str | int | float | bool] | None = None,
    ) -> GenerateOutput:
        """Generates `num_generations` outputs for one input in one gengate call (its `n`).

        Unset sampling values are left to the model's defaults on the server, which judges ranges.

        Args:
            input: a prompt, chat messages, or messages with a structured output.
            num_generations: the number of generations (gengate's `n`). Defaults to `1`.
            max_new_tokens: the most tokens each generation has (gengate's `max_tokens`).
                Defaults to `128`.
            temperature: the sampling temperature.
            top_p: the nucleus sampling probability mass.
            top_k: the number of most likely tokens sampled from.
            min_p: the least probability, relative to the most likely token's, of a sampled token.
            frequency_penalty: the frequency penalty.
            presence_penalty: the presence penalty.
            repetition_penalty: the repetition penalty.
            stop_sequences: text that ends a generation (gengate's `stop`).
            seed: the sampling seed (the server draws one when unset).
            logprobs: return each generated token's log-probability. Defaults to `False`.
            top_logprobs: with logprobs, this many most likely alternatives per token.
            backend_options: backend-specific options, as the model lists them in ListModels.

        Returns:
            The generations (None where a structured output could not be completed), their token
            counts from gengate's usage, and the logprobs when asked.
        """
        generation = GenerationKwargs(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            repetition_penalty=repetition_penalty,
            stop_sequences=stop_sequences,
            seed=seed,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            backend_options=backend_options,
        )
        call = self.build_call(input, num_generations, generation)
        client = self._require_client()
        try:
            response = await client.generate(self.model, **call.generate_kwargs())
        except OutputError as exc:  # cut at max_new_tokens before the structure was complete
            if exc.response is None:
                raise
            response = exc.response
        return self._output(response, call.spec, with_logprobs=logprobs)

    def _output(self, response: Response, spec: OutputSpec | None, *, with_logprobs: bool) -> dict[str, Any]:
        """distilabel's GenerateOutput: per generation its text and token counts (gengate's usage)."""
        constrained = response.enforcement not in (Enforcement.NONE, Enforcement.UNSPECIFIED)
        structured = spec is not None or constrained
        texts: list[str | None] = []
        for generation in response.generations:
            text: str | None = generation.text
            if structured and generation.finish_reason == FinishReason.LENGTH:
                self._warn(f"generation {generation.index} hit max_new_tokens before its structure ended")
                text = None
            elif spec is not None:
                try:
                    spec.parse(generation.text)
                except OutputError as exc:
                    self._warn(f"generation {generation.index} does not parse: {exc}")
                    text = None
            texts.append(text)
        n = len(response.generations)
        output: dict[str, Any] = {
            "generations": texts,
            "statistics": {
                "input_tokens": [response.usage.input_tokens] * n,
                "output_tokens": [g.output_tokens for g in response.generations],
            },
        }
        if with_logprobs:
            output["logprobs"] = [_logprobs(g.logprobs or ()) for g in response.generations]
        return output

    def _warn(self, message: str) -> None:
        if self._logger is not None:
            self._logger.warning(f"GengateLLM {self.model}: {message}")

    def offline_batch_generate(
        self, inputs: list[FormattedInput] | None = None, num_generations: int = 1, **kwargs: Any
    ) -> list[GenerateOutput]:
        """Offline batch generation as one durable gengate batch job: the first call creates the job
        and raises DistilabelOfflineBatchGenerationNotFinishedException with its id; later calls
        (distilabel keeps `jobs_ids`, also across a pipeline resume) raise it again until the job
        has finished, then return every input's output in input order."""
        generation = GenerationKwargs.of(kwargs)
        if self.jobs_ids:
            outputs: list[dict[str, Any]] = self.event_loop.run_until_complete(
                self._job_outputs(num_generations, generation.logprobs)
            )
            return outputs
        if not inputs:
            raise ValueError("No `inputs` were provided and no `jobs_ids` were found.")
        requests = [self.build_call(i, num_generations, generation).request(self.model) for i in inputs]
        pipeline = os.getenv("DISTILABEL_PIPELINE_NAME")
        create = self._require_client().batch_jobs.create(
            requests,
            display_name=f"distilabel {pipeline}" if pipeline else "distilabel",
            offline=self.batch_job_offline,
        )
        job: BatchJob = self.event_loop.run_until_complete(create)
        self.jobs_ids: tuple[str, ...] | None = (job.id,)
        raise DistilabelOfflineBatchGenerationNotFinishedException(jobs_ids=self.jobs_ids)

    async def _job_outputs(self, num_generations: int, with_logprobs: bool) -> list[dict[str, Any]]:
        jobs = self._require_client().batch_jobs
        outputs: list[dict[str, Any]] = []
        for job_id in self.jobs_ids or ():
            job = await jobs.get(job_id)
            if not job.finished:
                raise DistilabelOfflineBatchGenerationNotFinishedException(jobs_ids=self.jobs_ids)
            if job.state != "succeeded":
                self.jobs_ids = None
                reason = job.error or "no reason given"
                raise RuntimeError(f"gengate batch job {job_id} ended {job.state}: {reason}")
            items: list[ItemResult] = [item async for item in jobs.results(job_id, follow=False)]
            by_index = {item.index: item for item in items}
            for index in range(job.total):
                item = by_index.get(index)
                if item is None or item.response is None:
                    error = item.error if item is not None else "no result"
                    self._warn(f"batch job {job_id} item {index} failed: {error}")
                    outputs.append(_empty_output(num_generations))
                else:
                    outputs.append(self._output(item.response, None, with_logprobs=with_logprobs))
        return outputs
