"""The package is typed for its users (py.typed, annotations, and _C.pyi for the binding):
``mypy --strict`` on a user's program that calls the public API finds no error in it, and
finds the type mistakes of another through our annotations; _C.pyi matches the built module."""
import os
import pathlib
import re
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


def _machine_numbers():
    """Numbers that differ from machine to machine and that a careless default could carry into
    a signature: this machine's physical memory and its half (what default_storage_limit_bytes()
    returns, include/tensordict/memory.h), and that function's 4 GiB fallback."""
    page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    return [pages * page, pages // 2 * page, 4 << 30]


def _machine_defaults(stub):
    """The integer defaults of `stub` within 2% of a number of _machine_numbers(): computed from
    this machine (exactly equal), or from one of about its size (a stub generated elsewhere)."""
    return sorted({int(v) for v in re.findall(r"= (\d+)\b", stub)
                   if any(abs(int(v) - m) <= m // 50 for m in _machine_numbers())})


@pytest.fixture(scope="module")
def fresh_stub(tmp_path_factory):
    pytest.importorskip("pybind11_stubgen", reason="a test dependency (requirements-dev.txt)")
    out = tmp_path_factory.mktemp("stub")
    subprocess.run([sys.executable, "-m", "pybind11_stubgen", "tensordict_cpp._C", "-o",
                    str(out)], check=True, capture_output=True, timeout=600)
    return (out / "tensordict_cpp" / "_C.pyi").read_text()


def test_the_stub_of_the_binding_is_current(fresh_stub):
    # Exact: any change of a name, a type or a default makes it stale. It holds on every machine
    # because no default depends on the machine (the next test).
    assert (PACKAGE / "_C.pyi").read_text() == fresh_stub, (
        "python/tensordict_cpp/_C.pyi is stale: regenerate it with scripts/stubs")


def test_no_default_of_the_binding_depends_on_the_machine(fresh_stub):
    # A default computed from the machine (half its memory, say) would be a different number in
    # the stub of every machine, and a lie to its readers: such a default is None in the
    # signature and resolved where it is used (PipeOptions::max_storage_bytes).
    found = _machine_defaults(fresh_stub)
    assert not found, f"signature defaults computed from this machine: {found}"
    committed = _machine_defaults((PACKAGE / "_C.pyi").read_text())
    assert not committed, f"python/tensordict_cpp/_C.pyi has machine-sized defaults: {committed}"
