"""Run one benchmark script from two source trees, alternately, and compare their figures.

Each run is a fresh process with `PYTHONPATH` set to its tree (so `import dream_trainer` loads that
tree's code) and the script taken from that tree, or from the other one where it lacks the script.
The child calls the script's `main(argv)` (every script in benchmarks/ returns its figures as a dict)
and hands the dict back as JSON. Runs go in pairs, the order swapped every pair (A B, B A, A B, ...)
so drift on the machine hits both trees alike. For each figure it prints every pair, then the median
and the minimum of each tree, the after/before ratios (of the medians, of the minimums, and the median
and range of the per-pair ratios) and the median and range of the per-pair differences after - before
(the one to read for a figure near zero, such as step_overhead.py's `overhead_*_us`).

    python benchmarks/compare_trees.py BEFORE AFTER                      # step_overhead.py, 8 pairs
    python benchmarks/compare_trees.py /tmp/base /tmp/wt_after --pairs 8 -- --rounds 9 --steps 1000
    python benchmarks/compare_trees.py /tmp/wt_after /tmp/wt_nocrc --script benchmarks/checkpoint.py \\
        --pairs 4 -- --reps 9
    python benchmarks/compare_trees.py A B --keys save_s,save_min_s --json out.json -- --quick
    python benchmarks/compare_trees.py /tmp/base /tmp/wt_after --script benchmarks/suite.py --pairs 3 \\
        --json tiny.json -- --only tiny --rounds 5 --threads 1

Arguments after `--` go to the script. `--keys` picks the figures (default: per script below, all
numeric ones for any other script); nested results are flattened to dotted keys, e.g. suite.py's
`rows.1.value` (its second table row's ratio). Figures are taken from each run's returned dict, not
from its printed table; each child checks that `dream_trainer` came from its own tree.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SENTINEL = "@@COMPARE_RESULT "
DEFAULT_KEYS = {
    # the trainer's own us per step (dream - plain), then the whole dream step, then the plain control
    "step_overhead": ["overhead_min_us", "overhead_median_us", "dream_min_us", "dream_median_us", "plain_min_us"],
    # save_checkpoint, its ratio to torch.save in the same run, and the controls (same code in both trees)
    "checkpoint": ["save_s", "save_min_s", "save_ratio", "torch_save_s", "save_nocrc_s", "disk_floor_s"],
    # `suite.py --only tiny`: the time ratios to the plain loop of dream bare and dream defaults
    "suite": ["rows.1.value", "rows.2.value"],
}


def flatten(value: Any, name: str = "") -> dict[str, Any]:
    """Nested dicts and lists as one dict with dotted keys: {"rows": [{"value": 1}]} -> {"rows.0.value": 1}."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {name: value}
    return {k: v for key, item in items for k, v in flatten(item, f"{name}.{key}" if name else str(key)).items()}


def _child(script: str, argv: list[str]) -> None:
    """In the child: run `script`'s main(argv) and print its dict (plus where dream_trainer came from)."""
    import importlib.util

    sys.path[0] = str(Path(script).resolve().parent)  # the script's siblings, not this file's
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", script)
    assert spec is not None and spec.loader is not None, script
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (suite.py's Row) look their module up there
    spec.loader.exec_module(module)
    result = dict(module.main(argv))
    import dream_trainer

    result["_dream_trainer"] = str(Path(dream_trainer.__file__).resolve().parent)
    print(SENTINEL + json.dumps(result, default=str), flush=True)


def run_once(tree: Path, script: Path, argv: list[str]) -> dict[str, Any]:
    """One run of `script` with `tree` first on PYTHONPATH; the dict its main() returned."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(script), "--", *argv]
    # Output to a file, not a pipe: the parent does not wake up per line and steal CPU from the child.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=tree)
        out.seek(0)
        text = out.read()
    found = [line for line in text.splitlines() if line.startswith(SENTINEL)]
    if proc.returncode or not found:
        raise SystemExit(f"`{shlex.join(cmd)}` in {tree} failed (exit {proc.returncode}):\n{text[-3000:]}")
    result = flatten(json.loads(found[-1][len(SENTINEL) :]))
    if Path(result["_dream_trainer"]) != (tree / "dream_trainer").resolve():
        raise SystemExit(f"run in {tree} imported dream_trainer from {result['_dream_trainer']}")
    return result


def _script_in(tree: Path, other: Path, script: str) -> Path:
    for root in (tree, other):
        if (root / script).is_file():
            return root / script
    raise SystemExit(f"{script} is in neither {tree} nor {other}")


def summarise(keys: list[str], before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """Every pair's figures, then the summary table, as markdown."""
    pairs = ["| pair | " + " | ".join(f"{k}: before / after (ratio)" for k in keys) + " |"]
    pairs.append("|---|" + "---|" * len(keys))
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        cells = (f"{float(b[k]):.4g} / {float(a[k]):.4g} ({float(a[k]) / float(b[k]):.3f})" for k in keys)
        pairs.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    table = [
        "| figure | before median | after median | before min | after min | ratio of medians | ratio of mins "
        "| per-pair ratio: median (range) | per-pair after - before: median (range) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for key in keys:
        xs, ys = [float(r[key]) for r in before], [float(r[key]) for r in after]
        ratios = [y / x for x, y in zip(xs, ys, strict=True)]
        diffs = [y - x for x, y in zip(xs, ys, strict=True)]
        mx, my = statistics.median(xs), statistics.median(ys)
        table.append(
            f"| {key} | {mx:.4g} | {my:.4g} | {min(xs):.4g} | {min(ys):.4g} | {my / mx:.3f} | {min(ys) / min(xs):.3f} "
            f"| {statistics.median(ratios):.3f} ({min(ratios):.3f} to {max(ratios):.3f}) "
            f"| {statistics.median(diffs):+.4g} ({min(diffs):+.4g} to {max(diffs):+.4g}) |"
        )
    return "\n".join(pairs) + "\n\n" + "\n".join(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path, help="source tree A (the baseline)")
    p.add_argument("after", type=Path, help="source tree B")
    p.add_argument("--script", default="benchmarks/step_overhead.py", help="path inside the trees")
    p.add_argument("--pairs", type=int, default=8, help="runs of each tree, alternating")
    p.add_argument("--keys", help="comma-separated figures of the script's dict (default: see above)")
    p.add_argument("--json", help="also write every run's dict to this file")
    args, rest = p.parse_known_args(argv)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    trees = (args.before.resolve(), args.after.resolve())
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    scripts = (_script_in(trees[0], trees[1], args.script), _script_in(trees[1], trees[0], args.script))
    given = sys.argv[1:] if argv is None else argv
    print(f"command: `{shlex.join(['python', 'benchmarks/compare_trees.py', *given])}`")
    print(f"before: {trees[0]} ({scripts[0]})\nafter:  {trees[1]} ({scripts[1]})", flush=True)
    runs: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    for pair in range(args.pairs):
        for side in (0, 1) if pair % 2 == 0 else (1, 0):
            runs[side].append(run_once(trees[side], scripts[side], rest))
            print(f"pair {pair + 1}/{args.pairs}: {('before', 'after')[side]} done", file=sys.stderr, flush=True)
    stem = Path(args.script).stem
    numeric = [k for k, v in runs[0][0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    keys = args.keys.split(",") if args.keys else DEFAULT_KEYS.get(stem, numeric)
    print(summarise(keys, *runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"trees": [str(t) for t in trees], "before": runs[0], "after": runs[1]}))
    return {"before": runs[0], "after": runs[1]}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # internal: `--child SCRIPT -- ARGS...`, started by run_once
        _child(sys.argv[2], sys.argv[4:])
    else:
        main()
