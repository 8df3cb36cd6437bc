"""Tiny random Hugging Face checkpoints, written by transformers itself, for the fast tests."""

from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=400,  # room for the tiny tokenizer's 389 entries
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Larger than the usual 0.02 so that random logits are peaked and greedy argmax is not a near-tie.
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, overrides of COMMON)
KINDS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama_bias": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "llama3_rope": (
        transformers.LlamaConfig,
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    # The other RoPE scalings: a trained context of 64 (dynamic: max_position_embeddings, as transformers reads
    # it) so that a 120-token prompt, or a short prompt and a long generation, goes past it.
    "llama_linear_rope": (transformers.LlamaConfig, dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "llama_dynamic_rope": (
        transformers.LlamaConfig,
        dict(max_position_embeddings=64, rope_scaling=dict(rope_type="dynamic", factor=4.0)),
    ),
    "qwen2_yarn_rope": (
        transformers.Qwen2Config,
        dict(tie_word_embeddings=True, rope_scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=64)),
    ),
    # Phi-3 style: original_max_position_embeddings at the top level, no factor (512 / 64 it is).
    "llama_longrope": (
        transformers.LlamaConfig,
        dict(
            original_max_position_embeddings=64,
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0, 1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0],
            ),
        ),
    ),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    # SmolLM2's layout: 3 KV heads of 2 query heads each, which 2 ranks split 1 and 2.
    "llama_3kv": (transformers.LlamaConfig, dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
    # Qwen2.5-Coder-0.5B's head of 64 channels, which groups of 64 channels (kNvMg64) span whole;
    # 2 KV heads so that 2 ranks can split them.
    "qwen2_head64": (transformers.Qwen2Config, dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
}


def hf_model(kind: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_class, overrides = KINDS[kind]
    config = config_class(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers initialises biases to 0 and norm weights to 1; randomise them so they are tested.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def write_checkpoint(kind: str, folder: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """Save a tiny random model of `kind` to folder and return the transformers model."""
    model = hf_model(kind, seed)
    model.save_pretrained(folder)
    return model


def tensors_in_file(model, folder: Path) -> tuple[set[str], bool]:
    """The model's parameters and buffers that are views of a memory-mapped file of `folder`, and
    whether every such map is still in use by one of them (none outlives the loading)."""
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 6 and fields[5].startswith(str(folder)):
            maps.append(tuple(int(x, 16) for x in fields[0].split("-")))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    in_file = {name for name, t in tensors.items() if any(start <= t.data_ptr() < end for start, end in maps)}
    return in_file, all(any(start <= t.data_ptr() < end for t in tensors.values()) for start, end in maps)
