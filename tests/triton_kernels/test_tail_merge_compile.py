"""The tail kernel compiles for sm_90 without spills, with few registers and 16-byte loads; the
cascade kernel's default tilings compile for sm_90 on tensor cores; so do the shared-run stage and the page-table
audit.

The interpreter (the CPU suite) cannot see what the GPU compiler makes of the kernel. A layout
choice that replicates a ``[QH, D]`` tile across threads once cost 255 registers per thread and
stack spills (two resident rows per SM instead of five); this test compiles every representative
shape ahead of time with the ``ptxas`` bundled in the Triton wheel, so such a regression fails on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import triton
from sm90_resource_usage import CASCADE_SHAPES, CASCADE_VARIANTS, NVIDIA_BIN, sm90_ptxas

from triton_kernels.cascade import CascadeLaunchConfig, cascade_launch_config

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_resource_usage.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 4-warp programs with <= 128 registers keep >= 4 programs resident per SM (64K registers).
MAX_REGISTERS = 128


def _missing_nvidia_tools() -> list:
    """The tools the ahead-of-time compile needs that this Triton install lacks: the ``ptxas`` Triton itself picks for
    sm_90 (:func:`sm90_resource_usage.sm90_ptxas`) and the wheel's ``cuobjdump``, which ``sm90_resource_usage.py``
    reads resource usage with."""
    missing = []
    try:
        sm90_ptxas()
    except RuntimeError as exc:  # "Cannot find <tool>", from triton/knobs.py
        missing.append(str(exc).removeprefix("Cannot find "))
    if not os.path.exists(os.path.join(NVIDIA_BIN, "cuobjdump")):
        missing.append("cuobjdump")
    return missing


def _compile_for_sm90(*flags, timeout_s: int = 600):
    """Run ``sm90_resource_usage.py`` with ``flags`` outside the interpreter; skips where the tools are missing."""
    missing = _missing_nvidia_tools()
    if missing:
        pytest.skip(f"this Triton install ({triton.__version__}) lacks {', '.join(missing)}, which the ahead-of-time "
                    f"sm_90 compile needs")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, env=env, timeout=timeout_s)
    assert run.returncode == 0, f"ahead-of-time sm_90 compile failed:\n{run.stderr[-4000:]}"
    return run


def _usage_rows(run) -> list:
    """The usage rows ``sm90_resource_usage.py`` printed (one JSON object a line)."""
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


_COMPILE_RUNS = {}


def _compile_run(build: str):
    """The sm_90 compile of every kernel as the launchers build it with PDL on (``"pdl"``) or off (``"plain"``), once
    a process."""
    if build not in _COMPILE_RUNS:
        _COMPILE_RUNS[build] = _compile_for_sm90(*(("--plain",) if build == "plain" else ()))
    return _COMPILE_RUNS[build]


@pytest.fixture(scope="module", params=["pdl", "plain"])
def build(request):
    """With PDL off (``TRTLLM_ENABLE_PDL=0``, or a GPU before SM90) the launchers build the kernels without the wait:
    every test of a compiled build holds both builds to its budget."""
    return request.param


@pytest.fixture(scope="module")
def compile_run(build):
    return _compile_run(build)


@pytest.fixture(scope="module")
def usage(compile_run):
    rows = _usage_rows(compile_run)
    assert rows, compile_run.stdout
    return rows


def test_triton_warns_nothing_while_compiling(compile_run):
    """A warning Triton raises while compiling these kernels would reach every serving log once a process. Triton
    3.9 raised one until every launch asked for FP fusion (``triton_kernels/launch.py``; its default turns off in
    3.10), and the compile here uses the launches' options."""
    warnings = [line for line in compile_run.stderr.splitlines()
                if re.match(r"\S*[/\\]triton[/\\]\S*:\d+: \w*Warning: ", line)]
    assert not warnings, "Triton warned while compiling the kernels for sm_90:\n" + "\n".join(warnings)


def _tail(usage):
    return [row for row in usage if row["kernel"] == "tail"]


def _triton_floor() -> str:
    """The oldest Triton ``pyproject.toml`` accepts (its ``"triton>=X.Y"``)."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        (floor,) = re.findall(r'"triton>=([\d.]+)"', f.read())
    return floor


def test_compiles_with_the_oldest_triton_accepted(usage, build):
    """A kernel that only a newer Triton compiles would fail at its first launch, in serving, for a user whose torch
    brings an older one. So CI also compiles every tiling for sm_90 with the oldest Triton ``pyproject.toml`` accepts,
    which ``scripts/test.sh`` installs beside the suite's (``BSP_TRITON_FLOOR_SITE``): all compile, with no local-memory
    spill, and the tail's without a stack frame, as with the suite's Triton."""
    floor = _triton_floor()
    site = os.environ.get("BSP_TRITON_FLOOR_SITE")
    if not site:
        message = (f"BSP_TRITON_FLOOR_SITE is not set: no Triton {floor} to compile the kernels with "
                   "(scripts/test.sh installs one where CI is set)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([site, REPO])
    flags = ("--plain",) if build == "plain" else ()
    run = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    assert run.returncode == 0, f"ahead-of-time sm_90 {build} compile with Triton {floor} failed:\n{run.stderr[-4000:]}"
    rows = _usage_rows(run)
    assert {row["triton"].rsplit(".", 1)[0] for row in rows} == {floor}, "the compile ran another Triton"
    assert len(rows) == len(usage), (len(rows), len(usage))
    for row in rows:
        assert row["local"] == 0, f"local-memory spill with Triton {floor}: {row}"
        assert row["pdl_wait_first"] is not False, f"a PDL build touches memory before its wait with Triton {floor}: {row}"
        assert row["kernel"] != "tail" or row["stack"] == 0, f"a tail tiling's stack frame with Triton {floor}: {row}"


def test_pdl_builds_wait_before_touching_memory(usage, build):
    """Launched as programmatic dependents (``triton_kernels.launch``), the tail, cascade and shared-run kernels may
    start while the kernel before them still writes their inputs: each must take the ``PDL`` constexpr, and its
    build must run ``griddepcontrol.wait`` before its first load, store or atomic in the PTX (a hoisted load would
    read what that kernel has not finished writing). The page-table audit launches plainly and has neither. Their
    plain builds wait for nothing."""
    dependents = {"tail", "cascade", "cascade-prefix", "shared-run"}
    for row in usage:
        if row["kernel"] in dependents:
            assert row["pdl_param"] and row["pdl_wait_first"] is (True if build == "pdl" else None), row
        else:
            assert not row["pdl_param"] and row["pdl_wait_first"] is None, row
    assert {row["kernel"] for row in usage} >= dependents


def test_plain_builds_are_the_pdl_builds_without_the_wait():
    """PDL off builds the same kernels at the same tilings, in the same order (so each budget test above holds both
    builds to one budget). Their resources are not compared: register allocation moves with one instruction either
    way (round 86: Triton 3.5 gives the B-beam14 prompt pass 200 registers plain and 188 with the wait; 3.6 gave the
    fp16 flag cascade 188 and 189), so each build meets the budgets on its own."""
    resources = ("registers", "stack", "local", "shared")

    def key(row):
        return json.dumps({k: v for k, v in sorted(row.items()) if k not in (*resources, "pdl_wait_first")})

    plain, pdl = (_usage_rows(_compile_run(build)) for build in ("plain", "pdl"))
    assert plain and [key(row) for row in plain] == [key(row) for row in pdl]


def test_compiles_without_spills(usage):
    for row in _tail(usage):
        assert row["local"] == 0 and row["stack"] == 0, f"register spills: {row}"


def _tail_register_faults(row) -> list:
    """The register budgets a compiled tail tiling (a usage row) breaks; :func:`test_register_budget` says why each.
    The few-rows tiling is the one with index blocks (``config[5]``) at a known row count: G = 8's many-rows tiling at
    head 64 has index blocks too, and keeps the many-rows budget."""
    group_pad, kv_heads, block_t, num_warps, _, index_block, grouped = row["config"]
    few_rows, wide = index_block > 0 and row["num_rows"] is not None, group_pad >= 32
    programs_per_sm = 1 if few_rows and wide else 2 if few_rows or wide else 4
    faults = []
    if row["registers"] > MAX_REGISTERS and row["registers"] * 32 * num_warps > 65536 // programs_per_sm:
        faults.append(f"too many registers for {programs_per_sm} programs an SM")
    small = group_pad * kv_heads * block_t * row["shape"][3] <= 16 * 32 * num_warps
    if num_warps <= 2 and small and not index_block and not grouped and row["registers"] > 64:
        faults.append("a small tile past its 64-register cap")
    if num_warps == 1 and group_pad == 1 and not index_block and row["registers"] > 80:
        faults.append("an MHA tile past its 80-register cap")
    return faults


def test_register_budget(usage):
    """Many-rows tilings: at least 4 programs per SM. The few-rows tiling (index blocks; at most 1,024
    row-KV-heads, so a few programs per SM at most) and groups padded to 32 (a ``[4, 32, D]`` tile of 4
    tokens: on the H200 1.11-1.14x faster than 1-token tiles at tails 16-64, 3% slower at 4): at least 2;
    both at once (at most 128 row-KV-heads at groups of 32 and 64, so at most 128 programs, fewer than the
    H200's 132 SMs): at least 1. ``[QH, D]`` tiles of one or two warps and at most 16 elements a thread (G = 3-4
    at one warp, 5-8 at two): at most 64 registers, with the error flag too (their launch cap); MHA's one-warp
    tiles of two heads and 4 tokens: at most 80 (theirs); G = 4 at head 256 (one warp) and the grouped kernel's
    one-warp tiles (G = 2, few KV heads) are held to the many-rows budget, uncapped, since capped they spill."""
    few_rows = [row for row in _tail(usage) if row["num_rows"] == 1 and row["config"][5]]
    assert len(few_rows) >= 14, few_rows  # every shape with a few-rows tiling, with and without the flag
    for row in _tail(usage):
        assert not _tail_register_faults(row), f"{_tail_register_faults(row)}: {row}"


def test_kv_rows_load_as_16_byte_vectors(usage):
    for row in _tail(usage):
        assert row["vector_loads"] > 0, f"no 16-byte global loads: {row}"


def test_cascade_default_tilings_compile_for_sm90(usage):
    """Every default tiling of the cascade kernel compiles for sm_90 with this Triton, whole step and
    prompt pass, on tensor cores (``wgmma`` for 64-row tiles and up, ``mma.sync`` below).

    Its registers are reported, not bounded: the kernel's tiles trade registers for fewer programs
    (the fastest H200 tiling ran at 255 per thread with Triton 3.6), and the numbers differ between
    Triton versions; ``docs/benchmarks.md`` has the measured ones.
    """
    defaults = {shape[0] for shape in CASCADE_SHAPES}
    rows = [row for row in usage if row["kernel"].startswith("cascade") and row["shape"][0] in defaults]
    assert len(rows) == 16, rows  # 8 shapes, whole step and prompt pass
    for row in rows:
        assert row["wgmma"] + row["mma_sync"] > 0, f"no tensor-core instructions: {row}"


def test_cascade_batch_tilings_compile_for_sm90(usage):
    """The tilings the launcher picks by the batch (rounds 45-46) compile for sm_90 on tensor cores: without the
    shared-ancestry path where every tail is at most 16 tokens (with no more stack than the default tiling, at
    B-medium's head-64 shape), GQA 8's 128-row tile at head 64 with 8 warps where 32 programs run, GQA 4's
    32-beam tile at head 64 (no path at any tail) at two programs a multiprocessor, as measured on the H200, and the
    narrow widths' tiles of 4 and 8 beams."""
    rows = {row["shape"][0]: row for row in usage if row["kernel"] == "cascade"}
    fields = [f.name for f in dataclasses.fields(CascadeLaunchConfig)]
    shared_ancestry, beams = fields.index("shared_ancestry"), fields.index("beams_per_program")
    for name, *_, max_tail_len in CASCADE_VARIANTS:
        row = rows[name]
        assert row["wgmma"] + row["mma_sync"] > 0, f"no tensor-core instructions: {row}"
        assert row["config"][shared_ancestry] == (max_tail_len is None and not name.startswith("G4-D64")), row
    assert rows["G8-D64-few-programs"]["num_warps"] == 8 and rows["G8-D64-short-tail"]["num_warps"] == 4
    # The narrow tiles (round 56) hold 4 or 8 beams; G = 4's fits three programs a multiprocessor (154 registers on
    # Triton 3.6, where the 16-beam tile's 253 fit two), G = 2's lifts its cap to 168 where few programs run.
    assert rows["G4-D128-narrow"]["config"][beams] == 4 and _resident_programs(rows["G4-D128-narrow"]) >= 3
    assert rows["G2-D128-narrow-few-programs"]["config"][beams] == 8
    assert rows["G2-D128-narrow-few-programs"]["config"][fields.index("max_registers")] == 168
    assert rows["G8-D128-narrow"]["config"][beams] == 8 and rows["G8-D128-narrow"]["num_warps"] == 4
    # Round 57: the 168-register cap fits three programs a multiprocessor, the 8-position tail blocks compile.
    roomy = rows["G2-D128-16-beams-roomy"]
    assert roomy["config"][beams] == 16 and roomy["config"][fields.index("max_registers")] == 168
    assert _resident_programs(roomy) >= 3, roomy
    assert rows["G4-D64-tail-block-8"]["config"][fields.index("tail_block")] == 8
    assert rows["B-medium-D64-short-tail"]["stack"] <= rows["B-medium-D64"]["stack"], rows["B-medium-D64-short-tail"]
    # The 128-row tiles at head 64 spill alike (Triton 3.9: 176 and 168 bytes of stack; 3.6 on the H200, where the
    # 32-beam tile measured 8-18% faster than the 16-beam one: 36-48 bytes of spill). Triton 3.6 is the compiler the
    # tile was measured with: there it takes 192 bytes of stack against GQA 8's 112 (the H200's GPU run of this test,
    # session 57), 200 since the cascade clamps the prompt length it reads (round 86, 64 requests on an H100: medians
    # of 3 interleaved runs 108.0 against 108.4 us before the clamp at 4-token tails, 287.0 against 287.5 at 64;
    # docs/results/h100/round86/wide_tile_*_round86b*). A Triton that spills GQA 4's tile past both that and GQA 8's tile (by
    # 32 bytes), or fits fewer of its programs a multiprocessor, fails here. Triton 3.5 (TensorRT-LLM's pin) takes
    # 152 bytes against GQA 8's 32: less than the measured compile, so it passes.
    wide = rows["G4-D64-wide-tile"]
    assert wide["config"][beams] == 32 and wide["num_warps"] == 4 and _resident_programs(wide) == 2, wide
    assert wide["stack"] <= max(200, rows["G8-D64-short-tail"]["stack"] + 32), wide


def test_cascade_g4_head64_tiling_has_no_stack(usage):
    """The 16-beam tile of G = 3-4 at head 64 leaves the shared-ancestry path out: with it the tile spilled (6 bytes
    on Triton 3.6, 16 bytes of stack on 3.9) and every step ran 12-26% slower on the H200 (``docs/rounds.md``, "The
    forty-fourth round"). Its whole step must compile with no stack, so that turning the path back on fails here."""
    row = next(row for row in usage if row["kernel"] == "cascade" and row["shape"][0] == "B-4B-D64")
    assert row["stack"] == 0 and row["local"] == 0, f"the G = 4 head-64 cascade tile spills: {row}"


# SM90 (H100, H200): registers, shared memory and threads a multiprocessor; registers are allocated per warp in
# units of 256 (8 a thread), shared memory per block with 1 KB the system reserves.
SM90_REGISTERS, SM90_SHARED, SM90_THREADS = 65536, 228 * 1024, 2048
# The shared memory one block may take on SM90 (``sharedMemPerBlockOptin``), past which Triton refuses the launch.
SM90_SHARED_PER_BLOCK = 227 * 1024


def _resident_programs(row):
    """Programs of a compiled kernel (a usage row) resident on one SM90 multiprocessor."""
    by_registers = SM90_REGISTERS // (-(-row["registers"] // 8) * 8 * 32 * row["num_warps"])
    by_shared = SM90_SHARED // (row["dynamic_shared"] + row["shared"] + 1024)
    return min(by_registers, by_shared, SM90_THREADS // (32 * row["num_warps"]))


def test_every_cascade_tiling_the_launcher_picks_fits_sm90():
    """A tiling past the shared memory a block may take fails at its first launch (Triton's ``OutOfResources``), in
    serving. Tilings exist that do: the property test of ``test_cascade.py`` drew a 64-row tile at head 128 with
    8-position tail blocks and two stages that needs 276 KB (H100, round 77). The launcher must never pick one: every
    distinct tiling :func:`cascade_launch_config` returns over a wide walk of its inputs
    (:func:`sm90_resource_usage.reachable_cascade_tilings`; every preset's among them) compiles for sm_90, the whole
    step and the prompt pass, within that limit, without local-memory spills, and holds a program a multiprocessor.
    (Triton 3.9: 68 tilings, 110 builds, at most 113 KB.)"""
    from sm90_resource_usage import cascade_tiling_key, reachable_cascade_tilings

    tilings = reachable_cascade_tilings()
    for name, w, hq, hkv, d, _, capacity in CASCADE_SHAPES:
        cfg = cascade_launch_config(w, hq // hkv, d, capacity, None, hkv)
        assert cascade_tiling_key(cfg, d, capacity) in tilings, f"the walk misses {name}'s tiling {cfg}"
    rows = _usage_rows(_compile_for_sm90("--reachable-cascade"))
    steps = [row for row in rows if row["kernel"] == "cascade"]
    assert len(steps) == len(tilings) >= 60 and len(rows) > len(steps), (len(steps), len(rows), len(tilings))
    for row in rows:
        assert row["dynamic_shared"] <= SM90_SHARED_PER_BLOCK, f"past the shared memory of a block: {row}"
        assert row["local"] == 0 and _resident_programs(row) >= 1, row


def test_every_tail_tiling_the_launcher_picks_compiles_within_budget():
    """The tail kernel's counterpart of the test above: every distinct tiling :func:`tail_launch_config` returns over
    every head size and group the kernel takes, 1-64 KV heads and 1 to 12,288 beam rows or unknown
    (:func:`sm90_resource_usage.reachable_tail_shapes`; every shape this module compiles among them) compiles for
    sm_90 with the error flag off and on, and after the shared-run stage, with the prefix state in the query's dtype
    as the wrapper passes it, without local-memory spills and within the register budgets of
    :func:`test_register_budget`. A launcher change that picks a spilling or register-starved tiling for a shape no
    preset runs fails here. (93 tilings, 279 builds, about 2.5 minutes on 2 CPUs. Triton 3.9: no stack frame; 3.5
    and 3.6 keep an 8-16 byte frame in 8 builds, hence the bound below. With float32 prefix state, which only a
    direct caller of the tail kernel passes, 3.5 and 3.6 give G = 2's grouped tile at head 256 129-141 registers:
    three programs a multiprocessor instead of four.) Each tiling is compiled at the smallest group it serves. Round 79
    compiled every group (``--every-group``, 1,503 builds, about 6 minutes on 2 CPUs: too long for CI): 3.5 and 3.6 pass
    this test's bounds at all of them; 3.9 fails them at 16, G = 49-64 at head 256 with the error flag (the 16-warp
    tile of 2 tokens: 128 registers, the cap at 512 threads, and a 48-80 byte stack), which this walk's G = 33 does
    not show."""
    from sm90_resource_usage import SHAPES, reachable_tail_shapes

    from triton_kernels.tail_merge import tail_launch_config

    shapes = reachable_tail_shapes()
    walked = {(d, dataclasses.astuple(tail_launch_config(g, hkv, d, num_rows))) for g, hkv, d, num_rows in shapes}
    assert len(walked) == len(shapes) >= 90, len(shapes)
    for _, hq, hkv, d, _ in SHAPES:
        for num_rows in (None, 1, 1024):
            cfg = tail_launch_config(hq // hkv, hkv, d, num_rows)
            assert (d, dataclasses.astuple(cfg)) in walked, f"the walk misses {hq}/{hkv} D{d}'s tiling {cfg}"
    rows = _usage_rows(_compile_for_sm90("--reachable-tail", timeout_s=2400))
    assert len(rows) == 3 * len(shapes) and sum(row["skip_shared"] for row in rows) == len(shapes), len(rows)
    for row in rows:
        assert row["local"] == 0 and row["stack"] <= 16, f"register spills: {row}"
        assert not _tail_register_faults(row), f"{_tail_register_faults(row)}: {row}"


def test_wave_rule_occupancy_matches_the_compiled_cascade(usage):
    """The several-block rule by waves (``prefix/cascade_rule.py``) counts :data:`CASCADE_PROGRAMS_PER_SM` cascade
    programs a multiprocessor at heads 128 and 64, a constant read off the H200 (253-255 registers at head 128, Triton
    3.6) and the H100 (230 at head 64). Here it is read from the tilings the rule judges, compiled with this Triton:
    G = 2's 32-beam tile (B-medium's, the tiling of every width from 17 beams, at head 128 and at head 64) and G = 4's
    16-beam tile (B-4B's, every width from 9). A Triton whose compile moves the occupancy fails here before the rule misjudges the waves. (Triton 3.9,
    the CPU suite's: 255 registers, and 112 KB (G = 2, the prompt loop's three stages) and 80 KB (G = 4) of shared
    memory: both bounds give two; at head 64, 226 registers and 41 KB: the registers give two.)"""
    from beam_shared_prefix.prefix.select import (
        CASCADE_BY_WAVES_MIN_BALANCE,
        CASCADE_PROGRAMS_PER_SM,
    )
    from triton_kernels.cascade import cascade_launch_config

    rows = {row["shape"][0]: row for row in usage if row["kernel"] == "cascade"}
    judged = (("B-medium", (17, 48, 96, 160, 256), 2, 128), ("B-4B", (9, 30, 48, 64, 256), 4, 128),
              ("B-medium-D64", (17, 48, 96, 160, 256), 2, 64))
    assert {(group, d) for *_, group, d in judged} == set(CASCADE_BY_WAVES_MIN_BALANCE)  # every tiling the rule judges
    for name, widths, group, d in judged:
        row = rows[name]
        assert all(list(dataclasses.astuple(cascade_launch_config(w, group, d))) == row["config"] for w in widths), (
            name, row["config"])
        assert _resident_programs(row) == CASCADE_PROGRAMS_PER_SM, row


def test_shared_run_stage_compiles_for_sm90(usage):
    """The shared-run stage's tiles (G = 2, 4 and 8 at heads 64 and 128) compile for sm_90 on tensor cores
    without spills at one KV head a program; where the launcher gives a program two (the heads' runs in a loop:
    the 4-warp tiles of G = 2 and 4, the 8-warp tile of G = 8 at head 128) within 255 registers, so an SM
    holds as many programs as at one head, and a stack frame of at most 16 bytes (8 with Triton 3.9: a
    spilled value, a store and a load a head, against the 16-64 KB a head's run reads). The tail kernel
    after the stage (``tail_skip``) keeps its register budget (checked above with the others)."""
    from triton_kernels.shared_run import _stage_programs_per_sm

    rows = [row for row in usage if row["kernel"] == "shared-run"]
    assert sorted(row["config"][3] for row in rows) == [1, 1, 1, 1, 2, 2, 2], rows
    for row in rows:
        assert row["wgmma"] > 0, f"no wgmma: {row}"
        assert row["local"] == 0, f"local memory: {row}"
        if row["config"][3] == 1:
            assert row["stack"] == 0, f"register spills: {row}"
        else:
            assert row["stack"] <= 16, f"register spills: {row}"
            head_dim = row["shape"][4]
            programs = _stage_programs_per_sm(row["num_warps"], head_dim, 2)
            assert programs * row["num_warps"] * 32 * row["registers"] <= 65536, row
    assert sum(1 for row in _tail(usage) if row.get("skip_shared")) == 4


def test_page_table_audit_compiles_for_sm90(usage):
    """The page-table audit's two kernels (launched with the device error flag, once a step) compile for sm_90 with
    page numbers and with block offsets (a divisor), without spills and within ``MAX_REGISTERS`` (4 programs a
    multiprocessor at least): the holders' ``[16, 32]`` entries and the audit's ``[16, 64]`` comparison are 4 and 8
    lanes a thread of 4 warps (48-64 registers on Triton 3.9)."""
    rows = [row for row in usage if row["kernel"].startswith("page-table-")]
    assert sorted((row["kernel"], row["shape"][0]) for row in rows) == [
        ("page-table-audit", 1), ("page-table-audit", 2), ("page-table-holders", 1), ("page-table-holders", 2)], rows
    for row in rows:
        assert row["stack"] == 0 and row["local"] == 0 and row["registers"] <= MAX_REGISTERS, row
