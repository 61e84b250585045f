"""The README's Install section, as a user follows it: its shell blocks run line by line in a copy
of this tree with a fresh virtual environment (only the `apt-get` line is checked instead of run:
those packages must be installed). Every route is taken: the C++ install (whose build must print
no warning), `pip install .`, the editable install and the wheel, and the README's Python example
runs after each of the Python ones. The wheel holds one stripped module that needs nothing of this
machine but torch's and the libucx-cu12 wheel's libraries and the manylinux baseline, and
`auditwheel repair` grafts nothing and tags it manylinux; the example runs from the repaired wheel.

Every route runs twice, a fresh copy each time: with the README's `pip install` line as written,
which gives PyPI's CUDA build of torch 2.14.1 (from this machine's disk when it has the wheel,
else downloaded; skipped, saying so, where it can be neither), and with the CPU build of torch
2.13.0 (CI's, on this machine's disk) in that line's place: PyTorch's CPU index, which the
README names for it, is out of CI's reach. The CUDA route builds as the machine is, with its
CUDA toolkit if it has one (scripts/check-torch --without-cuda-toolkit builds and tests without).

The copy's virtual environment is `<copy>/.venv` and its builds go to `<copy>/build-*`, where
scripts/setup puts them in this tree: with ccache's paths relative to the tree (CCACHE_BASEDIR)
and the same CMake (Debian's, as the README's apt-get line says), the compiler commands are those
of build/, so the copy's builds take build/'s objects from the cache instead of compiling
everything three more times."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_docs import BLOCKS, PROGRAMS  # noqa: E402

README = ROOT / "README.md"
INSTALL = [b for b in BLOCKS if b.path == README and b.fragment and "test_install.py" in b.fragment]


def _block(marker):
    (block,) = [b for b in INSTALL if marker in b.code]
    return block


# The README's torch requirement, and what each route puts in its place: (requirement, the
# torch version and CUDA version the environment must then hold, the wheel's torch pin).
README_TORCH = "'torch>=2.13,<2.15'"
TORCHES = {
    "cuda": (README_TORCH, "2.14", "13.0", "torch<2.15,>=2.14"),
    "cpu": ("torch==2.13.0", "2.13.0", None, "torch<2.14,>=2.13"),
}
# What pip prints when it cannot download (no network, no index): the CUDA route then skips.
NO_DOWNLOAD = re.compile(r"No matching distribution found for torch|Could not fetch URL|"
                         r"NewConnectionError|Temporary failure in name resolution|"
                         r"Network is unreachable|Read timed out")


# The libraries manylinux lets a wheel take from the system (PEP 600's policies all list these).
MANYLINUX_SYSTEM = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                    "libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2"}
# What the wheel's dependencies bring: torch (torch/lib) and UCX (libucx/lib of libucx-cu12).
FROM_DEPENDENCIES = re.compile(r"^(libtorch\w*|libc10\w*|libshm|libgomp[-\w]*|libuc[mpst])\.so")


def _run(cmd, **kw):
    r = subprocess.run(cmd, text=True, capture_output=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


class Copy:
    """A copy of the working tree (what git tracks or would track) with a fresh .venv, whose
    README blocks install the ``torch`` of TORCHES."""

    def __init__(self, base, torch):
        self.torch = torch
        self.requirement, self.torch_version, self.cuda, self.pin = TORCHES[torch]
        self.root = base / "tensordict-cpp"
        self.home = base / "home"
        self.home.mkdir()
        files = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).split("\0")
        for name in filter(None, files):
            if (ROOT / name).is_file():
                (self.root / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, self.root / name)
        self.venv = self.root / ".venv"
        _run([sys.executable, "-m", "venv", str(self.venv)])
        self.python = self.venv / "bin" / "python"
        # TENSORDICT_WERROR stays: CI's builds all compile with -Werror (CMakeLists.txt).
        keep = {k: v for k, v in os.environ.items() if k == "TENSORDICT_WERROR" or
                not k.startswith(("PYTHON", "VIRTUAL_ENV", "CCACHE", "CMAKE", "TENSORDICT"))}
        # HOME moves (the C++ block installs into $HOME/.local); ccache's cache must not.
        ccache = shutil.which("ccache")
        if ccache:
            keep["CCACHE_DIR"] = _run([ccache, "--get-config", "cache_dir"]).strip()
        self.env = dict(keep, PATH=f"{self.venv / 'bin'}:{os.environ['PATH']}",
                        VIRTUAL_ENV=str(self.venv), HOME=str(self.home), PIP_DISABLE_PIP_VERSION_CHECK="1",
                        CCACHE_BASEDIR=str(self.root), CCACHE_NOHASHDIR="true",
                        CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime")

    def run_block(self, block):
        """Runs the block's lines in order in one bash, as a user types them (stopping at the
        first that fails), in the copy; returns their output."""
        lines = []
        for line in block.code.splitlines():
            if line.startswith("pip install ") and README_TORCH in line:
                line = line.replace(README_TORCH, self.requirement)
            if line.startswith("sudo apt-get install"):
                for package in line.split("#")[0].split()[3:]:
                    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                                            text=True, capture_output=True).stdout
                    assert "install ok installed" in status, f"{package} ({block.id}: {line})"
            else:
                lines.append(line)
        script = "set -euxo pipefail\n" + "\n".join(lines) + "\n"
        r = subprocess.run(["bash", "-c", script], cwd=self.root, env=self.env, text=True,
                           capture_output=True, timeout=3000)
        if r.returncode != 0 and self.torch == "cuda" and NO_DOWNLOAD.search(r.stderr):
            pytest.skip(f"{block.id}: PyPI's CUDA build of torch can be neither found on this "
                        f"machine nor downloaded: {NO_DOWNLOAD.search(r.stderr)[0]}")
        assert r.returncode == 0, f"{block.id} failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
        return r.stdout + r.stderr

    def example(self, tmp_path):
        """The README's Python example, run by the copy's Python from outside the tree."""
        (readme,) = [b for b in PROGRAMS if b.path == README and b.lang == "python"]
        script = tmp_path / "readme_example.py"
        script.write_text(readme.code)
        out = _run([str(self.python), str(script)], cwd=tmp_path, env=self.env, timeout=300)
        assert "tensor(12.)" in out
        return _run([str(self.python), "-c", "import tensordict_cpp; print(tensordict_cpp.__file__)"],
                    cwd=tmp_path, env=self.env).strip()

    def uninstall(self):
        _run([str(self.python), "-m", "pip", "uninstall", "-q", "-y", "tensordict-cpp"], env=self.env)


@pytest.fixture(scope="module", params=list(TORCHES))
def copy(request, tmp_path_factory):
    c = Copy(tmp_path_factory.mktemp(f"install-{request.param}"), request.param)
    yield c
    # A copy is a few GB (a CUDA torch, three build trees): gone once its routes have run.
    shutil.rmtree(c.root.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def prerequisites(copy):
    """The README's first Python block, with this copy's torch."""
    copy.run_block(_block("apt-get"))
    return copy


def test_the_prerequisites_give_the_torch_and_ucx_the_package_needs(prerequisites):
    copy = prerequisites
    versions = _run([str(copy.python), "-W", "ignore", "-c",
                     "import importlib.metadata as m, torch; "
                     "print(torch.__version__, torch.version.cuda, m.version('libucx-cu12'))"],
                    env=copy.env).split()
    assert versions[0].split("+")[0].startswith(copy.torch_version), versions
    assert versions[1] == str(copy.cuda), f"torch {versions[0]}, CUDA {versions[1]}"
    assert versions[2].startswith("1.21."), f"libucx-cu12 {versions[2]}: the package requires 1.21"


def test_the_cpp_install_builds_without_a_warning(prerequisites):
    copy = prerequisites
    log = copy.run_block(_block("cmake --install"))
    warnings = [line for line in log.splitlines() if "warning:" in line]
    assert not warnings, "\n".join(warnings[:40])
    prefix = copy.home / ".local" / "tensordict"
    for name in ["lib/libtensordict.so", "lib/libtensordict_wire.so", "lib/libtensordict_dist.so",
                 "lib/libtensordict_pipe.so",
                 "lib/cmake/tensordict/tensordictConfig.cmake", "include/tensordict/tensor_dict.h"]:
        assert (prefix / name).exists(), name
    assert ".debug_info" not in _run(["readelf", "-S", "-W", str(prefix / "lib/libtensordict.so")])


@pytest.fixture(scope="module")
def wheel(prerequisites):
    copy = prerequisites
    copy.uninstall()
    copy.run_block(_block("pip wheel"))
    (whl,) = (copy.root / "dist").glob("tensordict_cpp-*.whl")
    return whl


def test_the_wheel_route_runs_the_example(copy, wheel, tmp_path):
    where = copy.example(tmp_path)
    assert where.startswith(str(copy.venv)), where


def test_the_wheel_holds_one_stripped_module(copy, wheel, tmp_path):
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
    # The torch minor release it was built against (tools/build/torch_pin.py).
    assert f"Requires-Dist: {copy.pin}" in metadata, metadata
    assert "Requires-Dist: libucx-cu12<1.22,>=1.21" in metadata, metadata

    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", _run(["readelf", "-d", str(so)]))
    foreign = [n for n in needed if n not in MANYLINUX_SYSTEM and not FROM_DEPENDENCIES.match(n)]
    assert not foreign, f"the module needs libraries of this machine: {foreign}"
    assert any(n.startswith("libucp") for n in needed), needed


def test_the_source_route_runs_the_example(copy, wheel, tmp_path):
    copy.uninstall()
    copy.run_block(_block("pip install --no-build-isolation ."))
    where = copy.example(tmp_path)
    assert where.startswith(str(copy.venv)), where


def test_the_editable_route_runs_the_example_and_takes_python_edits(copy, wheel, tmp_path):
    copy.uninstall()
    copy.run_block(_block("-e ."))
    where = copy.example(tmp_path)
    assert where.startswith(str(copy.root / "python")), where
    with open(copy.root / "python" / "tensordict_cpp" / "__init__.py", "a") as f:
        f.write("\nEDITED_IN_PLACE = 42\n")
    out = _run([str(copy.python), "-c", "import tensordict_cpp; print(tensordict_cpp.EDITED_IN_PLACE)"],
               cwd=tmp_path, env=copy.env)
    assert out.strip() == "42"


@pytest.fixture(scope="module")
def repaired(copy, wheel):
    """The README's auditwheel line: torch's and UCX's libraries left out, the manylinux tag the
    build machine's glibc and libstdc++ allow, and nothing of the system grafted."""
    copy.run_block(_block("auditwheel repair"))
    (whl,) = (copy.root / "dist").glob("tensordict_cpp-*manylinux*.whl")
    return whl


def test_auditwheel_repair_grafts_nothing_and_tags_manylinux(copy, repaired):
    assert re.search(r"-cp3\d+-cp3\d+-manylinux_2_\d+_x86_64\.whl$", repaired.name), repaired.name
    with zipfile.ZipFile(repaired) as z:
        grafted = [n for n in z.namelist() if ".libs/" in n]
    assert not grafted, f"auditwheel copied libraries of this machine into the wheel: {grafted}"
    show = " ".join(_run([str(copy.venv / "bin" / "auditwheel"), "show", str(repaired)],
                         env=copy.env).split())
    print(show)
    assert "system-provided shared libraries" in show


def test_the_readme_example_runs_from_the_repaired_wheel(copy, repaired, tmp_path):
    copy.uninstall()
    _run([str(copy.python), "-m", "pip", "install", "-q", str(repaired)], env=copy.env, timeout=1200)
    where = copy.example(tmp_path)
    assert where.startswith(str(copy.venv)), where
