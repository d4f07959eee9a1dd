"""adapters.upstream: every workaround names code that exists and holds for the installed versions only."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from torchlike.adapters.upstream import WORKAROUNDS

ROOT = Path(__file__).resolve().parent.parent


def _row_id(workaround) -> str:
    return f"{workaround.package}{workaround.versions}:{workaround.where[0].rsplit(':', 1)[-1]}"


@pytest.mark.parametrize("workaround", WORKAROUNDS, ids=_row_id)
def test_the_installed_version_is_one_the_workaround_was_checked_on(workaround):
    installed = importlib.metadata.version(workaround.package)
    assert Version(installed) in SpecifierSet(workaround.versions), (
        f"{workaround.package} {installed} is outside {workaround.versions!r}, the versions this workaround was "
        f"checked on: {workaround.problem} Re-check {', '.join(workaround.where)}: drop the workaround and its row "
        "in adapters/upstream.py if upstream fixed it, else widen the row's range.")


@pytest.mark.parametrize("workaround", WORKAROUNDS, ids=_row_id)
def test_each_place_named_exists(workaround):
    for place in workaround.where:
        path, _, name = place.partition(":")
        source = (ROOT / path).read_text()
        assert re.search(rf"^\s*(def|class) {name}\b|^\s*{name}\s*=|\b{name}=", source, re.MULTILINE), (
            f"{place}: {name} is not defined in {path}; update adapters/upstream.py.")
