"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    monkeypatch.chdir(tmp_path)  # the default root_dir is relative
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.count("val_loss now") == 4  # the sanity check, then each of the 3 epochs
    assert "epoch 3/3" in out
