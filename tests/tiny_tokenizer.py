"""A real, tiny byte-level BPE tokenizer for tests, trained in-process in a few milliseconds.

It is shaped like Qwen2's (NFC normalizer, the Qwen2 split regex, byte-level pre-tokenizer and
decoder, ChatML special tokens appended after the learned vocab), so any UTF-8 text round-trips
and transformers' AutoTokenizer loads the folder offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# ChatML, like Qwen2: optional system message, any number of turns, optional generation prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEFAULT = CHATML_TEMPLATE
# The same with a BOS token in front, for write_tiny_tokenizer(add_bos=True), like Llama 3's templates.
CHATML_BOS_TEMPLATE = "{{- bos_token }}" + CHATML_TEMPLATE

BOS = "<|begin_of_text|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special (like Qwen3's think tags): kept by decode(skip_special_tokens=True).
PLAIN_ADDED_TOKENS = ["<think>", "</think>"]
VOCAB_SIZE_TARGET = 384  # learned vocab (256 bytes + merges); the added tokens come on top

# Qwen2's pre-tokenizer split pattern.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Once upon a time, there was a small model that wanted to think before it spoke.\n",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-5\n",
    "The answer is 42, and the question is what six times seven is.\n",
    "Hello, world! How are you today? I'm fine, thanks; and you're welcome.\n",
    "    indented line\n\n\tTabbed\tcolumns\there\n",
    "日本語のテキストと中文文本，还有한국어 텍스트.\n",
    "Emoji: 😀 🎉 👍🏽 ❤️ 🚀\n",
    "café naïve résumé Zürich Ελληνικά русский\n",
    "<html><body><p>markup &amp; entities</p></body></html>\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}\n',
]


def _corpus() -> list[str]:
    # A few KB: every line several times, so that common words and code fragments get merged.
    return [line for _ in range(6) for line in _CORPUS]


def build_tiny_tokenizer(*, add_bos: bool = False) -> Tokenizer:
    """Train the tokenizer. With add_bos, encode() prepends BOS through the post-processor (like Llama 3)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE_TARGET,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS + ([BOS] if add_bos else []))
    tok.add_tokens(PLAIN_ADDED_TOKENS)
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        template = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    return tok


def write_tiny_tokenizer(
    dir: Path,
    chat_template: str | None = DEFAULT,
    *,
    add_bos: bool = False,
    template_file: bool = False,
) -> int:
    """Write tokenizer.json and tokenizer_config.json into `dir`; return the vocab size (added tokens included).

    chat_template=None writes no template. template_file=True writes it to chat_template.jinja
    (the transformers 5 layout) instead of into tokenizer_config.json. add_bos=True makes encode()
    prepend "<|begin_of_text|>" (the bos_token); pair it with CHATML_BOS_TEMPLATE.
    No generation_config.json / config.json is written: EOS ids are the caller's business.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(add_bos=add_bos)
    tok.save(str(dir / "tokenizer.json"))
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS if add_bos else None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        if template_file:
            (dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        else:
            config["chat_template"] = chat_template
    (dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)
