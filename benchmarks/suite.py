"""The benchmark suite of dream_trainer: every case, one command, one markdown table.

Each case runs in fresh processes, the variants of a case interleaved (plain, dream, ..., plain,
dream, ...) so drift on the machine hits them alike, over several rounds; the table shows medians and
the median of the per-round ratios to the plain PyTorch baseline, with the target and PASS/MISS.

1. `tiny`: tiny MLP (Linear 32-32-1, batch 64, 2000 steps): plain loop, dream_trainer bare, dream_trainer
   defaults (rich bar on a fake terminal, TensorBoard every step, checkpoint at the end), Lightning
   minimal and Lightning defaults (benchmarks/tiny_mlp.py). Also the peak RSS of each run.
2. `transformer`: a small decoder-only LM on generated tokens, compute-bound: plain, dream, Lightning
   (benchmarks/transformer.py).
3. `ddp`: 2-rank DDP on gloo, plain DDP loop vs dream (benchmarks/ddp.py, run as it is; skipped if absent).
4. `checkpoint`: save/load vs torch.save/torch.load, async save blocking time (benchmarks/checkpoint.py).
5. `import`: `import dream_trainer` vs `import torch` vs `import lightning.pytorch` (benchmarks/import_time.py).

Lightning is the optional `bench` extra; without it (or with DREAM_BENCH_NO_LIGHTNING=1) its rows say
"skipped: lightning not installed".

    python benchmarks/suite.py                          # full run (about 15-25 minutes on 2 cores)
    python benchmarks/suite.py --quick                  # smoke run: few steps, 1 round (about 1-2 minutes)
    python benchmarks/suite.py --only tiny,import --rounds 3
    python benchmarks/suite.py --out results.md --json results.json
    python benchmarks/suite.py --threads 1              # a busy machine: OpenMP barriers on shared cores
                                                        # make multi-threaded torch wildly slow and noisy

Exit status: 1 when a case failed to run (or, with --strict, on a MISS); a MISS alone exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SENTINEL = "@@BENCH_RESULT "
NO_LIGHTNING_ENV = "DREAM_BENCH_NO_LIGHTNING"
LIGHTNING_SKIP = "skipped: lightning not installed"
SECTIONS = ("tiny", "transformer", "ddp", "checkpoint", "import")
ALIASES = {"rss": "tiny", "mlp": "tiny", "tiny_mlp": "tiny", "lm": "transformer", "import_time": "import"}


# --- helpers shared with the case modules (stdlib only: workers import this file) -----------------
class BenchError(RuntimeError):
    """A benchmark process failed; the message carries the command and the tail of its output."""


def lightning_version() -> str | None:
    """The installed Lightning version, or None when absent or hidden by DREAM_BENCH_NO_LIGHTNING=1."""
    if os.environ.get(NO_LIGHTNING_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    try:
        if importlib.util.find_spec("lightning") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        from importlib.metadata import version

        return version("lightning")
    except Exception:
        return "unknown version"


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def current_rss_mb() -> float | None:
    """Current resident set size in MiB (Linux /proc only; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def emit(result: dict[str, Any]) -> None:
    """Print a worker's result as one JSON line the parent picks out of any other output."""
    print(SENTINEL + json.dumps(result, default=str), flush=True)


def source_commit() -> str:
    """The commit of the tree the suite runs from (`git rev-parse --short HEAD`, "+ changes" when the
    tree differs from it), or why there is none: a report names what it measured."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        if sha.returncode != 0:
            return "unknown (not a git checkout)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown (git not found)"
    return sha.stdout.strip() + (" + uncommitted changes" if dirty else "")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def run_child(argv: Sequence[str], timeout: float | None = None) -> dict[str, Any]:
    """Run one benchmark process and return the dict it emitted (its last SENTINEL line).

    Its output goes to temporary files, not pipes: the parent does not wake up per line of a
    progress bar and steal CPU from the measured process."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.run(argv, stdout=out, stderr=err, text=True, env=child_env(), timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"`{shlex.join(argv)}` timed out after {timeout:.0f} s") from exc
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return child_result(argv, proc.returncode, stdout, stderr)


def child_result(argv: Sequence[str], returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The dict a finished benchmark process emitted (its last SENTINEL line), its other output in
    `_stdout`; `BenchError` when it failed or printed none."""
    found = [line for line in stdout.splitlines() if line.startswith(SENTINEL)]
    if returncode != 0 or not found:
        tail = (stdout[-1500:] + "\n" + stderr[-2500:]).strip()
        why = f"exited with code {returncode}" if returncode else "printed no result"
        raise BenchError(f"`{shlex.join(argv)}` {why}:\n{tail}")
    result = json.loads(found[-1][len(SENTINEL) :])
    result["_stdout"] = "\n".join(line for line in stdout.splitlines() if not line.startswith(SENTINEL))
    return result


def interleave(
    argvs: dict[str, list[str]],
    rounds: int,
    warmup: bool = False,
    label: str = "",
    timeout: float | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Run every case once per round, in the order given, `rounds` times (plus an untimed warm-up
    round); return each case's results in round order."""
    results: dict[str, list[dict[str, Any]]] = {case: [] for case in argvs}
    for rnd in range(-1 if warmup else 0, rounds):
        for case, argv in argvs.items():
            tag = "warm-up" if rnd < 0 else f"round {rnd + 1}/{rounds}"
            log(f"{label}: {case} ({tag})")
            result = run_child(argv, timeout=timeout)
            if rnd >= 0:
                results[case].append(result)
    return results


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-round ratios a/b (robust to drift between rounds)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def ratio_text(a: Sequence[float], b: Sequence[float]) -> tuple[float, str]:
    """The median of the per-round ratios a/b and its text, with the range over the rounds when several."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    med = statistics.median(ratios)
    text = f"{med:.3f}x"
    if len(ratios) > 1:
        text += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return med, text


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_module(name: str) -> Any:
    """A sibling module of this file (benchmarks/ is not a package)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


# --- the table ------------------------------------------------------------------------------------
@dataclass
class Row:
    benchmark: str
    case: str
    median: str = ""
    vs_baseline: str = ""
    target: str = ""
    result: str = ""
    value: float | None = None  # the number compared with the target (a ratio, a fraction or seconds)


def check(value: float, limit: float) -> str:
    return "PASS" if value <= limit else "MISS"


def markdown_table(rows: list[Row]) -> str:
    lines = ["| benchmark | case | median | vs baseline | target | result |", "|---|---|---:|---|---|---|"]
    lines += [f"| {r.benchmark} | {r.case} | {r.median} | {r.vs_baseline} | {r.target} | {r.result} |" for r in rows]
    return "\n".join(lines)


def error_rows(benchmark: str, cases: Sequence[str], exc: BaseException) -> list[Row]:
    # The last line of a child's traceback names the exception; the full text goes below the table.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = lines[-1] if lines else type(exc).__name__
    return [Row(benchmark, case, result=f"error: {why[:200]} (see below)".replace("|", "/")) for case in cases]


# --- sections ---------------------------------------------------------------------------------------
def section_tiny(args: argparse.Namespace, lightning: str | None) -> tuple[list[Row], dict[str, Any]]:
    tiny = load_module("tiny_mlp")
    steps, batch = (50, 64) if args.quick else (2000, 64)
    rounds = args.rounds or (1 if args.quick else 7)
    cases = [c for c in tiny.CASES if lightning or c not in tiny.LIGHTNING_CASES]
    raw = tiny.measure(cases, rounds=rounds, steps=steps, batch=batch, warmup=not args.quick)
    bench = f"tiny MLP ({steps} steps x batch {batch}; {_n(rounds)}), time"
    mem = f"tiny MLP, peak RSS ({_n(rounds)})"
    time_targets = {"dream": 1.05, "dream_defaults": 1.25}
    rss_targets = {"dream": 1.05, "dream_defaults": 1.05}
    rows: list[Row] = []
    rss_rows: list[Row] = []
    for case in tiny.CASES:
        label = tiny.LABELS[case]
        if case not in raw["seconds"]:
            rows.append(Row(bench, label, result=LIGHTNING_SKIP))
            rss_rows.append(Row(mem, label, result=LIGHTNING_SKIP))
            continue
        secs, rss = raw["seconds"][case], raw["peak_rss_mb"][case]
        if case == "plain":
            rows.append(Row(bench, label, f"{statistics.median(secs):.3f} s", "1.000x (baseline)", value=1.0))
            rss_rows.append(Row(mem, label, f"{statistics.median(rss):.0f} MiB", "1.000x (baseline)", value=1.0))
            continue
        r, r_text = ratio_text(secs, raw["seconds"]["plain"])
        m, m_text = ratio_text(rss, raw["peak_rss_mb"]["plain"])
        t, mt = time_targets.get(case), rss_targets.get(case)
        rows.append(
            Row(bench, label, f"{statistics.median(secs):.3f} s", r_text,
                f"<= {t:.2f}x" if t else "", check(r, t) if t else "", value=r)
        )  # fmt: skip
        rss_rows.append(
            Row(mem, label, f"{statistics.median(rss):.0f} MiB", m_text,
                f"<= {mt:.2f}x (plain + 5%)" if mt else "", check(m, mt) if mt else "", value=m)
        )  # fmt: skip
    raw.update(steps=steps, batch=batch, rounds=rounds)
    return rows + rss_rows, raw


def section_transformer(args: argparse.Namespace, lightning: str | None) -> tuple[list[Row], dict[str, Any]]:
    lm = load_module("transformer")
    steps = 2 if args.quick else lm.DEFAULT_STEPS
    rounds = args.rounds or (1 if args.quick else 5)
    cases = [c for c in lm.CASES if lightning or c not in lm.LIGHTNING_CASES]
    raw = lm.measure(cases, rounds=rounds, steps=steps, warmup=not args.quick)
    bench = f"transformer LM ({lm.describe(steps)}; {_n(rounds)})"
    rows: list[Row] = []
    for case in lm.CASES:
        label = lm.LABELS[case]
        if case not in raw["seconds"]:
            rows.append(Row(bench, label, result=LIGHTNING_SKIP))
            continue
        secs = raw["seconds"][case]
        if case == "plain":
            rows.append(Row(bench, label, f"{statistics.median(secs):.3f} s", "1.000x (baseline)", value=1.0))
            continue
        r, r_text = ratio_text(secs, raw["seconds"]["plain"])
        target = 1.02 if case == "dream" else None
        rows.append(
            Row(bench, label, f"{statistics.median(secs):.3f} s", r_text,
                f"<= {target:.2f}x" if target else "", check(r, target) if target else "", value=r)
        )  # fmt: skip
    raw.update(steps=steps, rounds=rounds)
    return rows, raw


def _n(rounds: int) -> str:
    return f"{rounds} round" + ("s" if rounds != 1 else "")


def _require(raw: dict[str, Any], script: Path, *keys: str) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        got = ", ".join(k for k in raw if not k.startswith("_")) or "nothing"
        raise BenchError(f"benchmarks/{script.name} main() returned no {', '.join(missing)} (it returned: {got})")


def _call_script(script: Path, argv: list[str], timeout: float | None = None) -> dict[str, Any]:
    """Run `main(argv)` of a benchmark script in a fresh process and return its dict."""
    return run_child([sys.executable, str(Path(__file__).resolve()), "--call", str(script), "--", *argv], timeout)


def section_ddp(args: argparse.Namespace, lightning: str | None) -> tuple[list[Row], dict[str, Any]]:
    rounds = args.rounds or (1 if args.quick else 7)  # ddp.py's own defaults
    bench = f"2-rank DDP (gloo, CPU; {_n(rounds)})"
    labels = ("plain DDP loop: steps", "dream: steps", "plain DDP loop: setup + steps", "dream: setup + steps")
    script = HERE / "ddp.py"
    if not script.exists():
        return [Row(bench, label, result="skipped: benchmarks/ddp.py not found") for label in labels], {}
    argv = ["--quick"] if args.quick else []
    if args.rounds:
        argv += ["--rounds", str(args.rounds)]
    log(f"ddp: python benchmarks/ddp.py {shlex.join(argv)}")
    raw = _call_script(script, argv)
    _require(raw, script, "plain_loop_median_s", "dream_loop_median_s", "loop_ratio", "plain_total_median_s",
             "dream_total_median_s", "total_ratio")  # fmt: skip
    rows = []
    for kind, plain_label, dream_label in (("loop", labels[0], labels[1]), ("total", labels[2], labels[3])):
        rows.append(Row(bench, plain_label, f"{raw[f'plain_{kind}_median_s']:.3f} s", "1.000x (baseline)", value=1.0))
        r = raw[f"{kind}_ratio"]
        rows.append(Row(bench, dream_label, f"{raw[f'dream_{kind}_median_s']:.3f} s", f"{r:.3f}x", "<= 1.05x",
                        check(r, 1.05), value=r))  # fmt: skip
    return rows, raw


def section_checkpoint(args: argparse.Namespace, lightning: str | None) -> tuple[list[Row], dict[str, Any]]:
    script = HERE / "checkpoint.py"
    argv = ["--quick"] if args.quick else []
    if args.rounds:
        argv += ["--reps", str(args.rounds)]
    log(f"checkpoint: python benchmarks/checkpoint.py {shlex.join(argv)}")
    raw = _call_script(script, argv)
    _require(raw, script, "params", "file_bytes", "reps", "torch_save_s", "save_s", "save_ratio", "torch_save_fsync_s",
             "save_ratio_vs_fsync", "save_nocrc_s", "save_nocrc_ratio", "torch_load_s", "load_s", "load_ratio",
             "async_s", "async_block_ratio", "disk_floor_s", "disk_floor_ratio", "save_ratio_vs_floor")  # fmt: skip
    bench = (
        f"checkpoint ({_count(raw['params'])} params + AdamW state, file {_bytes(raw['file_bytes'])}; "
        f"{_n(raw['reps'])})"
    )
    save, load, block = raw["save_ratio"], raw["load_ratio"], raw["async_block_ratio"]
    rows = [
        Row(bench, "torch.save(state)", f"{raw['torch_save_s']:.3f} s", "1.000x (baseline)", value=1.0),
        Row(bench, "trainer.save_checkpoint (+ fsync, atomic rename)", f"{raw['save_s']:.3f} s", f"{save:.3f}x",
            "<= 1.20x", check(save, 1.2), value=save),
        Row(bench, "&nbsp;&nbsp;for reference: torch.save + fsync", f"{raw['torch_save_fsync_s']:.3f} s",
            f"save_checkpoint = {raw['save_ratio_vs_fsync']:.3f}x this"),
        Row(bench, "&nbsp;&nbsp;disk floor: the same bytes written durably, no serialisation",
            f"{raw['disk_floor_s']:.3f} s", f"{raw['disk_floor_ratio']:.3f}x; save_checkpoint = "
            f"{raw['save_ratio_vs_floor']:.3f}x this"),
        Row(bench, "trainer.save_checkpoint, checkpoint_crc32=False (no zip checksums)",
            f"{raw['save_nocrc_s']:.3f} s", f"{raw['save_nocrc_ratio']:.3f}x", "", "",
            value=raw["save_nocrc_ratio"]),
        Row(bench, "torch.load + load_state_dict", f"{raw['torch_load_s']:.3f} s", "1.000x (baseline)", value=1.0),
        Row(bench, "trainer.load_checkpoint", f"{raw['load_s']:.3f} s", f"{load:.3f}x", "<= 1.20x",
            check(load, 1.2), value=load),
        Row(bench, "async save_checkpoint: caller blocked", f"{raw['async_s']:.3f} s", f"{block:.1%} of a sync save",
            "<= 10%", check(block, 0.10), value=block),
    ]  # fmt: skip
    return rows, raw


def _count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _bytes(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def section_import(args: argparse.Namespace, lightning: str | None) -> tuple[list[Row], dict[str, Any]]:
    imp = load_module("import_time")
    rounds = args.rounds or (1 if args.quick else 10)
    modules = [m for m in imp.MODULES if lightning or m not in imp.LIGHTNING_MODULES]
    raw = imp.measure(modules, rounds=rounds, warmup=not args.quick)
    bench = f"import time (fresh process; {_n(rounds)})"
    rows = []
    torch_s = statistics.median(raw["seconds"]["torch"])
    for module in imp.MODULES:
        label = f"import {module}"
        if module == "torch.utils.tensorboard":
            label += " (Lightning's TensorBoard logger imports it at fit)"
        if module == "torch, tensorboard.compat.proto.event_pb2":
            label += " (dream_trainer's TensorBoard logger imports it at fit)"
        if module not in raw["seconds"]:
            rows.append(Row(bench, label, result=LIGHTNING_SKIP))
            continue
        med = statistics.median(raw["seconds"][module])
        if module == "torch":
            rows.append(Row(bench, label, f"{med:.3f} s", "baseline", value=0.0))
            continue
        # The median of the per-round differences, as the ratios elsewhere.
        diffs = [a - b for a, b in zip(raw["seconds"][module], raw["seconds"]["torch"], strict=True)]
        diff = statistics.median(diffs)
        spread = f" ({min(diffs):+.2f} to {max(diffs):+.2f})" if len(diffs) > 1 else ""
        is_dream = module == "dream_trainer"
        rows.append(
            Row(bench, label, f"{med:.3f} s", f"torch {diff:+.3f} s{spread}", "<= torch + 0.20 s" if is_dream else "",
                check(diff, 0.2) if is_dream else "", value=diff)
        )  # fmt: skip
    raw["torch_median_s"] = torch_s
    return rows, raw


SECTION_FUNCS: dict[str, Callable[[argparse.Namespace, str | None], tuple[list[Row], dict[str, Any]]]] = {
    "tiny": section_tiny,
    "transformer": section_transformer,
    "ddp": section_ddp,
    "checkpoint": section_checkpoint,
    "import": section_import,
}
SECTION_TITLES = {
    "tiny": "tiny MLP",
    "transformer": "transformer LM",
    "ddp": "2-rank DDP (gloo, CPU)",
    "checkpoint": "checkpoint",
    "import": "import time",
}


# --- the report -------------------------------------------------------------------------------------
def machine_line(lightning: str | None) -> str:
    try:  # from the metadata: the suite process itself stays free of torch
        from importlib.metadata import version

        torch_desc = f"torch {version('torch')}"
    except Exception:
        torch_desc = "torch absent"
    if os.environ.get("OMP_NUM_THREADS"):
        torch_desc += f" (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    if lightning:
        light = f"lightning {lightning}"
    elif os.environ.get(NO_LIGHTNING_ENV):
        light = f"lightning absent ({NO_LIGHTNING_ENV}={os.environ[NO_LIGHTNING_ENV]})"
    else:
        light = "lightning absent"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    try:
        load = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "load average n/a"
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({cpu}), {load} at start; "
        f"Python {platform.python_version()}, {torch_desc}, {light}"
    )


def parse_only(text: str | None) -> list[str]:
    if not text:
        return list(SECTIONS)
    wanted = []
    for raw in text.split(","):
        name = ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if not name:
            continue
        if name not in SECTIONS:
            raise SystemExit(f"--only: unknown case {raw!r}; valid: {', '.join(SECTIONS)} (alias: rss = tiny)")
        if name not in wanted:
            wanted.append(name)
    return [s for s in SECTIONS if s in wanted]


def _call_mode(script: str, argv: list[str]) -> None:
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", script)
    assert spec is not None and spec.loader is not None, script
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    emit(module.main(argv))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, 1 round (timings not meaningful)")
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    p.add_argument("--rounds", type=int, help="rounds (repetitions) of every case; default: per case (5-10)")
    p.add_argument(
        "--threads", type=int,
        help="torch threads of every benchmark process (sets OMP_NUM_THREADS); default: torch's own choice "
        "(the tiny MLP always runs 1, DDP ranks 1 each); --quick: 1",
    )  # fmt: skip
    p.add_argument("--out", help="also write the report (markdown) to this file")
    p.add_argument("--json", help="also write every measurement (each round of each case) to this JSON file")
    p.add_argument("--strict", action="store_true", help="exit with status 1 on a MISS (errors always do)")
    p.add_argument("--call", help=argparse.SUPPRESS)  # internal: run SCRIPT's main(argv) and emit its dict
    args, rest = p.parse_known_args(argv)
    if args.call:
        _call_mode(args.call, [a for a in rest if a != "--"])
        return {}
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    sections = parse_only(args.only)
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "benchmarks/suite.py", *given])
    lightning = lightning_version()
    threads = args.threads or (1 if args.quick else None)
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every benchmark process
    try:
        return _run(args, sections, command, lightning)
    finally:
        if threads:
            if saved_omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved_omp


def _run(args: argparse.Namespace, sections: list[str], command: str, lightning: str | None) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.UTC)
    machine = machine_line(lightning)

    rows: list[Row] = []
    raw: dict[str, Any] = {}
    errors: dict[str, str] = {}
    t0 = time.perf_counter()
    for name in sections:
        log(f"=== {SECTION_TITLES[name]} ===")
        try:
            section_rows, section_raw = SECTION_FUNCS[name](args, lightning)
        except Exception as exc:
            errors[name] = str(exc)
            log(f"{name} failed: {exc}")
            section_rows, section_raw = error_rows(SECTION_TITLES[name], ("all cases",), exc), {}
        rows += section_rows
        raw[name] = {k: v for k, v in section_raw.items() if not k.startswith("_")}
    elapsed = time.perf_counter() - t0

    misses = [r for r in rows if r.result == "MISS"]
    head = [
        "# dream_trainer benchmarks",
        "",
        f"- command: `{command}`",
        f"- date: {started:%Y-%m-%d %H:%M} UTC (suite took {elapsed / 60:.1f} min)",
        f"- commit: {source_commit()}",
        f"- machine: {machine}",
        "- method: every measurement in a fresh process; the variants of a case interleaved, round after "
        "round; median over the rounds; vs baseline = the median of the per-round ratios (their range in "
        "parentheses). Times cover the same work on each side (building data, model and optimizer, then "
        "training), after the imports (torch._dynamo, which the first optimizer step imports, included). "
        "The tiny MLP runs 1 torch thread, DDP ranks 1 each. Peak RSS: ru_maxrss of the process at the end.",
    ]
    if args.quick:
        head.append("- **quick (smoke) run: few steps, 1 round; the timings and PASS/MISS mean nothing.**")
    if lightning is None:
        head.append(f"- Lightning rows: {LIGHTNING_SKIP} (install the `bench` extra: `pip install -e '.[bench]'`).")
    text = "\n".join(head) + "\n\n" + markdown_table(rows) + "\n"
    summary = f"\n{sum(r.result == 'PASS' for r in rows)} PASS, {len(misses)} MISS"
    if errors:
        summary += f", {len(errors)} section(s) failed: " + ", ".join(errors)
        text += summary + "\n\n" + "\n\n".join(f"**{k} failed:**\n```\n{v}\n```" for k, v in errors.items()) + "\n"
    else:
        text += summary + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    result = {
        "command": command,
        "machine": machine,
        "date": started.isoformat(),
        "lightning": lightning,
        "sections": sections,
        "rows": [asdict(r) for r in rows],
        "raw": raw,
        "errors": errors,
        "markdown": text,
        "misses": len(misses),
        "exit_code": 1 if errors or (args.strict and misses) else 0,
    }
    if args.json:
        Path(args.json).write_text(
            json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=1, default=str)
        )
        log(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    sys.exit(main().get("exit_code", 0))
