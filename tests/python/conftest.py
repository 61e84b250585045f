import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD_DIR = pathlib.Path(os.environ.get("TENSORDICT_BUILD_DIR", ROOT / "build"))


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    return BUILD_DIR


def built(name: str) -> pathlib.Path:
    """Path of a program built by CMake; fails clearly when it is missing."""
    path = BUILD_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/setup first")
    return path
