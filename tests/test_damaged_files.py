"""Every damaged input file ends in one UserError that names the file, says what is wrong and what to do.

Each test damages a real file on disk: a copy of the tiny checkpoint, the tiny tokenizer, a synthetic
GGUF file or the packaged SmolLM2 GGUF file, cut short, overwritten or edited the way a broken
download, copy or converter leaves it.
"""

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import generate
import weights.packaged
from errors import UserError
from test_gguf import write_gguf
from tiny_tokenizer import write_tiny_tokenizer
from weights.gguf import import_gguf
from weights.forms import load_model
from weights.tokenizer import Tokenizer

CPU = torch.device("cpu")
CUT_OFF = "cut off during a copy or download"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@contextmanager
def names_the_damage(path: Path, *phrases: str) -> Iterator[None]:
    """The body must raise a one-line UserError that names `path` (file and folder) and holds each phrase."""
    with pytest.raises(UserError) as caught:
        yield
    message = str(caught.value)
    assert "\n" not in message
    assert f"{path.name} in {path.parent}" in message, message
    for phrase in phrases:
        assert phrase in message, message


# --- safetensors -------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama")[0], folder)
    return folder


def load(folder: Path) -> None:
    load_model(folder, torch.float32, CPU)


def edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite the JSON header of a safetensors file, leaving its tensor data as it is."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + length :])


def tensors_by_offset(header: dict) -> list[dict]:
    return sorted((entry for name, entry in header.items() if name != "__metadata__"), key=lambda e: e["data_offsets"][0])


@pytest.mark.parametrize("keep", [lambda size: size // 2, lambda size: 8, lambda size: 0], ids=["half", "8 bytes", "empty"])
def test_safetensors_cut_short(checkpoint, keep):
    path = checkpoint / "model.safetensors"
    os.truncate(path, keep(path.stat().st_size))
    with names_the_damage(path, "is damaged", CUT_OFF, "download or copy it again"):
        load(checkpoint)


def test_safetensors_header_length_past_the_end(checkpoint):
    path = checkpoint / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes((2 * len(raw)).to_bytes(8, "little") + raw[8:])
    with names_the_damage(path, "shorter than its header says", CUT_OFF):
        load(checkpoint)


@pytest.mark.parametrize("flip", [lambda b: b ^ 0xFF, lambda b: ord("#")], ids=["not UTF-8", "not JSON"])
def test_safetensors_header_bytes_flipped(checkpoint, flip):
    path = checkpoint / "model.safetensors"
    raw = bytearray(path.read_bytes())
    for i in range(8, 12):  # the header's first bytes: its opening brace and the first name
        raw[i] = flip(raw[i])
    path.write_bytes(bytes(raw))
    with names_the_damage(path, "its header is damaged"):
        load(checkpoint)


def test_safetensors_tensor_past_the_data(checkpoint):
    path = checkpoint / "model.safetensors"

    def push_last_past_the_end(header):
        last = tensors_by_offset(header)[-1]
        last["data_offsets"][1] += 4096

    edit_header(path, push_last_past_the_end)
    with names_the_damage(path, "shorter than its header says"):
        load(checkpoint)


def test_safetensors_tensors_overlap(checkpoint):
    path = checkpoint / "model.safetensors"

    def overlap_the_first_two(header):
        first, second = tensors_by_offset(header)[:2]
        start, end = second["data_offsets"]
        second["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + end - start]

    edit_header(path, overlap_the_first_two)
    with names_the_damage(path, "its header is damaged", "offset"):
        load(checkpoint)


def test_safetensors_unknown_dtype(checkpoint):
    path = checkpoint / "model.safetensors"
    edit_header(path, lambda header: header["model.norm.weight"].update(dtype="F99"))
    with names_the_damage(path, "its header is damaged", "F99"):
        load(checkpoint)


@pytest.fixture
def sharded(checkpoint) -> Path:
    """The tiny checkpoint in two shards with their index; returns the index file."""
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    halves = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2 :]}
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, checkpoint / shard)
    (checkpoint / "model.safetensors").unlink()
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {n: shard for shard, ns in halves.items() for n in ns}}))
    return index


def test_shard_index_cut_short(sharded):
    sharded.write_text(sharded.read_text()[:100])
    with names_the_damage(sharded, "is damaged", "not valid JSON", "download or copy it again"):
        load(sharded.parent)


def test_shard_index_without_weight_map(sharded):
    sharded.write_text(json.dumps({"metadata": {}}))
    with names_the_damage(sharded, 'no "weight_map"'):
        load(sharded.parent)


def test_shard_index_names_the_wrong_shard(sharded):
    """transformers loads this (it reads every shard whole); the engine takes it for files from two downloads."""
    index = json.loads(sharded.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = SHARDS[1]
    sharded.write_text(json.dumps(index))
    with names_the_damage(sharded, f"does not match its shards: {SHARDS[0]} holds {name}, but the index puts it in {SHARDS[1]}"):
        load(sharded.parent)


# --- tokenizer -----------------------------------------------------------------------------------


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    folder = tmp_path / "tok"
    write_tiny_tokenizer(folder)
    return folder


def edit_json(path: Path, **changes) -> None:
    raw = json.loads(path.read_text()) if path.is_file() else {}
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_tokenizer_json_cut_short(tokenizer_dir):
    path = tokenizer_dir / "tokenizer.json"
    path.write_text(path.read_text()[: path.stat().st_size // 2])
    with names_the_damage(path, "is damaged", CUT_OFF, "download or copy it again"):
        Tokenizer.from_dir(tokenizer_dir)


def test_tokenizer_json_of_the_wrong_shape(tokenizer_dir):
    path = tokenizer_dir / "tokenizer.json"
    path.write_text('{"model": 3}')
    with names_the_damage(path, "is not a tokenizer that tokenizers", "upgrade tokenizers"):
        Tokenizer.from_dir(tokenizer_dir)


def test_tokenizer_config_cut_short(tokenizer_dir):
    path = tokenizer_dir / "tokenizer_config.json"
    path.write_text(path.read_text()[:60])
    with names_the_damage(path, "is damaged", CUT_OFF):
        Tokenizer.from_dir(tokenizer_dir)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json"])
def test_json_that_is_not_an_object(tokenizer_dir, name):
    path = tokenizer_dir / name
    path.write_text("[1, 2]")
    with names_the_damage(path, "not a JSON object"):
        Tokenizer.from_dir(tokenizer_dir)


# tokenizer_config.json entries of the wrong type -> what the message says. transformers refuses each of
# these too (a chat_template that is not text only when it renders it).
WRONG_TOKENIZER_CONFIG = {
    "chat_template": (dict(chat_template=3), "chat_template is 3"),
    "chat_template list": (dict(chat_template=[{"name": "default"}]), "chat_template is [{'name': 'default'}]"),
    "added_tokens_decoder list": (dict(added_tokens_decoder=[1, 2]), "added_tokens_decoder"),
    "added_tokens_decoder entry": (dict(added_tokens_decoder={"386": "<|im_end|>"}), "added_tokens_decoder"),
    "eos_token": (dict(eos_token=5), "eos_token is 5"),
    "bos_token": (dict(bos_token=["<|endoftext|>"]), "bos_token is ['<|endoftext|>']"),
    "pad_token": (dict(pad_token={"content": 3}), "pad_token is {'content': 3}"),
    "extra_special_tokens": (dict(extra_special_tokens=3), "extra_special_tokens is 3"),
    "extra special token": (dict(extra_special_tokens={"image_token": 5}), "image_token is 5"),
}


@pytest.mark.parametrize("case", WRONG_TOKENIZER_CONFIG)
def test_tokenizer_config_with_wrong_types(tokenizer_dir, case):
    changes, phrase = WRONG_TOKENIZER_CONFIG[case]
    path = tokenizer_dir / "tokenizer_config.json"
    edit_json(path, **changes)
    with names_the_damage(path, "is damaged", phrase):
        Tokenizer.from_dir(tokenizer_dir)


def test_special_tokens_map_with_wrong_types(tokenizer_dir):
    path = tokenizer_dir / "special_tokens_map.json"
    edit_json(path, eos_token=7)
    with names_the_damage(path, "eos_token is 7"):
        Tokenizer.from_dir(tokenizer_dir)


@pytest.mark.parametrize("value", ["<|im_end|>", ["<|im_end|>"], [2, "3"], 2.0])
@pytest.mark.parametrize("name", ["generation_config.json", "config.json"])
def test_eos_token_id_that_is_not_an_id(tokenizer_dir, name, value):
    path = tokenizer_dir / name
    edit_json(path, eos_token_id=value)
    with names_the_damage(path, "eos_token_id is"):
        Tokenizer.from_dir(tokenizer_dir)


def test_what_transformers_accepts_loads(tokenizer_dir):
    """Graceful where transformers is: a non-standard "*_token" of another type is no token, and named
    templates may come as a dict."""
    path = tokenizer_dir / "tokenizer_config.json"
    template = json.loads(path.read_text())["chat_template"]
    edit_json(path, image_token=5, chat_template={"default": template, "tool_use": "unused"})
    chat = [{"role": "user", "content": "hi"}]
    ours = Tokenizer.from_dir(tokenizer_dir)
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert "image_token" not in ours.special_tokens
    assert ours.render_chat(chat) == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


# --- GGUF ----------------------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tiny_checkpoint, tmp_path) -> Callable[[], Path]:
    """tiny_gguf() writes the tiny llama model as a GGUF file (with whatever GGUFWriter is patched to do)."""

    def write() -> Path:
        path = tmp_path / "tiny.gguf"
        write_gguf(path, tiny_checkpoint("llama")[1], "llama")
        return path

    return write


def gguf_cuts(path: Path) -> list[int]:
    """Sizes to cut a GGUF file to, longest first: inside the last tensor, the first tensor, the metadata, the counts."""
    data_offset = gguf.GGUFReader(path).data_offset
    return [path.stat().st_size - 100, data_offset + 100, data_offset // 2, 20]


def test_gguf_cut_short(tiny_gguf, tmp_path):
    path = tiny_gguf()
    for size in gguf_cuts(path):
        os.truncate(path, size)
        with names_the_damage(path, "is damaged", CUT_OFF, "download, copy or convert it again"):
            import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.real
def test_packaged_smollm2_gguf_cut_short(tmp_path):
    path = tmp_path / "SmolLM2.gguf"
    shutil.copyfile(weights.packaged.smollm2_gguf(), path)
    for size in gguf_cuts(path):
        os.truncate(path, size)
        with names_the_damage(path, "is damaged", CUT_OFF):
            import_gguf(path, tmp_path / "out", progress=False)


# GGUFWriter method -> what it writes instead, and what the message then says.
WRONG_METADATA = {
    "block count as text": (
        "add_block_count",
        lambda w, n: w.add_string("llama.block_count", str(n)),
        "llama.block_count is '2' (str), not an integer",
    ),
    "block count as float": (
        "add_block_count",
        lambda w, n: w.add_float32("llama.block_count", n),
        "llama.block_count is 2.0 (float), not an integer",
    ),
    "epsilon as text": (
        "add_layer_norm_rms_eps",
        lambda w, x: w.add_string("llama.attention.layer_norm_rms_epsilon", "1e-6"),
        "llama.attention.layer_norm_rms_epsilon is '1e-6' (str), not a number",
    ),
    "context as text": (
        "add_context_length",
        lambda w, n: w.add_string("llama.context_length", "long"),
        "llama.context_length is 'long' (str), not an integer",
    ),
    "tokens as numbers": (
        "add_token_list",
        lambda w, tokens: w.add_array("tokenizer.ggml.tokens", list(range(len(tokens)))),
        "tokenizer.ggml.tokens is an array of int, not an array of text",
    ),
    "tokens as one text": (
        "add_token_list",
        lambda w, tokens: w.add_string("tokenizer.ggml.tokens", "".join(tokens)),
        "tokenizer.ggml.tokens is '",
    ),
    "token types as text": (
        "add_token_types",
        lambda w, types: w.add_array("tokenizer.ggml.token_type", [str(t) for t in types]),
        "tokenizer.ggml.token_type is an array of str, not an array of integers",
    ),
    "token types cut short": (
        "add_token_types",
        lambda w, types: w.add_array("tokenizer.ggml.token_type", types[:10]),
        "tokenizer.ggml.token_type has 10 entries for 400 tokens",
    ),
    "merges of unknown tokens": (
        "add_token_merges",
        lambda w, merges: w.add_array("tokenizer.ggml.merges", ["no-such-token another", *merges]),
        "its tokenizer metadata does not hold together",
    ),
    "eos id past the tokens": (
        "add_eos_token_id",
        lambda w, i: w.add_uint32("tokenizer.ggml.eos_token_id", 100_000),
        "tokenizer.ggml.eos_token_id is 100000, but it has 400 tokens",
    ),
    "eos id as text": (
        "add_eos_token_id",
        lambda w, i: w.add_string("tokenizer.ggml.eos_token_id", "<|im_end|>"),
        "tokenizer.ggml.eos_token_id is '<|im_end|>' (str), not an integer",
    ),
    "add_bos as text": (
        "add_add_bos_token",
        lambda w, b: w.add_string("tokenizer.ggml.add_bos_token", "no"),
        "tokenizer.ggml.add_bos_token is 'no' (str), not a boolean",
    ),
    "chat template as number": (
        "add_chat_template",
        lambda w, t: w.add_uint32("tokenizer.chat_template", 3),
        "tokenizer.chat_template is 3 (int), not text",
    ),
}


@pytest.mark.parametrize("case", WRONG_METADATA)
def test_gguf_metadata_of_the_wrong_type(tiny_gguf, tmp_path, monkeypatch, case):
    method, write_instead, phrase = WRONG_METADATA[case]
    monkeypatch.setattr(gguf.GGUFWriter, method, write_instead)
    path = tiny_gguf()
    with names_the_damage(path, "is damaged", phrase, "download, copy or convert it again"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --- end to end --------------------------------------------------------------------------------


def test_generate_reports_a_truncated_checkpoint_in_one_line(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "chat"
    shutil.copytree(tiny_checkpoint("qwen2")[0], folder)
    write_tiny_tokenizer(folder)
    weights_file = folder / "model.safetensors"
    os.truncate(weights_file, weights_file.stat().st_size // 2)
    capsys.readouterr()  # what writing the checkpoint printed
    code = generate.main(["--checkpoint", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "float32", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"model.safetensors in {folder} is damaged" in err and CUT_OFF in err
    assert "Traceback" not in err
