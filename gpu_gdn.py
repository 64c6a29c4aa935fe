import statistics, json, os, torch
from lynn_kernels import deltanet
from lynn_kernels.deltanet import triton_chunk as tc
torch.manual_seed(0)
res = {}
for T in (2048, 16384):
    q = torch.randn(1, T, 16, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, T, 16, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, T, 32, 128, dtype=torch.bfloat16, device="cuda")
    g = -torch.rand(1, T, 32, device="cuda") * 0.1
    beta = torch.rand(1, T, 32, dtype=torch.bfloat16, device="cuda")
    h0 = torch.randn(1, 32, 128, 128, device="cuda") * 0.1
    outs, times, kern = {}, {False: [], True: []}, {}
    graphs = {}
    for pf in (False, True):
        tc.STATE_PREFETCH = pf
        f = lambda: deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
        outs[pf] = f(); torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            f()
        graphs[pf] = gr
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5): f()
            torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and "state" in e.name:
                per.setdefault(e.name.split("(")[0][:40], []).append(e.time_range.elapsed_us())
        kern[pf] = {k_: statistics.median(v_) for k_, v_ in per.items()}
    for r in range(30):
        for pf in ((False, True) if r % 2 == 0 else (True, False)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); graphs[pf].replay(); b.record(); b.synchronize()
            times[pf].append(a.elapsed_time(b))
    same = torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1])
    res[T] = {"call_ms": {str(pf): statistics.median(times[pf][2:]) for pf in times}, "state_kernel_us": {str(pf): kern[pf] for pf in kern}, "same_bits": same}
    print(T, json.dumps(res[T]), flush=True)
os.makedirs(os.environ["OUT"] + "/keep", exist_ok=True)
json.dump(res, open(os.environ["OUT"] + "/keep/gdn_prefetch.json", "w"), indent=1)
