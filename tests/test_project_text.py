"""Project text speaks of the software, not of how it was developed (issue 29).

Results are named by date, commit, machine and command; a reader cannot place "session 4", "no GPU was
lent to this task" or "the device tool answered". The patterns start from the words
`benchmarks/RESULTS.md` once used for its section headings and for its missing GPU figures; they are
written so that software terms ("an MLflow session", `tuning_session`, `SessionLog`, `session.py`) do
not match. Checked: README.md, CHANGELOG.md, docs/**/*.md, benchmarks/**/*.md and *.py,
examples/**/*.py, and the comments and docstrings of dream_trainer/**/*.py.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each pattern names a way of describing the development process instead of the software ("(?i:...)":
# case-insensitive; the others are case-sensitive so that software terms do not match).
PROCESS_PATTERNS = [
    r"\b[Ss]ession[- ]\d",  # "session 4", "Session 6 (2026-11-25)", "session-4 full run"
    r"\b[Ss]essions \d",  # "sessions 1-4"
    r"\bs[1-9] \d{1,2}:\d{2}\b",  # "s4 13:25" (runs named by work period)
    r"(?i:\b(?:this|that|earlier|later|previous|quieter|other|the last|the next) sessions?\b(?!\.py))",
    r"(?i:\bproject's sessions\b)",
    r"(?i:\bsections? by sessions?\b)",
    r"(?i:\blent\b)",  # "no GPU was lent to this task", "lent to this project"
    r"(?i:\bdevice tool\b)",  # "the device tool answered"
    r"(?i:\bdevice machine\b)",  # "No device machine is lent in this task"
    r"`status`: not drawn",
    r"(?i:\b(?:task|session|GPU|device|machine) (?:was |is )?not drawn\b)",
    r"(?i:\bdrawn (?:by chance|once per task|for this task)\b)",
    r"(?i:\bwork periods?\b)",
    r"(?i:\bsubagents?\b)",
    r"(?i:\b(?:we|I) measured\b)",
    r"(?i:\bdevelopment machine\b)",  # name the machine: cores, CPU, torch version
    r"\b[Ss]eed 00\d\b",  # the project's planning documents, not the software
]
PROCESS_WORDS = re.compile("|".join(f"(?:{p})" for p in PROCESS_PATTERNS))
# Words (lower case) of which every pattern above contains one; a new pattern adds its word here.
CANDIDATES = re.compile(r"session|lent|device (?:tool|machine)|drawn|work period|subagent|measured|s[1-9] \d")

RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def whole_files() -> list[Path]:
    """Files whose every line is project text."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted((ROOT / "benchmarks").rglob("*.md")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    files += sorted((ROOT / "examples").rglob("*.py"))
    return [f for f in files if f.is_file()]


def process_hits(label: str, text: str, lines: set[int] | None = None) -> list[str]:
    """`label:line: text` for each line of `text` (only those in `lines`, when given) that describes the
    development process."""
    return [f"{label}:{n}: {line.strip()}" for n, line in process_lines(text) if lines is None or n in lines]


def process_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of `text` that one of PROCESS_PATTERNS matches. A plain search for
    the words every pattern contains finds the few lines worth matching (one pass over the text; the
    patterns themselves would be tried at every position)."""
    low = text.lower()
    found = []
    number, pos, checked = 1, 0, 0
    for match in CANDIDATES.finditer(low):
        number += low.count("\n", pos, match.start())
        pos = match.start()
        if number == checked:
            continue
        checked = number
        start = low.rfind("\n", 0, pos) + 1
        end = low.find("\n", pos)
        line = text[start : end if end >= 0 else len(text)]
        if PROCESS_WORDS.search(line):
            found.append((number, line))
    return found


def comment_and_docstring_lines(source: str) -> set[int]:
    """Line numbers of the comments and docstrings of a Python module."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_hits() -> list[str]:
    """Process lines in the comments and docstrings of dream_trainer/ (its code and messages are not
    scanned: a string such as "session" there is the software's own)."""
    hits = []
    for path in sorted((ROOT / "dream_trainer").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if process_lines(text):  # the common case is none: parse only the files with a hit
            hits += process_hits(str(path.relative_to(ROOT)), text, comment_and_docstring_lines(text))
    return hits


HEX = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# A short hash right after the word: all digits is a hash too there (4612454 was one: the check above wants a letter).
COMMIT_NAMED = re.compile(r"\bcommit:?\s+[0-9a-f]{7,40}\b", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*python [^`]+`")


def first_table_label_problems(text: str) -> list[str]:
    """What the lines of the first table's section, before the table, fail to name: a date, a commit, the
    machine (cores, CPU, torch version) and the command in backticks."""
    lines = text.splitlines()
    table = next((i for i, line in enumerate(lines) if line.lstrip().startswith("|")), None)
    if table is None:
        return ["no table"]
    start = max((i for i in range(table) if lines[i].startswith("#")), default=-1) + 1
    before = lines[start:table]
    joined = "\n".join(before)
    problems = []
    if not DATE.search(joined):
        problems.append("a date (YYYY-MM-DD)")
    if not any((HEX.search(line) or COMMIT_NAMED.search(line)) and "commit" in line.lower() for line in before):
        problems.append("a commit (7+ hex characters on a line that says 'commit')")
    items: list[str] = []  # list items and paragraphs, their continuation lines joined
    for line in before:
        if not line.strip() or line.lstrip().startswith(("- ", "* ")) or not items:
            items.append(line)
        else:
            items[-1] += " " + line.strip()
    machine = [item for item in items if "machine" in item.lower()]
    if not any(re.search(r"\bcores?\b", m) and re.search(r"\btorch \d", m) for m in machine):
        problems.append("a machine line with the cores and the torch version")
    if not COMMAND.search(joined):
        problems.append("the command in backticks")
    return problems


def test_project_text_describes_the_software_not_its_development():
    hits = []
    for path in whole_files():
        hits += process_hits(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    hits += code_hits()
    assert not hits, (
        "project text describes how the project was developed; name results by date, commit, machine and "
        "command, and state missing figures as a fact about the results:\n" + "\n".join(hits)
    )


def test_results_start_with_a_labelled_table():
    problems = first_table_label_problems(RESULTS.read_text(encoding="utf-8"))
    assert not problems, "benchmarks/RESULTS.md: the first table's section does not name " + ", ".join(problems)


def test_the_patterns_leave_software_terms_alone():
    software = [
        "An MLflow session ends with the run's status.",
        "with tuning_session(trainer, 'lr_find') as snapshot:",
        "from dream_trainer.tuner.session import TrainerSnapshot",
        "The hparams session now ends with the run's real status.",
        "START = event_pb2.SessionLog.START",
        "os.makedirs(path, exist_ok=True)  # equivalent to mkdir -p",
        "a rich progress bar, redrawn at most four times a second; the latent noise is drawn from the RNG",
        "The trainer's settings plus this task's data settings.",
        "9 rounds of 2000 steps; round 0 is the warm-up",
    ]
    assert process_hits("text", "\n".join(software)) == []
    process = [  # what RESULTS.md said before issue 29, and one line for each pattern
        "## Session 6 (2026-11-25): trackers and codecs",
        "RESULTS.md: session-4 full run (11 PASS, 0 MISS)",
        "torch 2.13.0+cpu; no GPU was lent to this task (sessions 1-4; in session 4 the",
        '  device tool answered "No device machine is lent in this task")',
        "No GPU was lent to this task (`status`: not drawn).",
        "| case | s4 13:25 (above) | s3 10:56 |",
        "`dream, no logger` at 1.15x here (1.06x in quieter sessions): this run shared the machine.",
        "Session 4's three runs are on the left; this project's sessions so far",
        "the results, in sections by sessions",
        "the GPU run is for a session that has a GPU; this task was not drawn",
        "a machine is drawn by chance for each task",
        "figures named by work period",
        "a subagent measured it; we measured 1.02x",
    ]
    assert len(process_hits("text", "\n".join(process))) == len(process)


def test_a_short_hash_of_digits_only_names_a_commit() -> None:
    # gpu_check.py printed "commit 4612454" in CI, and the check wanted a letter in every hash.
    section = (
        "## A check (2026-12-07, commit 4612454)\n\n- commit: 4612454\n"
        "- machine: Linux x86_64, 2 CPU cores; torch 2.13.0+cpu\n- command: `python x.py`\n\n| a |\n|---|\n| 1 |\n"
    )
    assert "a commit (7+ hex characters on a line that says 'commit')" not in first_table_label_problems(section)
