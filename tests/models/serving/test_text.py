"""Text in and text out against transformers: `generate --prompt` prints transformers' greedy
text and stops at the generation config's end-of-sequence ids, `--chat` applies the chat
template as transformers renders it, text streams to a terminal, `forward` takes text, and
`train` from a checkpoint keeps its tokenizer, token ids and generation config
(tests/golden/text, from scripts/make_text_golden.py)."""

import io
import json
import pathlib
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.cli.main import main
from models.serving.api import ChoiceText
from models.serving.text import (
    TEXT_FILES,
    ByteCodec,
    TextStream,
    TokenizerCodec,
    eos_token_ids,
    text_codec,
)

TEXT = pathlib.Path(__file__).parents[2] / "golden" / "text"
REFERENCE = json.loads((TEXT / "text_reference.json").read_text())
CASES = REFERENCE["cases"]
NEW = str(REFERENCE["max_new_tokens"])
# One program, and two pipeline stages (one layer each, a microbatch per prompt). By default
# the pipeline stages: one program's text runs in the chat and forward tests below, and its
# streamed tokens in tests/models/serving/test_runtime.py; one program here under -m slow.
MESHES = pytest.mark.parametrize(
    "mesh",
    [
        pytest.param([], id="one-program", marks=pytest.mark.slow),
        pytest.param(["--mesh", "pp=2"], id="pp2"),
    ],
)


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_tokenizer_and_chat_template_match_transformers():
    """The codec encodes each prompt (the chat one through the template) to transformers' ids,
    renders the template to transformers' text, decodes transformers' generated ids to its text,
    and stops at generation_config.json's eos ids (not config.json's)."""
    codec = text_codec(TEXT, 256)
    assert isinstance(codec, TokenizerCodec)
    chat = CASES["chat"]
    assert codec.render_chat([{"role": "user", "content": chat["prompt"]}]) == chat["rendered"]
    for name, case in CASES.items():
        encode = codec.encode_chat if name == "chat" else codec.encode
        assert encode(case["prompt"]) == case["input_ids"], name
        assert codec.decode(case["generated_ids"]) == case["text"], name
    assert eos_token_ids(TEXT) == (3, 1) == tuple(REFERENCE["eos_token_ids"])
    with pytest.raises(ValueError, match="roles are system, user and assistant"):
        codec.render_chat([{"role": "tool", "content": "x"}])


@MESHES
def test_generate_prints_transformers_text_and_stops_at_eos(capsys, mesh):
    """generate --prompt (twice) gives each continuation, transformers' greedy ids and text: the
    first stops at <|im_end|> (generation_config.json's eos), the second runs to
    --max-new-tokens; in one program and in pipeline stages."""
    args = ["generate", "--checkpoint", str(TEXT), *mesh, "--max-new-tokens", NEW, "--json"]
    prompts = ["--prompt", CASES["stops"]["prompt"], "--prompt", CASES["runs"]["prompt"]]
    assert main([*args, *prompts]) == 0
    rows = json.loads(_last_line(capsys))
    for row, name in zip(rows, ("stops", "runs"), strict=True):
        case = CASES[name]
        assert (row["ids"], row["text"]) == (case["generated_ids"], case["text"]), name
        assert row["stopped_at_eos"] is case["stopped_at_eos"]
    assert len(rows[0]["ids"]) < int(NEW) == len(rows[1]["ids"])


def test_generate_chat_prints_the_reply_text(capsys):
    """generate --chat encodes the prompt through the chat template and prints transformers'
    reply text, one line per prompt."""
    case = CASES["chat"]
    args = ["generate", "--checkpoint", str(TEXT), "--max-new-tokens", NEW, "--chat"]
    assert main([*args, "--prompt", case["prompt"]]) == 0
    assert capsys.readouterr().out == case["text"] + "\n"


class _Terminal(io.StringIO):
    """A stdout that is a terminal and records each write."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def isatty(self):
        return True

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


@MESHES
def test_generate_streams_text_to_a_terminal(monkeypatch, tmp_path, mesh):
    """On a terminal, one prompt's text comes piece by piece as its tokens do (one decode step
    per program, or per pass through the pipeline stages), and reads as transformers' text; the
    prompt comes from --prompt-file."""
    case = CASES["runs"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"\n{case['prompt']}\n\n")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    args = ["generate", "--checkpoint", str(TEXT), *mesh, "--max-new-tokens", NEW]
    assert main([*args, "--prompt-file", str(prompts)]) == 0
    pieces = [piece for piece in terminal.writes if piece]
    assert len(pieces) >= len(case["generated_ids"]) - 2  # a piece per token, give or take
    assert "".join(pieces) == case["text"] + "\n"


def test_text_stream_holds_back_a_partial_character():
    """A byte-level stream shows a character only once all its bytes have come."""
    stream = TextStream(ByteCodec())
    assert [stream.push([b]) for b in "aé€".encode()] == ["a", "", "é", "", "", "€"]
    stream.push([0xE2])
    assert stream.finish() == "\ufffd"


def test_a_byte_level_tokenizer_streams_whole_characters(tmp_path):
    """With a byte-level BPE (as Llama 3's and Qwen's), a character split over tokens is shown
    once complete, and the pieces join to the whole decoded text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(["plain words here"], trainer=trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TokenizerCodec.from_directory(tmp_path)
    text = "naïve 日本"
    ids = codec.encode(text)
    stream = TextStream(codec)
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) + stream.finish() == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert len(ids) > len(text)  # the CJK characters took several byte tokens each


def test_a_byte_fallback_run_streams_as_it_decodes_as_a_whole(tmp_path):
    """With byte fallback (as Llama 2's and Mistral's), a run of <0xNN> tokens that is not UTF-8
    decodes to U+FFFD as a whole, so a newline byte shown before the run went on would differ
    from the whole text: the stream holds a run's text until another token closes it, and the
    pieces join to the whole decoded text (a stop string after the run still ends it)."""
    tokens = ["<unk>", "Hell", "o", "<0x0A>", "<0xE4>", "▁the▁", "do", "g"]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TokenizerCodec.from_directory(tmp_path)
    ids = list(range(1, len(tokens)))
    whole = codec.decode(ids)
    assert whole == "Hello\ufffd\ufffd the dog" and codec.decode(ids[:3]) == "Hello\n"
    stream = TextStream(codec)
    pieces = [stream.push([i]) for i in ids]
    assert pieces[2:4] == ["", ""] and "".join(pieces) + stream.finish() == whole
    text = ChoiceText(codec, ["dog"])
    assert "".join(text.push([i]) for i in ids) + text.finish() == "Hello\ufffd\ufffd the "


def test_a_template_marking_the_assistant_for_training_renders_its_text(tmp_path):
    """transformers' `{% generation %}` block (a training mask's marker) renders as its body,
    as `apply_chat_template` renders it."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    turn = "{{ m.role }}: {{ m.content }};"
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        + turn
        + "{% endgeneration %}{% else %}"
        + turn
        + "{% endif %}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    codec = TokenizerCodec.from_directory(tmp_path)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert codec.render_chat(messages) == "user: hi;assistant: yo;"


@pytest.mark.parametrize(
    ("name", "advice"),
    [
        ("tokenizer.model", r"AutoTokenizer\.from_pretrained"),
        ("tiktoken.model", r"TikTokenConverter\(vocab_file="),
    ],
)
def test_a_tokenizer_in_another_format_is_refused_not_read_as_bytes(tmp_path, name, advice):
    """A checkpoint whose tokenizer is a SentencePiece or tiktoken file and no tokenizer.json
    (Kimi-Linear ships `tiktoken.model`) is refused with how to write one, though its
    vocabulary could hold UTF-8 bytes; without any tokenizer file the same model reads bytes."""
    assert isinstance(text_codec(tmp_path, vocab_size=163840), ByteCodec)
    (tmp_path / name).write_bytes(b"aGVsbG8= 0\n")
    with pytest.raises(ValueError, match=f"{name}.* but no tokenizer.json; .*{advice}"):
        text_codec(tmp_path, vocab_size=163840)


def test_forward_takes_text_as_generate_does(tmp_path):
    """forward --prompt writes transformers' logits of the encoded prompt."""
    case = CASES["stops"]
    out = tmp_path / "logits.npy"
    assert (
        main(["forward", "--checkpoint", str(TEXT), "--prompt", case["prompt"], "--out", str(out)])
        == 0
    )
    want = np.load(TEXT / "reference.npz")["logits"]
    got = np.load(out)[0]
    assert got.shape == want.shape == (len(case["input_ids"]), 256)
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


def test_train_from_a_checkpoint_keeps_its_text_files(tmp_path):
    """train --checkpoint writes --out with the source's tokenizer files and generation config
    byte for byte and its config.json (bos / eos ids included) but for the dtype, so text and
    end-of-sequence ids read from it as from the source."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    out = tmp_path / "trained"
    args = ["train", "--checkpoint", str(TEXT), "--text", str(text), "--steps", "1"]
    assert main([*args, "--batch-tokens", "32", "--seq-len", "16", "--out", str(out)]) == 0
    for name in TEXT_FILES:
        source = TEXT / name
        assert (out / name).is_file() == source.is_file(), name
        if source.is_file():
            assert (out / name).read_bytes() == source.read_bytes(), name
    written = json.loads((out / "config.json").read_text())
    source = json.loads((TEXT / "config.json").read_text())
    assert written == source | {"dtype": "float32"}
    assert (written["bos_token_id"], written["eos_token_id"]) == (0, 1)
    assert eos_token_ids(out) == (3, 1)
    assert isinstance(text_codec(out, 256), TokenizerCodec)
