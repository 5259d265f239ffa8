"""The committed H200 results (``docs/results/h200``) that the rule tests check the code against."""

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "h200"

# Grids measured again, with the same command, after a kernel change made the library faster there: the
# rule is checked against the library as it is. Each old file stays committed (docs/rounds.md reports
# both) and test_decline.py checks that its replacement holds the same shapes.
SUPERSEDED = {
    # Held-out 7 and 8 of the tail tables below 8 KV heads ran first with the tail kernel's previous
    # tiling, whose few-rows chain served two points under the margin (1.00x, 1.06x); the twenty-fourth
    # round's few-rows tiling made every one of their steps 1.01-1.66x faster.
    f"tail_auto_check_round24_{name}.json": f"tail_auto_check_round24_{name}_few_rows_tail.json"
    for name in ("heldout7_kv3", "heldout7_kv6", "heldout8_kv4", "heldout8_mqa")
}


def grid_points(pattern, include_superseded=False):
    """``(file name, shape, mean prompt, {arm name: arm record})`` of every point of the committed grids
    whose file name matches ``pattern``, with only the arms that ran (status ``ok``); files in
    :data:`SUPERSEDED` only with ``include_superseded``."""
    for path in sorted(RESULTS.glob(pattern)):
        if path.name in SUPERSEDED and not include_superseded:
            continue
        for point in json.loads(path.read_text())["results"]:
            arms = {a["name"]: a for a in point["arms"] if a["status"] == "ok"}
            yield path.name, point["shape"], point["prompt_lens"]["mean"], arms
