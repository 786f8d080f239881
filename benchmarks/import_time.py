"""Import time: `import dream_trainer` against `import torch` (and `import lightning.pytorch`).

Each import runs in a fresh interpreter (`python -c`), timed inside it around the import statement alone
(interpreter start-up is the same for all and left out); the modules are interleaved (torch,
dream_trainer, lightning.pytorch, torch, ...) over the rounds, after one untimed warm-up round that
fills the page cache and writes any stale bytecode. Reported: the median of each, and the median of
the per-round differences to torch. Target: dream_trainer <= torch + 0.2 s. Two more for reference: a
run with the defaults imports its TensorBoard writer when it starts, once, on top of the framework:
tensorboard's event protos for dream_trainer's (`import torch, tensorboard.compat.proto.event_pb2`), the whole
`torch.utils.tensorboard` (and tensorboard's TensorFlow stub) for Lightning's.

    python benchmarks/import_time.py                 # 10 rounds
    python benchmarks/import_time.py --rounds 3 --detail   # plus dream_trainer's own slowest modules
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

MODULES = (
    "torch",
    "dream_trainer",
    "torch, tensorboard.compat.proto.event_pb2",
    "torch.utils.tensorboard",
    "lightning.pytorch",
)
LIGHTNING_MODULES = frozenset({"lightning.pytorch"})

_CODE = """\
import time
t = time.perf_counter()
import {module}
seconds = time.perf_counter() - t
import json, resource, sys
print({sentinel!r} + json.dumps({{"module": {module!r}, "seconds": seconds,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10),
    "modules_loaded": len(sys.modules)}}))
"""


def _suite() -> Any:
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import suite

    return suite


def worker_argv(module: str) -> list[str]:
    return [sys.executable, "-c", _CODE.format(module=module, sentinel=_suite().SENTINEL)]


def measure(modules: list[str] | tuple[str, ...] = MODULES, rounds: int = 10, warmup: bool = True) -> dict[str, Any]:
    s = _suite()
    assert modules and modules[0] == "torch", "torch is the baseline: list it first"
    runs = s.interleave({m: worker_argv(m) for m in modules}, rounds, warmup=warmup, label="import")
    return {
        "seconds": {m: [r["seconds"] for r in v] for m, v in runs.items()},
        "peak_rss_mb": {m: [r["peak_rss_mb"] for r in v] for m, v in runs.items()},
        "modules_loaded": {m: v[0]["modules_loaded"] for m, v in runs.items()},
    }


def own_modules(top: int = 15) -> list[tuple[str, float]]:
    """dream_trainer's own modules and the non-torch modules it pulls in, by self time (python -X importtime)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import torch; import dream_trainer"],
        capture_output=True, text=True, check=True, env=_suite().child_env(),
    )  # fmt: skip
    seen_torch_end = False
    rows: list[tuple[str, float]] = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = [x.strip() for x in line[len("import time:") :].split("|")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        self_us, name = int(parts[0]), parts[2]
        if name == "torch":  # everything after `import torch` finished is dream_trainer's doing
            seen_torch_end = True
            continue
        if seen_torch_end:
            rows.append((name.strip(), self_us / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--detail", action="store_true", help="also list the slowest modules dream_trainer adds")
    args = p.parse_args(argv)
    s = _suite()
    modules = [m for m in MODULES if s.lightning_version() or m not in LIGHTNING_MODULES]
    raw = measure(modules, args.rounds)
    print(f"import time, fresh interpreters, {args.rounds} interleaved round(s) after a warm-up")
    print("| import | median s | median difference to torch | modules loaded |")
    print("|---|---:|---:|---:|")
    for m in modules:
        diff = statistics.median(a - b for a, b in zip(raw["seconds"][m], raw["seconds"]["torch"], strict=True))
        med = statistics.median(raw["seconds"][m])
        print(f"| {m} | {med:.3f} | {diff:+.3f} s | {raw['modules_loaded'][m]} |")
    if args.detail:
        raw["own_modules"] = own_modules()
        print("\nslowest modules imported by dream_trainer after torch (self time, one run):")
        for name, sec in raw["own_modules"]:
            print(f"  {sec * 1e3:7.1f} ms  {name}")
    return raw


if __name__ == "__main__":
    main()
