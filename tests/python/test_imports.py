"""Imports go one way through the package: errors, _C, then _p2p / _collectives, _td,
tensorclass, pipe, __init__. No module imports (at top level or inside a function) a module that
imports it back."""
import ast
import pathlib
import subprocess
import sys

import tensordict_cpp

PACKAGE = "tensordict_cpp"
ROOT = pathlib.Path(tensordict_cpp.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.glob("*.py"))}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules `path` imports, from every Import / ImportFrom node (those inside
    functions and classes included). `from tensordict_cpp import x` imports the module
    tensordict_cpp.x when there is one, else the package itself."""
    out = set()
    here = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package (all modules are top level)
                base = PACKAGE + (f".{node.module}" if node.module else "")
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known and n != here)
    return out


def test_the_package_modules_import_each_other_without_cycles():
    modules = _modules()
    known = set(modules) | {f"{PACKAGE}._C"}
    graph = {name: _imports(path, known) for name, path in modules.items()}
    assert f"{PACKAGE}._td" in graph and f"{PACKAGE}.pipe" in graph  # the walk found them

    # Depth-first search for a back edge; report the cycle it closes.
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_layers_below_td_import_only_errors_and_c():
    modules = _modules()
    known = set(modules) | {f"{PACKAGE}._C"}
    allowed = {f"{PACKAGE}._C", f"{PACKAGE}.errors", f"{PACKAGE}._p2p"}
    for low in ("errors", "_p2p", "_collectives"):
        deps = _imports(modules[f"{PACKAGE}.{low}"], known)
        assert deps <= allowed, (low, deps)
    assert _imports(modules[f"{PACKAGE}.errors"], known) == set()


def test_errors_imports_nothing_of_the_package():
    # `import tensordict_cpp.errors` runs the package's __init__ first, which imports every
    # module on purpose; stand a bare package in for it, so that what is left to observe is
    # what errors.py itself imports.
    code = f"""
import sys, types
pkg = types.ModuleType({PACKAGE!r})
pkg.__path__ = [{str(ROOT)!r}]
sys.modules[{PACKAGE!r}] = pkg
import tensordict_cpp.errors as errors
assert issubclass(errors.TimeoutError, TimeoutError)
loaded = sorted(m for m in sys.modules if m.startswith({PACKAGE!r} + "."))
assert loaded == [{PACKAGE!r} + ".errors"], loaded
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
