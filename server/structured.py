"""Structured output: `response_format` json_object and json_schema, and `tool_choice` required or
named, as a token mask per row (engine/logit_rules.py's TokenMask), from llguidance.

llguidance was chosen by measurement against xgrammar and outlines-core (docs/serving.md): a
schema compiles in 1-2.4 ms, a mask costs 17-43 us a step, it builds from tokenizer.json alone,
and a schema feature it cannot enforce is an error, which the request gets as a 400 naming it,
instead of output that silently ignores the schema. JSON is written on one line, as json.dumps
writes it (", " between items, ": " after keys): the spacing models write most, and no free
whitespace, so a model cannot pad an answer with blank lines forever.

A forced tool call is the JSON of a call in the format the chat template teaches its model
(server/answer_parts.py): `<tool_call>` blocks around {"name", "arguments"}, or Llama 3's one
{"name", "parameters"} object. Each call's name is one of the tools', its arguments hold to that
tool's parameters schema.
"""

import json
from pathlib import Path

import llguidance
import llguidance.torch
import torch

from errors import UserError
from server.answer_parts import THINK_CLOSE, TOOL_CLOSE, TOOL_OPEN

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class JsonMask:
    """One request's grammar: the tokens that keep its answer a prefix of what the grammar allows.
    Once the answer is complete, every end-of-sequence token of the checkpoint may end it (a chat
    model ends its turn with its own, e.g. Qwen's <|im_end|>, which llguidance's one EOS is not)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: frozenset[int], eos_words: list[tuple[int, int]]):
        """eos_words: (word, bit as an int32 value) of each end token in a [*, ceil(V / 32)] bitmask."""
        self.matcher, self.eos_ids, self.eos_words = matcher, eos_ids, eos_words

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_accepting():
            for word, bit in self.eos_words:
                bitmask[row, word] |= bit

    def accept(self, token: int) -> None:
        if token not in self.eos_ids:  # an end ends the row: nothing follows it to match
            self.matcher.consume_token(token)


class JsonGrammars:
    """Masks for one tokenizer; model vocab_size: the logits' width (a model may pad past its tokenizer)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: frozenset[int]):
        eos = min(eos_ids) if eos_ids else None  # llguidance's own; JsonMask allows all of them
        self.eos_ids = eos_ids
        bits = [(token // 32, 1 << token % 32) for token in sorted(eos_ids)]
        self.eos_words = [(word, bit - (1 << 32) if bit >= 1 << 31 else bit) for word, bit in bits]  # bit 31 is int32's sign
        self.tokenizer, self.unreadable = None, ""
        try:  # a tokenizer it cannot read costs the server its masks, not every request
            self.tokenizer = llguidance.LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # its Rust side raises a bare error
            self.unreadable = str(e)

    def mask(self, kind: str, schema: dict | None, thinking: bool) -> JsonMask | None:
        """kind: response_format's type; schema: json_schema's; thinking: the answer begins inside
        the model's reasoning, which stays free until it closes. None for plain text."""
        if kind == "text":
            return None
        schema = {"type": "object"} if kind == "json_object" else schema
        options = JSON_LAYOUT | (schema.get("x-guidance") or {})
        return self._matcher("%json " + json.dumps({**schema, "x-guidance": options}), thinking, "response_format")

    def tool_calls(self, tools: list[dict], only: str | None, once: bool, calls_format: str, thinking: bool) -> JsonMask:
        """tool_choice 'required' (only None: a call to any of the tools) or named (only: that
        function); once: one call, else one or more; tools: the request's, as the template is shown them."""
        key = "arguments" if calls_format == "tagged" else "parameters"
        calls = [
            {"type": "object", "properties": {"name": {"const": f["name"]}, key: f.get("parameters") or {"type": "object"}}, "required": ["name", key], "additionalProperties": False}
            for f in (tool["function"] for tool in tools)
            if only in (None, f["name"])
        ]
        call = "%json " + json.dumps({"anyOf": calls, "x-guidance": JSON_LAYOUT})
        if calls_format == "json":
            return self._matcher(call, thinking, "tool_choice")
        tagged = f'{self._literal(TOOL_OPEN)} "\\n" {call} "\\n" {self._literal(TOOL_CLOSE)}'
        return self._matcher(tagged if once else f'call ("\\n" call)*\ncall: {tagged}', thinking, "tool_choice")

    def _literal(self, text: str) -> str:
        """The text in a lark rule: the token itself where the tokenizer holds it as one special
        token (which no quoted text matches), else the text."""
        tokens = self.tokenizer.tokenize_str(text) if self.tokenizer else []
        return text if len(tokens) == 1 and self.tokenizer.is_special_token(tokens[0]) else json.dumps(text)

    def _matcher(self, answer: str, thinking: bool, field: str) -> JsonMask:
        """answer: the lark rule of what the answer must be; field: the request's field that asked
        for it, named in its errors."""
        if self.tokenizer is None:
            raise UserError(f"{field} is not available for this checkpoint: llguidance cannot read its tokenizer.json ({self.unreadable})")
        lark = f"start: {'think GAP? ' if thinking else ''}answer\nanswer: {answer}\n"
        if thinking:
            close = self._literal(THINK_CLOSE)
            lazy = "" if close == THINK_CLOSE else "[lazy]"  # a special token ends free text by itself; a quoted one must stop it
            lark += f"think{lazy}: THOUGHT {close}\n" + r"THOUGHT: /(.|\n)*/" + "\n" + r"GAP: /[ \n]{1,4}/" + "\n"
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:  # each message's first line names the problem; the rest quotes the grammar
            raise UserError(f"{field}: the schema cannot be enforced: {'; '.join(m.splitlines()[0] for m in messages)}")
        return JsonMask(llguidance.LLMatcher(self.tokenizer, grammar), self.eos_ids, self.eos_words)
