"""The code blocks of README.md and docs/*.md are programs: each Python block runs as a script,
each C++ block is compiled against the installed C++ package (cmake --install, then
find_package(tensordict) in a separate project) and run. Both must print what the block's
`<!-- output: TEXT -->` comments say, in that order.

A block that is not a whole program (a side-by-side sketch, a signature, JSON on the wire, a
CMake excerpt) says so with `<!-- fragment: why -->` on a line of its own just above the fence;
any other block must be Python or C++ and is run."""

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!--\s*(fragment|output):\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    fragment: str | None
    outputs: list

    @property
    def id(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def stem(self):
        return re.sub(r"\W", "_", f"{self.path.stem}_{self.line}")


def blocks():
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        marks, k = [], 0
        while k < len(lines):
            mark, fence = MARK.match(lines[k]), FENCE.match(lines[k])
            if mark:
                marks.append(mark.groups())
            elif fence:
                end = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("```"))
                fragment = next((why for kind, why in marks if kind == "fragment"), None)
                outputs = [text for kind, text in marks if kind == "output"]
                found.append(Block(path, k + 1, fence.group(1), "\n".join(lines[k + 1:end]) + "\n",
                                   fragment, outputs))
                marks, k = [], end
            elif lines[k].strip():
                marks = []  # the marks belong to the fence right below them only
            k += 1
    return found


BLOCKS = blocks()
PROGRAMS = [b for b in BLOCKS if b.fragment is None]


def check_output(block, stdout):
    at = 0
    for want in block.outputs:
        found = stdout.find(want, at)
        assert found >= 0, f"{block.id}: expected {want!r} (in order) in the output:\n{stdout}"
        at = found + len(want)


def test_every_block_is_a_program_or_a_marked_fragment():
    assert len(BLOCKS) >= 20
    for b in BLOCKS:
        if b.fragment is None:
            assert b.lang in ("python", "cpp"), \
                f"{b.id}: a ```{b.lang} block must be marked <!-- fragment: why -->"
        else:
            assert b.fragment, f"{b.id}: a fragment says why it is one"
            assert not b.outputs, f"{b.id}: a fragment is not run, its output cannot be checked"


def test_the_send_recv_blocks_are_the_example():
    example = (ROOT / "examples" / "send_recv.cpp").read_text()
    copies = [b for b in PROGRAMS if b.lang == "cpp" and "dist::recv(td, /*src=*/0)" in b.code]
    assert {b.path.name for b in copies} >= {"README.md", "distributed.md"}
    for b in copies:
        assert b.code == example, f"{b.id} differs from examples/send_recv.cpp"


@pytest.mark.parametrize("block", [b for b in PROGRAMS if b.lang == "python"], ids=lambda b: b.id)
def test_python_block(block, tmp_path):
    script = tmp_path / f"{block.stem}.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, f"{block.id} failed:\n{r.stdout}\n{r.stderr}"
    check_output(block, r.stdout)


CPP_PROJECT = """cmake_minimum_required(VERSION 3.25)
project(doc_blocks LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(tensordict REQUIRED)
foreach(name {names})
  add_executable(${{name}} ${{name}}.cpp)
  target_link_libraries(${{name}} PRIVATE tensordict::core tensordict::dist tensordict::pipe)
endforeach()
"""


@pytest.fixture(scope="session")
def cpp_blocks(tmp_path_factory):
    """Installs the CMake build into a scratch prefix and builds every C++ block against it."""
    build_dir = pathlib.Path(os.environ.get("TENSORDICT_BUILD_DIR", ROOT / "build"))
    if not (build_dir / "build.ninja").exists():
        pytest.skip(f"no CMake build in {build_dir} (scripts/setup makes one)")
    work = tmp_path_factory.mktemp("doc_blocks")
    prefix, src = work / "prefix", work / "src"
    src.mkdir()
    subprocess.run(["cmake", "--install", str(build_dir), "--prefix", str(prefix)], check=True,
                   capture_output=True)
    programs = {}  # code -> name: identical blocks (the example, twice) compile once
    for b in PROGRAMS:
        if b.lang == "cpp" and b.code not in programs:
            programs[b.code] = b.stem
            (src / f"{b.stem}.cpp").write_text(b.code)
    (src / "CMakeLists.txt").write_text(CPP_PROJECT.format(names=" ".join(programs.values())))
    import torch.utils
    configure = ["cmake", "-S", str(src), "-B", str(work / "build"), "-G", "Ninja",
                 f"-DCMAKE_PREFIX_PATH={prefix};{torch.utils.cmake_prefix_path}"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    r = subprocess.run(configure, text=True, capture_output=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"configuring the doc blocks failed:\n{r.stdout}\n{r.stderr}")
    # -k 0: every block that compiles is built, so each test reports its own block.
    r = subprocess.run(["cmake", "--build", str(work / "build"), "--", "-k", "0"], text=True,
                       capture_output=True, timeout=1500)
    log = r.stdout + r.stderr
    return work / "build", programs, log


@pytest.mark.parametrize("block", [b for b in PROGRAMS if b.lang == "cpp"], ids=lambda b: b.id)
def test_cpp_block(block, cpp_blocks, tmp_path):
    build, programs, log = cpp_blocks
    name = programs[block.code]
    exe = build / name
    assert exe.exists(), f"{block.id} does not compile:\n" + "\n".join(
        line for line in log.splitlines() if name in line or "error" in line)[-6000:]
    r = subprocess.run([str(exe)], cwd=tmp_path, text=True, capture_output=True, timeout=300)
    assert r.returncode == 0, f"{block.id} failed:\n{r.stdout}\n{r.stderr}"
    check_output(block, r.stdout)
