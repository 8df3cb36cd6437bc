"""Drafters for speculative decoding (engine/speculative.py): cheap guesses of the tokens that
follow a text, each a function of the text alone.

- `PromptLookup`: the tokens that followed the latest earlier occurrence of the text's last few
  tokens, in the prompt or the answer (vLLM's `ngram`, llama.cpp's lookup);
- `DraftModel`: a smaller model's greedy continuation; it must share the target's tokenizer.
"""

from engine.decode import prefill
from engine.verify import step_back
from kv.cache import KVCache
from models.transformer import Transformer

MAX_NGRAM = 4  # prompt lookup matches the text's last 4 tokens, else 3, ... down to MIN_NGRAM
MIN_NGRAM = 1


class PromptLookup:
    """Drafts from the text itself: the tokens that followed the latest earlier occurrence of the
    text's last n tokens, for the longest n from MAX_NGRAM down to MIN_NGRAM that has one."""

    def __init__(self):
        self.after: dict[tuple[int, ...], int] = {}  # an n-gram -> the index just after its latest occurrence
        self.indexed = 0  # history[:indexed] ends every n-gram indexed so far

    def draft(self, history: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens, and the length of the n-gram matched (0: none)."""
        # An n-gram ending at the last token has no continuation yet: index up to the one before.
        for end in range(self.indexed, len(history) - 1):
            for n in range(1, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self.after[tuple(history[end + 1 - n : end + 1])] = end + 1
        self.indexed = max(self.indexed, len(history) - 1)
        for n in range(min(MAX_NGRAM, len(history)), MIN_NGRAM - 1, -1):
            start = self.after.get(tuple(history[-n:]))
            if start is not None:
                return history[start : start + k], n
        return [], 0


class DraftModel:
    """Drafts a smaller model's greedy continuation, on a one-row cache of its own that follows
    the text: what it fed of drafts the target rejected is stepped back at the next round."""

    def __init__(self, model: Transformer, n_slots: int):
        self.model = model
        self.cache = KVCache.allocate(model.config, 1, n_slots, model.dtype, model.device)
        self.fed: list[int] = []  # the tokens its cache holds

    def draft(self, history: list[int], k: int) -> tuple[list[int], int]:
        same = 0
        while same < min(len(self.fed), len(history) - 1) and self.fed[same] == history[same]:
            same += 1
        step_back(self.cache, len(self.fed) - same)
        logits = prefill(self.model, self.cache, [history[same:]])  # [1, V] at the last token
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(int(logits.argmax(-1)))
            if len(drafts) < k:
                logits = prefill(self.model, self.cache, [drafts[-1:]])
        self.fed = history + drafts[:-1]
        return drafts, 1
