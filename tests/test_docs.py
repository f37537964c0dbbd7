"""The tutorials' Python blocks run as written: each file's blocks, in order, in one fresh process
(a block may register names in rlkit's registries), after a short prelude that defines what the
tutorial assumes the reader already has (a state, a batch, prompts). A block right after an
``<!-- not run by tests: why -->`` line is skipped (it needs a GPU, or runs for minutes)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDES = {
    "custom_algorithm.md": "",  # its first block builds what the others use
    "performance.md": "",
}

SKIP = re.compile(r"<!--\s*not run by tests:.*?-->\s*$")


def python_blocks(text: str) -> tuple[list[str], int]:
    """The ```python blocks of a markdown text, in order, and how many were marked skipped."""
    blocks, skipped, lines = [], 0, text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            if SKIP.search(before):
                skipped += 1
            else:
                blocks.append("\n".join(lines[i + 1 : j]))
            i = j
        i += 1
    return blocks, skipped


def test_python_blocks_are_found_and_markers_skip():
    text = "a\n```python\nx = 1\n```\n<!-- not run by tests: GPU -->\n\n```python\ny = 2\n```\n```bash\nls\n```\n```python\nz = x\n```\n"
    assert python_blocks(text) == (["x = 1", "z = x"], 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRELUDES))
def test_tutorial_python_blocks_run(name, tmp_path):
    with open(os.path.join(ROOT, "tutorials", name)) as f:
        blocks, _ = python_blocks(f.read())
    assert blocks, f"tutorials/{name} has no python blocks"
    script = textwrap.dedent(PRELUDES[name]) + "\n".join(
        f"\nprint('--- block {k}', flush=True)\n{block}" for k, block in enumerate(blocks)
    )
    path = tmp_path / "doc.py"
    path.write_text(script)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"tutorials/{name}: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert f"--- block {len(blocks) - 1}" in proc.stdout
