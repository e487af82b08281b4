"""The third-party SIF corpus: real SIF files other projects built (../shared/testdata/sif, or
$ARCHWAY_TESTDATA/sif), never part of this repository.

CI has it and runs every test that reads it. A lone clone does not: those tests skip, all with
the one line below (pytest -ra folds skips raised at the same place into one), and the files
sifbuild.generated_corpus() makes cover the same reader paths (tests/test_sif.py checks that
line by line when both are there).
"""
import os

import pytest

from lab.procs import SHARED_TESTDATA

CORPUS_DIR = os.path.join(SHARED_TESTDATA, "sif")
ABSENT = (f"third-party SIF corpus absent ({CORPUS_DIR}; set ARCHWAY_TESTDATA to use one "
          "elsewhere): its tests skip, the generated SIF files cover the same reader paths")


def present() -> bool:
    return os.path.isdir(CORPUS_DIR)


def require() -> None:
    """Skip the calling test when the corpus is absent. Call it in the test's body, not in a
    fixture: pytest reports a fixture's skip at each test, a body's at this one line."""
    if not present():
        pytest.skip(ABSENT)


def path(name: str) -> str:
    """The corpus file `name`; skips the calling test when the corpus is absent."""
    require()
    return os.path.join(CORPUS_DIR, name)


def read(name: str) -> bytes:
    with open(path(name), "rb") as f:
        return f.read()
