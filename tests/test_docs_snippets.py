"""Every ```python block of the documentation (docs/*.md and README.md) runs, or says why it cannot.

How a page marks its blocks (an HTML comment on the line right before the opening fence; it does not
show on the rendered site):

- no marker: the block runs on its own, in a fresh namespace, in a temporary working directory;
- `<!-- continue -->`: the block runs in the namespace of the previous runnable block of the same page
  (a page may build one trainer over several blocks); the chain is one test;
- `<!-- not-runnable: REASON -->`: the block is not run; REASON (required) says why, e.g. a method
  fragment or a script meant for `torchrun`.

Any other HTML comment in that place, a marker with no block after it, or a Python block fenced as
`py`/`python3`/`pycon` (which this test would not see) fails the collection test below, so a block can
be neither skipped silently nor mislabelled. The other tests keep pages in step with the code: every
hook, built-in callback, error and public name appears where the docs promise it.
"""

from __future__ import annotations

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
OTHER_PYTHON_TAGS = {"py", "py3", "python3", "pycon", "ipython", "pyi"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # the HTML comment body right before the fence, if any

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
        if marker is not None and k in marker_lines and lang == "python":
            marker_lines.pop(k)
        blocks.append(Block(page, i + 1, lang, "\n".join(body) + "\n", marker))
        i = j + 1
    for index, body in marker_lines.items():
        problems.append(
            f"{page.relative_to(ROOT)}:{index + 1}: marker <!-- {body} --> is not right before a ```python block"
        )
    return blocks, problems


def _is_ours(body: str) -> bool:
    """Looks like one of our markers (a misspelled one included, so that it is reported)."""
    return body.startswith(("not-runnable", "not runnable", "continue"))


def _collect() -> tuple[list[Chain], list[Block], list[str]]:
    chains: list[Chain] = []
    skipped: list[Block] = []
    problems: list[str] = []
    for page in PAGES:
        blocks, page_problems = _blocks(page)
        problems += page_problems
        previous: Chain | None = None
        for block in blocks:
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
    name = "docs_snippet_" + re.sub(r"\W", "_", chain.id)
    module = types.ModuleType(name)
    module.__file__ = str(chain.blocks[0].page)
    monkeypatch.setitem(sys.modules, name, module)
    for block in chain.blocks:
        code = "\n" * (block.line) + block.code  # tracebacks point at the page's own line numbers
        try:
            exec(compile(code, str(block.page), "exec"), module.__dict__)
        except SystemExit as exc:  # a snippet that ends a script with sys.exit(0) is fine
            assert exc.code in (None, 0), f"{block.where} exited with {exc.code!r}"


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
    missing = [n for n in callbacks.__all__ if n not in internal and f"### `{n}`" not in page]
    assert missing == []


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

    assert [n for n in public if not documented(n)] == []


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
