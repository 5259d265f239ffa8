"""pyproject.toml lists every subpackage (a new one left out would be missing from the wheel)."""

import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOP_LEVEL = ("beam_shared_prefix", "triton_kernels", "microbenchmarks")


def test_pyproject_lists_every_subpackage():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    setuptools = pytest.importorskip("setuptools")
    with open(os.path.join(_ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set(setuptools.find_packages(_ROOT, include=[p + suffix for p in _TOP_LEVEL for suffix in ("", ".*")]))
    assert found, f"no package found under {_ROOT}"
    assert listed == found, (
        f"missing from pyproject.toml: {sorted(found - listed)}; not a package: {sorted(listed - found)}"
    )
