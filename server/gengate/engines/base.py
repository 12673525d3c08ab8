"""What the local engines (llama.cpp, transformers, vLLM) share: the capabilities every one of
them declares, the seed a generation runs with, the room a prompt leaves in the context, and
the start frame of a stream."""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from gengate import errors
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    GenerationRequest,
    GrammarSyntax,
    ImagePart,
    Modality,
    ModelCapabilities,
    SamplingParams,
    StoppingCriteria,
    StreamStart,
)
from gengate.engines.options import ENGINE_OPTIONS
from gengate.magpie import PRESET_TOKENS

PROMPT_TOO_LONG = "PROMPT_TOO_LONG"


def engine_capabilities(
    *,
    grammar_syntaxes: frozenset[GrammarSyntax],
    max_n: int,
    max_top_logprobs: int,
    context_length: int,
    chat: bool,
    backend_options: frozenset[str] = ENGINE_OPTIONS,
    special_tokens: frozenset[str] | None = None,
    chat_continuation: bool | None = None,
    tools: Enforcement | None = None,
    chat_template_kwargs: bool = False,
    reasoning_control: bool = False,
    reasoning: bool = False,
) -> ModelCapabilities:
    """A local engine's capabilities: every constraint kind enforced in its own decoding loop,
    seeds, text input, logprobs where it keeps any, the engine options, and raw prompts (Magpie),
    continuing a conversation where the model has a chat template. `special_tokens`: the
    tokenizer's tokens among gengate.magpie.PRESET_TOKENS (None until the model is loaded); `tools`:
    how the engine enforces tool calls (None: it takes no tools); `chat_template_kwargs`: it renders
    a chat template of its own; `reasoning_control` / `reasoning`: see engines/reasoning.py."""
    return ModelCapabilities(
        constraints={kind: Enforcement.ENGINE for kind in ConstraintKind},
        grammar_syntaxes=grammar_syntaxes,
        max_n=max_n,
        logprobs=max_top_logprobs > 0,
        max_top_logprobs=max_top_logprobs,
        input_modalities=frozenset({Modality.TEXT}),
        context_length=context_length,
        seed=True,
        chat=chat,
        backend_options=backend_options,
        raw_prompt=True,
        chat_continuation=chat if chat_continuation is None else chat_continuation,
        special_tokens=special_tokens,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        reasoning_control=reasoning_control,
        reasoning=reasoning,
    )


def special_tokens_of(tokenizer: Any) -> frozenset[str]:
    """The Magpie presets' tokens (gengate.magpie.PRESET_TOKENS) a Hugging Face tokenizer reads as one
    special token: one id, and not what the same text gives as plain text."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    found = set()
    for text in PRESET_TOKENS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in special:
            found.add(text)
    return frozenset(found)


def refuse_images(request: GenerationRequest, model: str) -> None:
    """INVALID_ARGUMENT UNSUPPORTED_MODALITY naming the first image part: the text-only local
    engines' own guard (the service refuses them first, by the model's declared modalities)."""
    for i, message in enumerate(request.messages or ()):
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                raise errors.InvalidArgument.field(
                    f"messages[{i}].content[{j}].image",
                    f"model {model!r} takes text input only",
                    reason="UNSUPPORTED_MODALITY",
                )


def seeded(sampling: SamplingParams) -> SamplingParams:
    """The sampling with a seed: the core fills one in for every served request (checks.prepare);
    an engine called directly draws one the same way, so every run is reproducible from its start
    frame."""
    return sampling if sampling.seed is not None else replace(sampling, seed=secrets.randbits(63))


def output_room(request: GenerationRequest, prompt_tokens: int, context_length: int) -> StoppingCriteria:
    """The stopping criteria with max_tokens cut to what the context leaves after the prompt;
    INVALID_ARGUMENT PROMPT_TOO_LONG on the input field when nothing is left."""
    room = context_length - prompt_tokens
    if room < 1:
        raise errors.InvalidArgument.field(
            "messages" if request.messages is not None else "prompt",
            f"the prompt has {prompt_tokens} tokens; the model's context holds {context_length}",
            reason=PROMPT_TOO_LONG,
        )
    requested = request.stopping.max_tokens
    return replace(request.stopping, max_tokens=room if requested is None else min(requested, room))


def stream_start(
    request: GenerationRequest,
    model: str,
    input_tokens: int,
    enforcement: Enforcement,
    sampling: SamplingParams,
    stopping: StoppingCriteria,
) -> StreamStart:
    """The first frame of an engine's stream, echoing the settings the generation runs with."""
    return StreamStart(
        request_id=request.request_id,
        model=model,
        input_tokens=input_tokens,
        enforcement=enforcement,
        effective_sampling=sampling,
        effective_stopping=stopping,
    )
