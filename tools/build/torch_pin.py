"""A scikit-build-core metadata provider (pyproject.toml, [tool.scikit-build.metadata]): the
package's dependencies, with torch pinned to the minor release the module is built against.

The module compiles against one torch's C++ API and pybind11 internals, which change between
minor releases, so a wheel built on torch 2.14.x requires ``torch>=2.14,<2.15`` and one built on
2.13.x requires ``torch>=2.13,<2.14``. The torch is the one this build's Python imports: the
environment's with ``--no-build-isolation`` (the README's routes), the build requirement's
otherwise; CMake finds the same one (CMakeLists.txt asks that Python for its prefix).
"""
from __future__ import annotations

import importlib.metadata
import re
from typing import Any

# The minor releases the source is built and tested against (scripts/check-torch); any patch
# release of them, CPU or CUDA build.
SUPPORTED = ((2, 13), (2, 14))


def torch_requirement() -> str:
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("tensordict-cpp is built against the torch of the Python that builds "
                           "it, and this one has none: pip install torch (2.13.x or 2.14.x) "
                           "first, then build with --no-build-isolation") from None
    match = re.match(r"(\d+)\.(\d+)", version)
    minor = (int(match[1]), int(match[2])) if match else None
    if minor not in SUPPORTED:
        names = " or ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise RuntimeError(f"tensordict-cpp builds against torch {names}; this Python has torch "
                           f"{version}")
    return f"torch>={minor[0]}.{minor[1]},<{minor[0]}.{minor[1] + 1}"


def dynamic_metadata(field: str, settings: dict[str, Any]) -> list[str]:
    """The ``dependencies`` field: ``settings["others"]`` after the torch requirement."""
    if field != "dependencies":
        raise RuntimeError(f"torch_pin provides the dependencies field, not {field!r}")
    return [torch_requirement(), *settings.get("others", [])]
