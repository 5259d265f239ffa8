"""The markdown tables of ``results_table``: a kernel-span column only for runs that traced kernels."""

import json

import pytest
from h200_grids import RESULTS

from microbenchmarks.results_table import point_markdown


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.parametrize("name,traced", [("B-short_session18.json", True), ("B-short_session17.json", False)])
def test_every_row_has_the_header_columns(name, traced):
    path = RESULTS / name
    if not path.exists():
        pytest.fail(f"{path} is gone: these tests render the recorded H200 results")
    doc = json.loads(path.read_text())
    text = point_markdown(doc["results"][0], doc["rates"])
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = _cells(rows[0])
    assert ("kernels (x floor)" in header) is traced
    assert all(len(_cells(r)) == len(header) for r in rows), text
    assert ("An empty kernel measures" in text) is traced
    if traced:
        auto = next(_cells(r) for r in rows if "library/auto" in r)
        arm = next(a for a in doc["results"][0]["arms"] if a["name"] == "library/auto")
        assert auto[header.index("kernels (x floor)")].startswith(f"{arm['kernel_us']:.1f} us")
