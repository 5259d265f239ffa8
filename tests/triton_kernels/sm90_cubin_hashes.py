"""Hash the sm_90 cubins of every tiling :mod:`sm90_resource_usage` compiles, with and without the device error flag.

Run at two revisions (``git worktree add``) and compare the hashes to show that a change leaves the kernels without
the flag as they were (``docs/results/cpu/agreement_bits_sm90_cubins_round62.json``)::

    env -u TRITON_INTERPRET TRITON_DISABLE_LINE_INFO=1 python3 tests/triton_kernels/sm90_cubin_hashes.py > hashes.jsonl

Line info is off because it records source line numbers, which any edit above a kernel moves. One JSON line per
tiling: ``tag``, ``hash`` (the cubin's sha256, 16 hex digits), ``regs``, ``local``, ``stack``. ``ptxas`` is not
deterministic for every kernel: compare the PTX (``--ptx``) where two cubins differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_resource_usage as usage  # noqa: E402

_last = {}
_compile = usage._compile_sm90


def _hashing_compile(*args, **kwargs):
    compiled = _compile(*args, **kwargs)
    asm = compiled.asm["ptx"].encode() if "--ptx" in sys.argv else compiled.asm["cubin"]
    _last["hash"] = hashlib.sha256(asm).hexdigest()[:16]
    return compiled


def _emit(tag: str, row: dict) -> None:
    print(json.dumps(dict(tag=tag, hash=_last["hash"], regs=row["registers"], local=row["local"], stack=row["stack"])),
          flush=True)


def main() -> None:
    usage._compile_sm90 = _hashing_compile
    for shape in usage.SHAPES:
        _, hq, hkv, d, _ = shape
        done = set()
        for num_rows in (None, 1, 1024):
            for rep in (False, True):
                key = (usage.tail_launch_config(hq // hkv, hkv, d, num_rows), rep)
                if key not in done:
                    done.add(key)
                    _emit(f"tail {shape} rows={num_rows} rep={rep}",
                          usage.compile_sm90(*shape, report_errors=rep, num_rows=num_rows))
    for shape in (usage.SHAPES[0], usage.SHAPES[2]):
        _emit(f"tail-ib0 {shape}", usage.compile_sm90(*shape, index_block=0))
        _emit(f"tail-ib0 {shape} rep", usage.compile_sm90(*shape, index_block=0, report_errors=True))
    for rep in (False, True):
        usage.REPORT_ERRORS = rep
        for *shape, cap in usage.CASCADE_SHAPES:
            for prefix_only in (False, True):
                _emit(f"cascade {shape} po={prefix_only} rep={rep}",
                      usage.compile_cascade_sm90(*shape, prefix_only=prefix_only, prompt_capacity=cap))
        for *shape, cap, requests, tail in usage.CASCADE_VARIANTS:
            _emit(f"cascade-var {shape} rep={rep}",
                  usage.compile_cascade_sm90(*shape, prompt_capacity=cap, num_requests=requests, max_tail_len=tail))
    usage.REPORT_ERRORS = True
    for shape in usage.SHARED_RUN_SHAPES:
        _emit(f"shared-run {shape}", usage.compile_shared_run_sm90(*shape))


if __name__ == "__main__":
    main()
