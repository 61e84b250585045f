"""The wheel, as a user gets it: `pip wheel` builds it (README, "Install"), it holds one stripped
module that needs nothing of this machine but torch's and the libucx-cu12 wheel's libraries and
the manylinux baseline, `auditwheel repair` grafts nothing and tags it manylinux, and in a fresh
virtual environment holding only torch and what the wheel asks for, the README's Python example
runs from the repaired wheel."""

import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_docs import PROGRAMS  # noqa: E402

# The libraries manylinux lets a wheel take from the system (PEP 600's policies all list these).
MANYLINUX_SYSTEM = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                    "libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2"}
# What the wheel's dependencies bring: torch (torch/lib) and UCX (libucx/lib of libucx-cu12).
FROM_DEPENDENCIES = re.compile(r"^(libtorch\w*|libc10\w*|libshm|libgomp[-\w]*|libuc[mpst])\.so")


def _run(cmd, **kw):
    r = subprocess.run(cmd, text=True, capture_output=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # The objects of the editable build are the same (ccache, paths relative to the repo).
    env = dict(os.environ, CCACHE_BASEDIR=str(ROOT), CCACHE_NOHASHDIR="true",
               CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime")
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
          "-w", str(out), str(ROOT)], env=env, timeout=3000)
    (whl,) = out.glob("tensordict_cpp-*.whl")
    return whl


def test_the_wheel_holds_one_stripped_module(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert all(n.startswith(("tensordict_cpp/", "tensordict_cpp-")) for n in names), names
        (module,) = [n for n in names if n.endswith(".so")]
        z.extract(module, tmp_path)
        metadata = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    so = tmp_path / module
    sections = _run(["readelf", "-S", "-W", str(so)])
    assert ".debug_info" not in sections and ".symtab" not in sections, "the module is not stripped"
    assert so.stat().st_size < 30 << 20, f"{so.stat().st_size} bytes"
    assert "Requires-Dist: torch<2.14,>=2.13" in metadata, metadata
    assert "Requires-Dist: libucx-cu12" in metadata, metadata

    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", _run(["readelf", "-d", str(so)]))
    foreign = [n for n in needed if n not in MANYLINUX_SYSTEM and not FROM_DEPENDENCIES.match(n)]
    assert not foreign, f"the module needs libraries of this machine: {foreign}"
    assert any(n.startswith("libucp") for n in needed), needed


# What `auditwheel repair` must leave out: the dependencies bring them (README, "Install").
EXCLUDE = ["libtorch*", "libc10*", "libuc[mpst].so*"]


@pytest.fixture(scope="module")
def repaired(wheel, tmp_path_factory):
    """auditwheel's repair with torch's and UCX's libraries excluded: the manylinux tag the
    build machine's glibc and libstdc++ allow, and nothing of the system grafted."""
    out = tmp_path_factory.mktemp("repaired")
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
    cmd = [sys.executable, "-m", "auditwheel", "repair", "-w", str(out), str(wheel)]
    for pattern in EXCLUDE:
        cmd[4:4] = ["--exclude", pattern]
    _run(cmd, env=env, timeout=600)
    (whl,) = out.glob("tensordict_cpp-*.whl")
    return whl


def test_auditwheel_repair_grafts_nothing_and_tags_manylinux(repaired):
    assert re.search(r"-cp3\d+-cp3\d+-manylinux_2_\d+_x86_64\.whl$", repaired.name), repaired.name
    with zipfile.ZipFile(repaired) as z:
        grafted = [n for n in z.namelist() if ".libs/" in n]
    assert not grafted, f"auditwheel copied libraries of this machine into the wheel: {grafted}"
    show = " ".join(_run([sys.executable, "-m", "auditwheel", "show", str(repaired)]).split())
    print(show)
    assert "system-provided shared libraries" in show


def test_the_readme_example_runs_from_the_wheel_in_a_fresh_venv(repaired, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    # The user's torch first (the CPU build, as a user chooses it), then the wheel and its deps.
    _run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], timeout=1200)
    _run([str(py), "-m", "pip", "install", "-q", str(repaired)], timeout=1200)
    (readme,) = [b for b in PROGRAMS if b.path.name == "README.md" and b.lang == "python"]
    script = tmp_path / "readme_example.py"
    script.write_text(readme.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    out = _run([str(py), str(script)], cwd=tmp_path, env=env, timeout=300)
    assert "tensor(12.)" in out
    where = _run([str(py), "-c", "import tensordict_cpp; print(tensordict_cpp.__file__)"],
                 cwd=tmp_path, env=env)
    assert where.startswith(str(venv)), where
