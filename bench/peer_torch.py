#!/usr/bin/env python3
"""The PyTorch peer: the usual eager MoE pipeline on exactly the work `mok bench` ran.

    python3 bench/peer_torch.py DIR [--warmup 500] [--iters 100]

Reads DIR (mok.json and the .npy peer inputs, bench/README.md "The contract"), then on the
GPU:
  1. checks the pipeline's routed rows against rows_ref.npy and its y against y_ref.npy
     with MoK's bar; a peer that fails its check is not timed (the failure is recorded);
  2. times the forward pipeline: dispatch (index_select, standing in for the all-to-all),
     argsort permute, one grouped GEMM for gate/up, SwiGLU, one grouped GEMM for down,
     unpermute (the rank's own tokens' rows straight into their combine slots, row_slot.npy),
     then shared experts + weighted combine for the local tokens;
  3. times the two grouped GEMMs alone on pre-permuted inputs;
  4. times autograd backward of that forward (see bench/README.md for its upstream
     gradients);
  5. measures the ceilings: dense bf16 GEMM, fp8 e4m3 GEMM, device-to-device copy;
and writes DIR/peer.json. Exit status: 0 all good, 1 a check failed or a part raised
(peer.json still written) or the work directory was refused (a message naming what is wrong,
no peer.json), 2 no CUDA GPU.
"""
import argparse
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
import workdir  # noqa: E402

SCHEMA = 1


# ---- timing -----------------------------------------------------------------------------

def event_times(fn, warmup, iters, before_timing=None):
    """Warm-up calls, then `iters` calls each between two CUDA events, enqueued back to back
    and read after one synchronisation: (per-iteration times in ms, in iteration order; the
    host's clock in Unix seconds right after that synchronisation, before the events are read:
    the timed loop's end, as near as the host sees it; reading a hundred events first would put
    it a few hundred microseconds late, and every iteration the record pairs with a clock
    sample with it). `before_timing` runs between the two (a group's barrier, say)."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if before_timing:
        before_timing()
    # One untimed call keeps the stream busy, so the first timed call's enqueue overlaps device
    # work, as every later one's does (mok's timer does the same: core/device_timer.h).
    fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    end_unix_s = time.time()
    return [s.elapsed_time(e) for s, e in events], end_unix_s


def time_cuda(fn, warmup, iters, keep_iters=False):
    """Median, min and max of event_times (ms), and the timed loop's window in Unix seconds
    (checks.timed_window: where the record looks for the GPU's clock during it); with
    `keep_iters` each iteration's time too ("iters_ms", iteration order: the record reads them
    against the clock sampled inside each)."""
    ms, end_unix_s = event_times(fn, warmup, iters)
    t = checks.summarize_ms(ms)
    t["window_unix_s"] = checks.timed_window(ms, end_unix_s)
    if keep_iters:
        t["iters_ms"] = ms
    return t


# ---- the pipeline (eager PyTorch, as users write it) ------------------------------------

def swiglu(h, width, limit):
    """silu(gate) * up on h = [gate | up] ([n, 2*width], bf16); clamped when limit is set."""
    import torch.nn.functional as F
    g, u = h[:, :width], h[:, width:]
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def expert_offsets(sorted_expert, num_local):
    """Each local expert's end offset in rows sorted by expert ([num_local] int32, as
    _grouped_mm takes them), on the device: bincount on CUDA reads the ids' min and max back to
    the host (two synchronisations a forward), and nothing here needs the counts on the host."""
    import torch
    ends = torch.arange(1, num_local + 1, device=sorted_expert.device, dtype=sorted_expert.dtype)
    return torch.searchsorted(sorted_expert, ends).to(torch.int32)


def expert_ffn(x_perm, sorted_expert, w13, w2, num_local, width, limit):
    """The experts on rows sorted by expert ([N, H] bf16 in, the same order out, not weighted).

    w13: [E_loc, 2I, H] (gate rows then up rows), w2: [E_loc, H, I]; both are handed to
    _grouped_mm as transposed views ([E_loc, H, 2I] and [E_loc, I, H])."""
    import torch
    offs = expert_offsets(sorted_expert, num_local)
    h = torch._grouped_mm(x_perm, w13.transpose(-2, -1), offs=offs)
    a = swiglu(h, width, limit)
    return torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)


def routed_rows(x_recv, row_expert, w13, w2, num_local, width, limit):
    """Expert outputs of the received rows, in arrival order ([N, H] bf16, not weighted), as
    autograd sees them (time_backward): permute, the experts, and the unpermute `out[order] = o`,
    whose gradient is a gather (a gather forward, as Work.forward does it, would have a
    scatter-add backward)."""
    import torch
    order = torch.argsort(row_expert, stable=True)
    o = expert_ffn(x_recv.index_select(0, order), row_expert.index_select(0, order), w13, w2, num_local, width,
                   limit)
    out = torch.empty_like(o)
    out[order] = o
    return out


def shared_out(x, w13s, w2s, width, limit):
    """One shared expert on x [T, H]: gate and up in one dense matmul, then down."""
    return swiglu(x @ w13s.t(), width, limit) @ w2s.t()


def local_y(x_local, shared, router_weights, combine_local, limit):
    """y of the local tokens: the router-weighted combine slots plus the shared experts. The
    weighting is one batched GEMM over each token's k slots ([1,k] x [k,H]: weights rounded to
    bf16, fp32 accumulation, bf16 out), which reads the slots once, where an elementwise
    product in fp32 made and re-read [T,k,H] fp32 tensors; that sum, in fp32, plus the shared
    experts' outputs, rounded to bf16 (two roundings where mok has one: within the bar)."""
    import torch
    T, k = router_weights.shape
    weights = router_weights.to(combine_local.dtype).unsqueeze(1)
    acc = torch.bmm(weights, combine_local.view(T, k, -1)).squeeze(1)
    if not shared:
        return acc  # (already bf16: the fp32 round trip would change no bit)
    acc = acc.float()
    for w13s, w2s, width in shared:
        acc = acc + shared_out(x_local, w13s, w2s, width, limit).float()
    return acc.to(torch.bfloat16)


def bf16_tensor(bits, device):
    """'<u2' bf16 bit patterns (numpy) -> a bf16 tensor on `device`."""
    import numpy as np
    import torch
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).to(device)


def fused_weights(arrays, widths, device):
    """The rank's weights as the pipeline uses them, made once (outside every timing):
    w13 = [gate | up] per local expert, w2, and (w13s, w2s, width) per shared expert, from
    bf16 bit arrays: arrays["w_gate"/"w_up"/"w_down"], arrays["shared"][s]["w_gate"/...]."""
    import torch

    def bf16(bits):
        return bf16_tensor(bits, device)

    w13 = torch.cat([bf16(arrays["w_gate"]), bf16(arrays["w_up"])], dim=1).contiguous()
    w2 = bf16(arrays["w_down"]).contiguous()
    shared = []
    for s, width in zip(arrays["shared"], widths):
        w13s = torch.cat([bf16(s["w_gate"]), bf16(s["w_up"])], dim=0).contiguous()
        shared.append((w13s, bf16(s["w_down"]).contiguous(), width))
    return w13, w2, shared


class Work:
    """The peer inputs on the GPU, with the fused weights made once (outside every timing)."""

    def __init__(self, doc, arrays, device):
        import numpy as np
        import torch

        def bf16(bits):
            return bf16_tensor(bits, device)

        def plain(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        p = doc["problem"]
        self.R, self.T, self.H, self.I, self.k, self.E_loc, widths = workdir.problem_dims(p)
        self.limit = None if p.get("swiglu_limit") is None else float(p["swiglu_limit"])
        self.x_all = bf16(arrays["x_all"])
        self.row_source = plain(arrays["row_source"]).long()
        self.row_expert = plain(arrays["row_expert"]).long()
        self.row_weight = plain(arrays["row_weight"]).float()
        self.N = int(self.row_source.numel())
        self.w13, self.w2, self.shared = fused_weights(arrays, widths, device)
        self.x_local = bf16(arrays["x_local"])
        self.router_weights = plain(arrays["router_weights"]).float()
        # Where the forward's unpermute puts each row (row_slot.npy): the rank's own tokens'
        # rows into their combine slots (NaN in combine_local.npy: the peer fills them, so its
        # y is checked on its own rows), the other ranks' into a send buffer (what the combine
        # all-to-all would carry off), in arrival order. Which arrival rows go where is part
        # of the layout the peer is given.
        row_slot = plain(arrays["row_slot"]).long()
        slots = self.T * self.k
        self.arrival = torch.arange(self.N, device=row_slot.device)
        self.own_rows = torch.nonzero(row_slot >= 0).flatten()
        self.own_slots = row_slot.index_select(0, self.own_rows)
        self.remote_rows = torch.nonzero(row_slot < 0).flatten()
        self.combine_local = bf16(arrays["combine_local"]).clone()  # (on the CPU .to() would share the array)
        self.send_buffer = torch.empty(int(self.remote_rows.numel()), self.H, dtype=torch.bfloat16, device=device)
        # Every slot filled by a row of this rank and no row sent elsewhere (one GPU, EP = 1):
        # the slots are then one gather of the expert outputs, slot by slot (slot_row: the
        # arrival row of each slot). (A slice's own rows may fill all of its slots while other
        # ranks' rows still arrive, under worst-case routing: those go to the send buffer.)
        self.slot_row = None
        if int(self.own_rows.numel()) == slots and int(self.remote_rows.numel()) == 0:
            self.slot_row = torch.empty(slots, dtype=torch.long, device=row_slot.device)
            self.slot_row[self.own_slots] = self.own_rows
        self.rows_ref = bf16(arrays["rows_ref"])
        self.y_ref = bf16(arrays["y_ref"])
        self.dy_local = bf16(arrays["dy_local"]) if "dy_local" in arrays else None
        counts = np.bincount(arrays["row_expert"].astype(np.int64), minlength=self.E_loc)
        self.expert_rows = {"min": int(counts.min()), "max": int(counts.max()), "mean": float(counts.mean())}

    def forward(self):
        """The timed pipeline: y, with the routed rows left in the combine slots and the send
        buffer (routed_out). Each row's bytes move once each way, as in mok: gathered in expert
        order, and gathered back to where it goes."""
        import torch
        order = torch.argsort(self.row_expert, stable=True)
        if self.R == 1:  # one GPU: no all-to-all, the permute is the dispatch
            x_perm = self.x_all.index_select(0, self.row_source.index_select(0, order))
        else:
            x_recv = self.x_all.index_select(0, self.row_source)  # what the all-to-all delivers
            x_perm = x_recv.index_select(0, order)
        o = expert_ffn(x_perm, self.row_expert.index_select(0, order), self.w13, self.w2, self.E_loc, self.I,
                       self.limit)
        # Unpermute as gathers: at[r] is arrival row r's row of o (N indices, not N rows).
        at = torch.empty_like(order)
        at[order] = self.arrival
        if self.slot_row is not None:
            torch.index_select(o, 0, at.index_select(0, self.slot_row), out=self.combine_local)
        else:
            self.combine_local.index_copy_(0, self.own_slots, o.index_select(0, at.index_select(0, self.own_rows)))
            torch.index_select(o, 0, at.index_select(0, self.remote_rows), out=self.send_buffer)
        return local_y(self.x_local, self.shared, self.router_weights, self.combine_local, self.limit)

    def routed_out(self):
        """The last forward's routed rows in arrival order (for the check, outside the timing)."""
        import torch
        out = torch.empty(self.N, self.H, dtype=torch.bfloat16, device=self.combine_local.device)
        out[self.own_rows] = self.combine_local.index_select(0, self.own_slots)
        out[self.remote_rows] = self.send_buffer
        return out


# ---- the measured parts ------------------------------------------------------------------

def check_forward(work, tol):
    y = work.forward()
    out = work.routed_out()
    import torch
    torch.cuda.synchronize()
    res = {"tolerance": tol}
    for name, got, ref in (("rows", out, work.rows_ref), ("y", y, work.y_ref)):
        st = checks.compare(got.float(), ref.float(), torch)
        st["passes"] = checks.passes(st, tol)
        res[name] = st
    res["passes"] = res["rows"]["passes"] and res["y"]["passes"]
    return res


def profile_forward(work, iters):
    """Where one forward of the pipeline spends its time: torch.profiler over `iters` forwards
    (after one untimed forward; outside every timing): on the GPU each kernel's device time and
    launches per forward, on the CPU each operator's self time; most first, the first 25, and
    the total over every entry."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    on_gpu = work.x_all.is_cuda
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    work.forward()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            work.forward()
        sync()
    rows = []
    for e in prof.key_averages():
        if on_gpu and e.device_type != torch.autograd.DeviceType.CUDA:
            continue  # (on the GPU: kernels only; the CPU side is the launches)
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key[:160], "us_per_forward": us / iters, "calls_per_forward": e.count / iters})
    rows.sort(key=lambda r: -r["us_per_forward"])
    if not rows:
        raise RuntimeError("the profiler recorded no " + ("GPU kernels (CUPTI unavailable?)" if on_gpu else "operators"))
    return {"iters": iters, "what": "GPU kernels' device time" if on_gpu else "CPU operators' self time",
            "total_us_per_forward": sum(r["us_per_forward"] for r in rows), "top": rows[:25]}


def time_grouped_gemms(work, warmup, iters):
    """The two grouped GEMMs alone, on rows already permuted by expert."""
    import torch
    order = torch.argsort(work.row_expert, stable=True)
    x_perm = work.x_all.index_select(0, work.row_source.index_select(0, order)).contiguous()
    offs = expert_offsets(work.row_expert.index_select(0, order), work.E_loc)
    w13t, w2t = work.w13.transpose(-2, -1), work.w2.transpose(-2, -1)
    a_perm = swiglu(torch._grouped_mm(x_perm, w13t, offs=offs), work.I, work.limit).contiguous()

    def gate_up():
        return torch._grouped_mm(x_perm, w13t, offs=offs)

    def down():
        return torch._grouped_mm(a_perm, w2t, offs=offs)

    def both():
        gate_up()
        down()

    return {"grouped_gemms": time_cuda(both, warmup, iters),
            "gate_up_gemm": time_cuda(gate_up, warmup, iters),
            "down_gemm": time_cuda(down, warmup, iters)}


BACKWARD_INCLUDES = (
    "torch.autograd.grad of the forward graph (built once, retain_graph=True) w.r.t. the received rows "
    "x_recv, the local expert weights, x_local, the router weights, the combine slots and the shared "
    "weights; upstream gradients: dy_local.npy for y and, for the routed rows, row_weight * dy_rows with "
    "dy_rows a seeded random bf16 [N,H] (the remote tokens' dy is not in the work directory)")


def time_backward(work, warmup, iters, seed):
    import torch
    # The rank's own slots are NaN until a forward placed its rows there (Work).
    if bool(torch.isnan(work.combine_local.float()).any()):
        raise RuntimeError("time_backward: the combine slots still hold NaN: run the forward (check_forward) first")
    leaf = lambda t: t.detach().requires_grad_()  # noqa: E731  (shares storage, no copy)
    x_recv = leaf(work.x_all.index_select(0, work.row_source))
    x_local = leaf(work.x_local)
    w13, w2 = leaf(work.w13), leaf(work.w2)
    rw, comb = leaf(work.router_weights), leaf(work.combine_local)
    shared = [(leaf(a), leaf(b), width) for a, b, width in work.shared]
    with torch.enable_grad():
        out = routed_rows(x_recv, work.row_expert, w13, w2, work.E_loc, work.I, work.limit)
        y = local_y(x_local, shared, rw, comb, work.limit)
    gen = torch.Generator(device=work.x_all.device)
    gen.manual_seed(seed)
    dy_rows = torch.randn(work.N, work.H, generator=gen, device=work.x_all.device, dtype=torch.float32)
    g_rows = (work.row_weight.unsqueeze(-1) * dy_rows).to(torch.bfloat16)
    del dy_rows
    inputs = [x_recv, w13, w2, x_local, rw, comb] + [t for a, b, _ in shared for t in (a, b)]

    def backward():
        return torch.autograd.grad([out, y], inputs, grad_outputs=[g_rows, work.dy_local],
                                   retain_graph=True, allow_unused=True)

    grads = backward()
    finite = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
    del grads
    if not finite:  # a broken backward is an error of the peer, not a time to report
        raise FloatingPointError("the peer's backward produced non-finite gradients")
    timing = time_cuda(backward, warmup, iters)
    timing["grads_finite"] = finite
    return timing


def ceiling_dense_bf16(n, warmup, iters):
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda: torch.matmul(a, b, out=c), warmup, iters)
    t.update({"m": n, "n": n, "k": n, "tflops": 2.0 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12,
              "how": "torch.matmul bf16, random normal data"})
    return t


def ceiling_fp8(n, warmup, iters, fast_accum=True):
    import torch
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda", dtype=torch.float32)
    t = time_cuda(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                           use_fast_accum=fast_accum), warmup, iters)
    t.update({"m": n, "n": n, "k": n, "tflops": 2.0 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12,
              "use_fast_accum": fast_accum,
              "how": "torch._scaled_mm e4m3 x e4m3 -> bf16, per-tensor scales, random normal data"})
    return t


def ceiling_copy(nbytes, warmup, iters):
    import torch
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), warmup, iters)
    t.update({"bytes": nbytes, "bytes_moved": 2 * nbytes,
              "gbps": 2.0 * nbytes / (t["median_ms"] * 1e-3) / 1e9,
              "how": "Tensor.copy_ device to device; bytes read + bytes written per second"})
    return t


# ---- driver ------------------------------------------------------------------------------

def gpu_env():
    """The process's current GPU (peer_dist sets each rank's before asking): its name, UUID
    (which tells two cards of one model apart), SMs and capability, and the software."""
    import torch
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device),
            "uuid": None if uuid is None else str(uuid),
            "sms": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
            "python": platform.python_version()}


def cuda_ready():
    try:
        import torch
    except ImportError:
        return False, "PyTorch is not installed"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, ""


def measure_peer(work, args, result, attempt):
    """Checks the pipeline, then times it, its grouped GEMMs and its backward. False when the
    check fails (the timings are then skipped)."""
    result["rows"] = {"N": work.N, "per_local_expert": work.expert_rows}
    tol = checks.tolerance(result["problem"]["precision"])
    result["check"] = attempt("check", lambda: check_forward(work, tol))
    if not (result["check"] and result["check"]["passes"]):
        reason = "the peer failed its forward check" if result["check"] else "the forward check raised"
        for part in ("forward", "grouped_gemms", "backward"):
            result["skipped"][part] = reason
        return False
    result["forward"] = attempt("forward", lambda: time_cuda(work.forward, args.warmup, args.iters, keep_iters=True))
    gg = attempt("grouped_gemms", lambda: time_grouped_gemms(work, args.warmup, args.iters))
    if gg:
        result.update(gg)
    if args.no_backward:
        result["skipped"]["backward"] = "--no-backward"
    else:
        result["backward"] = attempt("backward", lambda: time_backward(work, args.warmup, args.iters, args.seed))
    return True


def profile_last(work, args, result):
    """--profile: a diagnosis, run after every timing (the ceilings too: a profiler may leave
    later launches slower, CUPTI staying set up); a profile that fails is noted, the record
    stands."""
    try:
        result["profile"] = profile_forward(work, args.profile)
    except Exception as exc:
        result["profile"] = {"error": f"{type(exc).__name__}: {exc}"}


def run(args, doc, arrays):
    """Measures the peer on the loaded work (workdir.load_work's doc and arrays)."""
    import torch
    result = {"tool": "peer_torch", "schema": SCHEMA, "work_dir": os.path.abspath(args.work_dir),
              "peer_code": checks.peer_code("peer_torch"),
              "env": gpu_env(), "shape": doc["shape"], "problem": doc["problem"],
              "peer": "pytorch eager pipeline: index_select dispatch and argsort permute (one gather at "
                      "EP = 1), device offsets (searchsorted), torch._grouped_mm x2, SwiGLU, unpermute by "
                      "gather, shared experts, weighted combine as one bmm (bf16)",
              "peer_precision": "bf16",
              "timing": {"warmup": args.warmup, "iters": args.iters, "ceiling_warmup": args.ceiling_warmup,
                         "ceiling_iters": args.ceiling_iters, "median": "sorted[n//2] of per-iteration CUDA-event times"},
              "check": None, "forward": None, "grouped_gemms": None, "gate_up_gemm": None, "down_gemm": None,
              "backward": None, "backward_includes": BACKWARD_INCLUDES, "ceilings": {}, "skipped": {}, "errors": {}}
    ok = True

    def attempt(name, fn):
        nonlocal ok
        try:
            return fn()
        except Exception as exc:  # recorded, and the other parts still run
            ok = False
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None

    work = Work(doc, arrays, torch.device("cuda"))
    checked = measure_peer(work, args, result, attempt)
    ok = checked and ok
    del arrays
    if not (args.profile and checked):
        work = None  # (its tensors freed before the ceilings, unless the profile still needs them)
    torch.cuda.empty_cache()
    if args.no_ceilings:
        result["skipped"]["ceilings"] = "--no-ceilings"
    else:
        cw, ci = args.ceiling_warmup, args.ceiling_iters
        result["ceilings"]["dense_bf16"] = attempt("dense_bf16", lambda: ceiling_dense_bf16(args.gemm_n, cw, ci))
        result["ceilings"]["fp8_e4m3"] = attempt("fp8_e4m3", lambda: ceiling_fp8(args.gemm_n, cw, ci, True))
        result["ceilings"]["fp8_e4m3_exact_accum"] = attempt(
            "fp8_e4m3_exact_accum", lambda: ceiling_fp8(args.gemm_n, cw, ci, False))
        nbytes = int(args.copy_gib * (1 << 30))
        result["ceilings"]["copy"] = attempt("copy", lambda: ceiling_copy(nbytes, cw, ci))
    if work is not None:
        profile_last(work, args, result)
    return result, ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work_dir", help="the directory `mok bench --work-dir` wrote")
    checks.add_timing_options(ap)
    ap.add_argument("--gemm-n", type=int, default=8192, help="M=N=K of the GEMM ceilings")
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy ceiling's buffer")
    ap.add_argument("--seed", type=int, default=1, help="seed of the routed rows' upstream gradient")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after every timing (the ceilings too), profile N more forwards (torch.profiler) into "
                         "peer.json's 'profile'")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.ceiling_iters < 1 or args.ceiling_warmup < 0:
        ap.error("--iters/--ceiling-iters must be >= 1 and the warm-ups >= 0")
    if args.profile < 0:
        ap.error("--profile must be >= 0 (0: no profile)")
    ready, why = cuda_ready()
    if not ready:
        print(f"peer_torch.py: no CUDA GPU ({why}); the PyTorch peer runs on the device only", file=sys.stderr)
        return 2
    try:
        doc, arrays = workdir.load_work(args.work_dir, need_backward=not args.no_backward)
    except (workdir.ContractError, OSError, ValueError) as exc:
        # A work directory that breaks the contract is an input error, named, not a traceback;
        # no peer.json is written (run.py records the peer as failed).
        print(f"peer_torch.py: {args.work_dir}: not a usable work directory: {exc}", file=sys.stderr)
        return 1
    result, ok = run(args, doc, arrays)
    path = workdir.write_peer_json(args.work_dir, result)
    fwd = result["forward"]["median_ms"] if result["forward"] else None
    print(f"peer_torch.py: check {'PASS' if result['check'] and result['check']['passes'] else 'FAIL'}, "
          f"forward median {fwd} ms; wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
