"""Every bad checkpoint gives one clear UserError naming the problem."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from errors import UserError
from weights.forms import load_model
from weights.loader import read_config

CPU = torch.device("cpu")


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    """A private, editable copy of the tiny llama checkpoint."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama")[0], folder)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, CPU)


def test_folder_without_config(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        load_model(tmp_path, torch.float32, CPU)


def test_folder_without_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no model.safetensors"):
        load_model(checkpoint, torch.float32, CPU)


def test_unsupported_model_type_lists_the_supported_ones(checkpoint):
    edit_config(checkpoint, model_type="gpt2")
    with pytest.raises(UserError, match="unsupported model_type 'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
        load_model(checkpoint, torch.float32, CPU)


def test_missing_tensor_is_named(checkpoint):
    edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(UserError, match=r"tensor model.layers.1.mlp.up_proj.weight missing .* expected \[160, 64\]"):
        load_model(checkpoint, torch.float32, CPU)


def test_unexpected_tensor_is_named(checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(UserError, match="unexpected tensor model.layers.0.extra.weight"):
        load_model(checkpoint, torch.float32, CPU)


def test_wrong_shape_names_expected_and_found(checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(UserError, match=r"model.norm.weight .* has shape \[65\], config.json implies \[64\]"):
        load_model(checkpoint, torch.float32, CPU)


def test_sharded_checkpoint_loads_like_the_single_file(checkpoint, tiny_checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, checkpoint / shard)
    (checkpoint / "model.safetensors").unlink()
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_model(checkpoint, torch.float32, CPU)
    single = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    for (name, a), b in zip(sharded.state_dict().items(), single.state_dict().values()):
        assert torch.equal(a, b), name


def test_ignored_buffers_and_tied_lm_head_are_accepted(tiny_checkpoint, tmp_path):
    folder = tmp_path / "tied"
    shutil.copytree(tiny_checkpoint("llama_tied")[0], folder)

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    edit_tensors(folder, add)
    model = load_model(folder, torch.float32, CPU)
    assert model.lm_head.weight is model.embed.weight


def test_config_reads_rope_theta_from_top_level_and_rope_parameters():
    base = dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert ModelConfig.from_dict({**base, "rope_theta": 1234.0}).rope_theta == 1234.0
    assert ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 99.0}}).rope_theta == 99.0


def test_config_refuses_unknown_rope_scaling_and_sliding_window():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(UserError, match="RoPE scaling 'foo'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "foo", "factor": 4.0}})
    with pytest.raises(UserError, match="sliding-window"):
        ModelConfig.from_dict({**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16})


@pytest.mark.parametrize(
    "changes, field, holds, expected",
    [
        ({"hidden_size": "896"}, "hidden_size", r'"896" \(a string\)', "a positive integer"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers", r"2.5 \(a number\)", "a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads", r"0 \(an integer\)", "a positive integer"),
        ({"rope_theta": "big"}, "rope_theta", r'"big" \(a string\)', "a number"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": True}}, "rope_parameters.rope_theta", r"true \(a boolean\)", "a number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings", r'"yes" \(a string\)', "true or false"),
        ({"rope_scaling": ["linear", 2.0]}, "rope_scaling", r'\["linear", 2.0\] \(a list\)', r"an object \{...\} or null"),
        ({"rope_scaling": {"type": 3, "factor": 2.0}}, "rope_scaling.type", r"3 \(an integer\)", "a string"),
    ],
)
def test_config_field_of_the_wrong_type_is_one_clear_error(checkpoint, changes, field, holds, expected):
    edit_config(checkpoint, **changes)
    path = re.escape(str(checkpoint / "config.json"))
    with pytest.raises(UserError, match=rf"^{path}: field '{field}' holds {holds}, but must be {expected}; correct it in that file$"):
        load_model(checkpoint, torch.float32, CPU)


def test_config_that_is_not_a_json_object_is_refused(checkpoint):
    path = checkpoint / "config.json"
    path.write_text(json.dumps([{"model_type": "llama"}]))
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} holds a list, not an object of named fields"):
        load_model(checkpoint, torch.float32, CPU)


def test_truncated_config_is_refused_as_invalid_json(checkpoint):
    path = checkpoint / "config.json"
    path.write_text(path.read_text()[:50])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} is not valid JSON"):
        load_model(checkpoint, torch.float32, CPU)


def test_config_missing_field_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(UserError, match="has no 'num_attention_heads' field"):
        ModelConfig.from_file(tmp_path / "config.json")
