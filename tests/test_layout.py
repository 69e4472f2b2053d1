"""docs/design.md's "Layout of the code" names every file of the package and every folder of the
checkout, and nothing that does not exist: a file added, moved or removed fails here with the
line to add or to remove."""

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"

#: Folders of a checkout that are not the project's: caches, builds, virtual environments.
NOT_THE_PROJECTS = {"build", "dist", "site", "__pycache__"}


def layout_lines():
    """The lines of the code block under the design's "## Layout of the code"."""
    text = DESIGN.read_text()
    section = text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```\n(.*?)```", section, re.S).group(1).splitlines()


def named_paths():
    """The paths the layout names: the first word of each line that does not start with a space."""
    return [line.split()[0] for line in layout_lines() if line and not line[0].isspace()]


def package_files():
    """Every file under fastbwd/, as a path from the checkout's root (no caches)."""
    files = []
    for folder, subfolders, names in os.walk(ROOT / "fastbwd"):
        subfolders[:] = sorted(name for name in subfolders if name != "__pycache__")
        for name in names:
            if not name.endswith((".pyc", ".nbi", ".nbc")):
                files.append((pathlib.Path(folder) / name).relative_to(ROOT).as_posix())
    return sorted(files)


def top_level_folders():
    """The checkout's top-level folders (hidden ones only when tracked: .ci), the package's aside."""
    return sorted(
        f"{entry.name}/"
        for entry in ROOT.iterdir()
        if entry.is_dir()
        and entry.name not in NOT_THE_PROJECTS
        and not entry.name.endswith(".egg-info")
        and (not entry.name.startswith(".") or entry.name == ".ci")
        and entry.name != "fastbwd"
    )


def _where(path, named):
    """Where the line for ``path`` goes: after the named path that sorts just before it."""
    before = [other for other in named if other < path]
    return f"after the line of {max(before)}" if before else "at the top of the block"


def test_the_layout_names_every_file_of_the_package():
    named = named_paths()
    missing = [path for path in package_files() if path not in named]
    assert not missing, "\n".join(
        f"docs/design.md, 'Layout of the code': add the line `{path:<34}<what it holds>` {_where(path, named)}"
        for path in missing
    )


def test_the_layout_names_every_top_level_folder():
    named = named_paths()
    missing = [folder for folder in top_level_folders() if folder not in named]
    assert not missing, "\n".join(
        f"docs/design.md, 'Layout of the code': add the line `{folder:<34}<what it holds>` {_where(folder, named)}"
        for folder in missing
    )


def test_the_layout_names_nothing_that_does_not_exist():
    gone = [path for path in named_paths() if not (ROOT / path).exists()]
    assert not gone, "\n".join(
        f"docs/design.md, 'Layout of the code': remove the line of {path} (it does not exist)" for path in gone
    )


def test_each_path_is_named_once():
    named = named_paths()
    twice = sorted({path for path in named if named.count(path) > 1})
    assert not twice, f"docs/design.md's layout names these more than once: {twice}"
