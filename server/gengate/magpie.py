"""Magpie's chat formats: the pre-query text of each preset, the special tokens it needs, and the
conversation rendered in that format (for a model whose chat template the server cannot see).

Magpie (arXiv 2406.08464) asks an instruction-tuned model to write the user's turn itself: the
conversation so far in the model's chat format, then the header of a user turn (the pre-query),
and the model continues as the user. The presets' pre-query texts are distilabel's where it has
them (llama3, qwen2), so a pipeline moved to gengate sends the very same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gengate.domain import ChatMessage, MagpiePreset, Role


@dataclass(frozen=True)
class ChatFormat:
    """One chat format: how a turn is written, and the text that opens a user turn."""

    # The text a conversation starts with (a BOS the tokenizer may also add).
    begin: str
    # A turn's header, with {role} in it.
    header: str
    # What ends a turn.
    end_of_turn: str
    # The role names the format writes (gemma calls the assistant "model").
    role_names: tuple[tuple[Role, str], ...] = ()
    # The format has no system turn: a system prompt opens the first user turn instead.
    no_system: bool = False

    def role_name(self, role: Role) -> str:
        return dict(self.role_names).get(role, role.value)

    @property
    def tokens(self) -> frozenset[str]:
        """The special tokens this format is written with: a tokenizer without them cannot read it."""
        roles = [Role.USER, Role.ASSISTANT] + ([] if self.no_system else [Role.SYSTEM])
        written = (
            self.begin + self.end_of_turn + "".join(self.header.format(role=self.role_name(r)) for r in roles)
        )
        return frozenset(t for t in _FORMAT_TOKENS if t in written)

    def pre_query(self, *, after_conversation: bool = False) -> str:
        """The text that opens a user turn; at the start of a conversation, with `begin`."""
        opening = self.header.format(role=self.role_name(Role.USER))
        return opening if after_conversation else self.begin + opening

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The conversation in this format, each turn ended, no generation prompt (what a chat
        template writes with add_generation_prompt=False)."""
        turns: list[tuple[Role, str]] = [(m.role, m.text) for m in messages]
        if self.no_system and turns and turns[0][0] is Role.SYSTEM:
            system, rest = turns[0][1], turns[1:]
            if rest and rest[0][0] is Role.USER:
                turns = [(Role.USER, f"{system}\n\n{rest[0][1]}"), *rest[1:]]
            else:
                turns = [(Role.USER, system), *rest]
        body = "".join(
            self.header.format(role=self.role_name(role)) + text + self.end_of_turn for role, text in turns
        )
        return self.begin + body if body else ""

    def assistant_prompt(self) -> str:
        """The header that opens the assistant's turn (the generation prompt)."""
        return self.header.format(role=self.role_name(Role.ASSISTANT))


_FORMAT_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
    "<start_of_turn>",
    "<end_of_turn>",
)

PRESETS: dict[MagpiePreset, ChatFormat] = {
    MagpiePreset.LLAMA3: ChatFormat(
        begin="<|begin_of_text|>",
        header="<|start_header_id|>{role}<|end_header_id|>\n\n",
        end_of_turn="<|eot_id|>",
    ),
    MagpiePreset.QWEN2: ChatFormat(begin="", header="<|im_start|>{role}\n", end_of_turn="<|im_end|>\n"),
    MagpiePreset.PHI3: ChatFormat(begin="", header="<|{role}|>\n", end_of_turn="<|end|>\n"),
    MagpiePreset.GEMMA: ChatFormat(
        begin="",
        header="<start_of_turn>{role}\n",
        end_of_turn="<end_of_turn>\n",
        role_names=((Role.ASSISTANT, "model"),),
        no_system=True,
    ),
}

# Every special token a preset is written with: the ones an engine looks for in its tokenizer.
PRESET_TOKENS: frozenset[str] = frozenset().union(*(f.tokens for f in PRESETS.values()))


def end_of_turn_stop(fmt: ChatFormat) -> str:
    """The stop string that ends a written turn (its end-of-turn token, without the newline)."""
    return fmt.end_of_turn.rstrip("\n")
