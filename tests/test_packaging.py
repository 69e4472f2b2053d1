"""fastbwd as users install released packages: ``python -m build`` gives a wheel and an sdist
that install into fresh virtual environments (not editable) and pass ``python -m fastbwd``; the
wheel ships the package alone and the LICENSE; the sdist is the whole source. An editable
install exposes the package alone (not the checkout's bench, tests or tools), and that of a
checkout named ``fastbwd`` is not shadowed from the checkout's parent folder; a checkout's
package that shadows an installed one says so."""

import os
import pathlib
import subprocess
import sys
import tarfile
import venv
import zipfile

import pytest

import fastbwd

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(command, cwd, **kwargs):
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=1200, **kwargs)
    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done


def _clean_environment():
    """The environment without this checkout on PYTHONPATH and without a cache folder override:
    what a user's shell has."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "NUMBA_CACHE_DIR")}
    environment.pop("VIRTUAL_ENV", None)
    return environment


def _fresh_python(folder):
    venv.create(folder, with_pip=True)
    return str(pathlib.Path(folder) / "bin" / "python")


def _source_copy(destination):
    """The checkout's tracked files (as a fresh clone has them, symbolic links as links), in ``destination``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        source, target = ROOT / name, destination / name
        if name and (source.is_symlink() or source.is_file()):
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_symlink():
                target.symlink_to(os.readlink(source))
            else:
                target.write_bytes(source.read_bytes())
    return destination


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(wheel, sdist)`` built by ``python -m build`` from a copy of the checkout's files."""
    pytest.importorskip("build")
    folder = tmp_path_factory.mktemp("build")
    source = _source_copy(folder / "fastbwd")
    _run([sys.executable, "-m", "build", "--outdir", str(folder / "dist"), str(source)], cwd=folder)
    (wheel,) = (folder / "dist").glob("fastbwd-*.whl")
    (sdist,) = (folder / "dist").glob("fastbwd-*.tar.gz")
    return wheel, sdist


def test_the_wheel_ships_the_package_and_its_license(built):
    wheel, _ = built
    names = zipfile.ZipFile(wheel).namelist()
    assert f"fastbwd-{fastbwd.__version__}.dist-info/licenses/LICENSE" in names
    assert {name.split("/")[0] for name in names} == {"fastbwd", f"fastbwd-{fastbwd.__version__}.dist-info"}
    assert {"fastbwd/torch/__init__.py", "fastbwd/jax/__init__.py", "fastbwd/kernels/__init__.py"} <= set(names)
    metadata = zipfile.ZipFile(wheel).read(f"fastbwd-{fastbwd.__version__}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata


def test_the_sdist_is_the_whole_source(built):
    _, sdist = built
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    # the package's files under src/ (the link's target, as files), what runs beside it at the root
    for name in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "mkdocs.yml", "src/fastbwd/__init__.py",
                 "src/fastbwd/kernels/_jit.py", "bench/__main__.py", "bench/results.json", "bench/models/torch_unet.py",
                 "tests/test_packaging.py", "docs/semantics.md", "docs/reference/index.md"):  # fmt: skip
        assert name in names, name
    assert not [name for name in names if "__pycache__" in name or name.endswith((".pyc", ".nbi", ".nbc"))]


def test_wheel_and_sdist_install_in_fresh_environments_and_pass_the_self_check(built, tmp_path):
    """Each into a fresh venv (pip install of the file, not editable), then ``python -m fastbwd``
    from a folder that holds no checkout: every operator compiles from an empty cache and
    matches the reference. The two self-checks run side by side."""
    environment = _clean_environment()
    checks = []
    for name, package in zip(("wheel", "sdist"), built):
        python = _fresh_python(tmp_path / f"venv-{name}")
        _run([python, "-m", "pip", "install", "--quiet", str(package)], cwd=tmp_path, env=environment)
        where = _run([python, "-c", "import fastbwd; print(fastbwd.__file__)"], cwd=tmp_path, env=environment)
        assert str(tmp_path / f"venv-{name}") in where.stdout  # the installed copy, not this checkout
        command = [python, "-m", "fastbwd"]
        checks.append((name, subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))  # fmt: skip
    for name, process in checks:
        output, _ = process.communicate(timeout=1200)
        assert process.returncode == 0, f"{name}:\n{output}"
        lines = output.splitlines()
        assert len([line for line in lines if "matches the float64 reference" in line]) == 7, output
        assert "note:" not in output  # nothing shadows the installed package there
    # run from this checkout, the checkout's package shadows the installed wheel: it says so
    python = str(tmp_path / "venv-wheel" / "bin" / "python")
    shadowed = _run([python, "-m", "fastbwd", "--ops", "replication_pad2d_backward"], cwd=ROOT, env=environment)
    assert f"note: this is the fastbwd package in {ROOT / 'fastbwd'}, found in the current folder" in shadowed.stdout
    assert "pip install -e" in shadowed.stdout and "matches the float64 reference" in shadowed.stdout


def test_an_editable_checkout_named_fastbwd_works_from_its_parent_folder(tmp_path):
    """pip install -e of a checkout named fastbwd, then Python started in the folder holding it:
    ``import fastbwd`` is the package, not the checkout folder as an empty namespace package; the
    checkout's other folders are not importable there; from the checkout's root the main job and
    the tests' harness are."""
    environment = _clean_environment()
    checkout = _source_copy(tmp_path / "fastbwd")
    python = _fresh_python(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--quiet", "-e", str(checkout)], cwd=tmp_path, env=environment)
    done = _run([python, "-c", "import fastbwd; print(fastbwd.__version__, fastbwd.__file__)"], cwd=tmp_path, env=environment)  # fmt: skip
    version, file = done.stdout.split()
    assert version == fastbwd.__version__ and os.path.realpath(file) == str(checkout / "fastbwd" / "__init__.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("bench", "tests", "tools", "src"):
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is not None)"
        assert subprocess.run([python, "-c", code], cwd=elsewhere, env=environment).returncode == 0, name
    code = "import bench.targets, fastbwd; print(fastbwd.__file__)"
    done = _run([python, "-c", code], cwd=checkout, env=environment)  # the checkout's root: the harness is there
    assert done.stdout.strip() == str(checkout / "fastbwd" / "__init__.py")
    done = _run([python, "-m", "fastbwd", "--ops", "replication_pad2d_backward"], cwd=tmp_path, env=environment)
    assert "matches the float64 reference" in done.stdout and "note:" not in done.stdout
