"""A multi-turn chat over one session: each turn prefills only the tokens it adds.

The cache holds the conversation so far as the model saw it: every rendered prompt and the
answer tokens fed back. A new turn renders the whole conversation with the chat template and
feeds only the text past what the cache already holds (the end of the last answer, the next
user message, the assistant header), as llama.cpp's chat does. A template that rewrites earlier
turns (some drop a model's reasoning from past answers) breaks that prefix: the conversation
is then prefilled again from the start.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.generation import OnTokens, Session, decode
from errors import UserError


class ChatTokenizer(Protocol):
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Turn:
    answer: list[int]  # the generated ids, EOS excluded
    prefilled: int  # tokens this turn fed to the model before answering
    prefill_logits: torch.Tensor  # [V] at the last token the turn prefilled


@dataclass
class Conversation:
    session: Session  # batch 1
    tokenizer: ChatTokenizer
    system: str | None = None
    max_positions: int = 1 << 62  # the model's position limit
    messages: list[dict] = field(default_factory=list)
    cache_text: str = ""  # the text of the tokens the cache holds, and of `pending`
    pending: list[int] = field(default_factory=list)  # the last answer's last token: sampled, not fed yet
    fed: list[int] = field(default_factory=list)  # every token fed, in order (the cache's content, without a KV policy)
    restarts: int = 0  # times a template rewrote history and the conversation was prefilled again

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.session.reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.cache_text, self.fed, self.pending = "", [], []

    def turn(self, user_text: str, max_new_tokens: int, on_tokens: OnTokens | None = None) -> Turn:
        """Answer one user message. A message that does not fit raises a UserError and changes nothing."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        full = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        restart = not full.startswith(self.cache_text)
        new_text = full if restart else full[len(self.cache_text) :]
        # The pending token goes in as it was sampled: alone, its text may be part of a character.
        new_ids = ([] if restart else self.pending) + self.tokenizer.encode(new_text, add_special_tokens=restart)
        max_new_tokens = self._room(len(new_ids), max_new_tokens, restart)
        if restart and self.cache_text:
            self.restarts += 1
            self.session.reset()
            self.fed = []

        first = self.session.prefill([new_ids])
        self.fed += new_ids
        logits = self.session.last_logits[0]
        decoded = decode(self.session, first, max_new_tokens, on_tokens=on_tokens)
        answer = decoded.tokens[0]
        # The last sampled token is fed only by a next step: unless it was EOS, the answer's last
        # token is not in the cache yet, and the next turn starts with it.
        self.pending = [] if decoded.ended_on_eos[0] else answer[-1:]
        self.fed += answer[: len(answer) - len(self.pending)]
        self.cache_text = full + self.tokenizer.decode(answer)
        self.messages = messages + [{"role": "assistant", "content": self.tokenizer.decode(answer)}]
        return Turn(answer, len(new_ids), logits)

    def _room(self, n_new: int, max_new_tokens: int, restart: bool) -> int:
        """How many tokens this turn may generate; a UserError when its prompt does not fit."""
        cache = self.session.cache
        held = 0 if restart else int(cache.length[0])
        position = 0 if restart else int(cache.position[0])
        # Without a KV policy every token stays; with one, compaction makes room once the turn's
        # first step is taken, so only the prompt and that step must fit now.
        room = cache.n_slots - held - n_new if self.session.policy is None else max_new_tokens
        allowed = min(max_new_tokens, room, self.max_positions - position - n_new)
        if held + n_new + 1 > cache.n_slots or allowed < 1:
            limit = "the model's position limit" if self.max_positions - position - n_new < 1 else f"the cache's {cache.n_slots} slots"
            raise UserError(
                f"this message ({n_new} tokens) and the conversation so far ({held} in the cache) do not fit {limit}; "
                "/reset starts a new conversation; a larger --context or a --kv-policy lets one run longer"
            )
        return allowed
