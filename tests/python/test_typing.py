"""The package is typed for its users (py.typed, annotations, and _C.pyi for the binding):
``mypy --strict`` on a user's program that calls the public API finds no error in it, and
finds the type mistakes of another through our annotations; _C.pyi matches the built module."""
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent / "typing"
PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "tensordict_cpp"

pytest.importorskip("mypy", reason="mypy is a test dependency (requirements-dev.txt)")


def mypy(path):
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                          "--cache-dir", "/dev/null", str(path)],
                         capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def test_a_users_program_type_checks():
    rc, out = mypy(HERE / "user_program.py")
    assert rc == 0, out


def test_mypy_finds_a_users_mistakes_through_our_types():
    rc, out = mypy(HERE / "user_mistakes.py")
    assert rc == 1, out
    assert 'expression has type "Size", variable has type "str"' in out, out
    assert 'expression has type "int", variable has type "str"' in out, out
    assert 'Argument "timeout" has incompatible type "str"' in out, out
    assert "missing library stubs or py.typed" not in out, out


def test_the_stub_of_the_binding_is_current(tmp_path):
    pytest.importorskip("pybind11_stubgen", reason="a test dependency (requirements-dev.txt)")
    subprocess.run([sys.executable, "-m", "pybind11_stubgen", "tensordict_cpp._C", "-o",
                    str(tmp_path)], check=True, capture_output=True, timeout=600)
    fresh = (tmp_path / "tensordict_cpp" / "_C.pyi").read_text()
    assert (PACKAGE / "_C.pyi").read_text() == fresh, (
        "python/tensordict_cpp/_C.pyi is stale: regenerate it with scripts/stubs")
