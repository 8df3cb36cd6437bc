"""The interactive chat: each turn prefills only what it adds, and gives what one prefill of the whole conversation gives."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compression.config import CompressionConfig
from engine.chat import Conversation
from engine.decode import prefill
from engine.options import RunOptions, generate, open_session
from kv.cache import KVCache
from weights.forms import load_model
from weights.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
MESSAGES = ["Tell me about the fox.", "And the dog?", "Which one is faster?"]


def test_each_turn_equals_one_prefill_of_the_whole_conversation(chat_checkpoint):
    model = load_model(chat_checkpoint, torch.float32, CPU)
    tokenizer = Tokenizer.from_dir(chat_checkpoint)
    conversation = Conversation(open_session(model, 1, 512, RunOptions(), eos_ids=tokenizer.eos_ids), tokenizer, "Be brief.", 512)
    for message in MESSAGES:
        held = len(conversation.fed)
        turn = conversation.turn(message, 12)
        assert 0 < turn.prefilled < len(conversation.fed) - held + 1  # only the new part was prefilled
        history = conversation.fed[: held + turn.prefilled]
        cache = KVCache.allocate(model.config, 1, len(history), torch.float32, CPU)
        one_shot = prefill(model, cache, [history])[0]
        assert (turn.prefill_logits - one_shot).abs().max().item() <= 1e-4
        assert turn.answer == generate(model, [history], 12, eos_ids=tokenizer.eos_ids).tokens[0]
    assert conversation.restarts == 0


def test_an_answer_cut_inside_a_character_goes_on_without_a_restart(chat_checkpoint):
    """An answer that stops after a token holding only part of a character's bytes: the cache
    holds all but its last token, whose text is not a prefix of the whole answer's. The next
    turn feeds that token itself and goes on, as one prefill of the conversation would."""
    model = load_model(chat_checkpoint, torch.float32, CPU)
    tokenizer = Tokenizer.from_dir(chat_checkpoint)
    for n in range(2, 40):
        conversation = Conversation(open_session(model, 1, 512, RunOptions(), eos_ids=frozenset()), tokenizer, None, 512)
        answer = conversation.turn(MESSAGES[0], n).answer
        if not tokenizer.decode(answer).startswith(tokenizer.decode(answer[:-1])):
            break
    else:
        pytest.fail("no answer of 2-39 tokens ends inside a character")
    held = len(conversation.fed)
    turn = conversation.turn(MESSAGES[1], 4)
    assert conversation.restarts == 0
    assert conversation.fed[held] == answer[-1]  # the cut token, fed as it was sampled
    history = conversation.fed[: held + turn.prefilled]
    cache = KVCache.allocate(model.config, 1, len(history), torch.float32, CPU)
    assert (turn.prefill_logits - prefill(model, cache, [history])[0]).abs().max().item() <= 1e-4


def test_a_kv_policy_keeps_a_long_conversation_in_its_cache(chat_checkpoint):
    model = load_model(chat_checkpoint, torch.float32, CPU)
    tokenizer = Tokenizer.from_dir(chat_checkpoint)
    policy = CompressionConfig(policy="beacon", budget=16, hysteresis=8, window=4, n_beacon=4, n_recent=4)
    session = open_session(model, 1, 160, RunOptions(compression=policy), eos_ids=tokenizer.eos_ids)
    conversation = Conversation(session, tokenizer, None, 512)
    for i in range(8):
        conversation.turn(f"{MESSAGES[i % 3]} Number {i}.", 16)
    assert len(conversation.fed) > 2 * session.cache.n_slots  # far more than the cache holds
    assert session.stats.compactions > 0 and session.cache.n_slots == 160


def chat_process(folder: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "generate.py"), "--checkpoint", str(folder), "-i", "--temperature", "0", "--dtype", "float32", *flags],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )


def first_answer(folder: Path, message: str) -> str:
    chat = chat_process(folder, "--max-new-tokens", "10")
    return chat.communicate(message + "\n", timeout=120)[0]


def test_chat_through_a_pipe_with_reset_and_exit(chat_checkpoint):
    chat = chat_process(chat_checkpoint, "--max-new-tokens", "10")
    out, err = chat.communicate("Hello there\nWhat about foxes?\n/reset\nHello there\n/exit\nnever read\n", timeout=120)
    assert chat.returncode == 0, err
    alone = first_answer(chat_checkpoint, "Hello there")
    # after /reset the same first message gets the same answer; /exit ends before the last line
    assert out.startswith(alone) and out.endswith(alone) and len(out) > 2 * len(alone)
    assert err.count("> ") == 5 and "(a new conversation)" in err  # one prompt per line read


def test_a_full_cache_without_a_policy_says_so_and_the_chat_goes_on(chat_checkpoint):
    chat = chat_process(chat_checkpoint, "--max-new-tokens", "10", "--context", "48")
    out, err = chat.communicate("Hello there\n" + "a much longer message about foxes and dogs and cats " * 3 + "\n/reset\nHello there\n", timeout=120)
    assert chat.returncode == 0, err
    assert "do not fit the cache's 48 slots" in err and "/reset starts a new conversation" in err
    assert out == 2 * first_answer(chat_checkpoint, "Hello there")


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT")
def test_ctrl_c_stops_the_answer_not_the_chat(chat_checkpoint):
    chat = chat_process(chat_checkpoint, "--max-new-tokens", "400")
    chat.stdin.write("Tell me everything about foxes\n")
    chat.stdin.flush()
    chat.stdout.read(1)  # the answer has begun
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate("Hello\n/exit\n", timeout=120)
    assert chat.returncode == 0, err
    assert "(answer stopped)" in err and err.count("> ") == 3  # the chat asked for the next two lines
