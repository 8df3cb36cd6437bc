"""Speculative decoding: the same greedy tokens as plain decoding, a cache as if the rejected
drafts were never fed, and sampled tokens distributed as the target's own."""

import math
from dataclasses import replace

import pytest
import torch

import engine.speculative as speculative
import cli
import generate
from engine.generation import run
from engine.options import RunOptions, generate as generate_with, open_session
from engine.sampling import SamplingConfig
from engine.drafters import PromptLookup
from engine.speculative import Speculation, Widths
from engine.verify import Verifier, accept, step_back, verify
from errors import UserError
from kv.paged import PageConfig
from weights.forms import load_model

CPU = torch.device("cpu")


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Oracle:
    """Drafts the plain answer's next tokens, every fifth one wrong, so that rounds keep some drafts
    and reject the rest; none for the first three tokens, which plain steps make (the first builds a
    compiled step, and the verify compiles after it)."""

    answer: list[int] = []
    prompt_length = 0

    def draft(self, history: list[int], k: int) -> tuple[list[int], int]:
        done = len(history) - self.prompt_length
        drafts = self.answer[done : done + k] if done > 3 else []
        return [t if (done + i) % 5 != 2 else (t + 1) % 384 for i, t in enumerate(drafts)], 1


@pytest.fixture
def oracle(monkeypatch):
    """Speculation drafting from Oracle, every round verifying the most drafts it may (filled with guesses past the oracle's)."""
    monkeypatch.setattr(speculative, "PromptLookup", Oracle)
    monkeypatch.setattr(Widths, "choose", lambda self, n_drafts, match, room: max((j for j in self.allowed if j <= room), default=0) if n_drafts else 0)
    return Oracle


def test_prompt_lookup_proposes_what_followed_the_longest_earlier_match():
    lookup = PromptLookup()
    # [2, 3] last occurred at 5..6 (followed by 7), but [1, 2, 3] occurred at 0..2, followed by 4, 9, 2.
    assert lookup.draft([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3], 3) == ([4, 9, 2], 3)
    assert lookup.draft([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3, 5], 3) == ([], 0)  # 5 never occurred before
    assert lookup.draft([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3, 5, 9], 2) == ([2, 3], 1)  # only [9] matches, at 4
    assert PromptLookup().draft([8, 8], 4) == ([8], 1)  # up to the end of the text


def test_widths_start_from_a_prior_cost_and_time_a_width_from_its_second_verify():
    widths = Widths([1, 2], step_s=1.0)  # nothing measured: a draft is taken to add a quarter step, kept half the time
    assert widths.cost(1) == 1.25 and widths.cost(2) == 1.5
    assert widths.choose(2, 3, room=8) == 1  # 1.5 tokens / 1.25 s against 1.75 / 1.5
    widths.measured(9.0, 1)  # the first verify of a width (it may have compiled) is not timed
    assert widths.cost(1) == 1.25
    widths.measured(1.1, 1)
    assert widths.cost(1) == 1.1


def test_widths_choose_the_most_tokens_per_second_and_probe_when_none_pays():
    widths = Widths(list(range(1, 9)), verify_s={1: 1.0, 2: 1.2, 4: 2.0, 8: 4.0}, step_s=1.0)
    widths.kept[3], widths.missed[3] = 8.0, 2.0  # a draft after a 3-gram match is kept 80% of the time
    # tokens per second: 1 draft 1.8 / 1.0, 2 drafts 2.44 / 1.2 = 2.03, 3 drafts 2.95 / 1.6, 4 drafts 3.36 / 2.0
    assert widths.choose(8, 3, room=8) == 2
    assert widths.choose(8, 3, room=1) == 1
    assert widths.choose(1, 3, room=8) == 1  # a second, guessed, draft would cost 1.2 for the same 1.8 tokens
    widths.kept[1], widths.missed[1] = 0.0, 5.0  # never kept: no verify beats a plain step (1 token / 1.0 s)
    assert [widths.choose(8, 1, room=8) for _ in range(speculative.PROBE_EVERY)] == [0] * (speculative.PROBE_EVERY - 1) + [1]
    assert widths.choose(0, 0, room=8) == 0

    compiled = Widths([2], verify_s={2: 1.2}, step_s=1.0)  # one width: one draft is verified with a guess beside it
    compiled.kept[3], compiled.missed[3] = 8.0, 2.0
    assert compiled.choose(1, 3, room=8) == 2 and compiled.choose(1, 3, room=1) == 0


@pytest.mark.parametrize(
    "kind,options",
    [
        ("llama", RunOptions()),
        ("qwen2", RunOptions()),
        ("qwen3", RunOptions(compile=True)),
        ("llama", RunOptions(pages=PageConfig(block_size=4))),
        ("llama", RunOptions(kv_dtype="int8")),
        ("llama", RunOptions(compile=True, kv_dtype="int8")),
    ],
    ids=["llama", "qwen2", "qwen3-saved-step", "llama-paged", "llama-int8-kv", "llama-int8-kv-compiled"],
)
def test_greedy_speculation_gives_the_plain_tokens(kind, options, oracle, tiny_checkpoint):
    model = load_model(tiny_checkpoint(kind)[0], torch.float32, CPU)
    prompt = prompt_of(21)
    plain = generate_with(model, [prompt], 40, eos_ids=frozenset(), options=options).tokens[0]
    oracle.answer, oracle.prompt_length = plain, len(prompt)
    result = generate_with(model, [prompt], 40, eos_ids=frozenset(), options=replace(options, speculation=Speculation(max_draft=4)))
    assert result.tokens[0] == plain
    stats = result.speculation
    assert stats.plain_steps >= 3 and stats.rounds > 5 and 0 < stats.kept < stats.drafted  # drafts kept and rejected


def test_speculation_stops_at_eos_and_tells_the_end_once(oracle, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompt = prompt_of(9, seed=3)
    free = generate_with(model, [prompt], 30, eos_ids=frozenset()).tokens[0]
    k, eos = next((i, t) for i, t in enumerate(free) if i >= 6 and t not in free[:i])
    oracle.answer, oracle.prompt_length = free, len(prompt)
    heard: list[dict[int, int | None]] = []
    result = generate_with(model, [prompt], 30, eos_ids=frozenset({eos}), on_tokens=heard.append, options=RunOptions(speculation=Speculation(max_draft=4)))
    assert result.tokens[0] == free[:k]
    assert [news[0] for news in heard] == [*free[:k], None]


def test_a_rejected_drafts_slots_are_handed_back_as_if_never_fed(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompt = prompt_of(13, seed=1)
    plain = open_session(model, 1, 40, RunOptions(), eos_ids=frozenset())
    answer = run(plain, [prompt], 8).tokens[0]

    session = open_session(model, 1, 40, RunOptions(), eos_ids=frozenset())
    session.prefill([prompt])
    drafts = [answer[1], answer[2], (answer[3] + 1) % 384, answer[4]]  # the third is wrong
    n_kept, token = verify(Verifier(session), answer[0], drafts, SamplingConfig())
    assert (n_kept, token) == (2, answer[3])
    # The plain session after feeding the same tokens: prompt, answer[0..2]; answer[3] is the next to feed.
    step_back(plain.cache, 8 - 4)
    n = len(prompt) + 3
    assert session.lengths == [n] and session.cache.length.tolist() == [n] and session.cache.position.tolist() == [n]
    assert plain.cache.length.tolist() == [n]
    # float32 products of 5 rows may round apart from 1 row's (the GEMM kernel differs), by ~1e-6
    torch.testing.assert_close(session.cache.k[:, :, :, :n], plain.cache.k[:, :, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(session.cache.v[:, :, :, :n], plain.cache.v[:, :, :, :n], rtol=1e-5, atol=1e-5)
    assert session.state.tokens.tolist() == [answer[3]]
    assert [session.step().tokens[0] for _ in range(4)] == answer[4:8]  # decoding goes on as plainly


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """By hand: the top_k largest logits, divided by the temperature, softmaxed; the rest 0."""
    probs = torch.zeros_like(logits)
    for row in range(logits.shape[0]):
        best = sorted(range(logits.shape[1]), key=lambda t: -logits[row, t].item())[:top_k]
        weights = [math.exp(logits[row, t].item() / temperature) for t in best]
        for t, w in zip(best, weights):
            probs[row, t] = w / sum(weights)
    return probs


def chi_square(counts: dict, expected: dict) -> tuple[float, int]:
    cells = [c for c in expected if expected[c] >= 5]
    return sum((counts.get(c, 0) - expected[c]) ** 2 / expected[c] for c in cells), len(cells) - 1


CHI_SQUARE_999 = {3: 16.27, 5: 20.52, 7: 24.32, 8: 26.12, 11: 31.26, 15: 37.70}  # the 0.999 quantile, by degrees of freedom


def test_the_acceptance_rule_draws_each_token_from_the_targets_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.9, 0.0], [0.1, 1.0, 2.2, 0.4, -0.5, 1.1]])  # [j + 1, V], j = 1
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    p = filtered_probs(logits, 0.8, 4)
    trials = 6000
    for draft in (1, 3):  # a likely draft, and one the top-k filter removes (always rejected)
        pairs: dict[tuple[int, int | None], int] = {}
        for _ in range(trials):
            n_kept, token = accept(logits, [draft], sampling)
            pair = (draft, token) if n_kept else (token, None)
            pairs[pair] = pairs.get(pair, 0) + 1
        firsts = {}
        for (first, _), count in pairs.items():
            firsts[first] = firsts.get(first, 0) + count
        expected = {t: trials * p[0, t].item() for t in range(6) if p[0, t] > 0}
        stat, dof = chi_square(firsts, expected)
        assert stat < CHI_SQUARE_999[dof], (draft, firsts, expected)
        kept = sum(count for (first, second), count in pairs.items() if second is not None)
        seconds = {second: count for (_, second), count in pairs.items() if second is not None}
        if kept:  # after a kept draft, the next token follows the target's distribution there
            expected = {t: kept * p[1, t].item() for t in range(6) if p[1, t] > 0}
            stat, dof = chi_square(seconds, expected)
            assert stat < CHI_SQUARE_999[dof], (seconds, expected)
        assert (kept > 0) == (draft == 1)


def test_speculative_sampling_on_a_model_follows_its_distribution(tiny_checkpoint):
    """Two tokens after a prompt, sampled with drafts many times, against the joint distribution
    worked out by brute force from the model's logits."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompt, first = prompt_of(7, seed=5), 17
    temperature, top_k = 1.5, 3
    sampling = SamplingConfig(temperature=temperature, top_k=top_k)
    session = open_session(model, 1, 16, RunOptions(), eos_ids=frozenset(), sampling=sampling)

    def logits_after(tokens: list[int]) -> torch.Tensor:
        session.reset()
        session.prefill([tokens])
        return session.last_logits

    p2 = filtered_probs(logits_after(prompt + [first]), temperature, top_k)[0]
    joint = {}
    for second in p2.nonzero()[:, 0].tolist():
        p3 = filtered_probs(logits_after(prompt + [first, second]), temperature, top_k)[0]
        joint.update({(second, third): p2[second].item() * p3[third].item() for third in p3.nonzero()[:, 0].tolist()})
    likely = max(joint, key=joint.get)
    drafts = [likely[0], (likely[1] + 1) % 384]  # a likely token, then one that may be filtered out

    torch.manual_seed(0)
    trials, counts = 3000, {}
    for _ in range(trials):
        session.reset()
        session.prefill([prompt])
        session.state.tokens[0] = first
        n_kept, token = verify(Verifier(session), first, drafts, sampling)
        pair = (drafts[0], drafts[1] if n_kept == 2 else token) if n_kept else (token, session.step().tokens[0])
        counts[pair] = counts.get(pair, 0) + 1
    expected = {pair: trials * p for pair, p in joint.items()}
    stat, dof = chi_square(counts, expected)
    assert stat < CHI_SQUARE_999[dof], (counts, expected)


def test_speculation_refuses_what_it_does_not_run_with(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    speculation = RunOptions(speculation=Speculation())
    with pytest.raises(UserError, match="one prompt at a time"):
        generate_with(model, [prompt_of(5), prompt_of(6)], 8, eos_ids=frozenset(), options=speculation)
    with pytest.raises(UserError, match="repetition-penalty"):
        generate_with(model, [prompt_of(5)], 8, eos_ids=frozenset(), sampling=SamplingConfig(repetition_penalty=1.2), options=speculation)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--speculate", "lookup", "x"], "--speculate takes ngram or draft:DIR"),
        (["--speculate", "ngram", "--prompt-file", "p.txt"], "--speculate runs one prompt"),
        (["--speculate", "ngram", "--draft-tokens", "0", "x"], "--draft-tokens must be >= 1"),
    ],
)
def test_bad_speculate_options_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        generate.parse_args(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--kv-policy", "h2o"], "--speculate does not run with a KV policy"),
        (["--speculate", "draft:nowhere"], "no checkpoint there"),
    ],
)
def test_speculate_user_errors_exit_2_with_one_line(chat_checkpoint, capsys, flags, message):
    argv = ["--checkpoint", str(chat_checkpoint), "--speculate", "ngram", *flags, "--max-new-tokens", "4", "Hi"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_draft_folder_without_a_tokenizer_is_one_clear_error(chat_checkpoint, capsys, tmp_path):
    (tmp_path / "config.json").write_bytes((chat_checkpoint / "config.json").read_bytes())
    argv = ["--checkpoint", str(chat_checkpoint), "--speculate", f"draft:{tmp_path}", "--max-new-tokens", "4", "Hi"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json" in err and err.count("\n") == 1


def test_generate_py_speculating_prints_the_plain_answer(chat_checkpoint, capsys):
    base = ["--checkpoint", str(chat_checkpoint), "--temperature", "0", "--max-new-tokens", "30", "one two three one two three one two"]
    assert generate.main(base) == 0
    plain = capsys.readouterr().out
    for speculate in (["--speculate", "ngram"], ["--speculate", f"draft:{chat_checkpoint}"]):
        assert generate.main([*base, *speculate]) == 0
        out, err = capsys.readouterr()
        assert out == plain and "speculation:" in err


def test_a_compiled_speculative_run_says_it_compiles_until_step_and_verify_are_saved(chat_checkpoint, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    argv = ["--checkpoint", str(chat_checkpoint), "--temperature", "0", "--max-new-tokens", "30", "--compile", "one two three one two three one two"]
    assert generate.main([*argv, "--no-compile"]) == 0
    plain = capsys.readouterr().out
    assert generate.main(argv) == 0  # the plain step alone is saved
    assert capsys.readouterr().out == plain
    errs = []
    for _ in range(2):
        assert generate.main([*argv, "--speculate", "ngram"]) == 0
        out, err = capsys.readouterr()
        assert out == plain
        errs.append(err)
    assert cli.COMPILE_NOTICE in errs[0] and cli.COMPILE_NOTICE not in errs[1]  # the verify's package built once
