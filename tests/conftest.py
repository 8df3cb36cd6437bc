import json
import shutil
from pathlib import Path

import pytest
import torch

from tiny_checkpoints import KINDS, write_checkpoint
from tiny_tokenizer import write_tiny_tokenizer

IM_END = 386  # the tiny tokenizer's <|im_end|>

# One process compiles the decode step for dozens of cache shapes here (a command compiles one
# or two); past dynamo's default of 8 versions per function, fullgraph=True fails outright.
torch._dynamo.config.recompile_limit = 64


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(kind) -> (folder, transformers model); each kind is written once per session."""
    made: dict[str, tuple[Path, object]] = {}

    def get(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            made[kind] = (folder, write_checkpoint(kind, folder))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def chat_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Qwen2 checkpoint with a ChatML tokenizer and <|im_end|> as its EOS."""
    folder = tmp_path_factory.mktemp("chat")
    shutil.copytree(tiny_checkpoint("qwen2")[0], folder, dirs_exist_ok=True)
    write_tiny_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END]}))
    return folder


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


ALL_KINDS = list(KINDS)


@pytest.fixture(scope="session")
def packaged_model(tmp_path_factory):
    """packaged_model(name) -> (GGUF file, imported checkpoint folder) for "smollm2" / "qwen-coder"."""
    import weights.packaged as packaged

    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            if name == "smollm2":
                made[name] = (packaged.smollm2_gguf(), packaged.smollm2_checkpoint())
            else:
                gguf = packaged.assemble_qwen_coder_gguf(tmp_path_factory.mktemp("qwen") / "qwen-coder.gguf")
                made[name] = (gguf, packaged.qwen_coder_checkpoint())
        return made[name]

    return get


@pytest.fixture(scope="session")
def gguf_oracle(packaged_model):
    """gguf_oracle(name) -> transformers' own float32 load of the packaged GGUF file, made once."""
    import transformers

    made = {}

    def get(name: str):
        if name not in made:
            gguf, _ = packaged_model(name)
            made[name] = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        return made[name]

    return get
