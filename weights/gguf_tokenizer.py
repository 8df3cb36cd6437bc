"""Build an imported checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json and
generation_config.json) from the tokenizer a GGUF file carries in its metadata. Only byte-level BPE
vocabularies (Llama 3, SmolLM, Qwen) are supported; text is split the way llama.cpp splits it for the
file's `tokenizer.ggml.pre`, and generation ends on the tokens llama.cpp ends it on.
"""

from __future__ import annotations

from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from errors import UserError
from weights.gguf_metadata import Metadata, damaged

# llama.cpp's token types (enum llama_token_type).
_CONTROL, _USER_DEFINED, _UNUSED = 3, 4, 5

# How llama.cpp splits text for each `tokenizer.ggml.pre` (llama-vocab.cpp), spelled as the original
# model's tokenizer.json spells it. Unknown names are refused: a wrong split gives plausible but wrong ids.
_GPT2_SPLIT = None  # ByteLevel's own regex
_DIGITS_THEN_GPT2 = "digits"  # every \p{N} character alone, then GPT-2's regex (StarCoder, SmolLM)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, str | None] = {
    "gpt-2": _GPT2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp lets a word that is itself a token skip the merges for these (`ignore_merges`).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}
# Besides the declared EOS, llama.cpp ends generation on any of these tokens (its end-of-generation set).
_END_OF_GENERATION = {
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>", "<EOT>", "_<EOT>"
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level BPE vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tokenizer(meta: Metadata) -> Tokenizer:
    """tokenizer.json for the file's byte-level BPE vocabulary, split the way its `tokenizer.ggml.pre` says."""
    model_name = meta.get("tokenizer.ggml.model")
    if model_name != "gpt2":
        raise UserError(
            f"the GGUF tokenizer is {model_name!r}; the import supports byte-level BPE ('gpt2': Llama 3, SmolLM, Qwen) only"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _PRE_TOKENIZERS:
        raise UserError(
            f"the GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: {', '.join(_PRE_TOKENIZERS)}. "
            "Use the original checkpoint instead: python -m weights.download REPO_ID"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    merges: list[str] | None = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise UserError("the GGUF file has no tokenizer.ggml.tokens / tokenizer.ggml.merges; it carries no usable tokenizer")
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise damaged(meta.path, f"its metadata tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type == _UNUSED:
            # llama.cpp's "[PAD123]" placeholders for ids the model has and its tokenizer lacks: the
            # source tokenizer has no such tokens, so no text is spelled with them, nor may a grammar.
            continue
        # Control and user-defined tokens are matched in the raw text, so they keep their own spelling.
        if token_type not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = i
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES)  # type: ignore[arg-type]
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of tokens the vocabulary lacks
        raise damaged(meta.path, f"its tokenizer metadata does not hold together: {e}") from e
    tok = Tokenizer(bpe)

    split = _PRE_TOKENIZERS[pre]
    if split is _GPT2_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if split is _QWEN2_SPLIT:
        # Qwen's own tokenizer.json (and transformers' Qwen2Tokenizer) compose text to NFC first; llama.cpp
        # does not, and neither does transformers' GGUF loader. The model was trained with it, so keep it.
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    for i, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type in (_CONTROL, _USER_DEFINED) and tok.token_to_id(token) != i:
            raise UserError(f"the GGUF tokenizer lists the special token {token!r} twice; the file's tokenizer is inconsistent")

    byte_level = processors.ByteLevel(trim_offsets=False)
    template = _bos_eos_template(meta, tokens)
    tok.post_processor = processors.Sequence([byte_level, template]) if template else byte_level
    return tok


def _bos_eos_template(meta: Metadata, tokens: list[str]) -> processors.TemplateProcessing | None:
    """The post-processor that adds BOS/EOS to encode(), when the file says llama.cpp adds them."""
    single, special = "$A", []  # e.g. "<|begin_of_text|> $A"
    for flag, key, where in (("add_bos_token", "bos_token_id", "before"), ("add_eos_token", "eos_token_id", "after")):
        token_id = meta.token_id(key)
        if meta.get(f"tokenizer.ggml.{flag}", False) and token_id is not None:
            single = f"{tokens[token_id]} {single}" if where == "before" else f"{single} {tokens[token_id]}"
            special.append((tokens[token_id], token_id))
    if not special:
        return None
    second = " ".join(f"{piece}:1" for piece in single.replace("$A", "$B").split())  # as Llama 3's tokenizer.json
    return processors.TemplateProcessing(single=single, pair=f"{single} {second}", special_tokens=special)


def _token(meta: Metadata, key: str) -> str | None:
    token_id = meta.token_id(key)
    return None if token_id is None else meta.get("tokenizer.ggml.tokens")[token_id]


def tokenizer_config(meta: Metadata) -> dict[str, Any]:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, "bos_token_id"),
        "eos_token": _token(meta, "eos_token_id"),
        "pad_token": _token(meta, "padding_token_id"),
        "unk_token": _token(meta, "unknown_token_id"),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", False),
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.arch("context_length", 4096),
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return config


def generation_config(meta: Metadata) -> dict[str, Any]:
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    declared = [meta.token_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    # Like llama.cpp: a chat model ends its turn with e.g. <|im_end|> even when EOS is <|endoftext|>.
    named = [i for i, token in enumerate(tokens) if token in _END_OF_GENERATION]
    eos = list(dict.fromkeys(i for i in [*declared, *named] if i is not None))
    config: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key, name in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if (value := meta.token_id(name)) is not None:
            config[key] = value
    return config
