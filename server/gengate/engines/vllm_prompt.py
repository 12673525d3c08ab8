"""The prompt token ids of a vLLM request: the raw prompt, or the messages rendered by the
tokenizer's chat template (or the configured one) with the request's template variables. Pure
over the tokenizer, so it is tested without vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gengate.domain import GenerationRequest
from gengate.engines.chat_vars import refuse_unsupported_control, template_variables
from gengate.engines.toolcalls import chat_prompt, template_speaks_tools


def chat_template_of(tokenizer: Any, configured: str | None) -> Any:
    """The template vLLM renders chats with: the configured one, else the tokenizer's (or None)."""
    return configured or getattr(tokenizer, "chat_template", None)


def vllm_prompt_ids(tokenizer: Any, request: GenerationRequest, configured: str | None) -> list[int]:
    """Token ids of the request's prompt; refuses template variables the engine sets itself."""
    template = chat_template_of(tokenizer, configured)
    variables = template_variables(request, template)
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
