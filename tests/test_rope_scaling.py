"""Every RoPE scaling computes what transformers computes, and a scaling the engine lacks is refused clearly.

Full-sequence logits past the trained context, for each scaling's tiny checkpoint, are checked by
test_model_parity.py's tests over every kind; here: generation across the trained context (where dynamic
and longrope change their frequencies), each scaling's parameters, and the errors.
"""

import copy
import json
import shutil

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.generation import generate
from models.config import ModelConfig
from errors import UserError
from models.rope import attention_factor, rope_inverse_frequencies, rope_tables
from tiny_checkpoints import COMMON
from weights.forms import load_model

CPU = torch.device("cpu")
SCALED_KINDS = ["llama_linear_rope", "llama_dynamic_rope", "qwen2_yarn_rope", "llama_longrope", "llama3_rope"]


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", SCALED_KINDS)
@pytest.mark.parametrize("prompt_length, new_tokens", [(24, 100), (80, 40)])
def test_greedy_generation_across_the_trained_context_equals_transformers(kind, prompt_length, new_tokens, tiny_checkpoint):
    """A prompt within the trained context of 64 and a generation past it, or a prompt past it: dynamic and
    longrope switch frequencies mid-generation while the cached keys keep the rotation they were written with."""
    folder, _ = tiny_checkpoint(kind)
    # A fresh transformers model: dynamic RoPE keeps the longest length it has seen from one call to the next.
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder, torch.float32, CPU)
    prompt = random_prompt(prompt_length, seed=5)
    tokens = torch.tensor([prompt])
    expected = hf.generate(tokens, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate(model, [prompt], new_tokens, eos_ids=frozenset()).tokens[0]
    assert got == expected[0, prompt_length:].tolist()


# Parameters beyond each tiny checkpoint's: the defaults' alternatives, and where transformers reads them from.
SHORT, LONG = [1.0, 1.0, 1.2, 1.5, 2.0, 2.0, 3.0, 4.0], [2.0 + i for i in range(8)]
VARIANTS = {
    "yarn, mscale ratio, no truncation": dict(
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=1.0, truncate=False)
    ),
    "yarn, betas and attention factor": dict(
        rope_scaling=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=32, beta_fast=8.0, beta_slow=2.0, attention_factor=1.5)
    ),
    "yarn, original context from max_position_embeddings": dict(rope_scaling=dict(rope_type="yarn", factor=2.0)),
    "longrope, top-level original context wins": dict(
        original_max_position_embeddings=32,
        rope_scaling=dict(rope_type="longrope", original_max_position_embeddings=64, short_factor=SHORT, long_factor=LONG),
    ),
    "longrope, factor and attention factor given": dict(
        rope_scaling=dict(
            rope_type="longrope", factor=2.0, attention_factor=1.25, original_max_position_embeddings=64, short_factor=SHORT, long_factor=LONG
        ),
    ),
    "dynamic, transformers 5 rope_parameters": dict(
        max_position_embeddings=64, rope_parameters=dict(rope_type="dynamic", factor=2.5, rope_theta=5000.0)
    ),
    "linear, legacy 'type' key": dict(rope_theta=50000.0, rope_scaling=dict(type="linear", factor=2.0)),
    "llama3, original context from max_position_embeddings": dict(
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_frequencies_and_attention_factor_equal_transformers(variant):
    raw = {**COMMON, "model_type": "llama", **VARIANTS[variant]}
    ours = ModelConfig.from_dict(copy.deepcopy(raw))
    hf_config = transformers.LlamaConfig(**{k: v for k, v in copy.deepcopy(raw).items() if k != "model_type"})
    rope_type = hf_config.rope_parameters["rope_type"]
    for seq_len in (1, 32, 33, 64, 65, 100, 200):
        hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)
        inv_freq = rope_inverse_frequencies(ours, torch.tensor([float(seq_len)]))[0]
        torch.testing.assert_close(inv_freq, hf_inv_freq, rtol=1e-6, atol=0.0, msg=f"{variant}, {seq_len} tokens")
        assert attention_factor(ours.rope_scaling) == pytest.approx(hf_factor, rel=1e-12)


def test_dynamic_table_row_p_holds_the_frequencies_of_p_plus_1_tokens():
    """Decoding the token at position p, transformers sees a sequence of p + 1 tokens: within the trained
    context the original frequencies, beyond it NTK's for p + 1."""
    raw = {**COMMON, "max_position_embeddings": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    config = ModelConfig.from_dict({**copy.deepcopy(raw), "model_type": "llama"})
    assert config.max_position_embeddings == 128  # twice the trained context, as the factor says
    cos, _ = rope_tables(config)  # [128, D]
    hf_config = transformers.LlamaConfig(**raw)
    for p in (0, 40, 63, 64, 100, 127):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=p + 1)
        expected = (p * inv_freq).cos()
        torch.testing.assert_close(cos[p], torch.cat((expected, expected)), rtol=0.0, atol=1e-5)


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    """A private, editable copy of the tiny yarn checkpoint."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen2_yarn_rope")[0], folder)
    return folder


def set_rope_parameters(folder, rope_parameters: dict) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw["rope_parameters"] = rope_parameters
    path.write_text(json.dumps(raw))


def test_an_unsupported_scaling_is_named_with_the_supported_ones(checkpoint):
    set_rope_parameters(checkpoint, {"rope_type": "foo", "factor": 2.0, "rope_theta": 10000.0})
    supported = "default, linear, dynamic, yarn, longrope, llama3"
    with pytest.raises(UserError, match=rf"config.json asks for RoPE scaling 'foo', .*; supported: {supported}$"):
        load_model(checkpoint, torch.float32, CPU)


@pytest.mark.parametrize(
    "rope_parameters, message",
    [
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "has no 'rope_parameters.factor' field, which 'yarn' RoPE"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "has no 'rope_parameters.high_freq_factor' field"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8}, "has no 'rope_parameters.long_factor' field, which 'longrope'"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}, "'rope_parameters.short_factor' holds .* list of 8"),
        ({"rope_type": "yarn", "factor": "8"}, r"'rope_parameters.factor' holds \"8\" \(a string\), but must be a number"),
    ],
)
def test_a_scaling_with_a_missing_or_malformed_field_names_it(checkpoint, rope_parameters, message):
    set_rope_parameters(checkpoint, rope_parameters)
    with pytest.raises(UserError, match=message):
        load_model(checkpoint, torch.float32, CPU)
