"""The prompt token ids of a vLLM request: the raw prompt, or the messages rendered by the
tokenizer's chat template (or the configured one) with the request's template variables. Pure
over the tokenizer, so it is tested without vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gengate import errors
from gengate.domain import GenerationRequest
from gengate.engines.chat_vars import (
    refuse_unsupported_control,
    template_text,
    template_variables,
    thinking_enabled,
)
from gengate.engines.reasoning import ReasoningConfig, ReasoningPlan, reasoning_plan
from gengate.engines.toolcalls import chat_prompt, template_speaks_tools


def chat_template_of(tokenizer: Any, configured: str | None) -> Any:
    """The template vLLM renders chats with: the configured one, else the tokenizer's (or None)."""
    return configured or getattr(tokenizer, "chat_template", None)


def vllm_prompt(
    tokenizer: Any, request: GenerationRequest, configured: str | None, reasoning: ReasoningConfig
) -> tuple[list[int], ReasoningPlan | None]:
    """The prompt's token ids and how its think blocks are read. vLLM takes the constraint as it is
    (no think block can be put before it), so a constraint with a think block is refused."""
    template = chat_template_of(tokenizer, configured)
    tags = reasoning.tags_for(template_text(template))
    ids = vllm_prompt_ids(tokenizer, request, configured, thinks=tags is not None)
    if tags is None or request.messages is None:
        return ids, None
    variables = template_variables(request, template, thinks=True)
    text = tokenizer.apply_chat_template(
        chat_prompt(request, native=template_speaks_tools(template)).messages,
        tokenize=False,
        add_generation_prompt=request.continuation is None,
        **{**variables, "chat_template": configured},
    )
    plan = reasoning_plan(
        request, tags, str(text) + (request.continuation or ""), thinking_enabled(variables)
    )
    if plan is not None and (request.structured_output is not None or request.tools):
        where = "structured_output" if request.structured_output is not None else "tools"
        raise errors.Unimplemented(
            f"model {request.model!r} thinks first, and vLLM holds a constraint from the first token: "
            "set reasoning.enabled false (where the template has the switch) or leave out " + where,
            reason="REASONING_WITH_CONSTRAINT_UNSUPPORTED",
            violations=[errors.FieldViolation(where, "does not go with a think block on this engine")],
        )
    return ids, plan


def vllm_prompt_ids(
    tokenizer: Any, request: GenerationRequest, configured: str | None, *, thinks: bool = False
) -> list[int]:
    """Token ids of the request's prompt; refuses template variables the engine sets itself."""
    template = chat_template_of(tokenizer, configured)
    variables = template_variables(request, template, thinks=thinks)
    refuse_unsupported_control(request, budget=False)
    if request.prompt is not None:
        ids = list(tokenizer.encode(request.prompt))
        bos = getattr(tokenizer, "bos_token_id", None)
        if len(ids) > 1 and ids[0] == ids[1] == bos:
            ids = ids[1:]  # the prompt began with BOS (a pre-query's) and the tokenizer added one
        return ids
    prompt = chat_prompt(request, native=template_speaks_tools(template))
    own = {**variables, "tools": prompt.tools, "chat_template": configured}
    if request.continuation is not None:  # the conversation continued from a text (Magpie)
        text = tokenizer.apply_chat_template(
            prompt.messages, tokenize=False, add_generation_prompt=False, **own
        )
        return list(tokenizer.encode(text + request.continuation, add_special_tokens=False))
    ids = tokenizer.apply_chat_template(prompt.messages, tokenize=True, add_generation_prompt=True, **own)
    if isinstance(ids, Mapping):  # tokenizers that answer a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
