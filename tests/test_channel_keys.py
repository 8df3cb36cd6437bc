"""Keys in codes per channel over blocks of slots (kv/channel_keys.py): each block's range is that
of the slots it holds, checked by brute force after every write; writes of any size give the same
codes; every path agrees; what would move its slots is refused with one clear error."""

from types import SimpleNamespace

import pytest
import torch

from compression.config import CompressionConfig
from engine.options import RunOptions, generate
from engine.speculative import Speculation
from errors import UserError
from evaluation.config import split_storage
from kv import KV_CHANNEL_CODES
from kv.channel_keys import ChannelKeysKVCache, allocate_channel_keys
from kv.contiguous import contiguous_cache
from kv.paged import PageConfig
from kv.quantized import kv_storage
from tests.test_kv_quant import config_of, hard_values, prompts_of
from weights.forms import load_model

CPU = torch.device("cpu")
BLOCK = KV_CHANNEL_CODES["kc4v4"][1]
BLOCK_SIZES = sorted({group for _, group in KV_CHANNEL_CODES.values()})


def written(keys: torch.Tensor, bits: int, chunks: list[int], block: int = BLOCK):
    """ChannelKeys holding keys [B, H, S, D], written chunk by chunk (sizes summing to S)."""
    B, H, S, D = keys.shape
    stored = allocate_channel_keys((B, H, S, D), torch.float32, bits, CPU, block)
    start = 0
    for n in chunks:
        stored.write(keys[:, :, start : start + n], (start + torch.arange(n)).expand(B, n))
        start += n
    return stored


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("size", BLOCK_SIZES)
def test_after_every_write_each_channel_of_each_block_spans_the_slots_it_holds(bits, size):
    """After each write, every held key comes back within half a step of itself, and the step and
    minimum of each (block, channel) are those of the held slots alone (brute force), not of the
    zeros or older values in the slots past them."""
    keys = hard_values(2, 2, 2 * size + 13, 64)  # [B, H, S, D]
    stored = allocate_channel_keys(tuple(keys.shape), torch.float32, bits, CPU, size)
    levels = 2**bits - 1
    held = 0
    for n in [size + 5, 1, 1, 1, size - 12, 1, 16]:  # a prompt across a block's end, then steps and chunks
        stored.write(keys[:, :, held : held + n], (held + torch.arange(n)).expand(2, n))
        held += n
        back = stored.read(held, torch.float32)  # [B, H, held, D]
        for block in range(-(-held // size)):
            span = slice(block * size, min(held, (block + 1) * size))
            x = keys[:, :, span]  # [B, H, n, D]
            low, high = x.amin(2), x.amax(2)  # [B, H, D]
            step, stored_low = stored.step[:, :, block, :, 0].float(), stored.low[:, :, block, :, 0].float()
            assert torch.all(stored_low <= low) and torch.all(stored_low >= low - low.abs() * 2**-9 - 2**-20)
            assert torch.all(step * levels >= high - low) and torch.all(step * levels <= (high - low) * (1 + 2**-8) + 2**-20)
            assert torch.all((back[:, :, span] - x).abs() <= step[:, :, None] / 2 * (1 + 2**-8) + 1e-6)


@pytest.mark.parametrize("size", BLOCK_SIZES)
def test_the_codes_do_not_depend_on_how_the_slots_were_written(size):
    """Blocks are quantized again from floats at each write, so one write, a prompt and steps, or a
    slot at a time leave the same codes."""
    keys = hard_values(2, 2, 70, 32)
    at_once = written(keys, 3, [70], size)
    for chunks in ([33, *[1] * 37], [1] * 70, [31, 2, 30, 7]):
        other = written(keys, 3, chunks, size)
        assert torch.equal(other.read(70, torch.float32), at_once.read(70, torch.float32)), chunks


def test_a_channel_keys_cache_holds_its_blocks_bytes():
    """kc3v3 of a 64-channel head, 10 slots: keys in one block of 32 and one spare (each channel:
    12 bytes of codes, a step and a minimum), the tail's floats in bfloat16 and its block's number
    (int64); values per slot, a step and a minimum per 32 channels. kc3v3g64: blocks of 64 slots
    (24 bytes of codes per channel), one step and minimum per slot's 64 channels."""
    config = config_of(64, n_layers=3)
    model = SimpleNamespace(config=config, dtype=torch.bfloat16)
    keys = 2 * 64 * (12 + 4) + 32 * 64 * 2 + 8
    values = 10 * (24 + 2 * 2 * 2)
    assert contiguous_cache(model, 2, 10, "kc3v3", CPU).nbytes == 3 * 2 * 2 * (keys + values)  # layers, rows, heads
    keys = 2 * 64 * (24 + 4) + 64 * 64 * 2 + 8
    values = 10 * (24 + 2 * 2)
    assert contiguous_cache(model, 2, 10, "kc3v3g64", CPU).nbytes == 3 * 2 * 2 * (keys + values)
    assert kv_storage("kc3v3", torch.bfloat16) == (torch.bfloat16, (3, 3), 32) and kv_storage("kc3v3g64", torch.bfloat16) == (torch.bfloat16, (3, 3), 64)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_step_on_channel_keys_equals_eager(arch, tiny_checkpoint):
    """Rows of different lengths, decoded across a block's end; qwen2's key bias stays in the codes."""
    model = load_model(tiny_checkpoint(arch)[0], torch.float32, CPU)
    prompts = prompts_of([7, 29], seed=2)
    for kv_dtype in ("kc4v4", "kc3v2g64"):
        eager = generate(model, prompts, 12, eos_ids=frozenset(), options=RunOptions(kv_dtype=kv_dtype))
        compiled = generate(model, prompts, 12, eos_ids=frozenset(), options=RunOptions(kv_dtype=kv_dtype, compile=True))
        assert compiled.tokens == eager.tokens, kv_dtype


@pytest.mark.parametrize("kv_dtype", ["kc4v4", "kc2v3", "kc4v3g64"])
def test_a_prefill_attends_over_each_block_quantized_per_channel(kv_dtype, tiny_checkpoint, monkeypatch):
    """A prompt of two whole blocks: the logits are those of a float cache holding each block's
    keys quantized channel by channel (quantize over the block's slots, as a group) and each
    slot's values quantized along its channels, in groups of as many channels as a block has slots."""
    from engine.decode import prefill
    from kv.cache import KVCache, RowsView
    from kv.quantized import dequantize, quantize

    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    (key_bits, value_bits), size = KV_CHANNEL_CODES[kv_dtype]
    prompt = prompts_of([2 * size], seed=5)
    logits = prefill(model, contiguous_cache(model, 1, 2 * size, kv_dtype, CPU), prompt)
    assert not torch.allclose(logits, prefill(model, KVCache.allocate(model.config, 1, 2 * size, torch.float32, CPU), prompt))  # the codes are read

    def rounded_write(view, k, v, slots):  # k, v [1, H_kv, 2 * size, D]
        blocks = k.unflatten(2, (2, size)).transpose(-1, -2)  # [1, H_kv, 2, D, size]: each channel's slots
        view.k[:, :, : 2 * size] = dequantize(quantize(blocks, key_bits, group=size), torch.float32).transpose(-1, -2).flatten(2, 3)
        view.v[:, :, : 2 * size] = dequantize(quantize(v, value_bits, group=size), torch.float32)

    monkeypatch.setattr(RowsView, "write", rounded_write)
    reference = prefill(model, KVCache.allocate(model.config, 1, 2 * size, torch.float32, CPU), prompt)
    assert torch.equal(logits, reference)


def test_what_would_move_its_slots_is_refused_with_one_clear_error(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([5])
    asked = {
        "a KV policy": RunOptions(kv_dtype="kc3v3", compression=CompressionConfig(policy="streaming", budget=6, hysteresis=3, window=3)),
        "the paged cache": RunOptions(kv_dtype="kc3v3", pages=PageConfig(block_size=4)),
        "--speculate": RunOptions(kv_dtype="kc3v3", speculation=Speculation(None, 4)),
    }
    for what, options in asked.items():
        with pytest.raises(UserError, match=f"--kv-dtype kc3v3 keeps keys per channel over blocks of slots, which {what}"):
            generate(model, prompts, 4, eos_ids=frozenset(), options=options)
    with pytest.raises(UserError, match="run it as the full cache, none:kv_dtype=kc3v3"):
        split_storage("streaming:kv_dtype=kc3v3")
    assert split_storage("none:kv_dtype=kc3v3") == ("none", "kc3v3")
    with pytest.raises(UserError, match="unknown --kv-dtype 'kc8v8'"):
        kv_storage("kc8v8", torch.float32)


def test_a_policy_reads_the_written_keys_and_values_back():
    """keys(), all_keys() and gather() (what compression reads) give the written keys and values
    back within a step of their codes, at the slots asked for."""
    config = config_of(32, n_layers=2)
    cache = ChannelKeysKVCache.allocate(config, 1, 40, torch.float32, CPU, (4, 4), BLOCK)
    k, v = hard_values(2, 2, 1, 2, 40, 32).unbind(0)  # each [L, B, H_kv, S, D]
    for layer, view in enumerate(cache.layers(None)):
        view.write(k[layer], v[layer], torch.arange(40)[None])
    span = (k.amax(3, keepdim=True) - k.amin(3, keepdim=True)).amax(-2, keepdim=True) / 15  # a key step's bound, per channel
    assert torch.all((cache.all_keys() - k).abs() <= span)
    assert torch.equal(cache.keys(1, 40), cache.all_keys()[1])
    slots = torch.tensor([3, 31, 32, 39]).expand(2, 1, 2, 4)  # [L, B, H_kv, E]
    keys, values = cache.gather(slots)
    assert torch.equal(keys, cache.all_keys()[:, :, :, [3, 31, 32, 39]])
    value_span = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / 15
    assert torch.all((values - v[:, :, :, [3, 31, 32, 39]]).abs() <= value_span[:, :, :, [3, 31, 32, 39]])


def test_g64_values_share_a_step_and_minimum_over_64_channels():
    """kcNvMg64 quantizes each slot's 64 channels of values as one group (brute force: the step
    spans the slot's whole range, and each value is within half of it), where kcNvM's groups of 32
    each span their own half."""
    config = config_of(64)
    v = hard_values(1, 2, 5, 64)  # [B, H_kv, S, D]
    k = hard_values(1, 2, 5, 64)
    for kv_dtype, group in (("kc4v3", 32), ("kc4v3g64", 64)):
        cache = ChannelKeysKVCache.allocate(config, 1, 5, torch.float32, CPU, KV_CHANNEL_CODES[kv_dtype][0], KV_CHANNEL_CODES[kv_dtype][1])
        view = cache.layers(None)[0]
        view.write(k, v, torch.arange(5)[None])
        back = view.read(torch.float32)[1]  # [B, H_kv, S, D]
        groups = v.unflatten(-1, (-1, group))  # [B, H_kv, S, D / group, group]
        low = groups.amin(-1)  # [B, H_kv, S, D / group]
        span = (groups.amax(-1) - low) / 7
        step = cache.v.step[0].float()
        assert cache.v.step.shape[-1] == 64 // group
        assert torch.all(step >= span) and torch.all(step <= span * (1 + 2**-8) + low.abs() * 2**-9 + 2**-20)
        assert torch.all((back - v).abs() <= step.repeat_interleave(group, -1) / 2 * (1 + 2**-8) + 1e-6)


def test_a_head_that_groups_of_64_do_not_divide_gets_one_clear_error():
    """A 96-channel head splits into groups of 32 (kc4v3) but not of 64 (kc4v3g64)."""
    ChannelKeysKVCache.allocate(config_of(96), 1, 4, torch.float32, CPU, (4, 3), 32)
    with pytest.raises(UserError, match="needs a head dimension divisible by 64 .* this model's is 96"):
        ChannelKeysKVCache.allocate(config_of(96), 1, 4, torch.float32, CPU, (4, 3), 64)


def test_a_row_padded_past_its_block_takes_its_last_block_back_from_the_codes():
    """A prefill of rows of different lengths writes the short row's padding into later blocks, so
    the tail holds the padding's last block. The short row's next write starts in its own last
    block, whose earlier slots must be its own keys: taken back from the codes, within half a step
    of the prefill's block and half of the block quantized again."""
    B, H, D = 2, 2, 32
    keys = hard_values(B, H, 2 * BLOCK + 10, D)  # [B, H, S, D]; row 0 holds 5 real keys and then padding
    stored = allocate_channel_keys(tuple(keys.shape), torch.float32, 4, CPU, BLOCK)
    T = 2 * BLOCK + 9
    stored.write(keys[:, :, :T], torch.arange(T).expand(B, T))
    step_before = stored.step[0, :, 0, :, 0].float().clone()  # [H, D] row 0's first block, padding in its range
    new = torch.stack([keys[0, :, 5], keys[1, :, T]])[:, :, None]  # [B, H, 1, D]
    stored.write(new, torch.tensor([[5], [T]]))
    truth = torch.cat([keys[0, :, :5], keys[0, :, 5:6]], 1)  # [H, 6, D] row 0's real keys
    step_after = stored.step[0, :, 0, :, 0].float()
    back = stored.read(6, torch.float32)[0]  # [H, 6, D]
    assert torch.all((back - truth).abs() <= (step_before + step_after)[:, None] / 2 * (1 + 2**-8) + 1e-6)
    assert torch.equal(stored.tail_block, torch.tensor([[0, 0], [2, 2]]))
