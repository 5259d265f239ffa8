"""The committed H200 results (``docs/results/h200``) that the rule tests check the code against."""

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "h200"


def grid_points(pattern):
    """``(file name, shape, mean prompt, {arm name: arm record})`` of every point of the committed grids
    whose file name matches ``pattern``, with only the arms that ran (status ``ok``)."""
    for path in sorted(RESULTS.glob(pattern)):
        for point in json.loads(path.read_text())["results"]:
            arms = {a["name"]: a for a in point["arms"] if a["status"] == "ok"}
            yield path.name, point["shape"], point["prompt_lens"]["mean"], arms
