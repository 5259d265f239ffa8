"""The committed H200 results (``docs/results/h200``) that the rule tests check the code against, and the few
H100 ones (``docs/results/h100``, rounds 40, 63 and 65-68, when no H200 was lent)."""

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "h200"

# Grids measured again, with the same command, after a kernel change made the library faster there: the
# rule is checked against the library as it is. A replacement holds every point of its grid, or the
# points the change touched (the same sweep keys, so the same shape names); each old file stays committed
# (docs/rounds.md reports both) and test_decline.py checks that its replacement holds the old shapes.
SUPERSEDED = {
    # Held-out 7 and 8 of the tail tables below 8 KV heads ran first with the tail kernel's previous
    # tiling, whose few-rows chain served two points under the margin (1.00x, 1.06x); the twenty-fourth
    # round's few-rows tiling made every one of their steps 1.01-1.66x faster.
    **{f"tail_auto_check_round24_{name}.json": f"tail_auto_check_round24_{name}_few_rows_tail.json"
       for name in ("heldout7_kv3", "heldout7_kv6", "heldout8_kv4", "heldout8_mqa")},
    # The twenty-fifth round timed again every long-tail point whose launch the twenty-fourth round's
    # tiling by beam rows changed (404 points, 0.97x-2.89x of their first times), to refit the tail tables.
    **{f"tail_auto_check_{name}.json": f"tail_auto_check_{name}_retimed_round25.json"
       for name in ("r8", "r8_b", "round22_heldout_b_medium", "round23_heldout4_kv2", "round23_heldout4_kv4",
                    "round23_heldout4_mqa_d64", "round23_heldout5_kv3", "round23_heldout5_mqa",
                    "round23_heldout6_kv5", "round23_heldout6_mqa", "round23_heldout_g4_kv4",
                    "round23_heldout_mqa", "round23_mixed", "round23_mixed_mqa", "set2_g8", "set2_mqa",
                    "set3_mqa")},
    # Held-out 12's head-64 grid (GQA 14/2) ran the tail kernel's default tiling at 1,024-13,056 row-KV-heads; the
    # fifty-second round's few-rows bound at G = 5-8, head 64 (8,192) made its steps up to 1.60x faster.
    "tail_auto_check_round52_heldout12_g7_kv2_d64.json":
        "tail_auto_check_round52_heldout12_g7_kv2_d64_few_rows_tiling.json",
    # The GQA 2 grids of 3-5 beams at head 128 ran the cascade's 16-beam tile; the fifty-sixth round's narrow tile (8
    # beams a program) timed again with the same commands in the fifty-seventh (1.12x-2.85x of decode, every point).
    **{f"few_rows_{name}.json": f"few_rows_{name}_narrow_tile_round57.json"
       for name in ("heldout22_w3_g2_kv8", "heldout22_w3_g2_kv2", "round55_w3_g2_kv2", "heldout21_narrow_g2_kv2",
                    "heldout20_narrow_g2_kv4", "round55_narrow_g2")},
}
_REPLACEMENTS = frozenset(SUPERSEDED.values())


def _load(name, root=RESULTS):
    return json.loads((root / name).read_text())["results"]


def grid_points(pattern, as_measured=False, card="h200"):
    """``(file name, shape, mean prompt, {arm name: arm record})`` of every point of the committed grids
    whose file name matches ``pattern``, with only the arms that ran (status ``ok``). A grid in
    :data:`SUPERSEDED` yields the points of its replacement in place of its own, and a replacement
    is not yielded on its own; ``as_measured`` yields every file as it is. ``card``: the results folder
    (``h200`` or ``h100``)."""
    root = RESULTS.parent / card
    for path in sorted(root.glob(pattern)):
        if path.name in _REPLACEMENTS and not as_measured:
            continue
        points = _load(path.name, root)
        if path.name in SUPERSEDED and not as_measured:
            again = {point["shape"]["name"]: point for point in _load(SUPERSEDED[path.name], root)}
            points = [again.get(point["shape"]["name"], point) for point in points]
        for point in points:
            arms = {a["name"]: a for a in point["arms"] if a["status"] == "ok"}
            yield path.name, point["shape"], point["prompt_lens"]["mean"], arms


def with_auto_backend(arms):
    """``arms`` ({arm name: arm record}) with ``library/auto``'s record also under ``library/<its backend>``
    where that arm did not run: the twenty-sixth round's grids timed ``auto``'s backend only through ``auto``."""
    backend = arms.get("library/auto", {}).get("info", {}).get("backend")
    if backend is None or f"library/{backend}" in arms:
        return arms
    return {**arms, f"library/{backend}": arms["library/auto"]}
