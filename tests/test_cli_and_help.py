"""What users read from the package itself: help() (short signatures, a package docstring that
names everything), and one vocabulary of operator names for --ops in every command, listed by
each --help."""

import inspect
import pydoc
import re
import typing

import pytest

import fastbwd
from bench import __main__ as main_job
from fastbwd import __main__ as fastbwd_main
from fastbwd import _precompile
from fastbwd._registry import OPERATORS
from fastbwd.api.roi_align import roi_align_forward

PUBLIC_FUNCTIONS = [getattr(fastbwd, name) for name in fastbwd.__all__ if callable(getattr(fastbwd, name))]


@pytest.mark.parametrize("function", PUBLIC_FUNCTIONS + [roi_align_forward], ids=lambda f: f.__name__)
def test_signatures_read_well_and_their_hints_resolve(function):
    signature = str(inspect.signature(function))
    assert "numpy._typing" not in signature and "_array_like" not in signature
    assert len(signature) < 400, signature
    if function not in (fastbwd.precompile, fastbwd.ParamError, fastbwd.clear_result_cache):
        assert "'ArrayLike'" in signature
    typing.get_type_hints(function)  # every annotation names something importable


def test_help_of_the_package_lists_the_functions_and_the_bridges():
    text = pydoc.render_doc(fastbwd, renderer=pydoc.plaintext)
    assert "_array_like" not in text and len(text) < 40_000
    doc = fastbwd.__doc__
    for name in fastbwd.__all__:
        assert f"``{name}``" in doc, name
    assert "``fastbwd.torch``" in doc and "``fastbwd.jax``" in doc


def test_precompile_docstring_names_the_operators_it_takes():
    doc = fastbwd.precompile.__doc__
    assert "five" not in doc
    for name in OPERATORS:
        assert f"``{name}``" in doc, name


def _help(main, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_every_help_lists_the_same_operator_names(capsys):
    names = list(OPERATORS)
    assert len(names) == 7 and "roi_align_forward" in names
    for main, extra in ((fastbwd_main.main, []), (main_job.main, ["torch", "jax"])):
        text = _help(main, capsys)
        listed = re.search(r"only these operators \(default: all\): ([\w, ]+)", text).group(1).strip().split(", ")
        assert listed == names, text
        for name in extra:
            assert f"{name}: the" in text


@pytest.mark.parametrize("main", [fastbwd_main.main, main_job.main], ids=["python -m fastbwd", "python3 -m bench"])
def test_every_command_refuses_the_same_unknown_name(main, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--ops", "roi_align"])
    assert exit.value.code == 2
    assert "invalid choice: 'roi_align'" in capsys.readouterr().err


def test_precompile_takes_the_same_names():
    for name in OPERATORS:
        assert {entry.op for entry in _precompile.select(ops=[name])} == {name}
    with pytest.raises(SystemExit):
        fastbwd_main.main(["--precompile", "--ops", "roi_align"])


def test_the_self_check_takes_every_name(capsys):
    assert fastbwd_main.main(["--ops", "roi_align_forward", "replication_pad2d_backward"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["replication_pad2d_backward", "roi_align_forward"]
    assert all("matches the float64 reference" in line for line in lines[1:])


def test_precompile_options_without_precompile_are_refused(capsys):
    with pytest.raises(SystemExit):
        fastbwd_main.main(["--dtypes", "float32"])
    assert "go with --precompile" in capsys.readouterr().err


def test_the_shadowing_note(monkeypatch, tmp_path):
    """Nothing to say when the running package is the installed one; otherwise what shadows what
    and what to do."""
    import os

    running = os.path.dirname(os.path.abspath(fastbwd.__file__))
    monkeypatch.setattr(fastbwd_main, "installed_folder", lambda: running)
    assert fastbwd_main.shadowing_note() is None
    monkeypatch.setattr(fastbwd_main, "installed_folder", lambda: None)
    assert fastbwd_main.shadowing_note() is None
    monkeypatch.setattr(fastbwd_main, "installed_folder", lambda: str(tmp_path / "site-packages" / "fastbwd"))
    monkeypatch.chdir(os.path.dirname(running))
    note = fastbwd_main.shadowing_note()
    assert note.startswith(f"note: this is the fastbwd package in {running}, found in the current folder ahead of")
    assert str(tmp_path / "site-packages" / "fastbwd") in note
    assert f"-m pip install -e {os.path.dirname(running)}" in note
    monkeypatch.chdir(tmp_path)
    assert f"found in {os.path.dirname(running)} ahead of" in fastbwd_main.shadowing_note()
