"""Log-probabilities in the OpenAI API's two shapes: chat's `logprobs.content` (each token with
its bytes and the likeliest alternatives) and the completions endpoint's parallel lists.

A token is shown as its own bytes (a token may hold part of a UTF-8 character, so its text alone
can be lossy): byte-level BPE vocabularies (GPT-2's, Llama 3's, Qwen's) spell each byte as one
printable character, SentencePiece ones spell a space as U+2581 and a raw byte as <0xNN>.
"""

import re
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

from engine.logit_rules import TokenLogprobs

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


class TokenText:
    """Each token's bytes and text, from the vocabulary of a tokenizer.json."""

    def __init__(self, tokenizer_file: Path):
        self.vocabulary = Tokenizer.from_file(str(tokenizer_file))
        self.byte_level = type(self.vocabulary.decoder).__name__ == "ByteLevel"

    @cache
    def bytes(self, token: int) -> bytes:
        piece = self.vocabulary.id_to_token(token) or ""
        if self.byte_level:
            alphabet = byte_level_alphabet()
            return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in piece)
        if match := BYTE_TOKEN.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def text(self, token: int) -> str:
        """The token's text; one that is not whole UTF-8 is spelled as the API does: bytes:\\xNN..."""
        raw = self.bytes(token)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}


def chat_logprobs(read: list[TokenLogprobs], text: TokenText) -> dict:
    content = [{**text.entry(r.token, r.logprob), "top_logprobs": [text.entry(t, lp) for t, lp in r.top]} for r in read]
    return {"content": content, "refusal": None}


def completion_logprobs(read: list[TokenLogprobs], text: TokenText, offset: int) -> dict:
    """offset: the answer's characters before these tokens (text_offset counts from there)."""
    offsets, spelled = [], b""
    for r in read:  # a token inside a character starts where the character does
        offsets.append(offset + len(spelled.decode(errors="ignore")))
        spelled += text.bytes(r.token)
    return {
        "tokens": [text.text(r.token) for r in read],
        "token_logprobs": [r.logprob for r in read],
        "top_logprobs": [{text.text(t): lp for t, lp in r.top} for r in read],
        "text_offset": offsets,
    }
