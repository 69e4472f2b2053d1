"""The README's commands, read from README.md, so that `.ci/run` runs them exactly as written there.

``python3 .ci/readme_commands.py NAME`` prints one line of the README's bash blocks:

* ``test``: the install line and the test command (``pip install -e ".[test]" ... && python3 -m pytest ...``);
* ``main``: the main job's install line and command (``pip install -e . ... && python3 -m bench``);
* ``docs``: the documentation site's install line and strict build.

Standard library only: it runs before anything is installed.
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

#: What each command's line must contain (the first line of the README's bash blocks that does).
MARKS = {
    "test": ('pip install -e ".[test]"', "&& python3 -m pytest"),
    "main": ("pip install -e . ", "&& python3 -m bench"),
    "docs": ('pip install -e ".[docs]"', "&& python3 -m mkdocs build --strict"),
}


def command(name, text=None):
    """The README's line for ``name`` (a key of :data:`MARKS`), without its trailing comment."""
    text = README.read_text() if text is None else text
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if all(mark in line for mark in MARKS[name]):
                return line.split("  #", 1)[0].strip()
    raise LookupError(f"README.md has no {name} command (a line of a bash block with {' and '.join(MARKS[name])})")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MARKS:
        sys.exit(f"usage: python3 .ci/readme_commands.py {{{','.join(MARKS)}}}")
    print(command(sys.argv[1]))
