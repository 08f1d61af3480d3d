"""The decoder families, found by a `config.json`'s `architectures`.

Each file of `models.families` registers its family class here (`register`, as a class
decorator) and its named configurations (`add_presets`). The first lookup imports the
`models.families` package (plugin discovery, as sglang-jax's model registry does), whose
modules register themselves; this module holds only the table and the protocol a family meets,
and imports no family module by name.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .multimodal import ANY_TEXT_MODEL, TIES_FROM_TEXT, language_model_config

if TYPE_CHECKING:  # the config types import this table to check themselves
    from .tensors import HFTensor
    from .types import DecoderConfig

FAMILIES_PACKAGE = "models.families"
"""The package whose modules each register one family."""


class Family(Protocol):
    """What a registered family class answers about its Hugging Face form (the decoder classes
    of `models.families`, built on `models.decoder.CausalLM`).

    Attributes:
      architectures: The `config.json` `architectures` names it builds.
      model_type: Its `config.json` `model_type`.
      image_text_architectures: The image-text architectures whose language model it is
        (`models.config.multimodal`): their checkpoints load as this family's model.
      config_defaults: transformers' defaults of the keys a sparse `config.json` leaves out.
      image_text_defaults: Per image-text architecture, the defaults of its text config class
        where they differ from `config_defaults`.
      text_tie_architectures: Its image-text architectures that tie the head where their
        `text_config` says so under a top-level false.
      config_aliases: Pairs of names transformers reads one key under (its `attribute_map`).
      ties_head: transformers ties its LM head to the embeddings where `tie_word_embeddings`
        says so (False: its model reads `lm_head.weight` whatever the key says).
    """

    architectures: ClassVar[tuple[str, ...]]
    model_type: ClassVar[str]
    image_text_architectures: ClassVar[tuple[str, ...]]
    config_defaults: ClassVar[Mapping[str, Any]]
    image_text_defaults: ClassVar[Mapping[str, Mapping[str, Any]]]
    text_tie_architectures: ClassVar[tuple[str, ...]]
    config_aliases: ClassVar[Mapping[str, str]]
    ties_head: ClassVar[bool]

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """Raises unless `config` is one this family builds."""

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        """The `DecoderConfig` of a `config.json` (as a dict) of this family."""

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        """The `config.json` (as a dict) of `config`, in transformers 5's keys."""

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        """`{parameter path: HFTensor}` of every parameter of a model of `config`."""

    @classmethod
    def unread_tensors(
        cls, config: DecoderConfig, names: Iterable[str]
    ) -> tuple[tuple[str, ...], str | None]:
        """The checkpoint tensors among `names` the causal LM never reads (e.g. multi-token
        prediction layers), and a one-line notice saying so (None for none)."""


_BY_ARCHITECTURE: dict[str, type[Family]] = {}
_BY_IMAGE_TEXT: dict[str, type[Family]] = {}
_BY_MODEL_TYPE: dict[str, type[Family]] = {}
_PRESETS: dict[str, DecoderConfig] = {}


def load_families() -> None:
    """Imports the families package once, so every family is registered (a no-op while it is
    being imported: its modules register as they load)."""
    importlib.import_module(FAMILIES_PACKAGE)


class _Presets(Mapping):
    """The registered presets, read-only; reading them registers every family first."""

    def __getitem__(self, name: str) -> DecoderConfig:
        load_families()
        if name not in _PRESETS:
            raise KeyError(f"no preset {name!r}; the presets are {sorted(_PRESETS)}")
        return _PRESETS[name]

    def __iter__(self) -> Iterator[str]:
        load_families()
        return iter(sorted(_PRESETS))

    def __len__(self) -> int:
        load_families()
        return len(_PRESETS)


PRESETS: Mapping[str, DecoderConfig] = _Presets()
"""Named configurations for demos and tests (each family's, `add_presets`); none needs a
checkpoint. Every vocabulary holds at least the 256 byte values, so any preset trains on
byte-level text."""


def register[F: type[Family]](family: F) -> F:
    """Registers a family class under each of its `architectures` (and its
    `image_text_architectures`); every `DecoderConfig` of those architectures is then checked
    by its `check_config`.

    Raises:
      ValueError: Another class already builds one of its architectures.
    """
    if not family.architectures:
        raise ValueError(f"{family.__name__} names no architectures to build")
    for table, names in (
        (_BY_ARCHITECTURE, family.architectures),
        (_BY_IMAGE_TEXT, family.image_text_architectures),
    ):
        for architecture in names:
            held = table.get(architecture)
            if held is not None and held is not family:
                raise ValueError(f"{architecture} is built by {held.__name__} already")
            table[architecture] = family
    _BY_MODEL_TYPE.setdefault(family.model_type, family)
    return family


def image_text_family(hf_config: Mapping[str, Any]) -> type[Family] | None:
    """The family whose model is the language model of an image-text `config.json` (as a
    dict): the one its `text_config`'s `model_type` names where one does (always so for a
    wrapper of any text model, `multimodal.ANY_TEXT_MODEL`), else the one naming its
    architecture in `image_text_architectures`. None for any other config.

    Raises:
      ValueError: A wrapper of any text model whose `text_config` names a model no family
        builds.
    """
    names = hf_config.get("architectures")
    if not isinstance(names, list) or len(names) != 1:
        return None
    load_families()
    text = hf_config.get("text_config")
    model_type = text.get("model_type") if isinstance(text, Mapping) else None
    if names[0] in ANY_TEXT_MODEL and model_type is not None and model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"{names[0]}'s language model is a {model_type!r} model (its text_config's "
            f"model_type), which no family builds; the families build {sorted(_BY_MODEL_TYPE)}"
        )
    default = _BY_IMAGE_TEXT.get(names[0])
    if default is None and names[0] not in ANY_TEXT_MODEL:
        return None
    return _BY_MODEL_TYPE.get(model_type, default)


def as_text_model(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A `config.json` (as a dict) as its text family reads it: an image-text model's
    language model's (`multimodal.language_model_config`), any other as it is."""
    family = image_text_family(hf_config)
    if family is None:
        return hf_config
    outer = hf_config["architectures"][0]
    ties = outer in TIES_FROM_TEXT or outer in family.text_tie_architectures
    return language_model_config(hf_config, family.architectures[0], ties_from_text=ties)


def add_presets(presets: Mapping[str, DecoderConfig]) -> None:
    """Adds named configurations to `PRESETS`.

    Raises:
      ValueError: A name is taken.
    """
    taken = sorted(presets.keys() & _PRESETS.keys())
    if taken:
        raise ValueError(f"presets {taken} are named already")
    _PRESETS.update(presets)


def architectures() -> tuple[str, ...]:
    """Every architecture a registered family builds, sorted."""
    load_families()
    return tuple(sorted(_BY_ARCHITECTURE))


def family_named(architecture: str) -> type[Family]:
    """The family class that builds `architecture`.

    Raises:
      ValueError: No family builds it.
    """
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        load_families()
        family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise ValueError(
            f"no registered family builds {architecture!r}; the families build "
            f"{list(architectures())}"
        )
    return family


def family_of(config: DecoderConfig) -> type[Family]:
    """The family class that builds `config` (registered, since the config was checked)."""
    return family_named(config.architecture)


def family_for(hf_config: Mapping[str, Any]) -> type[Family]:
    """The family class of a `config.json` (as a dict), by its one `architectures` entry.

    Raises:
      ValueError: The file names no architecture (or several), or one no family builds.
    """
    names = hf_config.get("architectures")
    load_families()
    if not isinstance(names, list) or len(names) != 1 or names[0] not in _BY_ARCHITECTURE:
        raise ValueError(
            f"config.json must name exactly one architecture among {list(architectures())}; "
            f"got architectures={names!r}"
        )
    return _BY_ARCHITECTURE[names[0]]


def read_hf_config(hf_config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a Hugging Face `config.json` (as a dict) of a registered family, or of an
    image-text model whose language model is one (`as_text_model`), the family's
    `config_defaults` (transformers' defaults; an image-text model's text config class's, its
    `image_text_defaults`) standing in for the keys it leaves out under both names of its
    `config_aliases`.

    Raises:
      ValueError: The family is not registered, or its reader refuses the file (a key it does
        not compute, a missing key; the message names the key and the fix).
      NotImplementedError: An option its layers do not compute.
    """
    text = dict(as_text_model(hf_config))
    family = family_for(text)
    for one, other in family.config_aliases.items():
        for given, missing in ((one, other), (other, one)):
            if given in text and missing not in text:
                text[missing] = text[given]
    names = hf_config.get("architectures")
    outer = names[0] if isinstance(names, list) and len(names) == 1 else None
    defaults = dict(family.config_defaults) | dict(family.image_text_defaults.get(outer, {}))
    if "rope_scaling" in text:  # transformers builds rope_parameters from the legacy keys then
        defaults.pop("rope_parameters", None)
    merged = {**defaults, **text}
    try:
        config = family.read_config(merged)
    except KeyError as missing:
        raise ValueError(
            f"config.json has no {missing.args[0]!r}; {family.architectures[0]} needs it and "
            "transformers gives it no default"
        ) from None
    if not family.embedding_padding:
        return config
    return dataclasses.replace(
        config, padding_id=_padding_id(merged.get("pad_token_id"), config.vocab_size)
    )


def _padding_id(pad: Any, vocab_size: int) -> int | None:
    """`pad_token_id` as `nn.Embedding` takes it (a negative id counts from the end); None for
    none, or for an id past the vocabulary (no lookup reaches it)."""
    if not isinstance(pad, int) or isinstance(pad, bool) or not -vocab_size <= pad < vocab_size:
        return None
    return pad % vocab_size


def write_hf_config(config: DecoderConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` (as a dict) of `config`, in transformers 5's format;
    `read_hf_config` reads it back to `config`.

    Raises:
      ValueError: `config` has no Hugging Face form (its family's file cannot say it).
    """
    written = family_of(config).write_config(config) | {"pad_token_id": config.padding_id}
    if read_hf_config(written) != config:
        raise ValueError(
            f"{config.architecture}'s config.json cannot say this configuration (it would read "
            f"back as another): {config}"
        )
    return written


def hf_name_map(config: DecoderConfig, *, scan_layers: bool = False) -> dict[str, HFTensor]:
    """`{module path: HFTensor}` for every parameter of a decoder of `config`, built with or
    without `scan_layers` (its family's `tensor_names`)."""
    return family_of(config).tensor_names(config, scan_layers=scan_layers)
