"""The HTTP side without a server: a request's fields as `parse_request` reads them (the
checkpoint's sampling defaults, the fields it refuses), a choice's text as stop strings cut it
(`ChoiceText`) and a log-probability entry's token text (`token_text`)."""

import json
import pathlib

import pytest
from tokenizers import Tokenizer, decoders, models

from models.serving.api import (
    TOKEN_CONTEXT,
    UNSERVED_DEFAULTS,
    ApiError,
    ChoiceText,
    Endpoint,
    parse_request,
    sampling_defaults,
    token_text,
)
from models.serving.text import TokenizerCodec, generation_config, text_codec

TEXT = pathlib.Path(__file__).parents[2] / "golden" / "text"
MODEL = "tiny"


def test_stop_strings_wait_for_min_tokens():
    """A stop string cuts the text where it begins; with min_tokens, none ends the text before
    it holds that many tokens, and one that began before the token reaching them is not
    matched later (vLLM checks only new text), so the second occurrence cuts it; a longer stop
    string beside it, never met, changes nothing."""
    codec = text_codec(TEXT, 256)
    ids = codec.encode("the market opened the market closed")
    full = codec.decode(ids)

    def streamed(min_tokens: int, stops: tuple[str, ...] = ("market",)) -> str:
        text = ChoiceText(codec, stops, min_tokens)
        return "".join(text.push([token]) for token in ids) + text.finish()

    assert streamed(0) == full[: full.index("market")]
    assert streamed(6) == full[: full.rindex("market")]
    assert streamed(6, ("market", "a stop string never met")) == full[: full.rindex("market")]


def _away_from(neutral: tuple) -> object:
    """A value of a refused field's type that none of its neutral values equals."""
    if not neutral:
        return "x"
    value = neutral[0]
    if isinstance(value, bool):
        return not value
    if isinstance(value, float):
        return value / 2
    return {"a": 1} if isinstance(value, dict) else [1]


def test_fields_that_change_the_answer_are_refused_unless_neutral():
    """Each field the server does not compute (vLLM's and SGLang's extensions, structured
    output) is a 400 naming it away from its neutral value, and read as absent at it; chat's
    max_completion_tokens wins over max_tokens, and top_logprobs needs logprobs."""
    codec = text_codec(TEXT, 256)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 0}

    def parse(body):
        return parse_request(
            body, Endpoint.CHAT, codec=codec, vocab_size=256, model_name=MODEL, adapters={}
        )

    for name, neutral in UNSERVED_DEFAULTS.items():
        with pytest.raises(ApiError) as refused:
            parse(chat | {name: _away_from(neutral)})
        assert refused.value.param == name
        for value in (None, *neutral):
            assert parse(chat | {name: value}) == parse(chat), (name, value)
    assert parse(chat | {"max_tokens": 9, "max_completion_tokens": 4}).max_tokens == 4
    assert parse(chat | {"max_tokens": 9}).max_tokens == 9
    with pytest.raises(ApiError, match="needs 'logprobs'"):
        parse(chat | {"top_logprobs": 2})
    assert parse(chat | {"top_logprobs": 2, "logprobs": True}).logprobs == 2


def test_generation_config_sampling_defaults_fill_what_a_request_leaves_out(tmp_path):
    """A checkpoint's generation_config.json temperature / top_k / top_p / min_p /
    repetition_penalty are what a request without those fields samples with (SGLang's and
    vLLM's default); a field the request sends wins; other keys and a preset give none; a
    value no request could send fails when read."""
    codec = text_codec(TEXT, 256)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 0}
    written = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.1, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(written | {"max_length": 9}))
    defaults = sampling_defaults(generation_config(tmp_path))
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.1}
    assert sampling_defaults(generation_config(TEXT)) == {} == generation_config(None)

    def sampled(body, given=defaults):
        spec = parse_request(
            body,
            Endpoint.CHAT,
            codec=codec,
            vocab_size=256,
            model_name=MODEL,
            adapters={},
            defaults=given,
        )
        s = spec.sampling
        return s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty

    assert sampled(chat) == (0.6, 20, 0.95, 0.1, 1.0)
    assert sampled(chat | {"temperature": 0, "top_k": None}) == (0.0, 20, 0.95, 0.1, 1.0)
    assert sampled(chat | {"top_p": 0.5, "repetition_penalty": 1.2})[2:] == (0.5, 0.1, 1.2)
    assert sampled(chat, {}) == (1.0, 0, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults({"top_p": 0})
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults({"temperature": "warm"})


def test_a_log_probability_token_is_the_text_it_adds(tmp_path):
    """Under a Metaspace decoder (Llama 2, Mistral) a token decoded alone loses its leading
    space; a log-probability entry's token is the text it adds after the ids before it, so the
    tokens join to the text."""
    tokens = ["<unk>", "▁Hello", "▁the", "▁do", "g", "▁cat"]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [], unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TokenizerCodec.from_directory(tmp_path)
    ids = [1, 2, 3, 4, 2, 5]
    words = [token_text(codec, ids[max(i - TOKEN_CONTEXT, 0) : i], t) for i, t in enumerate(ids)]
    assert words == ["Hello", " the", " do", "g", " the", " cat"]
    assert "".join(words) == codec.decode(ids) and codec.decode([2]) == "the"
