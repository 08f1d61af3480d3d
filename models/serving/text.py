"""Text in and text out: a checkpoint's Hugging Face tokenizer, chat template and
end-of-sequence ids, or UTF-8 bytes for a model without a tokenizer.

A checkpoint directory's `tokenizer.json` is read with Hugging Face `tokenizers`, which encodes
and decodes exactly as transformers' fast tokenizers do (its post-processor adds the special
tokens, e.g. `<s>`). A chat template (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`) is rendered with jinja2 in a sandbox, in the environment transformers
gives it (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII, `{% generation %}` blocks), and the rendered text is encoded
without adding special tokens again. Generation stops at `generation_config.json`'s
`eos_token_id` (else `config.json`'s).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from tokenizers import Tokenizer

from ..weights import CONFIG_FILE, read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
TEXT_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    SPECIAL_TOKENS_FILE,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
)
"""The files beside a checkpoint's weights that say how text maps to ids and when generation
stops (`train` keeps them in the checkpoint it writes)."""
_SAVE_PRETRAINED = "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
UNREAD_TOKENIZER_FILES = {
    "tokenizer.model": _SAVE_PRETRAINED,
    "spiece.model": _SAVE_PRETRAINED,
    "vocab.json": _SAVE_PRETRAINED,
    "merges.txt": _SAVE_PRETRAINED,
    "vocab.txt": _SAVE_PRETRAINED,
    "tiktoken.model": "convert_slow_tokenizer.TikTokenConverter(vocab_file=DIR/tiktoken.model, "
    "pattern=the model's split pattern, extra_special_tokens=its special tokens).converted()"
    ".save(DIR/tokenizer.json)",
}
"""Tokenizer files of other formats, each with how transformers writes a `tokenizer.json` from
it: a checkpoint holding one but no `tokenizer.json` has a tokenizer this reader cannot use
(rather than none). Kimi-Linear ships a tiktoken vocabulary (`tiktoken.model`) that its own
Python tokenizer reads."""
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
"""The special tokens a chat template sees by name, as in transformers."""


class TextCodec(Protocol):
    """How a model's text maps to token ids and back."""

    @property
    def description(self) -> str:
        """What the codec is, for a log line."""
        ...

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with the special tokens the tokenizer adds to any text."""
        ...

    def encode_chat(self, text: str) -> list[int]:
        """The ids of a one-message user conversation `text`, with the generation prompt."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens left out."""
        ...

    @property
    def byte_ids(self) -> frozenset[int]:
        """Ids decoded together with the ids of the same kind next to them (byte-fallback
        `<0xNN>` tokens: a run that is not UTF-8 becomes U+FFFD as a whole), so their text may
        change until another id follows."""
        ...


@dataclasses.dataclass(frozen=True)
class ByteCodec:
    """Text as its UTF-8 bytes, ids 0-255: how `train` reads text for a model without a
    tokenizer, so a checkpoint it wrote speaks bytes. Decoding skips ids past 255 and shows a
    byte sequence that is not UTF-8 as U+FFFD."""

    @property
    def description(self) -> str:
        return "UTF-8 bytes (no tokenizer.json)"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, text: str) -> list[int]:
        raise ValueError("a chat needs the checkpoint's chat template; this model has no tokenizer")

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @property
    def byte_ids(self) -> frozenset[int]:
        return frozenset()  # a complete character's bytes decode the same whatever follows


class TokenizerCodec:
    """A checkpoint's Hugging Face tokenizer and chat template.

    Attributes:
      directory: The checkpoint directory it was read from.
      chat_template: The chat template's jinja source, or None.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        directory: Path,
        chat_template: str | None = None,
        template_tokens: Mapping[str, str] | None = None,
    ):
        self._tokenizer = tokenizer
        self.directory = directory
        self.chat_template = chat_template
        self._template_tokens = dict(template_tokens or {})
        self._template = None if chat_template is None else _compile(chat_template, directory)
        self._byte_ids = _byte_fallback_ids(tokenizer)

    @classmethod
    def from_directory(cls, directory: str | Path) -> TokenizerCodec:
        """Reads `tokenizer.json`, and `tokenizer_config.json` (the special tokens, the chat
        template) and `chat_template.jinja` where present.

        Raises:
          FileNotFoundError: No `tokenizer.json`.
          ValueError: A file is malformed, or the chat template does not compile (the message
            names the file).
        """
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{path} is not a tokenizers file: {error}") from None
        config = _json_object(directory / TOKENIZER_CONFIG_FILE)
        special = _json_object(directory / SPECIAL_TOKENS_FILE)
        tokens = {}
        for name in TEMPLATE_TOKENS:
            token = config.get(name, special.get(name))
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                tokens[name] = token
        return cls(
            tokenizer,
            directory=directory,
            chat_template=_chat_template(directory, config),
            template_tokens=tokens,
        )

    @property
    def description(self) -> str:
        chat = "with" if self.chat_template is not None else "without"
        return f"{self.directory / TOKENIZER_FILE} ({chat} a chat template)"

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text of `messages` (dicts with `role` and `content`).

        Raises:
          ValueError: The checkpoint has no chat template, or the template raised (e.g. a role
            it does not take).
        """
        if self._template is None:
            raise ValueError(
                f"{self.directory} has no chat template ({CHAT_TEMPLATE_FILE}, or chat_template "
                f"in {TOKENIZER_CONFIG_FILE})"
            )
        try:
            return self._template.render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._template_tokens,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template of {self.directory}: {error}") from None

    def encode_chat(self, text: str) -> list[int]:
        return self.encode_messages([{"role": "user", "content": text}])

    def encode_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of a conversation through the chat template, with the generation prompt
        (`render_chat`'s text, encoded without adding special tokens again).

        Raises:
          ValueError: As `render_chat`.
        """
        rendered = self.render_chat(messages)
        return self._tokenizer.encode(rendered, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def byte_ids(self) -> frozenset[int]:
        return self._byte_ids


def _byte_fallback_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the `<0xNN>` tokens of a tokenizer whose decoder joins their runs
    (`ByteFallback`, as SentencePiece-converted ones do), else none."""
    decoder = json.loads(tokenizer.to_str()).get("decoder")
    if "ByteFallback" not in json.dumps(decoder):
        return frozenset()
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    return frozenset(i for token, i in vocab.items() if re.fullmatch(r"<0x[0-9A-F]{2}>", token))


def text_codec(checkpoint: str | Path | None, vocab_size: int) -> TextCodec:
    """How the model of `checkpoint` (None: a preset) reads and writes text: its
    `tokenizer.json`, else UTF-8 bytes for a checkpoint without any tokenizer file (as `train`
    writes from a preset) or a preset.

    Raises:
      ValueError: The checkpoint has a tokenizer in another format only (e.g. a SentencePiece
        `tokenizer.model` or a tiktoken `tiktoken.model`), or bytes do not fit the vocabulary.
    """
    if checkpoint is not None:
        directory = Path(checkpoint)
        if (directory / TOKENIZER_FILE).is_file():
            return TokenizerCodec.from_directory(directory)
        others = [name for name in UNREAD_TOKENIZER_FILES if (directory / name).is_file()]
        if others:
            raise ValueError(
                f"{directory} has a tokenizer in {others} but no {TOKENIZER_FILE}; write one with "
                f"transformers: {UNREAD_TOKENIZER_FILES[others[0]]}"
            )
    if vocab_size < 256:
        raise ValueError(
            f"text as UTF-8 bytes needs a vocabulary of at least 256 ids; the model has "
            f"{vocab_size} (and no {TOKENIZER_FILE})"
        )
    return ByteCodec()


def eos_token_ids(checkpoint: str | Path | None) -> tuple[int, ...]:
    """The ids that end a generation: `generation_config.json`'s `eos_token_id` (an id or a
    list), else `config.json`'s; none for a preset or a checkpoint that names none.

    Raises:
      ValueError: A file is malformed or its `eos_token_id` is not an id or a list of ids.
    """
    if checkpoint is None:
        return ()
    directory = Path(checkpoint)
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        eos = _json_object(directory / name).get("eos_token_id")
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{directory / name}: eos_token_id must be an id or ids; got {eos!r}")
        return tuple(ids)
    return ()


class TextStream:
    """The text of a growing sequence of ids, handed out as it becomes final: `push` returns
    the text not yet returned, holding back a tail that decodes to U+FFFD (the first bytes of
    a character whose other bytes are still to come) and the text of a trailing run of
    byte-fallback ids (`TextCodec.byte_ids`: the run decodes as a whole). Where the decoded text
    no longer extends what was returned, what was returned stands and the text goes on from its
    length."""

    def __init__(self, codec: TextCodec):
        self._codec = codec
        self._ids: list[int] = []
        self._shown = 0

    @property
    def pushed(self) -> int:
        """How many ids were pushed so far."""
        return len(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """Adds `ids`; returns the new text that is final."""
        self._ids.extend(ids)
        if self._ids and self._ids[-1] in self._codec.byte_ids:
            return ""
        text = self._codec.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def finish(self) -> str:
        """The text not returned yet, held-back tail included."""
        return self._take(self._codec.decode(self._ids))

    def _take(self, text: str) -> str:
        new = text[self._shown :]
        self._shown += len(new)
        return new


def generation_config(checkpoint: str | Path | None) -> dict[str, Any]:
    """The checkpoint's `generation_config.json` as a dict ({} for a preset or without one).

    Raises:
      ValueError: The file is not a JSON object.
    """
    return {} if checkpoint is None else _json_object(Path(checkpoint) / GENERATION_CONFIG_FILE)


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON file's object, or {} without the file."""
    if not path.is_file():
        return {}
    value = read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(value).__name__}")
    return value


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a
    list of named templates: the one named "default")."""
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {
            item.get("name"): item.get("template") for item in template if isinstance(item, dict)
        }
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"{directory / TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list of "
            f"named templates with a 'default'; got {type(template).__name__}"
        )
    return template


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block, which marks the assistant's
    text for training masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _compile(source: str, directory: Path) -> jinja2.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"the chat template of {directory} does not compile: {error}") from None
