"""Chat-template variables on the local engines: GenerationRequest.chat_template_kwargs passed to
the template the engine renders itself, and ReasoningControl.enabled mapped to `enable_thinking`
(Qwen3's variable) where the template reads it.

A request's variables never replace the ones the engine sets (the conversation, the tools, the
generation prompt, the special tokens, the template's helper functions): such a key is refused by
name. A raw prompt is not rendered with a template, so variables (and reasoning.enabled) with one
are refused rather than dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gengate import errors
from gengate.domain import GenerationRequest
from gengate.tools import REASONING_UNSUPPORTED

FIELD = "chat_template_kwargs_json"
THINKING_VARIABLE = "enable_thinking"

# Variables (and apply_chat_template arguments) the engines set themselves: Hugging Face's
# apply_chat_template parameters, its special-token variables, and the template globals.
RESERVED_VARIABLES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
    }
)


def template_text(template: str | Mapping[str, str] | None) -> str:
    """A chat template's source (the default of a named set), "" for none."""
    if isinstance(template, Mapping):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def reads_thinking(template: str | Mapping[str, str] | None) -> bool:
    """Whether a chat template reads `enable_thinking` (Qwen3's switch for its think block)."""
    return THINKING_VARIABLE in template_text(template)


def template_variables(
    request: GenerationRequest, template: str | Mapping[str, str] | None, *, thinks: bool = False
) -> dict[str, Any]:
    """The request's variables for its chat template, with reasoning.enabled as `enable_thinking`;
    InvalidArgument naming `chat_template_kwargs_json.<key>` for a key the engine sets itself or one
    that contradicts reasoning.enabled, and for variables sent with a raw prompt; UNIMPLEMENTED
    REASONING_UNSUPPORTED for reasoning.enabled where the template has no switch for it (true is
    taken without one where the engine parses think blocks, `thinks`: the model thinks anyway)."""
    given = dict(request.chat_template_kwargs)
    if given and not template_text(template):
        raise errors.Unimplemented(
            f"model {request.model!r} does not pass variables to a chat template of its own",
            reason="CHAT_TEMPLATE_KWARGS_UNSUPPORTED",
            violations=[errors.FieldViolation(FIELD, "not supported by this model")],
        )
    for key in sorted(given):
        if key in RESERVED_VARIABLES:
            raise errors.InvalidArgument.field(
                f"{FIELD}.{key}", "is set by the server itself when it renders the chat template"
            )
    if request.messages is None:
        if given:
            raise errors.InvalidArgument.field(FIELD, "applies to messages; a raw prompt is sent as it is")
        return given
    enabled = None if request.reasoning is None else request.reasoning.enabled
    if enabled is None or (enabled and thinks and not reads_thinking(template)):
        return given
    if not reads_thinking(template):
        raise errors.Unimplemented(
            f"model {request.model!r}: its chat template has no `{THINKING_VARIABLE}` switch",
            reason=REASONING_UNSUPPORTED,
            violations=[errors.FieldViolation("reasoning.enabled", "not supported by this model")],
        )
    if THINKING_VARIABLE in given and given[THINKING_VARIABLE] != enabled:
        raise errors.InvalidArgument.field(
            f"{FIELD}.{THINKING_VARIABLE}", f"contradicts reasoning.enabled ({str(enabled).lower()})"
        )
    given[THINKING_VARIABLE] = enabled
    return given


def refuse_unsupported_control(request: GenerationRequest, *, budget: bool) -> None:
    """UNIMPLEMENTED REASONING_UNSUPPORTED naming reasoning.effort (no local template takes one),
    and reasoning.budget_tokens unless the engine caps the think block (`budget`)."""
    control = request.reasoning
    if control is None:
        return
    names = ["effort"] if budget else ["effort", "budget_tokens"]
    for name in names:
        if getattr(control, name) is not None:
            raise errors.Unimplemented(
                f"model {request.model!r} takes no reasoning.{name}",
                reason=REASONING_UNSUPPORTED,
                violations=[errors.FieldViolation(f"reasoning.{name}", "not supported by this model")],
            )


def thinking_enabled(variables: Mapping[str, Any]) -> bool:
    """Whether the template is asked to think: `enable_thinking` unset (the templates' default) or true."""
    return variables.get(THINKING_VARIABLE, True) is not False
