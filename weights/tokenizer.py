"""The tokenizer of a checkpoint: `tokenizers` for the ids, jinja2 for the chat template.

Everything here is meant to give exactly what transformers gives for the same folder
(AutoTokenizer(text), apply_chat_template, decode(skip_special_tokens=True)), without importing it.
"""

from __future__ import annotations

import json
import reprlib
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import __version__ as _TOKENIZERS_VERSION

from errors import UserError

# Names a message's reasoning may come under; transformers copies it to "reasoning_content" and "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The special tokens transformers refuses to load unless they are text (or an AddedToken).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What to do about a damaged file of a checkpoint.
_FETCH_AGAIN = "download or copy it again (a folder imported from a GGUF file: delete it and import it again)"


class Tokenizer:
    def __init__(
        self,
        tokenizer: _HFTokenizer,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        # Token strings by name (bos_token, eos_token, ...): the chat template sees all of them.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.eos_ids = eos_ids
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UserError(
                f"no tokenizer.json in {path}: this engine reads only the fast-tokenizer format. "
                "Point it at a checkpoint folder that has tokenizer.json, or create one with "
                "transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
            )
        try:
            tok = _HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise _unreadable_tokenizer(tokenizer_file, e) from e
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file)
        _check_special_tokens(config, config_file)
        _check_added_tokens(config, config_file)

        # Like transformers: a legacy special_tokens_map.json only counts without added_tokens_decoder.
        if "added_tokens_decoder" not in config:
            tokens_map = _read_json(path / "special_tokens_map.json")
            _check_special_tokens(tokens_map, path / "special_tokens_map.json")
            config.update(tokens_map)
        # Every "*_token" string (bos_token, eos_token, pad_token, model-specific ones like image_token)
        # is a template variable in transformers.
        special = {}
        for key, value in {**config, **(_dict_or_empty(config.get("extra_special_tokens")))}.items():
            if key.endswith("_token") and (content := _token_content(value)) is not None:
                special[key] = content

        template = _chat_template(config, config_file)
        if (path / "chat_template.jinja").is_file():
            template = _read_text(path / "chat_template.jinja")

        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos.update(_eos_ids(path / name))
        if not eos and "eos_token" in special and (eos_id := tok.token_to_id(special["eos_token"])) is not None:
            eos.add(eos_id)
        return cls(tok, template, special, frozenset(eos))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of a plain prompt, with the special tokens the tokenizer's post-processor adds (BOS...)
        unless add_special_tokens is False (text that continues a chat the template rendered)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids, special tokens left out (as transformers' decode(skip_special_tokens=True))."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The chat as text, rendered as transformers' apply_chat_template(tokenize=False) renders it.

        template_kwargs are extra template variables (e.g. enable_thinking=False for Qwen3, tools).
        """
        if self.chat_template is None:
            raise UserError("this checkpoint has no chat template: give a plain prompt instead of a chat")
        if not messages:
            raise UserError("cannot apply the chat template to an empty conversation: give at least one message")
        if self._compiled is None:
            self._compiled = _chat_environment().from_string(self.chat_template)
        variables = {"tools": None, "documents": None, **self.special_tokens, **_plain(template_kwargs)}
        try:
            return self._compiled.render(messages=_prepare_messages(messages), add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception() in the template, e.g. roles must alternate
            raise UserError(f"the chat template rejected the conversation: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        # The template writes the special tokens itself, so the post-processor must not add them again.
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self._tok.encode(text, add_special_tokens=False).ids


class StreamDecoder:
    """Turns a stream of token ids into text, one finished piece at a time.

    The usual prefix-window technique: decode only the tokens since the last emitted piece, plus the
    tokens of that piece as context (decoders like SentencePiece's strip a leading space at the start
    of a string, so text is only ever taken as the difference of two decodes from the same start).
    Text ending in U+FFFD is an incomplete UTF-8 character; it is held back until more bytes arrive.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []  # the context tokens, then the ones not yet emitted
        self._n_context = 0

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        context = self._tokenizer.decode(self._ids[: self._n_context])
        text = self._tokenizer.decode(self._ids)
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return ""
        # The new piece becomes the context of the next one.
        self._ids = self._ids[self._n_context :]
        self._n_context = len(self._ids)
        return text[len(context) :]

    def flush(self) -> str:
        """Emit whatever is held back (at the end of the stream), even an incomplete character."""
        context = self._tokenizer.decode(self._ids[: self._n_context])
        text = self._tokenizer.decode(self._ids)
        self._ids, self._n_context = [], 0
        return text[len(context) :]


def _damaged(path: Path, problem: str) -> UserError:
    return UserError(f"{path.name} in {path.parent} is damaged ({problem}); {_FETCH_AGAIN}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _damaged(path, f"it is not UTF-8 text: {e}") from e


def _read_json(path: Path) -> dict:
    """The JSON object in the file; {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise _damaged(path, _json_problem(e)) from e
    if not isinstance(value, dict):
        raise _damaged(path, f"its top level is {reprlib.repr(value)}, not a JSON object")
    return value


def _json_problem(error: json.JSONDecodeError) -> str:
    # A file cut short fails at its very end, or in a string that never closes.
    if error.pos >= len(error.doc.rstrip()) or error.msg.startswith("Unterminated string"):
        return f"its JSON stops after {len(error.doc)} characters: cut off during a copy or download?"
    return f"not valid JSON: {error}"


def _unreadable_tokenizer(path: Path, error: Exception) -> UserError:
    """Why `tokenizers` refused tokenizer.json: broken JSON (most often cut short), or JSON of another shape."""
    try:
        json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        return _damaged(path, _json_problem(e))
    return UserError(
        f"{path.name} in {path.parent} is not a tokenizer that tokenizers {_TOKENIZERS_VERSION} can read ({error}); "
        f"{_FETCH_AGAIN} (or upgrade tokenizers, if the checkpoint is newer than it)"
    )


def _check_special_tokens(config: dict, path: Path) -> None:
    """Refuse a special token that is neither text nor a token dict with a "content" string, as transformers
    does. Other "*_token" keys are not always tokens (add_bos_token is a flag), so only these are checked."""
    extra = config.get("extra_special_tokens")
    if extra is not None and not isinstance(extra, (list, dict)):
        raise _damaged(path, f"extra_special_tokens is {reprlib.repr(extra)}, neither a list nor a mapping of tokens")
    named = {**{key: config.get(key) for key in _SPECIAL_TOKENS}, **_dict_or_empty(extra)}
    for key, value in named.items():
        if value is not None and _token_content(value) is None:
            raise _damaged(path, f"{key} is {reprlib.repr(value)}, neither a token string nor a token with a \"content\" string")


def _check_added_tokens(config: dict, path: Path) -> None:
    # Only its presence matters here (tokenizer.json holds the added tokens), but transformers refuses a malformed one.
    added = config.get("added_tokens_decoder", {})
    if not isinstance(added, dict) or not all(isinstance(token, dict) for token in added.values()):
        raise _damaged(path, "added_tokens_decoder is not a mapping from token ids to tokens")


def _chat_template(config: dict, path: Path) -> str | None:
    """The chat template: text, or the one named "default" among several (a list of {name, template}, or a dict)."""
    template = config.get("chat_template")
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) and "template" in t for t in template):
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):  # transformers uses "default"
        template = template.get("default")
    if template is not None and not isinstance(template, str):
        raise _damaged(path, f"chat_template is {reprlib.repr(template)}, neither text nor a list of named templates")
    return template


def _eos_ids(path: Path) -> list[int]:
    """The eos_token_id of a config file: one id, a list of ids, or none."""
    value = _read_json(path).get("eos_token_id")
    ids = [value] if isinstance(value, int) else value or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _damaged(path, f"eos_token_id is {reprlib.repr(value)}, neither a token id nor a list of ids")
    return ids


def _dict_or_empty(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _plain(value: Any) -> Any:
    """A copy made of plain JSON-like types only, which is all transformers lets a template see."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy floats...) become the base type, shedding their methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list[dict]) -> list[dict]:
    """As transformers does: drop keys whose value is None, and alias the reasoning fields."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise UserError(f"a chat message must be a dict with 'role' and 'content', got {message!r}")
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")


class _Dict:
    """dict() for templates, without the type's other attributes (as in transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Unlike jinja's own tojson: no HTML escaping, and non-ASCII kept as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The jinja environment of transformers' apply_chat_template (utils/chat_template_utils.py)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env
