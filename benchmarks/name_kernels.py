"""Names the kernels of a profiled benchmark by the XLA fusions they run: each one's output, the
ops it fused and the project source lines it came from, per case and summed per source line;
and where the GPU sat idle, by the ops on either side of each gap.

A model benchmark's `--profile DIR` traces each case (`common.profile_into`); an HLO dump taken
in the same process gives the fusions. XLA numbers fusions per compilation, so a dump of another
process may give the same names to other fusions. On GPU, XLA also shares one kernel between
structurally equal fusions and names it after the first: a kernel launched N times a call is
usually one fusion repeated in N layers. Custom calls (cuBLAS, cuDNN, Pallas) have no fusion and
are listed by kernel name.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" \\
        python3 -m benchmarks.bench_deepseek --only prefill --profile /tmp/prof
    python3 -m benchmarks.name_kernels /tmp/prof /tmp/dump --top 40

Works on CPU traces too (their events carry the HLO op), e.g. after `bench_deepseek --smoke`;
there a loop's time includes its body's ops, which are listed as well.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import pathlib
import re

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


@dataclasses.dataclass(frozen=True)
class Module:
    """One after-optimizations HLO module of the dump.

    Attributes:
      name: The module's name (`jit_body`, `jit_prefill_step`, ...), as traces name it.
      instructions: Instruction name -> (its text after `=`, its innermost project frames).
      computations: Computation name -> the texts of its instructions.
    """

    name: str
    instructions: dict[str, tuple[str, str]]
    computations: dict[str, list[str]]


def _frames(lines: list[str]) -> dict[int, str]:
    """stack_frame_id -> 'file:line < file:line', the two innermost frames outside
    site-packages."""
    section, tables = None, collections.defaultdict(dict)
    for line in lines:
        if line.strip() in _TABLES:
            section = line.strip()
            continue
        entry = re.match(r"^(\d+) (.*)$", line)
        if section and entry:
            tables[section][int(entry.group(1))] = entry.group(2)
        elif section and line.strip():
            section = None
    field = lambda text, key: int(re.search(rf"{key}=(\d+)", text).group(1))  # noqa: E731
    frames = {}
    for frame_id in tables["StackFrames"]:
        chain, current, seen = [], frame_id, set()
        while current and current not in seen and len(chain) < 2:
            seen.add(current)
            frame = tables["StackFrames"][current]
            location = tables["FileLocations"].get(field(frame, "file_location_id"), "")
            if location:
                file = tables["FileNames"].get(field(location, "file_name_id"), "").strip('"')
                if "site-packages" not in file and "<frozen" not in file:
                    chain.append(f"{file.split('/main/')[-1]}:{field(location, ' line')}")
            current = field(frame, "parent_frame_id")
        frames[frame_id] = " < ".join(chain)
    return frames


def read_dump(dump_dir: pathlib.Path) -> dict[str, Module]:
    """The dump's after-optimizations modules, by file name."""
    modules = {}
    for path in glob.glob(str(dump_dir / "*after_optimizations.txt")):
        lines = pathlib.Path(path).read_text().splitlines()
        frames = _frames(lines)
        instructions, computations, current = {}, {}, None
        for line in lines:
            head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
            if head:
                current = head.group(1)
                computations[current] = []
            elif line.startswith("}"):
                current = None
            elif assigned := re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line):
                text = assigned.group(2)
                frame = re.search(r"stack_frame_id=(\d+)", text)
                source = frames.get(int(frame.group(1)), "") if frame else ""
                instructions[assigned.group(1)] = (text, source)
                if current:
                    computations[current].append(text)
        name = pathlib.Path(path).name.split(".")[1]
        modules[pathlib.Path(path).name] = Module(name, instructions, computations)
    return modules


def _trace_events(trace_dir: pathlib.Path) -> tuple[list[dict], dict, dict]:
    """(events, pid -> process name, (pid, tid) -> thread name) of a case's last trace; empty
    where it has none."""
    files = sorted(glob.glob(str(trace_dir / "**" / "*.json.gz"), recursive=True))
    if not files:
        return [], {}, {}
    with gzip.open(files[-1]) as stream:
        events = json.load(stream)
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    return events, processes, threads


def trace_ops(trace_dir: pathlib.Path, calls: int) -> dict[tuple[str, str], list[float]]:
    """(HLO module, op or kernel name) -> [ms per call, launches per call] of a case's trace:
    GPU kernels (named after their fusion, `.N` written `_N`) or CPU thunks (their HLO op).
    A kernel on a GPU stream without an `hlo_module` (the project's conditional branches ran
    so in one trace, run 45) counts under the module that ran the most of the case's kernels."""
    events, processes, threads = _trace_events(trace_dir)
    kernels = []
    for event in events:
        args = event.get("args", {})
        if event.get("ph") != "X":
            continue
        on_gpu = "GPU" in processes.get(event["pid"], "")
        stream = "Stream" in threads.get((event["pid"], event.get("tid")), "")
        if "hlo_module" in args or (on_gpu and stream):
            kernels.append((event, args, on_gpu))
    ran = collections.Counter(a["hlo_module"] for _, a, gpu in kernels if gpu and "hlo_module" in a)
    main = ran.most_common(1)[0][0] if ran else ""
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for event, args, on_gpu in kernels:
        name = event["name"] if on_gpu else args.get("hlo_op", event["name"])
        total = totals[args.get("hlo_module", main), name]
        total[0] += event.get("dur", 0) / 1e3 / calls
        total[1] += 1 / calls
    return dict(totals)


def idle_gaps(
    trace_dir: pathlib.Path, calls: int, floor_us: float = 10.0
) -> tuple[float, list[tuple[float, int, str, str]]]:
    """(GPU idle ms per call, [(idle ms per call, gaps per call, op before, op after)]) of a
    case's trace: the time no GPU activity (kernel or copy) runs, in gaps of at least `floor_us`
    between the first and the last activity, grouped by the ops on either side of the gap. The
    gaps between the traced calls count too (the step's own launch and its return)."""
    events, processes, threads = _trace_events(trace_dir)
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X"
        and "GPU" in processes.get(e["pid"], "")
        and "XLA Op" not in threads.get((e["pid"], e.get("tid")), "")
    )
    groups = collections.defaultdict(lambda: [0.0, 0.0])
    idle, end, before = 0.0, None, ""
    for start, stop, name in spans:
        if end is not None and start - end >= floor_us:
            gap = groups[before[:40], name[:40]]
            gap[0] += (start - end) / 1e3 / calls
            gap[1] += 1 / calls
            idle += (start - end) / 1e3 / calls
        if end is None or stop >= end:
            end, before = stop, name
    rows = sorted(((ms, round(n), a, b) for (a, b), (ms, n) in groups.items()), reverse=True)
    return idle, rows


def _instruction(module: Module, name: str) -> tuple[str, str] | None:
    return module.instructions.get(name) or module.instructions.get(
        re.sub(r"_(\d+)$", r".\1", name)
    )


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(text: str) -> int:
    """The bytes of every array shape written in `text` (`bf16[8,4096]{1,0}` is 65536)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]", text):
        size = 1
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        total += _BYTES.get(dtype, 0) * size
    return total


def moved_bytes(text: str, instructions: dict[str, tuple[str, str]] | None = None) -> int:
    """The bytes an instruction reads and writes at least once: its output shapes and its
    operands' (a fusion reading part of an operand moves less). Operands the text names without
    a shape, as XLA dumps them, are looked up in `instructions`."""
    parts = re.match(r"^(\(.*?\)|\S+) [a-z][\w\-]*\(([^)]*)\)", text)
    if parts is None:
        return _shape_bytes(text)
    total = _shape_bytes(parts.group(1))
    for operand in filter(None, (o.strip() for o in parts.group(2).split(", "))):
        if "[" in operand:
            total += _shape_bytes(operand)
        elif instructions and (found := instructions.get(operand.lstrip("%"))):
            total += _shape_bytes(re.match(r"^(\(.*?\)|\S+)", found[0]).group(1))
    return total


def describe(module: Module | None, name: str) -> tuple[str, str, int]:
    """(project source, 'output shape, fused ops, op name', bytes moved) of one op, or
    ('-', '', 0) for a kernel without an HLO instruction (a custom call's)."""
    found = None if module is None else _instruction(module, name)
    if found is None:
        return "-", "", 0
    text, source = found
    ops = collections.Counter()
    called = re.search(r"calls=%?([\w.\-]+)", text)
    for body in module.computations.get(called.group(1), []) if called else []:
        op = re.search(r"[\]}] ([a-z][\w\-]*)\(", body)
        ops[op.group(1) if op else "?"] += 1
    op_name = re.search(r'op_name="([^"]*)"', text)
    fused = ", ".join(f"{op} {count}" for op, count in ops.most_common(6))
    return (
        source or "-",
        f"{text.split(' ')[0][:40]} [{fused}] {op_name.group(1)[-60:] if op_name else ''}",
        moved_bytes(text, module.instructions),
    )


def _module_for(modules: dict[str, Module], hlo_module: str, names: list[str]) -> Module | None:
    """Of the dumped modules of that name, the one holding most of the case's ops."""
    candidates = [m for m in modules.values() if m.name == hlo_module]
    if not candidates:
        return None
    return max(candidates, key=lambda m: sum(_instruction(m, n) is not None for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=pathlib.Path, help="a benchmark's --profile directory")
    parser.add_argument("dump", type=pathlib.Path, help="the same process's --xla_dump_to")
    parser.add_argument("--top", type=int, default=30, help="ops listed per case")
    parser.add_argument("--calls", type=int, default=3, help="calls each trace holds")
    parser.add_argument(
        "--per",
        type=int,
        default=1,
        help="report per this many repeats of a call's body (decode steps x layers: per layer)",
    )
    args = parser.parse_args()
    modules = read_dump(args.dump)
    for case in sorted(p for p in args.profile.iterdir() if p.is_dir()):
        ops = trace_ops(case, args.calls * args.per)
        by_module = collections.defaultdict(list)
        for hlo_module, name in ops:
            by_module[hlo_module].append(name)
        chosen = {m: _module_for(modules, m, names) for m, names in by_module.items()}
        rows = []
        for (hlo_module, name), (ms, launches) in ops.items():
            rows.append((ms, launches, name, *describe(chosen[hlo_module], name)))
        rows.sort(reverse=True)
        print(f"\n## {case.name}: {sum(r[0] for r in rows):.3f} ms of kernels per call")
        sources = collections.defaultdict(lambda: [0.0, 0.0])
        for ms, launches, _, source, _, _ in rows:
            sources[source][0] += ms
            sources[source][1] += launches
        print("\nby project source line (ms per call, launches per call):")
        for source, (ms, launches) in sorted(sources.items(), key=lambda s: -s[1][0])[: args.top]:
            print(f"{ms:9.3f}  x{launches:<6.0f} {source}")
        idle, gaps = idle_gaps(case, args.calls * args.per)
        print(f"\nGPU idle {idle:.3f} ms per call (gaps >= 10 us; ms, gaps per call, between):")
        for ms, count, before, after in gaps[: args.top // 3]:
            print(f"{ms:9.3f}  x{count:<6} {before:40} -> {after}")
        print(
            f"\nlargest {args.top} ops (ms per call, launches per call, MB moved per launch, GB/s;"
            " bytes from the HLO: outputs and operands once):"
        )
        for ms, launches, name, source, text, moved in rows[: args.top]:
            rate = f"{moved / (ms / max(launches, 1)) / 1e6:6.0f}" if moved and ms else "     -"
            print(
                f"{ms:9.3f}  x{launches:<6.0f} {moved / 1e6:8.2f} {rate} {name[:40]:40} "
                f"{source:40} {text}"
            )


if __name__ == "__main__":
    main()
