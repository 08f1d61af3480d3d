"""Golden fixture for text in and text out: a tiny Llama checkpoint WITH a tokenizer.

Writes ``tests/golden/text/``:

* ``tokenizer.json``: a BPE tokenizer trained here with ``tokenizers`` on the corpus below (256
  ids: 5 special tokens, the corpus's characters and merges), SentencePiece-style (``▁`` for a
  space, as Llama 2's and Mistral's ``tokenizer.json``), so that even a random model's tokens
  read as text; its post-processor puts ``<s>`` before every encoded text, as Llama's does.
* ``tokenizer_config.json``: the special tokens and a ChatML-style ``chat_template`` that uses
  ``bos_token``, ``trim_blocks`` / ``lstrip_blocks`` whitespace control, ``| trim`` and
  ``raise_exception``.
* ``config.json`` (``bos_token_id`` 0, ``eos_token_id`` 1), ``generation_config.json``
  (``eos_token_id`` [3, 1]: ``<|im_end|>`` and ``</s>``; transformers' ``generate`` stops on
  these, not on config.json's), ``model.safetensors`` (float32, random as ``make_golden.py``'s
  ``randomize_``).
* ``text_reference.json``: per case (a plain prompt that stops at an end-of-sequence token,
  one that runs to ``max_new_tokens``, and a chat prompt), the prompt, its ids as transformers'
  tokenizer makes them (``tokenizer(prompt)``, or ``apply_chat_template(...,
  add_generation_prompt=True)`` with the rendered text), transformers' greedy ``generate`` ids
  (stopping at the generation config's eos ids, eos included) and their text
  (``decode(..., skip_special_tokens=True)``), and the smallest top-1 / top-2 logit gap over the
  greedy steps.
* ``reference.npz``: ``logits``, float32 [6, 256], of the first prompt's ids run alone.

So that a greedy run meets an end-of-sequence token, ``<|im_end|>``'s LM-head row is set to a
multiple of the row of the token the first prompt would otherwise generate at step
``STOP_STEP``: it wins exactly where that token would.

Run (from the repository root; the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_text_golden.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

OUT = base.GOLDEN / "text"
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
BOS, EOS_CONFIG, EOS_CHAT = 0, 1, 3
VOCAB = 256
SEED = 1021
MAX_NEW_TOKENS = 12
STOP_STEP = 4
CORPUS = """\
The quick brown fox jumps over the lazy dog. A stitch in time saves nine.
All that glitters is not gold. Where there is smoke, there is fire!
Do you know the way to the market? It's down the road, isn't it?
Boundaries complete the sums a layer owes, move rows between layouts and read the residual.
Every morning the baker sells bread, and every evening the market closes its gates.
She reads the letter twice, then writes an answer in the garden under the old tree.
Is it raining in the city today? No, the sun is shining and the streets are dry.
"""
PROMPTS = {
    "stops": "The quick brown fox",
    "runs": "Where there is smoke,",
    "chat": "Is it gold?",
}
CHAT_TEMPLATE = r"""{{ bos_token }}{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('roles are system, user and assistant') }}
    {% endif %}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant' }}
{% endif %}
"""


def train_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE of VOCAB ids with `<s>` put before every encoded text."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False)
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "</s>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
        "chat_template": CHAT_TEMPLATE,
    }


def make_model(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        dtype="float32",
        bos_token_id=BOS,
        eos_token_id=EOS_CONFIG,
        pad_token_id=None,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    base.randomize_(model, seed)
    model = model.to(torch.float32).eval()
    generation = model.generation_config
    generation.bos_token_id = BOS
    generation.eos_token_id = [EOS_CHAT, EOS_CONFIG]
    generation.pad_token_id = None
    generation.do_sample = False
    return model


@torch.no_grad()
def greedy(model, ids: list[int], eos: list[int]) -> tuple[list[int], float]:
    """transformers' greedy `generate` of `ids` alone, stopping at `eos` ids: the new ids (the
    eos included where it stops) and the smallest top-1 / top-2 logit gap over its steps."""
    tensor = torch.tensor([ids])
    out = model.generate(
        input_ids=tensor,
        attention_mask=torch.ones_like(tensor),
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=eos,
        pad_token_id=EOS_CONFIG,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    gaps = []
    for step in out.logits:
        top2 = torch.topk(step[0].double(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return new, min(gaps)


def engineer_stop(model, first_prompt: list[int]) -> int:
    """Makes the first prompt's greedy run end with `<|im_end|>` at STOP_STEP: that token's
    LM-head row becomes 1.5x the row of the token the run would pick there. Returns that token."""
    free, _ = greedy(model, first_prompt, eos=[EOS_CONFIG])
    target = free[STOP_STEP]
    if target in free[:STOP_STEP] or target in (BOS, EOS_CONFIG, EOS_CHAT):
        raise AssertionError(f"step {STOP_STEP}'s token {target} repeats earlier ones: {free}")
    with torch.no_grad():
        model.lm_head.weight[EOS_CHAT] = 1.5 * model.lm_head.weight[target]
    return target


def reference_cases(model, tokenizer, trained: Tokenizer, eos: list[int]) -> dict:
    """Each prompt's ids, transformers' greedy ids and text, and its smallest logit gap."""
    cases = {}
    for name, prompt in PROMPTS.items():
        if name == "chat":
            messages = [{"role": "user", "content": prompt}]
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            rendered, ids = None, tokenizer(prompt)["input_ids"]
        assert ids == trained.encode(rendered or prompt, add_special_tokens=rendered is None).ids
        new, gap = greedy(model, ids, eos=eos)
        cases[name] = {
            "prompt": prompt,
            "rendered": rendered,
            "input_ids": ids,
            "generated_ids": new,
            "text": tokenizer.decode(new, skip_special_tokens=True),
            "stopped_at_eos": new[-1] in eos,
            "min_top2_gap": gap,
        }
    return cases


def choose_model(tokenizer, trained: Tokenizer) -> tuple[int, LlamaForCausalLM, int, dict]:
    """The first seed from SEED whose model, its stop engineered, stops the first prompt at
    STOP_STEP, runs the second to MAX_NEW_TOKENS and has every greedy gap >= PREFERRED_GAP."""
    stops = tokenizer(PROMPTS["stops"])["input_ids"]
    for seed in range(SEED, SEED + base.MAX_PROMPT_TRIES):
        model = make_model(seed)
        try:
            replaced = engineer_stop(model, stops)
        except AssertionError:
            continue
        cases = reference_cases(model, tokenizer, trained, [EOS_CHAT, EOS_CONFIG])
        good = (
            len(cases["stops"]["generated_ids"]) == STOP_STEP + 1
            and cases["stops"]["stopped_at_eos"]
            and not cases["runs"]["stopped_at_eos"]
            and min(case["min_top2_gap"] for case in cases.values()) >= base.PREFERRED_GAP
        )
        if good:
            return seed, model, replaced, cases
    raise AssertionError(f"no seed in [{SEED}, {SEED + base.MAX_PROMPT_TRIES}) fits")


def main() -> int:
    torch.set_num_threads(1)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    trained = train_tokenizer()
    trained.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(OUT)
    seed, model, replaced, chosen = choose_model(tokenizer, trained)
    model.save_pretrained(OUT)
    for file in OUT.iterdir():
        file.chmod(0o644)
    reloaded = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
    eos = reloaded.generation_config.eos_token_id
    assert eos == [EOS_CHAT, EOS_CONFIG], eos
    cases = reference_cases(reloaded, tokenizer, trained, eos)
    gapless = [{n: c | {"min_top2_gap": None} for n, c in run.items()} for run in (cases, chosen)]
    assert gapless[0] == gapless[1], (cases, chosen)
    reference = {
        "made_with": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "seed": seed,
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_token_ids": eos,
        "im_end_row_copies": replaced,
        "cases": cases,
    }
    (OUT / "text_reference.json").write_text(json.dumps(reference, indent=2) + "\n")
    logits = base.logits_alone(reloaded, cases["stops"]["input_ids"])
    base.save_npz_deterministic(OUT / "reference.npz", {"logits": logits})
    for name, case in cases.items():
        ids, gap = len(case["generated_ids"]), case["min_top2_gap"]
        print(f"{name}: {case['text']!r} ({ids} ids, smallest gap {gap:.3f})")
    size = sum(file.stat().st_size for file in OUT.iterdir())
    print(f"seed {seed}; wrote {OUT} ({size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
