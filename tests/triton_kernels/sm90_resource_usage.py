"""Compile the tail, cascade, shared-run and page-table audit kernels ahead of time for sm_90 (no GPU needed) and
report resource usage.

Run as a script (``python tests/triton_kernels/sm90_resource_usage.py``) it prints one JSON line per
shape and kernel: registers per thread, stack and local (spill) bytes, shared memory, and whether
the K/V rows are loaded as 16-byte vectors (tail) or the dots use Hopper's ``wgmma`` (cascade). ``test_tail_merge_compile.py`` runs it in a subprocess, because
``TRITON_INTERPRET=1`` (set for the CPU suite) replaces ``@triton.jit`` functions with interpreted
ones that cannot be compiled.

``--reachable-cascade`` and ``--reachable-tail`` print instead every tiling the two launchers pick over a walk of
their inputs (:func:`reachable_cascade_tilings`, :func:`reachable_tail_shapes`). ``--plain`` compiles the kernels that
take a ``PDL`` constexpr without it, as a launch with PDL off builds them.

Uses the ``ptxas``/``cuobjdump`` shipped inside the Triton wheel.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from triton_kernels.cascade import (  # noqa: E402
    MAX_BLOCK_M,
    CascadeLaunchConfig,
    cascade_launch_config,
    cascade_supported,
)
from triton_kernels.cascade_kernel import SHARED_BLOCK, beam_cascade_kernel  # noqa: E402
from triton_kernels.launch import COMPILE_OPTIONS  # noqa: E402
from triton_kernels.page_table_audit import AUDIT_BLOCK_C, AUDIT_BLOCK_W  # noqa: E402
from triton_kernels.page_table_audit_kernel import page_holders_kernel, page_table_audit_kernel  # noqa: E402
from triton_kernels.shared_run import shared_run_kv_heads_per_program, shared_run_tile  # noqa: E402
from triton_kernels.shared_run_kernel import beam_shared_run_kernel  # noqa: E402
from triton_kernels.tail_merge import (  # noqa: E402
    MAX_GROUP_SIZE,
    SUPPORTED_HEAD_DIMS,
    _register_cap,
    tail_launch_config,
)
from triton_kernels.tail_merge_grouped_kernel import beam_tail_merge_grouped_kernel  # noqa: E402
from triton_kernels.tail_merge_kernel import beam_tail_merge_kernel  # noqa: E402

# Tokens per page (a compile-time constant of both kernels): the benchmark presets' 32.
PAGE_SIZE = 32

# (dtype, Hq, Hkv, D, prefix_out dtype)
SHAPES = [
    ("bf16", 16, 8, 128, "bf16"),  # the target shape
    ("fp16", 16, 8, 128, "fp32"),
    ("bf16", 32, 8, 128, "bf16"),  # G = 4 (the B-4B preset)
    ("bf16", 8, 8, 64, "fp32"),
    ("bf16", 6, 2, 64, "fp32"),  # G = 3, padded
    ("bf16", 64, 8, 128, "bf16"),  # G = 8
    ("bf16", 64, 8, 256, "bf16"),
    ("bf16", 16, 8, 256, "bf16"),  # G = 2, head 256: the grouped kernel at 4 warps
    ("bf16", 8, 4, 128, "bf16"),  # G = 2, 4 KV heads: the grouped kernel at 1 warp
    ("fp16", 40, 8, 256, "fp16"),  # G = 5
    ("bf16", 32, 2, 128, "fp32"),  # G = 16
    ("bf16", 32, 1, 128, "bf16"),  # MQA, G = 32
    ("bf16", 64, 1, 128, "bf16"),  # MQA, G = 64
    ("bf16", 32, 8, 256, "bf16"),  # G = 4 at head 256: one warp, uncapped (capped at 64 it spilled)
    ("bf16", 16, 16, 128, "bf16"),  # MHA (G = 1): one warp, two KV heads, 4 tokens; one head at few rows
]

# Ints Triton's runtime specializes as multiples of 16 for real pools and contiguous buffers.
_DIV16_INTS = {
    "stride_q_row", "stride_q_head", "stride_new_k_row", "stride_new_k_head", "stride_new_v_row",
    "stride_new_v_head", "stride_kv_page", "stride_kv_kv", "stride_kv_head", "stride_kv_slot",
    "stride_po_row", "stride_po_head", "stride_out_row", "stride_out_head", "max_seq_len",
}


#: The NVIDIA tools inside the Triton wheel (``cuobjdump`` reads the cubins here).
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def sm90_ptxas():
    """The ``ptxas`` Triton builds sm_90 with (Triton 3.9's ``ptxas-blackwell``; ``TRITON_PTXAS*_PATH``
    honoured); raises Triton's ``RuntimeError("Cannot find <tool>")`` where the install lacks it."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(90)
    except TypeError:  # Triton 3.4 and 3.5 have one ptxas for every architecture
        return get_ptxas()


def _cuobjdump(compiled, flag: str) -> str:
    """``cuobjdump <flag>`` of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), flag, f.name],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def _resources(compiled):
    """(registers, stack, shared, local) of a compiled kernel, from ``cuobjdump --dump-resource-usage``."""
    dump = _cuobjdump(compiled, "--dump-resource-usage")
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", dump)
    if m is None:
        raise RuntimeError(f"cuobjdump gave no resource line:\n{dump}")
    return tuple(int(x) for x in m.groups())


# Opcodes that tell two builds of one kernel apart (``--cascade-sass``): tensor-core ops, async and shared-memory
# traffic, global loads, barriers, shuffles, the softmax's arithmetic, branches.
SASS_OPCODES = ("HGMMA", "HMMA", "LDGSTS", "LDSM", "LDS", "STS", "LDG", "BAR", "SHFL", "FFMA", "FMUL", "MUFU", "BRA")


def _sass_opcodes(compiled) -> dict:
    """The instruction count of a compiled kernel's SASS (``cuobjdump -sass``) and the counts of
    :data:`SASS_OPCODES`; with the ``ptxas`` that built it (:func:`sm90_ptxas`)."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", _cuobjdump(compiled, "-sass"))
    ptxas = sm90_ptxas()
    return dict(ptxas=f"{os.path.basename(ptxas.path)} {ptxas.version}", instructions=len(ops),
                **{op: ops.count(op) for op in SASS_OPCODES})


# The device error flag (triton_kernels.device_errors) is opt-in: the default tilings compile without
# it; the tail kernel's shapes compile with it too (``report_errors`` in the rows), so a spill there fails.
REPORT_ERRORS = False
# Launches on SM90 are programmatic dependents (triton_kernels.launch: a kernel's PDL constexpr puts gdc_wait()
# first), so the kernels that take it compile so here; ``--plain`` builds them as a launch with PDL off does
# (``TRTLLM_ENABLE_PDL=0``, or a GPU before SM90).
PDL = True


def _compile_sm90(kernel, pointers, constexprs, float_args, div16_ints, num_warps: int, num_stages: int,
                  maxnreg=None):
    """Compile ``kernel`` for sm_90: ``pointers`` maps pointer arguments to element types, ``constexprs``
    gives the constexpr values, ``float_args`` are fp32 scalars, every other argument is an i32;
    pointers and ``div16_ints`` are specialised as multiples of 16, as Triton's runtime does."""
    names = list(inspect.signature(kernel.fn).parameters)
    if "PDL" in names and "PDL" not in constexprs:  # as a launch on SM90 builds it (triton_kernels.launch)
        constexprs = {**constexprs, "PDL": PDL}
    signature = {}
    for n in names:
        if n in pointers:
            signature[n] = "*" + pointers[n]
        elif n in constexprs:
            signature[n] = "constexpr"
        else:
            signature[n] = "fp32" if n in float_args else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n in div16_ints}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, **COMPILE_OPTIONS)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    _LAST_PDL.clear()
    _LAST_PDL.update(pdl_param="PDL" in names, pdl_wait_first=_wait_precedes_memory(compiled.asm["ptx"]))
    return compiled


# What the last compile of this process said about programmatic dependent launch (a row's ``pdl_param`` and
# ``pdl_wait_first``; each job of the pool compiles and reports in one process).
_LAST_PDL = {}
_MEMORY_OP = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async|ld\.shared|st\.shared|ldmatrix|stmatrix)")


def _wait_precedes_memory(ptx: str):
    """``None`` without a ``griddepcontrol.wait`` in ``ptx``; else whether it comes before the kernel's first load,
    store or atomic (a PDL build must touch no memory before the kernel it depends on has finished)."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if wait is None:
        return None
    first_memory = next((i for i, line in enumerate(lines) if _MEMORY_OP.search(line)), len(lines))
    return wait < first_memory


# (name, W, Hq, Hkv, D, dtype, prompt table tokens): the cascade kernel's default tiling at the
# presets it can serve (B-short's 4-page table takes the one-block tiling; None: a wide table).
CASCADE_SHAPES = [
    ("B-short", 30, 16, 8, 128, "bf16", 128),
    ("B-medium", 30, 16, 8, 128, "bf16", None),
    ("B-medium-D64", 30, 16, 8, 64, "bf16", None),
    ("B-4B", 30, 32, 8, 128, "bf16", None),
    ("B-4B-D64", 30, 32, 8, 64, "bf16", None),
    ("B-beam14", 14, 16, 8, 128, "bf16", None),
    ("A", 96, 16, 8, 128, "bf16", None),
    ("G8-D64-fp16", 8, 64, 8, 64, "fp16", None),
]
# (name, W, Hq, Hkv, D, dtype, prompt table tokens, requests, tail bound): tilings the launcher picks by the batch
# (round 45): without the shared-ancestry path where every tail is at most 16 tokens, and the 8-warp tile of GQA 5-8 at
# head 64 where every program has a multiprocessor of its own (4 requests x 8 KV heads); the 32-beam tile of GQA 3-4 at
# head 64 where many programs run (round 46: 64 requests x 8 KV heads).
CASCADE_VARIANTS = [
    ("B-medium-D64-short-tail", 30, 16, 8, 64, "bf16", None, None, 4),
    ("G8-D64-short-tail", 30, 64, 8, 64, "bf16", None, None, 4),
    ("G8-D128-short-tail", 30, 64, 8, 128, "bf16", None, None, 4),
    ("G8-D64-few-programs", 12, 64, 8, 64, "bf16", None, 4, None),
    ("G4-D64-wide-tile", 30, 32, 8, 64, "bf16", None, 64, None),
    # Narrow widths' tiles (round 56): 4 beams at G = 4, 8 at G = 2 (168 registers where 160 programs run) and at G = 8.
    ("G4-D128-narrow", 3, 32, 8, 128, "bf16", None, 34, None),
    ("G2-D128-narrow-few-programs", 3, 16, 8, 128, "bf16", None, 20, None),
    ("G8-D128-narrow", 3, 64, 8, 128, "bf16", None, 34, None),
    # Round 57: G = 2's 16-beam tile at 168 registers where 96 requests run as many waves at three programs a
    # multiprocessor as at four; GQA 3-4's 16-beam tile at head 64 with 8-position tail blocks.
    ("G2-D128-16-beams-roomy", 12, 16, 8, 128, "bf16", None, 96, None),
    ("G4-D64-tail-block-8", 16, 32, 8, 64, "bf16", None, 48, None),
]
# The launcher's inputs ``--reachable-cascade`` walks (:func:`reachable_cascade_tilings`): every width to 32 beams and
# wider ones to 256, every GQA group the kernel tiles at heads 64 and 128, prompt tables of one block, of a few and of
# many tokens (and unknown), batches of 1 to 1,024 requests (and unknown) over 1, 2 and 8 KV heads, tails short of, at
# and past the shared-ancestry bound (and unknown), on 132 multiprocessors. Wider walks found no other tiling (round
# 77: 68 either way): widths to 64 one by one with 11 prompt tables, 16 batch sizes, 1-16 KV heads and 9 tail bounds;
# and 78, 114 and 132 multiprocessors.
REACHABLE_WIDTHS = tuple(range(1, 33)) + (40, 48, 64, 96, 128, 256)
REACHABLE_PROMPT_CAPACITIES = (None, 32, 64, 128, 4096)
REACHABLE_REQUESTS = (None, 1, 4, 8, 16, 32, 64, 128, 256, 1024)
REACHABLE_KV_HEADS = (1, 2, 8)
REACHABLE_TAIL_BOUNDS = (None, 4, 16, 17)


def cascade_tiling_key(cfg: CascadeLaunchConfig, head_dim: int, prompt_capacity) -> tuple:
    """``(head_dim, group_pad, prompt_one_block, CascadeLaunchConfig fields)``: what the cascade kernel is compiled
    for; ``prompt_one_block`` where a prompt table of ``prompt_capacity`` tokens (``None``: unknown) is one block."""
    one_block = prompt_capacity is not None and prompt_capacity <= cfg.block_n
    return head_dim, cfg.group_pad, one_block, dataclasses.astuple(cfg)


def reachable_cascade_tilings() -> list:
    """Every distinct tiling :func:`cascade_launch_config` returns over the walk above, as sorted
    :func:`cascade_tiling_key` tuples (the group enters a tiling padded)."""
    found = set()
    for d in sorted(MAX_BLOCK_M):
        for g in range(1, MAX_BLOCK_M[d] + 1):
            if not cascade_supported(g, d)[0]:
                continue
            for w, capacity, requests, kv_heads, tail in itertools.product(
                    REACHABLE_WIDTHS, REACHABLE_PROMPT_CAPACITIES, REACHABLE_REQUESTS, REACHABLE_KV_HEADS,
                    REACHABLE_TAIL_BOUNDS):
                cfg = cascade_launch_config(w, g, d, capacity, requests, kv_heads, max_tail_len=tail)
                found.add(cascade_tiling_key(cfg, d, capacity))
    return sorted(found, key=repr)


def reachable_tail_shapes(largest_group: bool = False, every_group: bool = False) -> list:
    """One ``(G, Hkv, D, num_rows)`` for every distinct tiling :func:`tail_launch_config` returns over every head size
    and group the tail kernel takes, 1-64 KV heads and 1 to 12,288 beam rows (and unknown); ``--reachable-tail``
    compiles each with the error flag off and on, and after the shared-run stage (round 77: 93 tilings, 279 builds,
    none spilling, with Triton 3.9; about 2.5 minutes on 2 CPUs in CI's run). A tiling is compiled at one group, the first the walk
    meets (the smallest that pads to it), or with ``largest_group`` (``--largest-group``) the last (the largest), or with
    ``every_group`` (``--every-group``) at each group that reaches it: 501 builds a flag setting."""
    found = {}
    rows = (None, *range(1, 70), *(2**i for i in range(15)), 1535, 1536, 1537, 3000, 12288)
    for d in SUPPORTED_HEAD_DIMS:
        for g in range(1, MAX_GROUP_SIZE + 1):
            for hkv, num_rows in itertools.product((1, 2, 3, 5, 8, 12, 16, 32, 64), rows):
                key = (d, dataclasses.astuple(tail_launch_config(g, hkv, d, num_rows))) + ((g,) if every_group else ())
                # Groups come in increasing order: a larger group replaces the shape kept, with its first shape.
                if key not in found or (largest_group and found[key][0] < g):
                    found[key] = (g, hkv, d, num_rows)
    return list(found.values())


_CASCADE_DIV16_INTS = {
    "stride_q_row", "stride_q_head", "stride_new_k_row", "stride_new_k_head", "stride_new_v_row",
    "stride_new_v_head", "stride_kv_page", "stride_kv_kv", "stride_kv_head", "stride_kv_slot", "stride_out_row",
    "stride_out_head", "max_seq_len", "prompt_capacity",
}


def compile_cascade_sm90(name: str, beam_width: int, hq: int, hkv: int, d: int, dtype: str, prefix_only: bool = False,
                         prompt_capacity=None, num_requests=None, max_tail_len=None, sass: bool = False):
    """Compile the cascade kernel's default tiling of a shape (the whole step, or its prompt pass) for a
    prompt table of ``prompt_capacity`` tokens, ``num_requests`` requests and tails of at most ``max_tail_len``
    tokens (each ``None``: unknown); ``sass`` adds its SASS opcode counts (:func:`_sass_opcodes`)."""
    g = hq // hkv
    cfg = cascade_launch_config(beam_width, g, d, prompt_capacity, num_requests, hkv, max_tail_len=max_tail_len)
    _, _, one_block, _ = cascade_tiling_key(cfg, d, prompt_capacity)
    row = compile_cascade_tiling_sm90(cfg, g, d, dtype, prefix_only, one_block, sass)
    row["shape"] = [name, beam_width, hq, hkv, d, dtype]
    return row


def compile_cascade_tiling_sm90(cfg: CascadeLaunchConfig, group_size: int, d: int, dtype: str, prefix_only: bool,
                                prompt_one_block: bool, sass: bool = False):
    """Compile the cascade kernel with the tiling ``cfg`` (the whole step, or its prompt pass) at GQA ``group_size``
    and head size ``d``; ``prompt_one_block``: every prompt fits one ``block_n`` block."""
    g = group_size
    if prefix_only:  # as beam_prefix_attention launches it: the fused step's register cap is dropped
        cfg = dataclasses.replace(cfg, max_registers=None)
    pointers = dict(
        q_ptr=dtype, new_k_ptr=dtype, new_v_ptr=dtype, kv_ptr=dtype, prompt_pt_ptr="i32", beam_pt_ptr="i32",
        kv_lens_ptr="i32", prompt_lens_ptr="i32", ci_ptr="i32", out_ptr=dtype, lse_ptr="fp32", err_ptr="i32",
    )
    constexprs = dict(
        GROUP=g, GROUP_PAD=cfg.group_pad, BEAMS=cfg.beams_per_program, HEADS=cfg.heads_per_program, HEAD_DIM=d, BLOCK_N=cfg.block_n,
        TAIL_BLOCK=cfg.tail_block, WRITE_KV=True, PREFIX_ONLY=prefix_only, ALIGNED_ROWS=True, DOT_FP32=False,
        PROMPT_FIRST=cfg.prompt_first, PROMPT_STAGES=cfg.prompt_stages or cfg.num_stages,
        TAIL_STAGES=cfg.tail_stages or cfg.num_stages, TAIL_CORES=cfg.tail_on_cores,
        PROMPT_ONE_BLOCK=prompt_one_block, page_size=PAGE_SIZE,
        page_index_divisor=1, REPORT_ERRORS=REPORT_ERRORS,
        SHARED_ANCESTRY=cfg.folds_shared_ancestry and not prefix_only,
        SHARED_MIN_TAIL=cfg.shared_min_tail,
        # Triton's runtime makes an int argument equal to 1 a constant: the unit column strides of the
        # page tables and the indirection. (Compiled without that, Triton 3.6 built a kernel whose
        # runtime compile failed in its layout pass.)
        stride_ppt_col=1, stride_bpt_col=1, stride_ci_pos=1,
    )
    compiled = _compile_sm90(beam_cascade_kernel, pointers, constexprs, ("qk_scale_log2",), _CASCADE_DIV16_INTS,
                             cfg.num_warps, cfg.num_stages, cfg.max_registers)
    regs, stack, shared, local = _resources(compiled)
    ptx = compiled.asm["ptx"]
    return dict(
        kernel="cascade-prefix" if prefix_only else "cascade",
        **_LAST_PDL,
        shape=["tiling", None, g, 1, d, dtype],
        config=list(dataclasses.astuple(cfg)),
        triton=triton.__version__,
        registers=regs,
        stack=stack,
        shared=shared,
        dynamic_shared=int(compiled.metadata.shared),
        local=local,
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
        num_warps=cfg.num_warps,
        **(dict(sass=_sass_opcodes(compiled)) if sass else {}),
    )


# (name, W, Hq, Hkv, D, dtype, prefix_out dtype): the shared-run stage's tiles at the shapes FA4 or FlashInfer
# + tail serve: 32-beam tiles at G = 2, 16-beam tiles at G = 4 and at G = 8 (128 rows, 8 warps).
SHARED_RUN_SHAPES = [
    ("A", 96, 16, 8, 128, "bf16", "bf16"),
    ("B-4B", 30, 32, 8, 128, "bf16", "bf16"),
    ("G8-D64-fp16", 8, 64, 8, 64, "fp16", "fp32"),
    ("G8-D128", 30, 64, 8, 128, "bf16", "bf16"),
]


def compile_shared_run_sm90(name: str, beam_width: int, hq: int, hkv: int, d: int, dtype: str, prefix_dtype: str,
                            kv_heads_per_program: int = 1):
    """Compile the shared-run stage's tile of a shape for sm_90, with the error flag (REPORT_ERRORS)."""
    g = hq // hkv
    beams, group_pad, num_warps = shared_run_tile(beam_width, g, d)
    pointers = dict(q_ptr=dtype, kv_ptr=dtype, beam_pt_ptr="i32", kv_lens_ptr="i32", prompt_lens_ptr="i32",
                    ci_ptr="i32", prefix_out_ptr=prefix_dtype, prefix_lse_ptr="fp32", tail_skip_ptr="i32",
                    err_ptr="i32")
    constexprs = dict(GROUP=g, GROUP_PAD=group_pad, BEAMS=beams, HEAD_DIM=d, BLOCK_N=SHARED_BLOCK.value,
                      DOT_FP32=False, KV_HEADS_PER_PROG=kv_heads_per_program, page_size=PAGE_SIZE,
                      page_index_divisor=1, REPORT_ERRORS=REPORT_ERRORS,
                      stride_bpt_col=1, stride_ci_pos=1)
    div16 = {"stride_q_row", "stride_q_head", "stride_kv_page", "stride_kv_kv", "stride_kv_head", "stride_kv_slot",
             "stride_po_row", "stride_po_head", "max_seq_len"}
    compiled = _compile_sm90(beam_shared_run_kernel, pointers, constexprs, ("qk_scale_log2", "lse_scale"), div16,
                             num_warps, 1)
    regs, stack, shared, local = _resources(compiled)
    ptx = compiled.asm["ptx"]
    return dict(kernel="shared-run", **_LAST_PDL, shape=[name, beam_width, hq, hkv, d, dtype, prefix_dtype],
                config=[beams, group_pad, num_warps, kv_heads_per_program], triton=triton.__version__, registers=regs, stack=stack,
                shared=shared, local=local, wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"),
                num_warps=num_warps)


def compile_page_table_audit_sm90(kernel_name: str, page_index_divisor: int):
    """Compile a page-table audit kernel (``"holders"`` or ``"audit"``, the launcher's blocks and warps) for sm_90,
    with page numbers (``page_index_divisor`` 1, a constant Triton's runtime specializes) or block offsets (an int)."""
    pointers = dict(kv_lens_ptr="i32", prompt_lens_ptr="i32", page_table_ptr="i32", holders_ptr="i64", state_ptr="i32",
                    err_ptr="i32", plan_digest_ptr="i64")
    if kernel_name == "holders":
        kernel, constexprs, num_warps = page_holders_kernel, dict(BLOCK_W=AUDIT_BLOCK_W, BLOCK_C=AUDIT_BLOCK_C), 4
    else:  # with the plan's digest, as the wrapper launches it
        kernel, num_warps = page_table_audit_kernel, 4
        constexprs = dict(BLOCK_W=AUDIT_BLOCK_W, BLOCK_C=AUDIT_BLOCK_C, CHECK_PLAN=True)
    pointers = {k: v for k, v in pointers.items() if k in inspect.signature(kernel.fn).parameters}
    constexprs["stride_pt_col"] = 1
    if page_index_divisor == 1:
        constexprs["page_index_divisor"] = 1
    compiled = _compile_sm90(kernel, pointers, constexprs, (), (), num_warps, 3)
    regs, stack, shared, local = _resources(compiled)
    return dict(kernel=f"page-table-{kernel_name}", shape=[page_index_divisor], config=list(constexprs.values()),
                triton=triton.__version__, registers=regs, stack=stack, shared=shared, local=local,
                num_warps=num_warps, **_LAST_PDL)


def compile_sm90(dtype: str, hq: int, hkv: int, d: int, prefix_dtype: str, index_block=None,
                 report_errors: bool = REPORT_ERRORS, num_rows=None, skip_shared: bool = False):
    """Compile the default tiling of a shape at ``num_rows`` beam rows (``None``: many); ``index_block``
    selects the ``[QH, D]`` kernel with that ``index_block`` instead (its previous default tiling:
    ``QH * D = 1024``, 4 warps); ``skip_shared``: the tail after the shared-run stage (``tail_skip``)."""
    g = hq // hkv
    cfg = tail_launch_config(g, hkv, d, num_rows)
    if index_block is not None:
        kvh = max(1, min(triton.next_power_of_2(hkv), max(cfg.group_pad, 1024 // d) // cfg.group_pad))
        cfg = dataclasses.replace(cfg, kv_heads_per_prog=kvh, num_warps=4, grouped=False, index_block=index_block)
    pointers = dict(
        q_ptr=dtype, new_k_ptr=dtype, new_v_ptr=dtype, kv_ptr=dtype, page_table_ptr="i32", kv_lens_ptr="i32",
        prompt_lens_ptr="i32", cache_indirection_ptr="i32", prefix_out_ptr=prefix_dtype, prefix_lse_ptr="fp32",
        out_ptr=dtype, err_ptr="i32", tail_skip_ptr="i32",
    )
    constexprs = dict(
        GROUP=g, GROUP_PAD=cfg.group_pad, KV_HEADS_PER_PROG=cfg.kv_heads_per_prog, HEAD_DIM=d, WRITE_KV=True,
        page_size=PAGE_SIZE, page_index_divisor=1, REPORT_ERRORS=report_errors, SKIP_SHARED=skip_shared,
    )
    kernel = beam_tail_merge_grouped_kernel
    if not cfg.grouped:
        kernel = beam_tail_merge_kernel
        constexprs.update(BLOCK_T=cfg.block_t, TOKENS_OUTER=cfg.tokens_outer, INDEX_BLOCK=cfg.index_block)
    maxnreg = _register_cap(cfg, d, skip_shared, report_errors)  # the launcher's own choice
    compiled = _compile_sm90(kernel, pointers, constexprs, ("qk_scale_log2", "lse_scale"), _DIV16_INTS,
                             cfg.num_warps, 1, maxnreg=maxnreg)
    regs, stack, shared, local = _resources(compiled)
    return dict(
        kernel="tail",
        **_LAST_PDL,
        shape=[dtype, hq, hkv, d, prefix_dtype],
        num_rows=num_rows,
        skip_shared=skip_shared,
        report_errors=report_errors,
        config=[cfg.group_pad, cfg.kv_heads_per_prog, cfg.block_t, cfg.num_warps, cfg.tokens_outer, cfg.index_block,
                cfg.grouped],
        triton=triton.__version__,
        registers=regs,
        stack=stack,
        shared=shared,
        local=local,
        vector_loads=compiled.asm["ptx"].count("ld.global.v4.b32"),
        num_warps=cfg.num_warps,
    )


def _compile_job(job) -> dict:
    """Run one compile of :func:`_jobs` (``(function name, args, kwargs, pdl)``) and return its row."""
    global PDL
    name, args, kwargs, PDL = job  # set in the worker itself: a spawned pool process does not see main's globals
    return globals()[name](*args, **kwargs)


def _jobs(argv) -> list:
    """The compiles to report, in the order of the printed rows: ``(function name, args, kwargs)``."""
    if "--reachable-cascade" in argv:  # every tiling the launcher picks (the group at its padded size), nothing else
        jobs, compiled = [], set()
        for d, group_pad, one_block, fields in reachable_cascade_tilings():
            cfg = CascadeLaunchConfig(*fields)
            for prefix_only in (False, True):
                # The prompt pass drops the register cap and the shared-ancestry path: compile each build once.
                key = (d, group_pad, one_block, prefix_only,
                       dataclasses.replace(cfg, max_registers=None, shared_ancestry=False) if prefix_only else cfg)
                if key not in compiled:
                    compiled.add(key)
                    jobs.append(("compile_cascade_tiling_sm90", (cfg, group_pad, d, "bf16", prefix_only, one_block), {}))
        return jobs
    if "--reachable-tail" in argv:  # every tail tiling the launcher picks, and nothing else
        # The prefix state in the query's dtype, as the wrapper passes it (its prefix output buffer); SHAPES also
        # compiles float32 state, which direct callers of the tail kernel may pass.
        return [("compile_sm90", ("bf16", g * hkv, hkv, d, "bf16"),
                 dict(report_errors=report_errors, num_rows=num_rows, skip_shared=skip_shared))
                for g, hkv, d, num_rows in reachable_tail_shapes("--largest-group" in argv, "--every-group" in argv)
                for report_errors, skip_shared in ((False, False), (True, False), (False, True))]
    if "--cascade-sass" in argv:  # the cascade's default tilings with their SASS opcode counts, and nothing else
        return [("compile_cascade_sm90", tuple(shape), dict(prefix_only=prefix_only, prompt_capacity=prompt_capacity,
                                                            sass=True))
                for *shape, prompt_capacity in CASCADE_SHAPES for prefix_only in (False, True)]
    # Every shape with its default tiling, then the index-block-free chain (index_block 0) of the
    # first shapes for comparison: ``--compare-index-block 0,8,16,32`` adds those values.
    compare = [0]
    if "--compare-index-block" in argv:
        compare = [int(x) for x in argv[argv.index("--compare-index-block") + 1].split(",")]
    jobs = []
    for shape in SHAPES:
        # Many rows, then one row (the few-rows tiling where a shape has one) and 1,024 rows (G = 8 at
        # head 128 between its few-rows and many-rows tilings); a tiling is compiled once.
        _, hq, hkv, d, _ = shape
        compiled = set()
        for num_rows in (None, 1, 1024):
            for report_errors in (False, True):
                key = (tail_launch_config(hq // hkv, hkv, d, num_rows), report_errors)
                if key not in compiled:
                    compiled.add(key)
                    jobs.append(("compile_sm90", shape, dict(report_errors=report_errors, num_rows=num_rows)))
    for *shape, prompt_capacity in CASCADE_SHAPES:
        for prefix_only in (False, True):
            jobs.append(("compile_cascade_sm90", tuple(shape), dict(prefix_only=prefix_only,
                                                                    prompt_capacity=prompt_capacity)))
    for *shape, prompt_capacity, num_requests, max_tail_len in CASCADE_VARIANTS:  # the whole step only
        jobs.append(("compile_cascade_sm90", tuple(shape), dict(prompt_capacity=prompt_capacity,
                                                                num_requests=num_requests, max_tail_len=max_tail_len)))
    for shape in (SHAPES[0], SHAPES[2]):  # 16/8 and 32/8, D 128
        for ib in compare:
            jobs.append(("compile_sm90", shape, dict(index_block=ib)))
    for shape in (SHAPES[0], SHAPES[2]):  # the tail after the shared-run stage: many rows and few
        for num_rows in (None, 1):
            jobs.append(("compile_sm90", shape, dict(num_rows=num_rows, skip_shared=True)))
    for kernel_name in ("holders", "audit"):
        for page_index_divisor in (1, 2):
            jobs.append(("compile_page_table_audit_sm90", (kernel_name, page_index_divisor), {}))
    for shape in SHARED_RUN_SHAPES:  # one KV head a program; two where wide launches can take them
        _, w, hq, hkv, d, _, _ = shape
        two = shared_run_kv_heads_per_program(10**6, 2, 1, shared_run_tile(w, hq // hkv, d)[2], d) == 2
        for kv_heads_per_program in (1, 2) if two else (1,):
            jobs.append(("compile_shared_run_sm90", shape, dict(kv_heads_per_program=kv_heads_per_program)))
    return jobs


def main() -> None:
    # The compiles are independent: one process per CPU (each runs Triton's front end and ptxas), rows printed in
    # order. On a fresh Triton cache the 99 compiles took 72 s in one process on a 2-CPU machine.
    pdl = "--plain" not in sys.argv
    with concurrent.futures.ProcessPoolExecutor() as pool:
        for row in pool.map(_compile_job, [(*job, pdl) for job in _jobs(sys.argv)]):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
