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


def test_the_decline_tables_rule_is_the_librarys():
    """The rule column gives what auto does with the shape (runner.decline_reason): a one-request, 14-beam step on an
    8,000-token prompt takes FlashInfer's split prompt and is served."""
    from microbenchmarks.results_table import decline_markdown
    from microbenchmarks.runner import decline_reason
    from microbenchmarks.shapes import BenchShape

    shape = BenchShape(requests=1, beams=14, prompt=8000, tail=4, heads=16, kv_heads=8, head_dim=128)
    arm = {"name": "library/auto", "kind": "library", "status": "ok", "time_us": 50.0, "info": {"backend": "flashinfer"}}
    decode = {"name": "fi-decode-tc", "kind": "baseline", "status": "ok", "time_us": 80.0}
    doc = {"results": [{"shape": shape.to_dict(), "prompt_lens": {"mean": 8000.0}, "arms": [arm, decode]}]}
    assert decline_reason(shape) is None
    assert _cells(decline_markdown(doc).splitlines()[-1])[-1] == "serve"


def test_a_cpu_run_renders(tmp_path):
    """The CPU path measures no rates: the shape line says "-" for them."""
    from microbenchmarks import cli
    from microbenchmarks.report import load_json

    path = tmp_path / "cpu.json"
    assert cli.main(["--cpu", "--preset", "B-short", "--sets", "1", "--iters", "1", "--plan-repeats", "0", "--json",
                     str(path)]) == 0
    doc = load_json(str(path))
    assert "at - GB/s and - TFLOP/s" in point_markdown(doc["results"][0], doc["rates"])
