import dataclasses, sys, torch, numpy as np
import triton_kernels.cascade as C
from triton_kernels import beam_cascade_attention, beam_prefix_attention, beam_tail_attention_merge
from triton_kernels.cascade import CascadeLaunchConfig, cascade_launch_config
from beam_shared_prefix.plan import build_step_plan
from microbenchmarks.shapes import PRESETS
from microbenchmarks.workload import build_workload
from microbenchmarks.timing import capture_graph, time_cuda

compiled = {}
orig = C._launch
def spy(*a, **k):
    r = orig(*a, **k)
    compiled["last"] = r
    return r
C._launch = spy

def info():
    k = compiled.get("last")
    try:
        return f"regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}"
    except Exception as e:
        return f"? {e}"

# compile probe
for cfg in [CascadeLaunchConfig(16, 4, 16, 1, 4, 1), CascadeLaunchConfig(16, 4, 32, 1, 4, 1), CascadeLaunchConfig(16, 4, 16, 2, 4, 1), CascadeLaunchConfig(16,4,16,1,4,2)]:
    sh = dataclasses.replace(PRESETS["B-short"], requests=2, beams=18, heads=12, kv_heads=3, head_dim=64)
    wl = build_workload(sh, device="cuda", seed=0, with_baseline_pages=False)
    plan = build_step_plan(wl.prompt_page_indptr.numpy(), wl.prompt_page_indices.numpy(), wl.prompt_lens_host.astype(np.int32), wl.beam_width, sh.page_size, wl.num_pages)
    table = torch.from_numpy(plan.page_table.copy()).cuda()
    out = torch.empty_like(wl.q)
    try:
        beam_cascade_attention(wl.q, wl.new_k, wl.new_v, wl.kv_cache, table, wl.beam_page_table, wl.kv_lens, wl.prompt_lens, wl.cache_indirection, wl.beam_width, out, write_kv=False, launch_config=cfg)
        torch.cuda.synchronize(); print("compile ok", cfg)
    except Exception as e:
        print("compile FAIL", cfg, str(e)[-150:].replace("\n"," "))

def t(call):
    call(); torch.cuda.synchronize()
    return time_cuda([capture_graph(call)], iters=15, warmup=3).median_us

for name in sys.argv[1].split(","):
    for tail in (PRESETS[name].tail, 1):
        sh = dataclasses.replace(PRESETS[name], tail=tail)
        wl = build_workload(sh, device="cuda", seed=0, with_baseline_pages=False)
        plan = build_step_plan(wl.prompt_page_indptr.numpy(), wl.prompt_page_indices.numpy(), wl.prompt_lens_host.astype(np.int32), wl.beam_width, sh.page_size, wl.num_pages)
        table = torch.from_numpy(plan.page_table.copy()).cuda()
        plens = torch.from_numpy(plan.prompt_lens.copy()).cuda()
        g = sh.heads // sh.kv_heads
        d = cascade_launch_config(sh.beams, g, sh.head_dim)
        cfgs = [d, dataclasses.replace(d, num_stages=1), dataclasses.replace(d, num_stages=3), dataclasses.replace(d, num_warps=8 if d.num_warps==4 else 4), dataclasses.replace(d, block_n=32, num_stages=1), dataclasses.replace(d, block_n=128, num_stages=1)]
        out = torch.empty_like(wl.q); lse = torch.empty(wl.num_rows, sh.heads, device="cuda")
        for cfg in cfgs:
            try:
                tf = t(lambda: beam_cascade_attention(wl.q, wl.new_k, wl.new_v, wl.kv_cache, table, wl.beam_page_table, wl.kv_lens, wl.prompt_lens, wl.cache_indirection, wl.beam_width, out, write_kv=False, launch_config=cfg))
                i1 = info()
                tp = t(lambda: beam_prefix_attention(wl.q, wl.kv_cache, table, plens, wl.beam_width, out, lse, launch_config=cfg))
                i2 = info()
                print(f"{name} T{tail} {tuple(dataclasses.astuple(cfg))}: fused {tf:.1f} us [{i1}] prefix-only {tp:.1f} us [{i2}]", flush=True)
            except Exception as e:
                print(name, cfg, "FAIL", str(e)[-200:])
