"""One command that gives a GPU machine's evidence: every CUDA code path of dream_trainer, run once.

    python benchmarks/gpu_check.py --out gpu.md           # on a GPU, within 8 minutes; then paste gpu.md
    python benchmarks/gpu_check.py --device cpu --quick   # the CPU fallback, tiny sizes (a smoke run)
    python benchmarks/gpu_check.py --skip compile,transformer --budget 300

The checks, each in its own fresh process with its own time limit (a hang or a crash fails that check,
never the others):

1. `tests`: every CUDA-only test of the suite. A test is CUDA-only when pytest skips it once CUDA is
   absent, for a reason that names CUDA or a GPU: the test files that mention CUDA are collected in a
   process where `torch.cuda.is_available()` says False, and the items whose skip marks then fire are
   run with pytest (a second process, with the real torch); passed/failed/skipped come from its JUnit XML.
2. `bf16`: a small MLP trained through DreamTrainer with `mixed_precision="bf16"`: the loss falls and
   stays finite, the step computes in bfloat16 while the weights stay fp32, no loss scaler.
3. `fp16`: the same with `mixed_precision="fp16"`, through the trainer's one `torch.amp.GradScaler`.
4. `compile`: the same in fp32 with `compile_model=True` (the model is an `OptimizedModule`).
5. `ddp`: `torchrun --standalone --nproc_per_node N` (N = 2 with two GPUs, else 1) of a run with
   `strategy="ddp"`, then one with `strategy="fsdp"` in the same processes, then an all-reduce of a
   CUDA tensor through the process group the trainer made (NCCL; gloo for CPU tensors). On one rank the
   DDP strategy does not wrap the model (DDP over one rank only copies gradients) and makes no process
   group, so the NCCL group comes from the FSDP run; two GPUs run a real 2-rank DDP as well.
6. `transformer`: benchmarks/transformer.py's plain loop and dream_trainer cases (bf16 autocast and
   `torch.compile` on a GPU), fresh processes, interleaved, as many rounds as the budget allows (up to
   `--lm-rounds`); each case compiles into its own inductor and Triton caches, so both start cold. As
   ratios trainer/plain: tokens/s (overall and after the warm-up steps; above 1: the trainer is faster)
   and peak memory (`torch.cuda.max_memory_allocated`; peak RSS on the CPU). Fails only when a case
   fails or its loss is not finite: the speed target is shown (PASS/MISS), not enforced.

The report is a dated markdown section for benchmarks/RESULTS.md (date, commit, GPU, torch, command,
one table row per check: ok/failed/skipped, seconds, figures), printed and written to `--out`; the script
does not edit RESULTS.md. The whole run keeps within `--budget` seconds (default 480): a check gets at
most what is left, runs shrunk (fewer steps) when that is below its own limit, and is skipped, with a
line saying so, when too little is left. Exit status 1 when a check failed, 2 when `--device cuda`
finds no CUDA (or on a bad argument). `--jobs 2` runs two checks at a time: for the CPU fallback on an
idle machine; on a GPU the checks share the device and their timings, so keep the default of 1.

Without CUDA (or with `--device cpu`) the same checks run on the CPU, reduced, as a fallback that says
so: gloo instead of NCCL, bf16 and fp16 autocast on the CPU, small sizes, no compile in the transformer
case, one torch thread per process (unless OMP_NUM_THREADS is set), and no GPU visible to any check's
process (`CUDA_VISIBLE_DEVICES=''`: on a GPU machine `--device cpu` runs what a machine without one
runs). `--quick` shrinks every size further (the test suite runs the fallback with it); on the CPU it
also compiles with `backend="aot_eager"` (dynamo and AOTAutograd without inductor's C++ build, ~30 s on
2 cores), which `--compile-backend inductor` undoes.

The parent process imports no torch: a probe process reads the device (name, capability, CUDA and NCCL
versions), so the parent never holds a CUDA context.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TESTS = REPO / "tests"
CHECKS = ("tests", "bf16", "fp16", "compile", "ddp", "transformer")
TITLES = {
    "tests": "CUDA-only tests",
    "bf16": "bf16 autocast",
    "fp16": "fp16 autocast + GradScaler",
    "compile": "compile_model",
    "ddp": "DDP / process group",
    "transformer": "transformer vs plain loop",
}
# Per check: (time limit in seconds, the least it runs in). Each gets min(limit, what the budget has left).
LIMITS = {
    "tests": (150.0, 25.0),
    "bf16": (60.0, 10.0),
    "fp16": (60.0, 10.0),
    "compile": (180.0, 20.0),
    "ddp": (120.0, 20.0),
    "transformer": (300.0, 30.0),
}
DEFAULT_BUDGET = 480.0
# Sizes: the MLP of the training checks and benchmarks/transformer.py's model (d_model, layers, batch, steps,
# warm-up steps). "gpu" is RESULTS.md's documented GPU command of the transformer benchmark.
PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {"width": 1024, "batch": 512, "steps": 300, "n_data": 65536, "ddp_steps": 100, "lr": 1e-3,
            "lm": {"d_model": 1024, "layers": 8, "batch": 64, "steps": 300, "warm_steps": 50}, "lm_rounds": 3},
    "cpu": {"width": 64, "batch": 64, "steps": 80, "n_data": 4096, "ddp_steps": 40, "lr": 1e-2,
            "lm": {"d_model": 128, "layers": 2, "batch": 8, "steps": 8, "warm_steps": 2}, "lm_rounds": 2},
    "quick": {"width": 32, "batch": 64, "steps": 40, "n_data": 2048, "ddp_steps": 20, "lr": 1e-2,
              "lm": {"d_model": 64, "layers": 1, "batch": 4, "steps": 4, "warm_steps": 1}, "lm_rounds": 1},
}  # fmt: skip
FEATURES, CLASSES = 32, 4
# A skip reason that names CUDA or a GPU ("needs CUDA", "requires a GPU"): the CUDA-only tests' mark.
CUDA_REASON = re.compile(r"cuda|gpu", re.I)
# The check processes do not inherit what a surrounding torchrun or pytest-xdist worker set (a child
# would take itself for a rank, a nested pytest for a worker).
_LAUNCHER_VARS = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
    | {"ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"}
)
_NOT_INHERITED = ("TORCHELASTIC", "PYTEST_XDIST", "PYTEST_CURRENT_TEST")


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- running child processes ------------------------------------------------------------------------
@dataclass
class Proc:
    returncode: int | None  # None: killed at its time limit
    output: str  # stdout and stderr together
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def why(self) -> str:
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        return f"exited with code {self.returncode}"

    def tail(self, n: int = 3000) -> str:
        """The end of the output; with a traceback, the first one (a rank's own, above torchrun's
        summary) and then the end."""
        text = self.output.strip()
        first = text.find("Traceback (most recent call last)")
        if first < 0 or len(text) - first <= n:
            return text[-n:]
        start = text.rfind("\n", 0, first) + 1
        return text[start : start + n // 2] + "\n[...]\n" + text[-n // 2 :]


def python() -> str:
    """The interpreter of the checks' processes: torchrun's `PYTHON_EXEC` where it is set (torchrun starts its
    ranks with it), else this one."""
    return os.environ.get("PYTHON_EXEC") or sys.executable


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository on PYTHONPATH, minus anything a surrounding torchrun set."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_NOT_INHERITED)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONHASHSEED", "0")
    env.update(extra)
    return env


# The child processes running now (several with --jobs): Ctrl-C in the parent ends them all.
_LIVE: set[subprocess.Popen[Any]] = set()
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set by Ctrl-C: no new child starts


def run_proc(argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> Proc:
    """Run `argv` in the repository root in its own session, output to a file; at `timeout` the whole
    process group is killed (torchrun's ranks, pytest's children)."""
    argv = [str(a) for a in argv]
    start = time.perf_counter()
    if _STOPPING.is_set():
        return Proc(None, "not started: interrupted", 0.0)
    with tempfile.TemporaryFile("w+", errors="replace") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env or child_env(), cwd=REPO, start_new_session=True
        )
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            code: int | None = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
            if proc.returncode is None:  # timed out, or Ctrl-C while waiting
                _kill_group(proc)
        out.seek(0)
        text = out.read()
    return Proc(code, text, time.perf_counter() - start)


def kill_live_children() -> None:
    _STOPPING.set()
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_worker(
    name: str, spec: dict[str, Any], timeout: float, launcher: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[dict[str, Any] | None, Proc]:
    """`python gpu_check.py --worker NAME` (behind `launcher`, e.g. torchrun): the dict it wrote, or None."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        result_file = Path(tmp) / "result.json"
        script = [str(Path(__file__).resolve()), "--worker", name, "--spec", json.dumps(spec)]
        script += ["--result", str(result_file)]
        argv = [*launcher, *script] if launcher else [python(), *script]
        proc = run_proc(argv, timeout, env)
        result = json.loads(result_file.read_text()) if result_file.exists() else None
    return result, proc


# --- the checks (parent side) -------------------------------------------------------------------------
@dataclass
class CheckResult:
    name: str
    status: str  # "ok", "failed" or "skipped"
    seconds: float = 0.0
    figures: str = ""
    detail: str = ""  # why it failed: problems, the tail of the output

    @property
    def title(self) -> str:
        return TITLES[self.name]


@dataclass
class Context:
    device: str  # "cuda" or "cpu"
    probe: dict[str, Any]
    sizes: dict[str, Any]
    scale: float  # 1.0, or below when the budget shrinks this check
    compile_backend: str
    ddp_ranks: int
    lm_rounds: int
    workdir: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def steps(self, n: int, least: int = 4) -> int:
        return max(least, round(n * self.scale))


def _worker_check(name: str, result: dict[str, Any] | None, proc: Proc) -> CheckResult:
    if result is None:
        return CheckResult(name, "failed", proc.seconds, f"no result: the process {proc.why()}", proc.tail())
    problems = result.get("problems", [])
    if proc.returncode != 0:
        problems = [f"the process {proc.why()}", *problems]
    status = "failed" if problems else "ok"
    detail = "\n".join(problems) + ("\n\n" + proc.tail() if problems else "")
    return CheckResult(name, status, proc.seconds, result.get("figures", ""), detail.strip())


def candidate_test_files() -> list[str]:
    """The test files that mention CUDA or a GPU at all (the others cannot hold a CUDA-only test)."""
    return [str(p.relative_to(REPO)) for p in sorted(TESTS.glob("test_*.py")) if CUDA_REASON.search(p.read_text())]


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failed/skipped test names of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out["failed"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            out["failures"].append(f"{name}: {message[0][:300] if message else bad.tag}")
        elif skip is not None:
            out["skipped"] += 1
            out["skips"].append(f"{name}: {(skip.get('message') or '').strip()[:200]}")
        else:
            out["passed"] += 1
    return out


def check_tests(ctx: Context, timeout: float) -> CheckResult:
    deadline = time.perf_counter() + timeout
    files = candidate_test_files()
    found, proc = run_worker("collect", {"files": files}, timeout)
    if found is None or proc.returncode != 0:
        why = f"collecting {len(files)} test files: the process {proc.why()}"
        return CheckResult("tests", "failed", proc.seconds, why, proc.tail())
    ids: list[str] = found["cuda_only"]
    if not ids:
        why = f"no CUDA-only test found among the {found['collected']} tests of {len(files)} files (discovery broken?)"
        return CheckResult("tests", "failed", proc.seconds, why, proc.tail())
    log(f"tests: {len(ids)} CUDA-only test(s): {', '.join(ids)}")
    junit = ctx.workdir / "cuda_tests.xml"
    argv = [python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}"]
    argv.append(f"--basetemp={ctx.workdir / 'pytest'}")  # its own: no cleanup of other runs' directories
    run = run_proc([*argv, *ids], deadline - time.perf_counter())
    seconds = proc.seconds + run.seconds
    if not junit.exists():
        return CheckResult("tests", "failed", seconds, f"pytest {run.why()} and wrote no report", run.tail())
    counts = parse_junit(junit)
    figures = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped of {len(ids)}: "
    figures += ", ".join(i.split("::", 1)[-1] if "::" in i else i for i in ids[:8])
    figures += f" and {len(ids) - 8} more" if len(ids) > 8 else ""
    if counts["failures"]:
        figures += "; failed: " + "; ".join(counts["failures"])
    if ctx.cuda and counts["skipped"]:
        figures += "; skipped on this GPU: " + "; ".join(counts["skips"])
    problems = []
    if counts["failed"] or run.timed_out or run.returncode not in (0,):
        problems.append(f"pytest {run.why()}: {counts['failed']} failed")
    reported = counts["passed"] + counts["failed"] + counts["skipped"]
    if reported != len(ids):
        problems.append(f"pytest reported {reported} of {len(ids)} tests")
    if not ctx.cuda and counts["skipped"] != len(ids):
        problems.append("without CUDA every CUDA-only test should have been skipped")
    detail = "\n".join(problems) + ("\n\n" + run.tail() if problems else "")
    return CheckResult("tests", "failed" if problems else "ok", seconds, figures, detail.strip())


def _train_spec(ctx: Context, **kw: Any) -> dict[str, Any]:
    s = ctx.sizes
    spec = {"device": ctx.device, "width": s["width"], "batch": s["batch"], "n_data": s["n_data"], "lr": s["lr"]}
    spec.update(steps=ctx.steps(s["steps"], least=20), mixed_precision=None, compile=False)
    spec.update(compile_backend=ctx.compile_backend)
    return {**spec, **kw}


def check_bf16(ctx: Context, timeout: float) -> CheckResult:
    if ctx.cuda and not ctx.probe.get("bf16_supported", True):
        return CheckResult("bf16", "skipped", 0.0, f"{ctx.probe.get('name')} has no bf16 (NVIDIA GPUs from Ampere on)")
    return _worker_check("bf16", *run_worker("train", _train_spec(ctx, mixed_precision="bf16"), timeout))


def check_fp16(ctx: Context, timeout: float) -> CheckResult:
    return _worker_check("fp16", *run_worker("train", _train_spec(ctx, mixed_precision="fp16"), timeout))


def check_compile(ctx: Context, timeout: float) -> CheckResult:
    return _worker_check("compile", *run_worker("train", _train_spec(ctx, compile=True), timeout))


def check_ddp(ctx: Context, timeout: float) -> CheckResult:
    spec = _train_spec(ctx, steps=ctx.steps(ctx.sizes["ddp_steps"], least=8))
    launcher = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ctx.ddp_ranks)]
    env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return _worker_check("ddp", *run_worker("ddp", spec, timeout, launcher=launcher, env=env))


def check_transformer(ctx: Context, timeout: float) -> CheckResult:
    deadline = time.perf_counter() + timeout
    lm = dict(ctx.sizes["lm"])
    lm["steps"] = ctx.steps(lm["steps"], least=lm["warm_steps"] + 2)
    lm.update(device=ctx.device, bf16=ctx.cuda and bool(ctx.probe.get("bf16_supported")), compile=ctx.cuda)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "dream": []}
    seconds, note = 0.0, ""
    for rnd in range(ctx.lm_rounds):
        round_start = time.perf_counter()
        for case in runs:
            # Its own inductor and Triton caches per case: both compile cold in the first round, warm after it.
            caches = ctx.workdir / f"caches-{case}"
            env = child_env(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
            left = deadline - time.perf_counter()
            log(f"transformer: {case} (round {rnd + 1}/{ctx.lm_rounds}, {left:.0f} s left)")
            result, proc = run_worker("lm", {**lm, "case": case}, left, env=env)
            seconds += proc.seconds
            if result is None or proc.returncode != 0:
                why = f"{case}, round {rnd + 1}: the process {proc.why()}"
                return CheckResult("transformer", "failed", seconds, why, proc.tail())
            runs[case].append(result)
        took, left = time.perf_counter() - round_start, deadline - time.perf_counter()
        if rnd + 1 < ctx.lm_rounds and left < 1.2 * took:
            note = f"; {rnd + 1} of {ctx.lm_rounds} rounds (a round took {took:.0f} s, {left:.0f} s were left)"
            log(f"transformer: stopping after round {rnd + 1}{note}")
            break
    plain, dream = runs["plain"], runs["dream"]

    def ratio(key: str) -> float:
        return statistics.median(d[key] / p[key] for p, d in zip(plain, dream, strict=True))

    def med(case: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in case)

    def both(key: str, unit: str) -> str:
        return f"{ratio(key):.3f}x (dream {med(dream, key):,.0f}, plain {med(plain, key):,.0f} {unit})"

    mode = ", ".join(x for x, on in (("bf16", lm["bf16"]), ("torch.compile", lm["compile"])) if on) or "fp32 eager"
    figures = (
        f"{lm['layers']} layers, d_model {lm['d_model']}, batch {lm['batch']}, {lm['steps']} steps, {mode}, "
        f"{len(plain)} round(s){note}. tokens/s dream/plain {both('tokens_per_s', 'tokens/s')}"
    )
    key = "tokens_per_s"
    if "steady_tokens_per_s" in plain[0]:
        key = "steady_tokens_per_s"
        figures += f"; after {lm['warm_steps']} warm-up step(s) {both(key, 'tokens/s')}"
    # benchmarks/transformer.py's target, dream <= 1.02x the plain loop's time, as a rate: informative only.
    figures += f" (target >= 0.98x: {'PASS' if ratio(key) >= 1 / 1.02 else 'MISS'})"
    what = "peak CUDA memory" if ctx.cuda else "peak RSS"
    figures += f"; {what} dream/plain {both('peak_memory_mb', 'MiB')}"
    losses = {c: [r["final_loss"] for r in rs] for c, rs in runs.items()}
    figures += f"; final loss plain {losses['plain'][-1]:.3f}, dream {losses['dream'][-1]:.3f}"
    bad = [f"{c}: final loss {v}" for c, vs in losses.items() for v in vs if not math.isfinite(v)]
    return CheckResult("transformer", "failed" if bad else "ok", seconds, figures, "\n".join(bad))


CHECK_FUNCS: dict[str, Callable[[Context, float], CheckResult]] = {
    "tests": check_tests,
    "bf16": check_bf16,
    "fp16": check_fp16,
    "compile": check_compile,
    "ddp": check_ddp,
    "transformer": check_transformer,
}


def plan_check(left: float, limit: float, least: float) -> tuple[float | None, float]:
    """(time limit, scale) for a check with `left` seconds of the budget: None when under `least`
    (skip it); a scale below 1 (fewer steps) when what is left is below the check's own limit."""
    if left < least:
        return None, 0.0
    if left >= limit:
        return limit, 1.0
    return left, max(0.25, left / limit)


# --- the workers (child side: torch lives here) -------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def worker_probe(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    out.update(cuda=torch.cuda.is_available(), cuda_version=torch.version.cuda)
    if out["cuda"]:
        out["device_count"] = torch.cuda.device_count()
        out["name"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        out["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
        try:
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as exc:
            out["nccl"] = f"unavailable ({type(exc).__name__})"
    return out


def worker_collect(spec: dict[str, Any]) -> dict[str, Any]:
    """Collect `files` with torch told there is no CUDA; the tests whose skip marks then fire for a CUDA
    or GPU reason are the CUDA-only ones."""
    import torch

    torch.cuda.is_available = lambda: False
    torch.cuda.device_count = lambda: 0
    import pytest

    class Collector:
        def __init__(self) -> None:
            self.cuda_only: list[str] = []
            self.collected = 0

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items: list[Any]) -> None:
            self.collected = len(items)
            for item in items:
                try:
                    reasons = _skip_reasons(item)
                except Exception as exc:  # a condition that fails to evaluate: pytest reports it when run
                    reasons = [f"{type(exc).__name__}: {exc}"]
                if any(map(CUDA_REASON.search, reasons)):
                    self.cuda_only.append(item.nodeid)

    collector = Collector()
    # Collecting needs none of the plugins that only run tests (a second or so of imports).
    quiet = [f"no:{name}" for name in ("cacheprovider", "hypothesispytest", "anyio", "benchmark", "xdist")]
    args = ["--collect-only", "-q", *(x for q in quiet for x in ("-p", q)), "-o", "addopts=", *spec["files"]]
    code = pytest.main(args, plugins=[collector])
    if code not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise SystemExit(f"pytest --collect-only exited with {code}")
    return {"cuda_only": collector.cuda_only, "collected": collector.collected}


def _skip_reasons(item: Any) -> list[str]:
    """The reasons of the skip/skipif marks of `item` that fire (pytest's own evaluation of conditions)."""
    try:
        from _pytest.skipping import evaluate_condition
    except ImportError:  # pragma: no cover - a pytest without it: bool conditions only
        evaluate_condition = None
    reasons = []
    for mark in item.iter_markers(name="skipif"):
        conditions = mark.args if "condition" not in mark.kwargs else (mark.kwargs["condition"],)
        for condition in conditions or (True,):
            if evaluate_condition is not None:
                fired, reason = evaluate_condition(item, mark, condition)
            else:
                fired, reason = bool(condition) if not isinstance(condition, str) else False, ""
            if fired:
                reasons.append(reason or mark.kwargs.get("reason", "") or str(condition))
    for mark in item.iter_markers(name="skip"):
        reasons.append(str(mark.kwargs.get("reason", mark.args[0] if mark.args else "")))
    return reasons


def _check_net(spec: dict[str, Any]) -> Any:
    """The DreamTrainer of the training checks: an MLP classifying points by the fixed direction they point
    along most (the loss falls from ln 4 within a few dozen steps)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dream_trainer import DreamTrainer

    device, width, batch = spec["device"], spec["width"], spec["batch"]

    class CheckNet(DreamTrainer):
        def configure_models(self) -> None:
            self.model = nn.Sequential(
                nn.Linear(FEATURES, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, CLASSES)
            )
            self.losses: list[Any] = []
            self.scales: list[float] = []
            self.autocast_dtype: Any = None
            self.times: list[float] = []

        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec["lr"])

        def configure_dataloaders(self) -> Any:
            g = torch.Generator().manual_seed(0)
            directions = torch.randn(FEATURES, CLASSES, generator=g)
            x = torch.randn(spec["n_data"], FEATURES, generator=g)
            data = TensorDataset(x, (x @ directions).argmax(dim=1))
            pin = device.startswith("cuda")
            return DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, pin_memory=pin), None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.model(x)
            self.autocast_dtype = logits.dtype
            loss = F.cross_entropy(logits.float(), y)
            self.losses.append(loss.detach())
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.grad_scaler is not None:
                self.scales.append(float(self.grad_scaler.get_scale()))
            if len(self.times) < 2:  # after the first step (compilation, warm-up) and after the second
                _sync(device)
                self.times.append(time.perf_counter())

    return CheckNet


def _config(spec: dict[str, Any], root: str, **kw: Any) -> Any:
    from dream_trainer import DreamTrainerConfig

    return DreamTrainerConfig(
        max_steps=spec["steps"], seed=0, device=spec["device"], mixed_precision=spec["mixed_precision"],
        compile_model=spec["compile"], root_dir=root, loggers=[], enable_progress_bar=False,
        enable_checkpointing=False, print_epoch_summary=False, num_sanity_val_steps=0,
        log_every_n_steps=max(1, spec["steps"] // 4), **kw,
    )  # fmt: skip


def _loss_problems(losses: list[float], steps: int) -> tuple[str, list[str]]:
    """'loss a -> b (n steps)' and what is wrong with the series: non-finite, not falling."""
    problems = []
    if len(losses) != steps:
        problems.append(f"{len(losses)} training steps ran, expected {steps}")
    if not losses:
        return "no loss", [*problems, "no loss was recorded"]
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        problems.append(f"non-finite loss at {len(bad)} step(s), first at step {bad[0]}")
    elif not last < 0.8 * first:
        problems.append(f"the loss did not fall: mean of the first {k} steps {first:.4f}, of the last {k} {last:.4f}")
    return f"loss {first:.3f} -> {last:.3f} ({len(losses)} steps)", problems


def _patch_compile_backend(backend: str) -> None:
    import torch

    if backend and backend != "inductor":  # the trainer calls torch.compile(model): give it this backend
        torch.compile = functools.partial(torch.compile, backend=backend)


def worker_train(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    device, mp = spec["device"], spec["mixed_precision"]
    if spec["compile"]:
        _patch_compile_backend(spec["compile_backend"])
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="gpu-check-run-") as root:
        trainer = _check_net(spec)(_config(spec, root))
        start = time.perf_counter()
        trainer.fit()
        _sync(device)
        end = time.perf_counter()
    losses = [float(v) for v in torch.stack(trainer.losses).float().cpu().tolist()] if trainer.losses else []
    figures, problems = _loss_problems(losses, spec["steps"])
    param = next(trainer.model.parameters())
    parts = [figures, f"step dtype {str(trainer.autocast_dtype).replace('torch.', '')}"]
    parts.append(f"weights {str(param.dtype).replace('torch.', '')} on {param.device}")
    if param.device.type != torch.device(device).type:
        problems.append(f"the weights are on {param.device}, not {device}")
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp or "", torch.float32)
    if trainer.autocast_dtype != expected:
        problems.append(f"training_step computed in {trainer.autocast_dtype}, expected {expected}")
    if param.dtype != torch.float32:
        problems.append(f"the weights are {param.dtype}: autocast should leave them fp32")
    if mp == "fp16":
        scaler = trainer.grad_scaler
        if not isinstance(scaler, torch.amp.GradScaler):
            problems.append(f"fp16 without the trainer's GradScaler (grad_scaler={scaler!r})")
        else:
            # The scaler skips a step exactly when it halves the scale (from 2**16, its initial scale).
            halvings = sum(b < a for a, b in zip([65536.0, *trainer.scales], trainer.scales, strict=False))
            scale = trainer.scales[-1]
            parts.append(f"{type(scaler).__name__}: scale {scale:g} at the end, {halvings} step(s) skipped")
            if not (math.isfinite(scale) and scale > 0):
                problems.append(f"loss scale {scale}")
    elif trainer.grad_scaler is not None:
        problems.append(f"a GradScaler under mixed_precision={mp!r}")
    if spec["compile"]:
        compiled = hasattr(trainer.model, "_orig_mod")
        parts.append(f"OptimizedModule: {'yes' if compiled else 'NO'}, backend {spec['compile_backend']}")
        if not compiled:
            problems.append(f"compile_model=True left the model a {type(trainer.model).__name__}")
        try:
            from torch._dynamo.utils import counters

            parts.append(f"{counters['stats']['unique_graphs']} graph(s) compiled")
        except Exception:
            pass
    if len(trainer.times) == 2:
        first_step = trainer.times[0] - start
        rest = (end - trainer.times[1]) / max(1, len(losses) - 2)
        parts.append(f"fit() to the first step's end {first_step:.2f} s, then {rest * 1e3:.2f} ms/step")
    if device.startswith("cuda"):
        parts.append(f"peak CUDA memory {_peak_memory_mb(device):,.0f} MiB")
    return {"figures": "; ".join(parts), "problems": problems}


def worker_ddp(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Under torchrun: a fit with strategy="ddp", one with strategy="fsdp", then all-reduces through the
    group. Every rank checks; rank 0 reports."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = spec["device"].startswith("cuda")
    parts, problems = [f"torchrun, {world} rank(s)"], []
    net = _check_net(spec)
    for strategy in ("ddp", "fsdp"):
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{strategy}-") as root:
            trainer = net(_config(spec, root, strategy=strategy))
            trainer.fit()
            _sync(spec["device"])
        losses = [float(v) for v in torch.stack(trainer.losses).float().cpu().tolist()]
        figures, bad = _loss_problems(losses, spec["steps"])
        wrapper = type(trainer.model).__name__
        text = f"{strategy}: strategy {trainer.strategy!r}, model {wrapper}, {figures}"
        if strategy == "ddp":
            wrapped = wrapper == "DistributedDataParallel"
            if world == 1:
                text += " (one rank: the DDP strategy does not wrap)"
            elif not wrapped:
                bad.append(f"{world} ranks but the model is a {wrapper}, not DistributedDataParallel")
        if dist.is_initialized():
            text += f", group backend {dist.get_backend()}"
        parts.append(text)
        problems += [f"{strategy}: {p}" for p in bad]
        if strategy == "ddp" and world > 1:  # the replicas must hold the same weights
            total = torch.stack([p.detach().float().sum() for p in trainer.model.parameters()]).sum().item()
            sums: list[Any] = [None] * world
            dist.all_gather_object(sums, total)
            if len(set(sums)) != 1:
                problems.append(f"ddp: the ranks' weights differ after training: {sums}")
    if not dist.is_initialized():
        problems.append("no process group after the FSDP run")
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t)
        _sync(spec["device"])
        want = world * (world + 1) / 2
        ok = bool((t == want).all().item())
        used = "NCCL" if cuda else "gloo"
        parts.append(f"all_reduce of a {device.type} tensor ({used}): {'ok' if ok else 'WRONG'}")
        if not ok:
            problems.append(f"all_reduce gave {t.tolist()}, expected {want}")
        if cuda and "nccl" not in str(dist.get_backend()):
            problems.append(f"the trainer's process group on CUDA has backend {dist.get_backend()!r}, no NCCL")
    if rank != 0:
        if problems:
            raise SystemExit(f"rank {rank}: " + "; ".join(problems))
        return None
    return {"figures": "; ".join(parts), "problems": problems}


def worker_lm(spec: dict[str, Any]) -> dict[str, Any]:
    """One case of benchmarks/transformer.py (its own functions, configured as its command line would)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import transformer as lm

    keys = ("d_model", "layers", "batch", "device", "bf16", "compile", "warm_steps")
    lm._configure(argparse.Namespace(**{k: spec[k] for k in keys}))  # what its command line sets
    import torch
    import torch._dynamo  # as transformer.worker(): the imports stay out of the timing
    import torch.nn.functional
    import torch.utils.data

    if spec["case"] == "dream":
        import dream_trainer  # noqa: F401
    if spec["device"].startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    result = {"plain": lm.run_plain, "dream": lm.run_dream}[spec["case"]](spec["steps"])
    return {**result, "peak_memory_mb": _peak_memory_mb(spec["device"])}


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
    "probe": worker_probe,
    "collect": worker_collect,
    "train": worker_train,
    "ddp": worker_ddp,
    "lm": worker_lm,
}


def _worker_main(name: str, spec: dict[str, Any], result_file: str) -> None:
    result = WORKERS[name](spec)
    if result is not None:
        Path(result_file).write_text(json.dumps(result, default=str))


# --- the report --------------------------------------------------------------------------------------
def source_commit() -> str:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import suite

    return suite.source_commit()


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            return names[0]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(
    results: list[CheckResult], ctx: Context, command: str, started: datetime.datetime, elapsed: float,
    budget: float, notes: list[str], fallback: str | None = None,
) -> str:  # fmt: skip
    """The dated markdown section: a heading, the labels RESULTS.md's sections carry (date, commit,
    machine with its GPU, cores and torch version, command), the table, and each failure's output."""
    p = ctx.probe
    commit = source_commit()
    host = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({_cpu_name()})"
    software = f"torch {p.get('torch')}, Python {p.get('python')}"
    if ctx.cuda:
        title = f"## GPU check: {p.get('name')} ({started:%Y-%m-%d}, commit {commit.split()[0]})"
        machine = (
            f"{p.get('name')} (compute capability {p.get('capability')}, {p.get('memory_gib')} GiB; "
            f"{p.get('device_count')} GPU(s) visible), CUDA {p.get('cuda_version')}, NCCL {p.get('nccl')}; "
            f"{host}; {software}"
        )
    else:
        title = f"## GPU check, CPU fallback ({started:%Y-%m-%d}, commit {commit.split()[0]})"
        machine = f"CPU only, {fallback or 'the CPU fallback'}; {host}; {software}"
    lines = [
        title,
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC (the check took {elapsed:.0f} s of a {budget:.0f} s budget)",
        f"- commit: {commit}",
        f"- machine: {machine}",
        f"- command: `{command}`",
        *[f"- {n}" for n in notes],
        "",
        "| check | result | seconds | figures |",
        "|---|---|---:|---|",
    ]
    lines += [f"| {r.title} | {r.status} | {r.seconds:.1f} | {_cell(r.figures)} |" for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "failed", "skipped")}
    lines += ["", f"{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped"]
    for r in results:
        if r.status == "failed" and r.detail:
            lines += ["", f"**{r.title} failed:**", "```", r.detail[-4000:], "```"]
    return "\n".join(lines) + "\n"


# --- main -------------------------------------------------------------------------------------------
def choose_device(asked: str, probe: dict[str, Any]) -> tuple[str, str | None]:
    """("cuda" or "cpu", the line to print when falling back); ValueError for cuda without CUDA."""
    if asked == "cuda" and not probe.get("cuda"):
        raise ValueError(f"--device cuda: torch {probe.get('torch')} sees no CUDA device")
    if asked == "cpu":
        return "cpu", "--device cpu: the CPU fallback (reduced checks, not GPU evidence)"
    if probe.get("cuda"):
        return "cuda", None
    return "cpu", "no CUDA device: the CPU fallback (reduced checks, not GPU evidence)"


def parse_skip(text: str | None) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"--skip: unknown check(s) {', '.join(unknown)}; valid: {', '.join(CHECKS)}")
    return names


def local_probe() -> dict[str, Any]:
    """What the report says about torch on `--device cpu`, read from the metadata (no probe process)."""
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        torch_version = "unknown"
    return {"torch": torch_version, "cuda": None, "python": platform.python_version()}


def run_checks(
    names: Sequence[str], skip: Sequence[str], deadline: float, jobs: int, make_ctx: Callable[[float, Path], Context],
    notes: list[str],
) -> list[CheckResult]:  # fmt: skip
    """Each check in turn (`jobs` at a time), within what the budget has left when it starts."""

    def one(name: str, tmp: Path) -> CheckResult:
        if name in skip:
            return CheckResult(name, "skipped", figures="--skip")
        left = deadline - time.perf_counter()
        limit, scale = plan_check(left, *LIMITS[name])
        if limit is None:
            why = f"skipped: {max(left, 0):.0f} s of the budget left, the check needs at least {LIMITS[name][1]:.0f} s"
            log(f"{name}: {why}")
            notes.append(f"{TITLES[name]}: {why}")
            return CheckResult(name, "skipped", figures=why)
        if scale < 1:
            why = f"{left:.0f} s of the budget left (its limit {LIMITS[name][0]:.0f} s): steps scaled to {scale:.0%}"
            log(f"{name}: shrunk, {why}")
            notes.append(f"{TITLES[name]}: shrunk, {why}")
        log(f"=== {TITLES[name]} (limit {limit:.0f} s) ===")
        try:
            result = CHECK_FUNCS[name](make_ctx(scale, tmp), limit)
        except Exception as exc:  # the check's own code failed: report it, run the others
            result = CheckResult(name, "failed", 0.0, f"{type(exc).__name__}: {exc}", repr(exc))
        log(f"{name}: {result.status} ({result.seconds:.1f} s) {result.figures}")
        return result

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [pool.submit(one, name, Path(tmp)) for name in names]
        try:
            return [f.result() for f in futures]
        except BaseException:  # Ctrl-C: nothing new starts, the running children end
            for f in futures:
                f.cancel()
            kill_live_children()
            raise


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for the whole run (default 480)")
    p.add_argument("--out", default="gpu_check.md", help="write the markdown section here (default gpu_check.md)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--skip", help=f"comma-separated checks to leave out: {', '.join(CHECKS)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run; figures mean little)")
    p.add_argument("--jobs", type=int, default=1, help="checks run at a time (default 1; on a GPU keep 1: timings)")
    p.add_argument("--compile-backend", help="torch.compile backend (default inductor; --quick on the CPU: aot_eager)")
    p.add_argument("--ddp-ranks", type=int, help="torchrun processes (default: 2 with two GPUs, else 1)")
    p.add_argument("--lm-rounds", type=int, help="most transformer rounds (default 3 on a GPU, 2 on the CPU, 1 quick)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker_main(args.worker, json.loads(args.spec or "{}"), args.result)
        return {}
    try:
        skip = parse_skip(args.skip)
    except ValueError as exc:
        p.error(str(exc))
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "benchmarks/gpu_check.py", *given])
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()

    if args.device == "cpu":
        probe = local_probe()
    else:
        probe, proc = run_worker("probe", {}, min(120.0, max(args.budget, 10.0)))
        if probe is None:
            raise SystemExit(f"the probe process (import torch, read the device) {proc.why()}:\n{proc.tail()}")
    try:
        device, fallback = choose_device(args.device, probe)
    except ValueError as exc:
        p.exit(2, f"gpu_check.py: {exc}\n")
    if fallback:
        print(fallback, flush=True)
    else:
        log(f"CUDA: {probe['name']}, torch {probe['torch']}")
    sizes = PROFILES["quick" if args.quick else device.replace("cuda", "gpu")]
    backend = args.compile_backend or ("aot_eager" if args.quick and device == "cpu" else "inductor")
    ranks = args.ddp_ranks or (min(2, probe.get("device_count", 1)) if device == "cuda" else 1)
    rounds = args.lm_rounds or sizes["lm_rounds"]
    notes = []
    if args.quick:
        notes.append("quick run: tiny sizes, the figures mean little")
    if backend != "inductor":
        notes.append(f"compile check with torch.compile backend={backend!r}")
    if args.jobs > 1:
        notes.append(f"{args.jobs} checks at a time (--jobs): their timings overlap")
    # On the CPU the checks' processes run one torch thread each (unless OMP_NUM_THREADS says otherwise).
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    if device == "cpu" and saved_omp is None:
        os.environ["OMP_NUM_THREADS"] = "1"
        notes.append("OMP_NUM_THREADS=1 in every check process")
    # The CPU fallback hides any GPU from its checks: on a GPU machine `--device cpu` runs what a machine
    # without one runs (the CUDA-only tests skipped, gloo alone), not a mix of both.
    saved_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    def make_ctx(scale: float, tmp: Path) -> Context:
        return Context(device, probe, sizes, scale, backend, ranks, rounds, tmp)

    try:
        results = run_checks(CHECKS, skip, t0 + args.budget, args.jobs, make_ctx, notes)
    finally:
        if device == "cpu" and saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        if device == "cpu":
            if saved_visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved_visible
    elapsed = time.perf_counter() - t0
    text = report(results, make_ctx(1.0, Path(".")), command, started, elapsed, args.budget, notes, fallback)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    failed = [r.name for r in results if r.status == "failed"]
    out = {
        "device": device,
        "fallback": fallback,
        "probe": probe,
        "results": [asdict(r) for r in results],
        "markdown": text,
        "seconds": elapsed,
        "exit_code": 1 if failed else 0,
    }
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in out.items() if k != "markdown"}, indent=1))
    return out


if __name__ == "__main__":
    sys.exit(main().get("exit_code", 0))
