"""Every ```python block of the documentation (docs/*.md and README.md) runs, or says why it cannot.

How a page marks its blocks (an HTML comment on the line right before the opening fence; it does not
show on the rendered site):

- no marker: the block runs on its own, in a fresh namespace, in a temporary working directory;
- `<!-- continue -->`: the block runs in the namespace of the previous runnable block of the same page
  (a page may build one trainer over several blocks); the chain is one test;
- `<!-- not-runnable: REASON -->`: the block is not run; REASON (required) says why, e.g. a method
  fragment or a script meant for `torchrun`;
- `<!-- output -->`, before a ```text block that comes right after a runnable python block (prose in
  between is fine, another fenced block is not): the text is what that python block prints, stdout and
  stderr in the order written (the trainer's `dream_trainer: run directory ...` line is on stderr), as a
  run piped into a file prints it. The test compares the two after normalising both (see `normalise`):

  - durations (`1.4s`, `0:01`, `1:02:03`, an unknown remaining time `?`) become `<t>`, rates
    (`4.40 it/s`, `2.00 s/it`) `<rate>`: they depend on the machine;
  - decimal numbers (`0.6841`, `1.2e-05`) become `<x>`: metric values depend on the random initial
    weights and the PyTorch build. Integers (epochs, steps, batch counts, run names) must match;
  - trailing spaces and blank lines at either end are dropped;
  - progress lines on the clock, `TextProgress`'s `epoch 1/3 | 5/16 | 0:01<0:02 | 4.40 it/s | ...` (a
    line with `elapsed<remaining`): how many a run prints depends on its speed. They are left out of the
    line-by-line comparison, and each one the page shows must have the shape (integers aside) of one
    the run printed; to print some in a run of a second, the test lowers `TextProgress`'s first-line
    delay (`FIRST_LINE_SECONDS`) to 0 for a chain whose page shows one.

  Every other line must be equal, in order: a page cannot show output its snippet does not print.

Any other HTML comment in that place, a marker with no block after it, or a Python block fenced as
`py`/`python3`/`pycon` (which this test would not see) fails the collection test below, so a block can
be neither skipped silently nor mislabelled. The other tests keep pages in step with the code: every
hook, built-in callback, error and public name appears where the docs promise it.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
COMMENT = re.compile(r"^<!--(?P<body>.*)-->$")
NOT_RUNNABLE = re.compile(r"^not-runnable:(?P<reason>.*)$")
CONTINUE = "continue"
OUTPUT = "output"
OTHER_PYTHON_TAGS = {"py", "py3", "python3", "pycon", "ipython", "pyi"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # the HTML comment body right before the fence, if any
    output: Block | None = None  # the ```text block after it marked <!-- output -->: what it prints

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Chain:
    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.blocks[0].where


def _blocks(page: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a page, and problems found while reading it (markers in the wrong place)."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    marker_lines: dict[int, str] = {}  # index -> body of each of our markers, to find orphans
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        comment = COMMENT.match(stripped)
        if comment and _is_ours(comment["body"].strip()):
            marker_lines[i] = comment["body"].strip()
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        lang = info.split()[0].strip("{}.").lower() if info else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and set(lines[j].strip()) == {fence[0]}):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        prev = COMMENT.match(lines[k].strip()) if k >= 0 else None
        marker = prev["body"].strip() if prev else None
        if marker is not None and k in marker_lines and (lang == "python" or (marker == OUTPUT and lang == "text")):
            marker_lines.pop(k)
        blocks.append(Block(page, i + 1, lang, "\n".join(body) + "\n", marker))
        i = j + 1
    for index, body in marker_lines.items():
        fence = "```text" if body == OUTPUT else "```python"
        problems.append(
            f"{page.relative_to(ROOT)}:{index + 1}: marker <!-- {body} --> is not right before a {fence} block"
        )
    return blocks, problems


def _is_ours(body: str) -> bool:
    """Looks like one of our markers (a misspelled one included, so that it is reported)."""
    return body.startswith(("not-runnable", "not runnable", "continue", "output"))


def _collect() -> tuple[list[Chain], list[Block], list[str]]:
    chains: list[Chain] = []
    skipped: list[Block] = []
    problems: list[str] = []
    for page in PAGES:
        blocks, page_problems = _blocks(page)
        problems += page_problems
        previous: Chain | None = None
        for i, block in enumerate(blocks):
            if block.lang == "text" and block.marker == OUTPUT:
                problems += _attach_output(block, blocks[i - 1] if i else None, previous)
                continue
            if block.lang in OTHER_PYTHON_TAGS:
                problems.append(f"{block.where}: fence the block as ```python (not ```{block.lang}) so it is tested")
                continue
            if block.lang != "python":
                continue
            if block.marker is None:
                previous = Chain([block])
                chains.append(previous)
            elif block.marker == CONTINUE:
                if previous is None:
                    problems.append(f"{block.where}: <!-- continue --> but no runnable block before it on the page")
                else:
                    previous.blocks.append(block)
            elif block.marker == OUTPUT:
                problems.append(f"{block.where}: <!-- output --> belongs before the ```text block of what this prints")
            elif (nr := NOT_RUNNABLE.match(block.marker)) is not None:
                if not nr["reason"].strip():
                    problems.append(f"{block.where}: <!-- not-runnable: ... --> needs a reason")
                skipped.append(block)
            else:
                problems.append(
                    f"{block.where}: unknown marker <!-- {block.marker} --> before a python block; "
                    "use <!-- continue --> or <!-- not-runnable: REASON -->"
                )
    return chains, skipped, problems


def _attach_output(text: Block, before: Block | None, chain: Chain | None) -> list[str]:
    """Give `text` (a ```text block marked <!-- output -->) to the python block right before it."""
    if before is None or before.lang != "python":
        return [f"{text.where}: <!-- output --> must follow a runnable ```python block, with no other block between"]
    if chain is None or before not in chain.blocks:
        return [f"{text.where}: <!-- output --> follows {before.where}, which is not run"]
    if before.output is not None:
        return [f"{text.where}: {before.where} has an output block already"]
    before.output = text
    return []


CHAINS, SKIPPED, PROBLEMS = _collect()


def test_every_python_block_is_run_or_marked_not_runnable() -> None:
    assert PROBLEMS == []
    assert CHAINS, "no runnable python block found in the docs"
    n_run = sum(len(c.blocks) for c in CHAINS)
    n_python = sum(1 for page in PAGES for b in _blocks(page)[0] if b.lang == "python")
    assert n_run + len(SKIPPED) == n_python


@pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])
@pytest.mark.filterwarnings("ignore:fit.ckpt_path=.last... no valid checkpoint:UserWarning")
def test_python_block_runs(chain: Chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real module per chain, so classes defined in a snippet pickle by reference and dataclasses
    # find their module; removed afterwards. The working directory is the test's own (the default
    # root_dir="runs" lands there).
    monkeypatch.chdir(tmp_path)
    _isolate_registries(monkeypatch)
    if any(b.output is not None and any(map(_is_clock_line, normalise(b.output.code))) for b in chain.blocks):
        from dream_trainer.callbacks import text_progress

        monkeypatch.setattr(text_progress, "FIRST_LINE_SECONDS", 0.0)  # a clock line at every batch
    name = "docs_snippet_" + re.sub(r"\W", "_", chain.id)
    module = types.ModuleType(name)
    module.__file__ = str(chain.blocks[0].page)
    monkeypatch.setitem(sys.modules, name, module)
    for block in chain.blocks:
        code = "\n" * (block.line) + block.code  # tracebacks point at the page's own line numbers
        printed = io.StringIO()  # stdout and stderr in one, in order, as a terminal or a piped log shows them
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                exec(compile(code, str(block.page), "exec"), module.__dict__)
        except SystemExit as exc:  # a snippet that ends a script with sys.exit(0) is fine
            assert exc.code in (None, 0), f"{block.where} exited with {exc.code!r}"
        finally:
            sys.stdout.write(printed.getvalue())  # pytest shows it when the test fails
        if block.output is not None:
            problem = compare_output(block.output.code, printed.getvalue())
            assert problem is None, (
                f"{block.output.where}: the ```text block marked <!-- output --> is not what {block.where} "
                f"prints: {problem}\n--- it printed:\n{printed.getvalue()}"
            )


# --- what a snippet prints, against what its page shows -------------------------------------------
_RATE = re.compile(r"(?:\?|\b\d+(?:\.\d+)?) (?:it/s|s/it)\b")
_DURATION = re.compile(r"\b\d+(?::\d\d){1,2}\b|(?<=<)\?|\b\d+(?:\.\d+)?m?s\b")
_DECIMAL = re.compile(r"(?<![\w.])-?\d+(?:\.\d+(?:e[-+]?\d+)?|e[-+]\d+)(?![\w.])")
_CLOCK = "<t><<t>"  # elapsed<remaining: a line of the clock-driven progress


def normalise(text: str) -> list[str]:
    """`text`'s lines with what depends on the machine or the random weights replaced (see the module
    docstring): rates by `<rate>`, durations by `<t>`, decimal numbers by `<x>`."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    out = []
    for line in lines:
        line = _RATE.sub("<rate>", line)
        line = _DURATION.sub("<t>", line)
        out.append(_DECIMAL.sub("<x>", line))
    return out


def _is_clock_line(line: str) -> bool:
    return _CLOCK in line


def _shape(line: str) -> str:
    return re.sub(r"\d+", "<n>", line)


def compare_output(shown: str, printed: str) -> str | None:
    """None when `printed` is what the page `shown`, after `normalise`; else what differs."""
    want, got = normalise(shown), normalise(printed)
    want_lines = [line for line in want if not _is_clock_line(line)]
    got_lines = [line for line in got if not _is_clock_line(line)]
    if want_lines != got_lines:
        import difflib

        diff = "\n".join(difflib.unified_diff(want_lines, got_lines, "page", "printed", lineterm="", n=1))
        return f"the lines differ (normalised; progress lines on the clock left out):\n{diff}"
    shapes = {_shape(line) for line in got if _is_clock_line(line)}
    unlike = [line for line in want if _is_clock_line(line) and _shape(line) not in shapes]
    if unlike:
        return f"no progress line the run printed has the shape of {unlike} (it printed {sorted(shapes)})"
    return None


def test_an_output_block_belongs_to_the_run_python_block_right_before_it() -> None:
    page = DOCS / "index.md"
    run = Block(page, 10, "python", "print(1)\n", None)
    shown = Block(page, 20, "text", "1\n", OUTPUT)
    assert _attach_output(shown, run, Chain([run])) == [] and run.output is shown
    assert "has an output block already" in _attach_output(Block(page, 30, "text", "", OUTPUT), run, Chain([run]))[0]
    skipped = Block(page, 40, "python", "", "not-runnable: a fragment")
    assert "which is not run" in _attach_output(Block(page, 50, "text", "", OUTPUT), skipped, Chain([run]))[0]
    other = Block(page, 60, "bash", "", None)
    assert "must follow" in _attach_output(Block(page, 70, "text", "", OUTPUT), other, Chain([run]))[0]


def test_compare_output_normalises_times_rates_and_metric_values() -> None:
    page = """
dream_trainer: run directory runs/version_0
val_loss now 0.6841
epoch 1/3 | 5/16 | 0:01<0:02 | 4.40 it/s | run eta 0:09
epoch 1/3 | step 16 | loss 0.495 | accuracy 0.8262 | val_loss 0.3013 | 1.4s
"""
    run = (
        "dream_trainer: run directory runs/version_0\nval_loss now 0.7012\n"
        "epoch 1/3 | 1/16 | 0:00<? | ? it/s | run eta ?\n"  # clock lines: any number of them, any values
        "epoch 1/3 | 2/16 | 0:00<0:00 | 198 it/s | run eta 0:00\n"
        "epoch 1/3 | step 16 | loss 1.2e-05 | accuracy 1.0 | val_loss 0.3 | 12.0s\n"
    )
    assert compare_output(page, run) is None
    assert normalise("loss 0.25 | 3.00 s/it | step 48 | epoch=2-step=48.ckpt | 88.18% | torch 2.13.0  \n\n") == [
        "loss <x> | <rate> | step 48 | epoch=2-step=48.ckpt | <x>% | torch 2.13.0"
    ]
    # Integers count: a step, an epoch, a run directory.
    assert "the lines differ" in (compare_output(page, run.replace("step 16", "step 17")) or "")
    assert "the lines differ" in (compare_output(page, run.replace("version_0", "version_1")) or "")
    # A line the page shows but the run does not print; a progress line of another shape.
    assert "the lines differ" in (compare_output(page + "done\n", run) or "")
    no_eta = run.replace(" | run eta 0:00", "").replace(" | run eta ?", "")
    assert "no progress line" in (compare_output(page, no_eta) or "")


def _isolate_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Snippets register classes in the global registries (`@MODELS.register()`); give each chain its own
    entries, without what other tests registered, so the same example may run twice in one process."""
    try:
        from dream_trainer import registry
    except ImportError:  # a checkout without registries
        return
    for obj in vars(registry).values():
        if isinstance(obj, registry.Registry):
            own = {
                k: v
                for k, v in obj._entries.items()
                if str(getattr(v, "__module__", "")).startswith(("dream_trainer", "torch"))
            }
            monkeypatch.setattr(obj, "_entries", own)


# --- pages in step with the code ------------------------------------------------------------------
def _page(name: str) -> str:
    return (DOCS / name).read_text()


# (page, public name) -> the entry that page still lacks, for a name exported before its page (owned
# elsewhere) was written. Aim: empty. An entry whose page has it now fails the test: delete the entry.
PENDING_ENTRIES: dict[tuple[str, str], str] = {}


def _pending(page: str, missing: list[str], present: list[str]) -> tuple[list[str], list[str]]:
    """`missing` without the names PENDING_ENTRIES excuses on `page`, and the excused names that are
    `present` now (stale entries)."""
    excused = {name for (p, name) in PENDING_ENTRIES if p == page}
    return [n for n in missing if n not in excused], sorted(excused & set(present))


def test_getting_started_quickstart_is_the_readme_quickstart() -> None:
    def python_blocks(page: Path) -> list[str]:
        return [b.code for b in _blocks(page)[0] if b.lang == "python"]

    assert python_blocks(ROOT / "README.md")[0] in python_blocks(DOCS / "index.md")


def test_every_hook_is_in_the_callbacks_page_table() -> None:
    from dream_trainer.callbacks import HOOKS

    page = _page("callbacks.md")
    assert [h for h in HOOKS if f"| `{h}" not in page] == []
    assert [h for h in HOOKS if h not in page.split("```mermaid", 1)[1].split("```", 1)[0]] == [], (
        "every hook belongs in the diagram too"
    )


def test_every_builtin_callback_has_a_section_on_the_callbacks_page() -> None:
    import dream_trainer.callbacks as callbacks

    page = _page("callbacks.md")
    internal = {"HOOKS", "Callback", "CallbackBus", "CallbackList", "ProgressBarBase"}
    names = [n for n in callbacks.__all__ if n not in internal]
    missing, stale = _pending(
        "callbacks.md", [n for n in names if f"### `{n}`" not in page], [n for n in names if f"### `{n}`" in page]
    )
    assert missing == []
    assert stale == [], "docs/callbacks.md has these now: delete their PENDING_ENTRIES"


def test_every_error_is_in_troubleshooting() -> None:
    import dream_trainer
    import dream_trainer.errors as errors

    page = _page("troubleshooting.md")
    names = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    names |= {
        n
        for n in dream_trainer.__all__
        if isinstance(v := getattr(dream_trainer, n), type) and issubclass(v, BaseException)
    }
    assert sorted(n for n in names if f"`{n}`" not in page) == []


def test_every_example_is_on_the_examples_page() -> None:
    page = _page("examples.md")
    scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    missing = [s for s in scripts if f'--8<-- "examples/{s}"' not in page]
    assert missing == [], "run python docs/tools/examples_page.py to add them to docs/examples.md"


def test_every_public_name_is_in_the_api_reference() -> None:
    import dream_trainer
    import dream_trainer.callbacks
    import dream_trainer.loggers

    page = _page("api.md")
    public = [f"dream_trainer.{n}" for n in dream_trainer.__all__ if n != "__version__"]
    public += [f"dream_trainer.callbacks.{n}" for n in dream_trainer.callbacks.__all__ if n != "HOOKS"]
    public += [f"dream_trainer.loggers.{n}" for n in dream_trainer.loggers.__all__]

    def documented(dotted: str) -> bool:
        # `::: dream_trainer.callbacks.EarlyStopping` or the same object under another public path.
        short = dotted.rsplit(".", 1)[1]
        return re.search(rf"^::: dream_trainer(\.\w+)*\.{short}$", page, flags=re.M) is not None

    names = {n.rsplit(".", 1)[1]: documented(n) for n in public}
    missing, stale = _pending("api.md", [n for n, ok in names.items() if not ok], [n for n, ok in names.items() if ok])
    assert missing == []
    assert stale == [], "docs/api.md has these now: delete their PENDING_ENTRIES"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    import subprocess

    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path)]
    result = subprocess.run(
        command,
        cwd=ROOT,  # snippets (examples, CHANGELOG) are included relative to the repository root
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").is_file()
