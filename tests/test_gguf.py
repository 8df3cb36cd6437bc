"""GGUF import (weights.gguf) on synthetic files written the way llama.cpp's converter writes them.

Each file comes from a tiny random transformers model: float32 tensors under GGUF names, Llama's
Q/K rows permuted as llama.cpp permutes them, and a small byte-level BPE tokenizer in the metadata.
The imported folder must give the original model's logits in transformers, and tokenize like the
tokenizer the metadata came from.
"""

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

import weights.gguf as wg
from errors import UserError
from tiny_tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer
from weights.gguf import import_gguf

# Tied and untied output, GQA everywhere, Qwen2's q/k/v biases, Qwen3's head_dim and q/k norms.
KINDS = {"llama": "llama", "llama_tied": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]
TEXTS = [
    "Hello, world! The answer is 42.",
    "def f(x):\n    return x * 2  # 12345\n",
    "日本語 café 😀  two  spaces\n\n\ttab",
    "<|im_start|>user\nHi <think>hmm</think><|im_end|>\n<|im_start|>assistant\n",
]

_HF_TO_GGUF = {v: k for k, v in wg._LAYER_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tokenizer(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny tokenizer, padded to the model's vocab size as llama.cpp pads."""
    tok = build_tiny_tokenizer()
    model = json.loads(tok.to_str())["model"]
    learned = sorted(model["vocab"], key=model["vocab"].get)
    n_pad = vocab_size - len(learned) - len(CONTROL) - len(USER_DEFINED)
    assert n_pad >= 0, f"the tiny models' vocab_size {vocab_size} is too small for the tiny tokenizer"
    tokens = learned + [f"[PAD{i}]" for i in range(n_pad)] + CONTROL + USER_DEFINED
    types = [1] * len(learned) + [5] * n_pad + [3] * len(CONTROL) + [4] * len(USER_DEFINED)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, types, merges


def write_gguf(path, model: transformers.PreTrainedModel, arch: str, pre: str = "qwen2", add_bos: bool = False) -> None:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    tokens, types, merges = gguf_tokenizer(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for tied embeddings
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, c.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def synthetic(tiny_checkpoint, tmp_path):
    """synthetic(kind) -> (GGUF file, the transformers model it was written from)."""

    def make(kind: str):
        _, model = tiny_checkpoint(kind)
        path = tmp_path / f"{kind}.gguf"
        write_gguf(path, model, KINDS[kind])
        return path, model

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_import_gives_the_same_logits(synthetic, tmp_path, kind):
    path, model = synthetic(kind)
    out = import_gguf(path, tmp_path / "imported", progress=False)
    imported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(imported) is type(model)
    assert imported.config.tie_word_embeddings == model.config.tie_word_embeddings
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    assert (imported(ids).logits - model(ids).logits).abs().max().item() <= 1e-5
    for name, tensor in model.state_dict().items():  # names and values, so a failure says which tensor
        assert torch.equal(imported.state_dict()[name], tensor), name


def test_imported_tokenizer_matches_its_source(synthetic, tmp_path):
    path, model = synthetic("qwen2")
    out = import_gguf(path, tmp_path / "imported", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    source = build_tiny_tokenizer()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        # Same splitting as the tokenizer the vocabulary was learned with (its ids differ after the padding).
        assert [ours.id_to_token(i) for i in ids] == source.encode(text).tokens, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ours.encode("<|im_end|>x<think>").ids, skip_special_tokens=True) == "x<think>"
    # Qwen's NFC step, which transformers' GGUF tokenizer leaves out: decomposed text splits like composed text.
    assert ours.encode("cafe\u0301").tokens == source.encode("café").tokens
    # llama.cpp's padding placeholders are not tokens, as in the source: no text (nor a grammar's mask) can use them.
    placeholders = [token for token in gguf_tokenizer(model.config.vocab_size)[0] if token.startswith("[PAD")]
    assert placeholders and not any(ours.token_to_id(token) is not None for token in placeholders)
    assert [ours.id_to_token(i) for i in ours.encode("[PAD0]").ids] == source.encode("[PAD0]").tokens

    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["chat_template"]) == ("<|endoftext|>", "<|im_end|>", CHATML_TEMPLATE)
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    tokens = gguf_tokenizer(model.config.vocab_size)[0]
    assert eos == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]  # EOS first, then llama.cpp's end-of-turn set
    chat = [{"role": "user", "content": "hi"}]
    assert transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(chat, tokenize=False)


def test_add_bos_token(tiny_checkpoint, tmp_path):
    """Files that say tokenizer.ggml.add_bos_token (Llama 3's) get BOS prepended by encode(), as llama.cpp does."""
    _, model = tiny_checkpoint("llama")
    path = tmp_path / "bos.gguf"
    write_gguf(path, model, "llama", add_bos=True)
    out = import_gguf(path, tmp_path / "imported", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ids = ours.encode("Hello world").ids
    assert ids[0] == ours.token_to_id("<|endoftext|>") and ids == reference("Hello world")["input_ids"]
    assert ours.encode("Hello world", add_special_tokens=False).ids == ids[1:]


def test_bfloat16_import(synthetic, tmp_path):
    path, model = synthetic("qwen3")
    out = import_gguf(path, tmp_path / "imported", "bfloat16", progress=False)
    imported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert imported.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(imported.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())


def test_cli(synthetic, tmp_path, capsys):
    path, _ = synthetic("llama")
    assert wg.main([str(path), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert wg.main([str(path), str(tmp_path / "out")]) == 2  # exists now
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "already exists" in err and err.count("\n") == 1


def test_interrupted_import_leaves_nothing(synthetic, tmp_path, monkeypatch):
    path, _ = synthetic("llama")
    calls = []

    def failing_load(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_load(*args)

    real_load = wg._load
    monkeypatch.setattr(wg, "_load", failing_load)
    out = tmp_path / "nested" / "out"
    with pytest.raises(KeyboardInterrupt):
        import_gguf(path, out, progress=False)
    assert list(out.parent.iterdir()) == []


def test_out_dir_filled_meanwhile(synthetic, tmp_path, monkeypatch):
    """Two imports into the same folder: the second to finish gets a UserError, and the first's folder stays."""
    path, _ = synthetic("qwen2")
    out = tmp_path / "out"
    real_write = wg._write_safetensors

    def write_while_another_finishes(*args):
        real_write(*args)
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(wg, "_write_safetensors", write_while_another_finishes)
    with pytest.raises(UserError, match="cannot write the checkpoint"):
        import_gguf(path, out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "qwen2.gguf"]
    assert [p.name for p in out.iterdir()] == ["config.json"]


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text('{"this": "is json"}')
    with pytest.raises(UserError, match="not a GGUF file"):
        import_gguf(path, tmp_path / "out")


def test_truncated_gguf(synthetic, tmp_path):
    path, _ = synthetic("llama")
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(UserError, match="truncated"):
        import_gguf(path, tmp_path / "out")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_pre_tokenizer(tiny_checkpoint, tmp_path):
    _, model = tiny_checkpoint("qwen2")
    write_gguf(tmp_path / "m.gguf", model, "qwen2", pre="default")  # llama.cpp's fallback: a split no model was trained with
    with pytest.raises(UserError, match=r"pre-tokenizer 'default' \(tokenizer.ggml.pre\) is not supported; supported: gpt-2, smollm"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")


def test_unsupported_tensor_type(tiny_checkpoint, tmp_path, monkeypatch):
    _, model = tiny_checkpoint("qwen2")
    path = tmp_path / "int.gguf"
    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kwargs):
        if name == "blk.0.ffn_up.weight":  # an integer tensor: llama.cpp has the type, dequantize does not
            tensor = tensor.astype(np.int32)
        return original(self, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    write_gguf(path, model, "qwen2")
    with pytest.raises(UserError, match=r"blk\.0\.ffn_up\.weight has type I32"):
        import_gguf(path, tmp_path / "out")


def test_a_q8_0_copy_holds_every_matrix_to_within_half_a_step(synthetic, tmp_path):
    """benchmark/q8_0_gguf.py, which makes the Q8_0 file that the int8 weights are timed against."""
    from gguf.quants import dequantize

    from benchmark import q8_0_gguf

    path, model = synthetic("llama")
    out = tmp_path / "q8_0.gguf"
    assert q8_0_gguf.main([str(path), str(out)]) == 0
    source, copy = gguf.GGUFReader(path), gguf.GGUFReader(out)
    assert list(copy.fields) == list(source.fields)
    assert [t.name for t in copy.tensors] == [t.name for t in source.tensors]
    for a, b in zip(source.tensors, copy.tensors):
        values = dequantize(a.data, a.tensor_type).reshape(-1, 32 if a.data.ndim == 2 else a.data.size)
        copied = dequantize(b.data, b.tensor_type).reshape(values.shape)
        if a.data.ndim == 1:
            assert b.tensor_type == a.tensor_type and np.array_equal(copied, values), a.name
            continue
        assert b.tensor_type == gguf.GGMLQuantizationType.Q8_0, a.name
        step = np.abs(values).max(axis=1, keepdims=True) / 127
        # half a step of rounding, and the step itself stored in float16 (2^-11 of it, times up to 127)
        assert (np.abs(copied - values) <= step / 2 + step * 127 * 2**-11 + 1e-7).all(), a.name
    imported = transformers.AutoModelForCausalLM.from_pretrained(import_gguf(out, tmp_path / "imported", progress=False), dtype=torch.float32)
    embedding = next(t for t in copy.tensors if t.name == "token_embd.weight")
    expected = dequantize(embedding.data, embedding.tensor_type).reshape(model.config.vocab_size, -1)
    assert torch.equal(imported.model.embed_tokens.weight, torch.from_numpy(expected))  # the import reads the Q8_0 values as they are


def test_a_q8_0_copy_of_a_missing_file_is_one_line_of_error(tmp_path, capsys):
    from benchmark import q8_0_gguf

    assert q8_0_gguf.main([str(tmp_path / "absent.gguf"), str(tmp_path / "out.gguf")]) == 2
    assert capsys.readouterr().err == f"error: GGUF file {tmp_path / 'absent.gguf'} does not exist\n"
