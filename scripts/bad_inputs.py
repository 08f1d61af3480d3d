"""Every bad input we tried on the command line, run for real: writes docs/bad-inputs.md.

Each case runs `python -m models.cli ...` in a fresh process on the CPU (8 simulated devices
at most) and records its exit code and the last line of its stderr; a case passes when the
exit code is the one expected, stderr holds no traceback and its last line names the problem
(matches the case's pattern). Interrupts are sent once the run reaches a given log line.

Run from the repository root (a few minutes on two cores)::

    /work/main/.venv/bin/python scripts/bad_inputs.py             # all, writes the table
    /work/main/.venv/bin/python scripts/bad_inputs.py --only mesh  # cases whose name has "mesh"

`tests/models/cli/test_bad_inputs.py` runs some of these cases in-process (`CASES`,
`make_fixtures`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
DOC = ROOT / "docs" / "bad-inputs.md"
EXIT_BAD_INPUT = 2


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
      name: What is wrong, in words.
      kind: files, options, meshes, paths, memory or interrupts.
      args: The command's arguments, space-separated; `{tmp}` (the fixtures directory),
        `{qwen3}` and `{text}` (golden checkpoints) stand for paths.
      pattern: A regular expression the last stderr line must match.
      code: The exit code expected.
      interrupt: (signal, stderr line to wait for before sending it), or None.
      reader_gone: stdout goes to `true`, which exits without reading it (the command's
        first write then fails: a broken pipe, whatever the timing).
      early: The command refuses it before building or loading any model.
    """

    name: str
    kind: str
    args: str
    pattern: str
    code: int = EXIT_BAD_INPUT
    interrupt: tuple[int, str] | None = None
    reader_gone: bool = False
    early: bool = True


def make_fixtures(tmp: Path) -> Path:
    """Broken checkpoints, files and directories under `tmp`; returns `tmp`."""
    text = GOLDEN / "text"
    qwen3 = GOLDEN / "qwen3"

    def checkpoint(name: str, source: Path = qwen3) -> Path:
        directory = tmp / name
        shutil.copytree(source, directory)
        return directory

    (tmp / "empty_dir").mkdir()
    checkpoint("bad_json_config").joinpath("config.json").write_text('{"architectures": [')
    gpt2 = checkpoint("gpt2")
    gpt2.joinpath("config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    config = json.loads((qwen3 / "config.json").read_text())
    no_hidden = checkpoint("no_hidden")
    no_hidden.joinpath("config.json").write_text(json.dumps(config | {"hidden_size": None}))
    wrong_shape = checkpoint("wrong_shape")
    wrong_shape.joinpath("config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    weights = (qwen3 / "model.safetensors").read_bytes()
    checkpoint("truncated").joinpath("model.safetensors").write_bytes(weights[: len(weights) // 2])
    checkpoint("garbage").joinpath("model.safetensors").write_bytes(b"not safetensors" * 100)
    checkpoint("no_weights").joinpath("model.safetensors").unlink()
    checkpoint("bad_index", GOLDEN / "llama").joinpath("model.safetensors.index.json").write_text(
        "{weight_map: }"
    )
    checkpoint("missing_shard", GOLDEN / "llama").joinpath(
        "model-00002-of-00003.safetensors"
    ).unlink()
    checkpoint("bad_tokenizer", text).joinpath("tokenizer.json").write_text('{"model": 3}')
    checkpoint("bad_tokenizer_config", text).joinpath("tokenizer_config.json").write_text("{,}")
    checkpoint("bad_generation_config", text).joinpath("generation_config.json").write_text("[")
    template = json.loads((text / "tokenizer_config.json").read_text())
    checkpoint("bad_template", text).joinpath("tokenizer_config.json").write_text(
        json.dumps(template | {"chat_template": "{% for m in messages %}{{ m.content }"})
    )
    sentencepiece = checkpoint("sentencepiece", text)
    sentencepiece.joinpath("tokenizer.json").unlink()
    sentencepiece.joinpath("tokenizer.model").write_bytes(b"\x00")
    tiktoken = checkpoint("tiktoken", text)
    tiktoken.joinpath("tokenizer.json").unlink()
    tiktoken.joinpath("tiktoken.model").write_text("aGk= 0\n")
    (tmp / "ids.json").write_text("[[1, 2, 3], [4, 5]]")
    (tmp / "not_json.json").write_text("1 2 3")
    (tmp / "strings.json").write_text('[[1, 2], [3, "a"]]')
    (tmp / "outside.json").write_text("[[1, 999]]")
    (tmp / "long.json").write_text(json.dumps([[1] * 129]))
    (tmp / "blank.txt").write_text("\n  \n")
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (tmp / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (tmp / "empty.txt").write_text("")
    (tmp / "a_file").write_text("x")
    full = tmp / "full_out"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    return tmp


PLACES = {"tmp": None, "qwen3": GOLDEN / "qwen3", "text": GOLDEN / "text"}
"""What `{tmp}`, `{qwen3}` and `{text}` stand for in a case's arguments."""
IDS = "--input-ids {tmp}/ids.json --out {tmp}/o.npy"
GENERATE = "generate --checkpoint {text} --max-new-tokens 4"
TRAIN = "train --preset tiny-qwen3 --text {tmp}/text.txt"
PLAN = "plan --preset tiny-qwen3"


def _at(name: str) -> str:
    """forward on the fixture checkpoint `name`."""
    return f"forward --checkpoint {{tmp}}/{name} {IDS}"


def _case(kind: str, name: str, args: str, pattern: str, **options) -> Case:
    return Case(name, kind, args, pattern, **options)


F, OPT, M, P = "files", "options", "meshes", "paths"
CASES = (
    _case(F, "checkpoint directory missing", _at("nowhere"), "no checkpoint directory at"),
    _case(F, "checkpoint without config.json", _at("empty_dir"), "no config.json in"),
    _case(F, "config.json not JSON", _at("bad_json_config"), "config.json is not valid JSON"),
    _case(F, "config.json of an unsupported architecture", _at("gpt2"), "GPT2LMHeadModel"),
    _case(F, "config.json without hidden_size", _at("no_hidden"), "no 'hidden_size'"),
    _case(F, "config.json that does not fit the weights", _at("wrong_shape"),
          "has shape .* Build the model from the checkpoint's config.json", early=False),
    _case(F, "model.safetensors truncated", _at("truncated"),
          "truncated/model.safetensors is not a readable safetensors file"),
    _case(F, "model.safetensors not safetensors", _at("garbage"),
          "garbage/model.safetensors is not a readable safetensors file"),
    _case(F, "no weights file", _at("no_weights"), "has neither model.safetensors"),
    _case(F, "weights index not JSON", _at("bad_index"),
          "model.safetensors.index.json is not valid JSON"),
    _case(F, "weights index naming a missing shard", _at("missing_shard"),
          "model-00002-of-00003.safetensors .* is missing"),
    _case(F, "token-id file missing",
          "forward --checkpoint {qwen3} --input-ids {tmp}/none.json --out {tmp}/o.npy",
          "no token-id file"),
    _case(F, "token-id file not JSON",
          "forward --checkpoint {qwen3} --input-ids {tmp}/not_json.json --out {tmp}/o.npy",
          "not_json.json is not valid JSON"),
    _case(F, "token ids that are not ints",
          "generate --checkpoint {qwen3} --prompt-ids {tmp}/strings.json --max-new-tokens 2",
          "list of non-empty lists of ints"),
    _case(F, "token ids outside the vocabulary",
          "forward --checkpoint {qwen3} --input-ids {tmp}/outside.json --out {tmp}/o.npy",
          r"outside the vocabulary \[0, 250\)"),
    _case(F, "prompt file missing", f"{GENERATE} --prompt-file {{tmp}}/none.txt", "no file at"),
    _case(F, "prompt file of blank lines", f"{GENERATE} --prompt-file {{tmp}}/blank.txt",
          "holds no prompt"),
    _case(F, "prompt file not UTF-8", f"{GENERATE} --prompt-file {{tmp}}/binary.txt",
          "is not UTF-8"),
    _case(F, "tokenizer.json malformed",
          "generate --checkpoint {tmp}/bad_tokenizer --prompt hi --max-new-tokens 2",
          "tokenizer.json is not a tokenizers file"),
    _case(F, "tokenizer_config.json not JSON",
          "generate --checkpoint {tmp}/bad_tokenizer_config --prompt hi --max-new-tokens 2",
          "tokenizer_config.json is not valid JSON"),
    _case(F, "generation_config.json not JSON",
          "generate --checkpoint {tmp}/bad_generation_config --prompt hi --max-new-tokens 2",
          "generation_config.json is not valid JSON"),
    _case(F, "chat template that does not compile",
          "generate --checkpoint {tmp}/bad_template --prompt hi --chat --max-new-tokens 2",
          "chat template .* does not compile"),
    _case(F, "text for a checkpoint without a tokenizer, vocabulary under 256",
          "generate --checkpoint {qwen3} --prompt hi --max-new-tokens 2",
          "needs a vocabulary of at least 256"),
    _case(F, "--chat for a model without a tokenizer",
          "generate --preset tiny-qwen3 --prompt hi --chat --max-new-tokens 2",
          "a chat needs the checkpoint's chat template"),
    _case(F, "a SentencePiece tokenizer without tokenizer.json",
          "generate --checkpoint {tmp}/sentencepiece --prompt hi --max-new-tokens 2",
          "has a tokenizer in .* but no tokenizer.json"),
    _case(F, "a tiktoken vocabulary without tokenizer.json",
          "generate --checkpoint {tmp}/tiktoken --prompt hi --max-new-tokens 2",
          "has a tokenizer in .*tiktoken.model.* but no tokenizer.json; .*TikTokenConverter"),
    _case(F, "train text missing",
          "train --preset tiny-qwen3 --text {tmp}/none.txt --steps 2 --out {tmp}/o",
          "no text file or directory"),
    _case(F, "train text empty",
          "train --preset tiny-qwen3 --text {tmp}/empty.txt --steps 2 --out {tmp}/o",
          "no text in"),
    _case(OPT, "unknown preset", "plan --preset tiny-gpt", "invalid choice: 'tiny-gpt'"),
    _case(OPT, "a misspelled option beside a missing required one",
          "generate --checkpoint {text} --promt hi --max-new-tokens 2",
          "unrecognized arguments: --promt \\(did you mean --prompt\\?\\)"),
    _case(OPT, "--seq-len 1 (no next token)", f"{TRAIN} --steps 2 --seq-len 1 --out {{tmp}}/o",
          "--seq-len: must be at least 2"),
    _case(OPT, "--seq-len past the model's context",
          f"{TRAIN} --steps 2 --seq-len 100000 --out {{tmp}}/o",
          "--seq-len 100000 is longer than the model's context .*: 128"),
    _case(F, "--text a binary file", "train --preset tiny-qwen3 --text {tmp}/binary.bin "
          "--steps 2 --out {tmp}/o", "--text .*binary.bin is not UTF-8 text"),
    _case(OPT, "--steps 0", f"{TRAIN} --steps 0 --out {{tmp}}/o", "--steps: must be at least 1"),
    _case(OPT, "--log-every 0 (a division by zero)",
          f"{TRAIN} --steps 2 --log-every 0 --out {{tmp}}/o", "--log-every: must be at least 1"),
    _case(OPT, "--batch-tokens 0", f"{TRAIN} --steps 2 --batch-tokens 0 --out {{tmp}}/o",
          "--batch-tokens: must be at least 1"),
    _case(OPT, "--lr nan", f"{TRAIN} --steps 2 --lr nan --out {{tmp}}/o",
          "--lr: must be a finite number"),
    _case(OPT, "--lr 1e30 (the loss turns non-finite)",
          f"{TRAIN} --steps 4 --warmup 0 --lr 1e30 --batch-tokens 128 --out {{tmp}}/o",
          r"step \d/4: the (loss is nan|parameters are not finite); stopped, nothing was written",
          early=False),
    _case(OPT, "--max-new-tokens 0", f"{GENERATE} --prompt hi --max-new-tokens 0",
          "--max-new-tokens: must be at least 1"),
    _case(OPT, "--top-k without a temperature", f"{GENERATE} --prompt hi --top-k 5",
          "need --temperature > 0"),
    _case(OPT, "--top-p 1.5", f"{GENERATE} --prompt hi --temperature 1 --top-p 1.5",
          r"--top-p: must be in \(0, 1\]"),
    _case(OPT, "--temperature -1", f"{GENERATE} --prompt hi --temperature -1",
          "--temperature: must be a finite number >= 0"),
    _case(OPT, "--matmul-precision fast", f"{PLAN} --matmul-precision fast",
          "--matmul-precision: must be one of"),
    _case(OPT, "--capture-layers past the final read",
          f"forward --checkpoint {{qwen3}} {IDS} --capture-layers 1,7",
          r"--capture-layers takes indices in \[0, 3\]"),
    _case(OPT, "--hc-mult with a checkpoint", f"forward --checkpoint {{qwen3}} {IDS} --hc-mult 2",
          "holds no MHC weights"),
    _case(OPT, "--chat with token ids", f"forward --checkpoint {{text}} {IDS} --chat",
          "--chat applies a chat template to text"),
    _case(OPT, "a prompt longer than the context (forward)",
          "forward --checkpoint {qwen3} --input-ids {tmp}/long.json --out {tmp}/o.npy",
          "129 tokens; the model's context is 128"),
    _case(OPT, "prompt + new tokens past the context (generate)",
          f"{GENERATE} --prompt hi --max-new-tokens 200", "context is 128"),
    _case(OPT, "--moe-ep on a dense model", f"{PLAN} --mesh attn_tp=4 --moe-ep 4",
          "has no experts; --moe-ep and --moe-dispatch are for MoE models"),
    _case(OPT, "--input-scattered without attention TP", f"{PLAN} --input-scattered",
          "--input-scattered .* needs --mesh attn_tp > 1"),
    _case(OPT, "--input-scattered on LongCat-Flash (branches)",
          f"forward --preset tiny-longcat-flash --mesh attn_tp=4 --input-scattered {IDS}",
          "does not run input-scattered batches: .*branch", early=False),
    _case(M, "--mesh pp=5 with more stages than layers", f"{PLAN} --mesh pp=5",
          "5 pipeline stages need at least 5 layers .* Use at most 4 stages"),
    _case(M, "--pp-split of another stage count than --mesh pp",
          f"{PLAN} --mesh pp=2 --pp-split 1,1,2", "--pp-split gives 3 stages but --mesh has pp=2"),
    _case(M, "--pp-split with an empty stage", f"{PLAN} --mesh pp=2 --pp-split 4,0",
          "--pp-split 4,0: .*stage 1 holds 0"),
    _case(M, "--microbatches without pipeline stages", f"{PLAN} --microbatches 2",
          "--microbatches splits a batch over pipeline stages"),
    _case(M, "train under --mesh pp=2", f"{TRAIN} --steps 2 --mesh pp=2 --out {{tmp}}/o",
          "train runs one program; --mesh pp=2"),
    _case(M, "--quantize fp8 under --mesh pp=2", f"{PLAN} --mesh pp=2 --quantize fp8",
          "--quantize is not built for pipeline stages"),
    _case(M, "--scan-layers under --mesh pp=2", f"{PLAN} --mesh pp=2 --scan-layers",
          "pipeline stages run their layers unrolled"),
    _case(M, "--capture-layers under --mesh pp=2",
          f"forward --checkpoint {{qwen3}} {IDS} --mesh pp=3 --capture-layers 1",
          "--capture-layers is not built for pipeline stages"),
    _case(OPT, "launch without a command", "launch --processes 2",
          "launch needs the command every process runs after --"),
    _case(M, "--mesh attn_cp=2 on an MoE model", "plan --preset tiny-qwen3-moe --mesh attn_cp=2",
          "attn_cp=2: context parallelism is built for dense decoders; .* has experts"),
    _case(M, "--mesh attn_cp=2 with pp=2", f"{PLAN} --mesh attn_cp=2,pp=2",
          "context parallelism is not built for pipeline stages"),
    _case(M, "--cp-attention without attn_cp", f"{PLAN} --cp-attention ring",
          "--cp-attention ring .* needs --mesh attn_cp > 1"),
    _case(M, "--mesh with an unknown axis", f"{PLAN} --mesh tp=2", "takes name=size pairs"),
    _case(M, "--mesh naming an axis twice", f"{PLAN} --mesh attn_tp=2,attn_tp=4",
          "names attn_tp twice"),
    _case(M, "--mesh attn_tp=0", f"{PLAN} --mesh attn_tp=0", "sizes must be positive"),
    _case(M, "--mesh that does not divide the heads", f"{PLAN} --mesh attn_tp=3 --devices 3",
          "8 attention heads do not split over 3"),
    _case(M, "--mesh larger than the devices", f"{PLAN} --mesh attn_dp=4,attn_tp=4 --devices 8",
          "--devices 8 is fewer than the 16"),
    _case(M, "--moe-ep not dividing the TP group",
          "plan --preset tiny-qwen3-moe --mesh attn_tp=4 --moe-ep 3",
          "--moe-ep 3 on --mesh attn_tp=4: moe_ep must divide"),
    _case(P, "forward --out under a file",
          "forward --checkpoint {qwen3} --input-ids {tmp}/ids.json --out {tmp}/a_file/o.npy",
          "a_file is a file, not a directory"),
    _case(P, "forward --out in an unwritable directory",
          "forward --checkpoint {qwen3} --input-ids {tmp}/ids.json --out /sys/o.npy",
          "cannot write in /sys"),
    _case(P, "forward --out a directory",
          "forward --checkpoint {qwen3} --input-ids {tmp}/ids.json --out {tmp}", "is a directory"),
    _case(P, "train --out holding files, no --overwrite",
          f"{TRAIN} --steps 2 --out {{tmp}}/full_out", "already holds files; pass --overwrite"),
    _case(P, "train --out a file", f"{TRAIN} --steps 2 --out {{tmp}}/a_file",
          "a_file is a file; a checkpoint is a directory"),
    _case(P, "train --out in an unwritable directory", f"{TRAIN} --steps 2 --out /sys/trained",
          "cannot write in /sys"),
    _case("memory", "a batch larger than memory",
          f"{TRAIN} --steps 1 --batch-tokens 40000000 --out {{tmp}}/oom",
          "out of memory: RESOURCE_EXHAUSTED", early=False),
    _case("interrupts", "SIGINT while training", f"{TRAIN} --steps 100000 --out {{tmp}}/stopped",
          r"interrupted by SIGINT at step \d+/100000; nothing was written",
          code=128 + signal.SIGINT, interrupt=(signal.SIGINT, "step 1/"), early=False),
    _case("interrupts", "SIGTERM while training with --save-every",
          f"{TRAIN} --steps 100000 --save-every 2 --out {{tmp}}/saved",
          r"interrupted by SIGTERM at step \d+/100000; .*saved holds the checkpoint of step \d+",
          code=128 + signal.SIGTERM, interrupt=(signal.SIGTERM, "checkpoint of step 4"),
          early=False),
    _case("interrupts", "SIGTERM while loading", f"{GENERATE} --prompt hi",
          "interrupted by SIGTERM", code=128 + signal.SIGTERM,
          interrupt=(signal.SIGTERM, "end-of-sequence ids"), early=False),
    _case("interrupts", "plan --json, its reader gone (no BrokenPipeError: stderr ends at the log)",
          f"{PLAN} --json", "compiling the sharded forward done in", code=141, reader_gone=True,
          early=False),
)  # fmt: skip


def arguments(case: Case, tmp: Path) -> list[str]:
    """The case's command-line arguments with its places filled in."""
    places = PLACES | {"tmp": tmp}
    return [word.format(**places) for word in case.args.split()]


@dataclasses.dataclass(frozen=True)
class Result:
    case: Case
    code: int
    last_line: str
    traceback: bool
    seconds: float

    @property
    def passed(self) -> bool:
        matches = re.search(self.case.pattern, self.last_line) is not None
        return self.code == self.case.code and not self.traceback and matches


def run_case(case: Case, tmp: Path) -> Result:
    """Runs `case` in a fresh process; its exit code and last stderr line."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "models.cli", *arguments(case, tmp)]
    start = time.perf_counter()
    if case.reader_gone:
        pipeline = f"{subprocess.list2cmdline(command)} | true; exit ${{PIPESTATUS[0]}}"
        done = subprocess.run(
            ["bash", "-c", pipeline], env=env, capture_output=True, text=True, cwd=tmp
        )
        stderr, code = done.stderr, done.returncode
    else:
        process = subprocess.Popen(
            command, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        lines = []
        if case.interrupt is not None:
            signum, marker = case.interrupt
            for line in process.stderr:
                lines.append(line)
                if marker in line:
                    process.send_signal(signum)
                    break
        lines.extend(process.stderr)
        code = process.wait()
        stderr = "".join(lines)
    seconds = time.perf_counter() - start
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    return Result(case, code, last, "Traceback" in stderr, seconds)


def _cell(text: str, tmp: Path) -> str:
    return text.replace(str(tmp), "$TMP").replace(str(ROOT) + "/", "").replace("|", "\\|")


def write_table(results: list[Result], tmp: Path) -> str:
    lines = [
        "# Bad input on the command line",
        "",
        "Every bad input we tried, run for real by `scripts/bad_inputs.py` (which wrote this",
        "page; re-run it after changing a message). Each ran as `boundary-jax ARGS` in a fresh",
        "process on the CPU; `$TMP` is the script's scratch directory of broken checkpoints and",
        f"files. Exit code {EXIT_BAD_INPUT} is bad input, 128 + n a signal n (130 SIGINT, 143",
        "SIGTERM, 141 a closed pipe); the message is the last line of stderr (the only one when",
        "the command stops before any work). No case ends in a traceback.",
        "",
        "| # | kind | bad input | command | exit | message |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for number, result in enumerate(results, 1):
        case = result.case
        args = case.args.replace("{tmp}", "$TMP").replace("{qwen3}", "tests/golden/qwen3")
        args = args.replace("{text}", "tests/golden/text")
        if case.reader_gone:
            args += " \\| true"
        if case.interrupt is not None:
            args += f" (then {signal.Signals(case.interrupt[0]).name})"
        message = result.last_line
        lines.append(
            f"| {number} | {case.kind} | {case.name} | `{_cell(args, tmp)}` | {result.code} | "
            f"{_cell(message, tmp)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose name holds this text (no table)")
    options = parser.parse_args()
    cases = [c for c in CASES if options.only is None or options.only in c.name]
    failed = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = make_fixtures(Path(scratch))
        results = []
        for case in cases:
            result = run_case(case, tmp)
            results.append(result)
            status = "ok  " if result.passed else "FAIL"
            print(
                f"{status} {result.code:3d} {result.seconds:5.1f}s {case.name}: {result.last_line}"
            )
            if not result.passed:
                failed.append(case.name)
        if options.only is None:
            DOC.write_text(write_table(results, tmp))
            print(f"wrote {DOC} ({len(results)} cases)")
    if failed:
        print(f"{len(failed)} failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
