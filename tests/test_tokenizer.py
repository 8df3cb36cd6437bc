"""weights/tokenizer.py against transformers' AutoTokenizer on a tiny, real byte-level BPE tokenizer."""

import json
from pathlib import Path

import jinja2
import pytest
from tiny_tokenizer import CHATML_BOS_TEMPLATE, CHATML_TEMPLATE, write_tiny_tokenizer
from transformers import AutoTokenizer

from errors import UserError
from weights.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "Hello, world!",
    "The answer is 42.",
    "def f(x):\n    return x * 2  # double\n\n\nprint(f(21))",
    "Numbers 1234567890 3.14159 -1e-5 and 2024-06-30",
    "Emoji 😀🎉👍🏽❤️ and a family 👨‍👩‍👧",
    "中文文本，日本語のテキスト，한국어",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\r\nwindows newlines\n\n\n",
    "mixed: café 😀 中 x",
    "literal special token in a prompt: <|im_end|> and <think>hmm</think>",
    "",
    " ",
    "\n",
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 2 + 2?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are a terse assistant. 🤖"},
        {"role": "user", "content": "Say hi in Chinese."},
        {"role": "assistant", "content": "你好"},
        {"role": "user", "content": "And in code?\n```py\nprint('hi')\n```"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 😀"},
    ],
}

# A template that leans on what transformers' environment adds or sets: trim_blocks/lstrip_blocks,
# loop controls, its tojson (no HTML escaping, ensure_ascii=False, indent), namespace, dict(),
# raise_exception, the special-token variables (model-specific ones too), tools/documents passed as
# None, {% generation %}, dropped None values, and the reasoning field aliases.
FEATURE_TEMPLATE = """\
{{ bos_token }}
{% set ns = namespace(turns=0, sys='') %}
{% if messages[0]['role'] == 'system' %}
    {% set ns.sys = messages[0]['content'] %}
{% endif %}
tools={{ tools is none }} documents={{ documents is none }} defined={{ tools is defined }}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
        {% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}|{{ message.thinking }}</think>{% endif %}
        {% generation %}{{ message['content'] | trim }}{% endgeneration %}
    {% else %}
{{ message['content'] if 'content' in message else '(no content)' }}
    {% endif %}
<|im_end|>
    {% if message.get('stop') %}{% break %}{% endif %}
{% endfor %}
meta={{ {'sys': ns.sys, 'turns': ns.turns, 'html': '<b>&</b>', 'uni': '中😀'} | tojson }}
{{ dict(a=1, b=[1, 2]) | tojson(indent=2) }}
{{ dict.fromkeys(['x']) | tojson }} pad={{ pad_token }} eos={{ eos_token }} img={{ image_token }}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{% endif %}
"""


def hf_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chatml")
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bos")
    write_tiny_tokenizer(d, CHATML_BOS_TEMPLATE, add_bos=True)
    return d


@pytest.fixture(scope="module")
def feature_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("feature")
    write_tiny_tokenizer(d, FEATURE_TEMPLATE, add_bos=True)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["image_token"] = "<|im_start|>"  # a model-specific *_token: transformers passes it to the template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_tiny_tokenizer_is_small_fast_and_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    n = write_tiny_tokenizer(a)
    assert write_tiny_tokenizer(b) == n
    assert 300 <= n <= 500
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert Tokenizer.from_dir(a).vocab_size == n == len(hf_tokenizer(a))


@pytest.mark.parametrize("variant", ["chatml_dir", "bos_dir"])
def test_encode_and_decode_match_transformers(variant, request):
    path = request.getfixturevalue(variant)
    ours, hf = Tokenizer.from_dir(path), hf_tokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    if variant == "bos_dir":
        assert ours.encode("hi")[0] == ours.token_to_id("<|begin_of_text|>")
    # Special tokens are skipped, non-special added tokens kept, any text round-trips.
    assert ours.decode(ours.encode("<|im_start|>a<think>b</think>😀<|im_end|>")) == "a<think>b</think>😀"
    assert ours.decode(ours.encode(TEXTS[4] + TEXTS[5])) == TEXTS[4] + TEXTS[5]


@pytest.mark.parametrize("variant", ["chatml_dir", "bos_dir"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(variant, name, add_generation_prompt, request):
    path = request.getfixturevalue(variant)
    ours, hf = Tokenizer.from_dir(path), hf_tokenizer(path)
    messages = CONVERSATIONS[name]
    text = ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    hf_ids = hf.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )
    assert ids == hf_ids
    assert text.count("<|im_start|>") == len(messages) + add_generation_prompt
    assert ids.count(ours.token_to_id("<|im_start|>")) == len(messages) + add_generation_prompt
    if variant == "bos_dir":  # the template writes BOS; the post-processor must not add a second one
        assert ids.count(ours.token_to_id("<|begin_of_text|>")) == 1


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_transformers_template_environment(feature_dir, add_generation_prompt):
    ours, hf = Tokenizer.from_dir(feature_dir), hf_tokenizer(feature_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  spaces  "},
        {"role": "assistant", "content": "  ok  ", "reasoning": "thought 中", "tool_calls": None},
        {"role": "user", "content": None},
        {"role": "user", "content": "stop here", "stop": True},
        {"role": "user", "content": "never rendered"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        text = ours.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert text == expected
        ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        assert ids == hf.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    # The oracle really went through those paths.
    assert "<think>thought 中|thought 中</think>" in text and "(no content)" in text
    assert "never rendered" not in text and '"html": "<b>&</b>", "uni": "中😀"' in text
    assert "img=<|im_start|>" in text and "tools=True documents=True defined=True" in text


def test_raise_exception_in_template_is_a_user_error(feature_dir):
    messages = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):
        hf_tokenizer(feature_dir).apply_chat_template(messages, tokenize=False)
    with pytest.raises(UserError, match="Unknown role: tool"):
        Tokenizer.from_dir(feature_dir).render_chat(messages)


def test_template_sources(chatml_dir, tmp_path):
    messages = CONVERSATIONS["system_multi_turn"]
    # chat_template.jinja alone (the transformers 5 layout)
    jinja_dir = tmp_path / "jinja"
    write_tiny_tokenizer(jinja_dir, CHATML_TEMPLATE, template_file=True)
    assert "chat_template" not in json.loads((jinja_dir / "tokenizer_config.json").read_text())
    # chat_template.jinja wins over tokenizer_config.json
    both_dir = tmp_path / "both"
    write_tiny_tokenizer(both_dir, "WRONG {{ messages }}")
    (both_dir / "chat_template.jinja").write_text("JINJA " + CHATML_TEMPLATE)
    # a list of named templates: "default" is used
    list_dir = tmp_path / "list"
    write_tiny_tokenizer(list_dir, None)
    config = json.loads((list_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS {{ messages }}"},
        {"name": "default", "template": "LIST " + CHATML_TEMPLATE},
    ]
    (list_dir / "tokenizer_config.json").write_text(json.dumps(config))

    for path, prefix in ((jinja_dir, "<|im_start|>"), (both_dir, "JINJA<|im_start|>"), (list_dir, "LIST<|im_start|>")):
        ours, hf = Tokenizer.from_dir(path), hf_tokenizer(path)
        assert ours.has_chat_template
        text = ours.render_chat(messages)
        assert text.startswith(prefix)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(messages) == hf.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=True
        )


def test_no_chat_template(tmp_path):
    write_tiny_tokenizer(tmp_path, None)
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(UserError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_eos_ids(tmp_path):
    write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    # Neither config has one: the tokenizer's eos_token.
    assert tok.eos_ids == frozenset({im_end})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_dir(tmp_path).eos_ids == frozenset({7})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    assert Tokenizer.from_dir(tmp_path).eos_ids == frozenset({im_end, eot})
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_dir(tmp_path).eos_ids == frozenset({im_end, eot, 5})
    (tmp_path / "generation_config.json").unlink()
    assert Tokenizer.from_dir(tmp_path).eos_ids == frozenset({5})
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 4], "bos_token_id": 1}))
    assert Tokenizer.from_dir(tmp_path).eos_ids == frozenset({3, 4})
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    assert Tokenizer.from_dir(tmp_path).eos_ids == frozenset({im_end})


def test_special_tokens_as_added_token_dicts(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.special_tokens["eos_token"] == "<|endoftext|>" == hf_tokenizer(tmp_path).eos_token
    assert tok.eos_ids == frozenset({tok.token_to_id("<|endoftext|>")})


def test_missing_tokenizer_json_is_a_user_error(tmp_path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="tokenizer.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


class _CountingTokenizer:
    """Wraps a Tokenizer and records the longest id list decode() is asked for."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.longest = tok, 0

    def decode(self, ids: list[int]) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids)


STREAM_TEXTS = [
    "Emoji 😀🎉👍🏽❤️ family 👨‍👩‍👧 done",
    "中文文本，日本語のテキスト，한국어 텍스트",
    "mixed: café 😀 中 x\n\tdef f(): return '🚀'",
    "😀😀😀中中中",
]


@pytest.mark.parametrize("variant", ["chatml_dir", "bos_dir"])
def test_stream_decoder(variant, request):
    tok = Tokenizer.from_dir(request.getfixturevalue(variant))
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        counting = _CountingTokenizer(tok)
        stream = StreamDecoder(counting)  # type: ignore[arg-type]
        pieces = [stream.push(i) for i in ids]
        tail = stream.flush()
        assert not any("\ufffd" in p for p in pieces), pieces
        assert "".join(pieces) + tail == tok.decode(ids) == text
        assert tail == ""
        # Some characters span several tokens here, so something must have been held back.
        assert "" in pieces[1:]
        # A small window, not the whole sequence, is decoded each time.
        assert counting.longest < 12 < len(ids)


def test_stream_decoder_with_special_tokens_and_an_unfinished_character(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    ids = tok.encode_chat(CONVERSATIONS["system_multi_turn"]) + tok.encode("答案是 42 😀")
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)
    # The stream stops in the middle of an emoji: flush() gives what decode() gives.
    partial = tok.encode("ok 😀")[:-1]
    assert tok.decode(partial).endswith("\ufffd")
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in partial]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == tok.decode(partial)
    assert stream.flush() == ""
