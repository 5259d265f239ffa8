"""A/B of the device error flag (report_errors True/False) through the wrapper, same run (experiment).

python exp_errflag/ab_errflag.py OUT.json B-short,B-medium,...  [backend]
"""
import json, sys
import numpy as np
import torch

from beam_shared_prefix import BeamSharedPrefixAttention
from microbenchmarks.shapes import PRESETS
from microbenchmarks.workload import build_workload
from microbenchmarks.timing import capture_graph, time_cuda


def wrapper_call(wl, report, backend):
    sh = wl.shape
    att = BeamSharedPrefixAttention("cuda", backend=backend, use_cuda_graph=True, max_requests=sh.requests,
                                    max_beam_width=sh.beams, max_prompt_pages=int(wl.prompt_page_indices.numel()),
                                    check=False, report_errors=report)
    att.plan(wl.prompt_page_indptr.numpy(), wl.prompt_page_indices.numpy(), wl.prompt_lens_host.astype(np.int32),
             sh.beams, sh.heads, sh.kv_heads, sh.head_dim, sh.page_size, wl.num_pages, wl.dtype)
    out = torch.empty_like(wl.q)

    def call():
        return att.run(wl.q, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.cache_indirection,
                       new_k=wl.new_k, new_v=wl.new_v, out=out)
    return att, out, call


def main():
    backend = sys.argv[3] if len(sys.argv) > 3 else "auto"
    res = {}
    for name in sys.argv[2].split(","):
        shape = PRESETS[name]
        sets = [build_workload(shape, device="cuda", seed=s, with_baseline_pages=False) for s in (0, 1, 2)]
        calls, outs = {}, {}
        for report in (False, True):
            entries = [wrapper_call(wl, report, backend) for wl in sets]
            for att, out, call in entries:
                call()
            torch.cuda.synchronize()
            outs[report] = entries[0][1].clone()
            if report:
                errs = [att.device_errors() for att, _, _ in entries]
                print(name, "flags on valid input:", errs, "backend", entries[0][0].backend_name, flush=True)
            calls[report] = [capture_graph(call) for _, _, call in entries]
            calls[(report, "keep")] = entries
        diff = (outs[True].float() - outs[False].float()).abs().max().item()
        times = {str(r): [] for r in (False, True)}
        for _ in range(3):
            for r in (False, True):
                times[str(r)].append(time_cuda(calls[r], iters=10, warmup=2).median_us)
        res[name] = times
        print(name, "out diff", diff, {k: [round(x, 2) for x in v] for k, v in times.items()}, flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
