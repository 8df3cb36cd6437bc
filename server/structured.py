"""Structured output: `response_format` json_object and json_schema, as a token mask per row
(engine/logit_rules.py's TokenMask), from llguidance.

llguidance was chosen by measurement against xgrammar and outlines-core (docs/serving.md): a
schema compiles in 1-2.4 ms, a mask costs 17-43 us a step, it builds from tokenizer.json alone,
and a schema feature it cannot enforce is an error, which the request gets as a 400 naming it,
instead of output that silently ignores the schema. JSON is written without free whitespace
between tokens, so a model cannot pad an answer with blank lines forever.
"""

from pathlib import Path

import llguidance
import llguidance.torch
import torch

from errors import UserError


class JsonMask:
    """One request's grammar: the tokens that keep its answer a prefix of valid JSON."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)


class JsonGrammars:
    """Masks for one tokenizer; model vocab_size: the logits' width (a model may pad past its tokenizer)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: frozenset[int]):
        eos = min(eos_ids) if eos_ids else None  # the token the mask allows once the JSON is complete
        self.tokenizer, self.unusable = None, None
        try:  # a tokenizer it cannot read costs the server response_format, not every request
            self.tokenizer = llguidance.LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # its Rust side raises a bare error
            self.unusable = f"response_format is not available for this checkpoint: llguidance cannot read its tokenizer.json ({e})"

    def mask(self, kind: str, schema: dict | None) -> JsonMask | None:
        """kind: response_format's type; schema: json_schema's. None for plain text."""
        if kind == "text":
            return None
        if self.tokenizer is None:
            raise UserError(self.unusable)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"} if kind == "json_object" else schema, defaults={"whitespace_flexible": False})
        except Exception as e:  # its parser raises a bare error naming what it could not read
            raise UserError(f"response_format: the schema cannot be used: {e}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise UserError(f"response_format: the schema cannot be enforced: {'; '.join(messages)}")
        return JsonMask(llguidance.LLMatcher(self.tokenizer, grammar))
