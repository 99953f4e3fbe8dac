#!/usr/bin/env python3
"""The PyTorch + NCCL peer of a real EP group: one process per GPU, started by mok launch
(or torchrun), on exactly the work `mok bench --ep-mode distributed` ran.

    mok launch -n N -- python3 bench/peer_dist.py DIR [--warmup 500] [--iters 100]

Each rank r reads DIR/rank<r> (its x, top-k ids, router weights, its experts' weights and
y_ref), then, on its GPU, runs the pipeline users write around grouped GEMMs:
  1. counts per destination rank, all_to_all_single of the counts (and the host reads them:
     the split sizes), argsort of the (token, j) pairs by destination;
  2. all_to_all_single of the rows and of their local expert ids (NCCL: the dispatch);
  3. argsort permute, torch._grouped_mm gate/up, SwiGLU, torch._grouped_mm down
     (bench/peer_torch.py's expert_ffn), unpermute by a gather;
  4. all_to_all_single of the result rows back to their sources (the combine), unpermute
     into [T*k, H] slots (a gather), router-weighted sum plus the shared experts (local_y).
It checks y against y_ref and its combine slots (every row of its tokens, after the combine
all-to-all) against slots_ref (MoK's bar) on every rank before timing; times the forward with
CUDA events per iteration on every rank, the slowest rank per iteration making the figure
(as mok bench's group record does); and measures NCCL's own all-to-all bandwidth (the
NVLink ceiling) and the dense bf16 GEMM rate on rank 0. Rank 0 writes DIR/peer.json.
Exit status: 0 all good, 1 a check failed or a part raised, 2 no CUDA GPU / no group.

The exchange is planned by the array-module-agnostic functions below (numpy in the CPU
tests, torch here), so the permutations are tested without GPUs.
"""
import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
import workdir  # noqa: E402

SCHEMA = 1
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# ---- the exchange plan (numpy or torch) --------------------------------------------------

def send_plan(top_flat, k, local_experts, ranks, xp):
    """For the flattened top-k ids of one rank ([T*k], global expert ids, pair t*k + j):
    the pair order that groups pairs by destination rank (stable: token order within a
    destination), each sent row's source token, its destination-local expert id, and the
    rows for each destination rank."""
    dest = top_flat // local_experts
    if xp.__name__ == "torch":
        order = xp.argsort(dest, stable=True)
        # (On the device: torch.bincount on CUDA reads the ids' min and max back to the host.)
        counts = xp.zeros(ranks, dtype=dest.dtype, device=dest.device).scatter_add_(0, dest, xp.ones_like(dest))
    else:
        order = xp.argsort(dest, kind="stable")
        counts = xp.bincount(dest, minlength=ranks)
    return order, order // k, (top_flat % local_experts)[order], counts


def inverse_permutation(order, xp):
    """at with at[order[i]] = i: where each element of the unpermuted order sits in `order`'s."""
    n = int(order.shape[0])
    at = xp.empty_like(order)
    at[order] = xp.arange(n, device=order.device) if xp.__name__ == "torch" else xp.arange(n)
    return at


def unpermute_slots(back, order, xp):
    """Rows that came back in send order -> slots in (token, j) order: one gather (a scatter of
    the indices, not of the rows)."""
    at = inverse_permutation(order, xp)
    return back.index_select(0, at) if xp.__name__ == "torch" else back[at]


def simulate_exchange(sends, counts):
    """What R ranks' all_to_all_single calls deliver, in one process (tests): sends[r] is
    rank r's send buffer ordered by destination, counts[r][d] the rows r sends to d. Rank
    d receives every source's block for d, sources in rank order."""
    import numpy as np
    R = len(sends)
    offsets = [np.concatenate([[0], np.cumsum(c)]) for c in counts]
    return [np.concatenate([sends[s][offsets[s][d]:offsets[s][d + 1]] for s in range(R)]) for d in range(R)]


# ---- the group -------------------------------------------------------------------------

def group_env(environ=os.environ):
    """(rank, world_size, local_rank, rendezvous_dir) from mok launch's or torchrun's variables."""
    def first(*names):
        for n in names:
            if environ.get(n) not in (None, ""):
                return environ[n]
        return None
    rank, world, local = first("MOK_RANK", "RANK"), first("MOK_WORLD_SIZE", "WORLD_SIZE"), first(
        "MOK_LOCAL_RANK", "LOCAL_RANK")
    rdv = first("MOK_LAUNCH_DIR", "MOK_RENDEZVOUS_DIR")
    if rank is None or world is None:
        raise RuntimeError("peer_dist.py: no group: start it with `mok launch -n N -- ...` or torchrun "
                           "(MOK_RANK/MOK_WORLD_SIZE or RANK/WORLD_SIZE unset)")
    return int(rank), int(world), int(local if local is not None else rank), rdv


def init_group(rank, world, rdv):
    import torch.distributed as dist
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        dist.init_process_group("nccl", rank=rank, world_size=world)
    else:
        if not rdv:
            raise RuntimeError("peer_dist.py: no rendezvous: MOK_LAUNCH_DIR (mok launch) or MASTER_ADDR/PORT")
        dist.init_process_group("nccl", init_method="file://" + os.path.join(rdv, "torch_peer_dist"),
                                rank=rank, world_size=world)


class RankWork:
    """One rank's inputs on its GPU, fused weights made once (outside every timing)."""

    def __init__(self, rank_dir, device):
        import numpy as np
        import torch
        # (Every array checked against the problem's dtype and shape: load_rank_work.)
        self.doc, a = workdir.load_rank_work(rank_dir)
        p = self.doc["problem"]
        self.R, self.T, self.H, self.I, self.k, self.E_loc, widths = workdir.problem_dims(p)
        self.limit = None if p.get("swiglu_limit") is None else float(p["swiglu_limit"])

        from peer_torch import bf16_tensor, fused_weights

        self.x = bf16_tensor(a["x_local"], device)
        self.top = torch.from_numpy(a["top_experts"].astype(np.int64)).to(device).reshape(-1)
        self.router_weights = torch.from_numpy(a["router_weights"]).float().to(device)
        self.y_ref = bf16_tensor(a["y_ref"], device)
        # Every row of this rank's tokens as the reference computed it, slot by slot: the
        # peer's combine slots are checked with them (a few wrong rows could pass y's bar).
        self.slots_ref = bf16_tensor(a["slots_ref"], device)
        self.slots = None  # the last forward's combine slots
        weights = {name: a[name] for name in ("w_gate", "w_up", "w_down")}
        weights["shared"] = a["shared"]
        self.w13, self.w2, self.shared = fused_weights(weights, widths, device)

    def forward(self):
        import torch
        import torch.distributed as dist
        from peer_torch import expert_ffn, local_y
        order, src_token, expert_send, counts = send_plan(self.top, self.k, self.E_loc, self.R, torch)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()  # the host needs the sizes
        x_send = self.x.index_select(0, src_token)
        x_recv = self.x.new_empty((sum(recv_splits), self.H))
        dist.all_to_all_single(x_recv, x_send, recv_splits, send_splits)
        e_recv = expert_send.new_empty((sum(recv_splits),))
        dist.all_to_all_single(e_recv, expert_send, recv_splits, send_splits)
        # Permute by expert, the experts, and back to arrival order (gathers both ways).
        by_expert = torch.argsort(e_recv, stable=True)
        o = expert_ffn(x_recv.index_select(0, by_expert), e_recv.index_select(0, by_expert), self.w13, self.w2,
                       self.E_loc, self.I, self.limit)
        out = o.index_select(0, inverse_permutation(by_expert, torch))
        back = self.x.new_empty((self.T * self.k, self.H))
        dist.all_to_all_single(back, out, send_splits, recv_splits)
        slots = unpermute_slots(back, order, torch)
        self.slots = slots
        return local_y(self.x, self.shared, self.router_weights, slots, self.limit)


def time_rank(fn, warmup, iters):
    """(per-iteration CUDA-event times (ms) on this rank, iteration order; the host's clock at
    the end of the rank's timed loop: peer_torch.event_times); the ranks start the timed
    iterations together."""
    import torch.distributed as dist
    from peer_torch import event_times
    return event_times(fn, warmup, iters, before_timing=dist.barrier)


def gather_floats(values, world):
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device="cuda")
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def nccl_all_to_all(nbytes, warmup, iters, world):
    """NCCL's all-to-all on nbytes per rank: the slowest rank's median time, algorithm
    bandwidth (bytes each rank sends / time) and bus bandwidth (x (R-1)/R, nccl-tests)."""
    import torch
    import torch.distributed as dist
    n = nbytes // 2 // world * world
    inp = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(inp)
    times, _ = time_rank(lambda: dist.all_to_all_single(out, inp), warmup, iters)
    worst = checks.slowest_per_iteration(gather_floats(times, world))
    t = checks.summarize_ms(worst)
    algbw = n * 2 / (t["median_ms"] * 1e-3) / 1e9
    return {**t, "bytes_per_rank": n * 2, "algbw_gbps": algbw, "busbw_gbps": algbw * (world - 1) / world}


def multicast_off(environ=os.environ):
    """NVLink multicast off in this process before torch or NCCL start, whatever the launcher
    left set (torchrun passes the caller's environment through; on these machines multicast
    can take the host's GPUs out of service)."""
    for k, v in NCCL_ENV.items():
        environ[k] = v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work_dir", help="the directory `mok bench --ep-mode distributed --work-dir` wrote")
    checks.add_timing_options(ap)
    ap.add_argument("--a2a-mib", type=float, default=256.0, help="bytes per rank of the NCCL all-to-all ceiling")
    ap.add_argument("--gemm-n", type=int, default=8192)
    args = ap.parse_args(argv)
    multicast_off()
    try:
        rank, world, local, rdv = group_env()
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("peer_dist.py: PyTorch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
        print(f"peer_dist.py: rank {rank}: no CUDA GPU {local}", file=sys.stderr)
        return 2
    torch.cuda.set_device(local)
    init_group(rank, world, rdv)
    import torch.distributed as dist
    from peer_torch import ceiling_dense_bf16, gpu_env

    result = {"tool": "peer_dist", "schema": SCHEMA, "work_dir": os.path.abspath(args.work_dir), "env": gpu_env(),
              "peer_code": checks.peer_code("peer_dist"), "world_size": world,
              "peer": "pytorch + NCCL: all_to_all_single dispatch (counts, rows, expert ids), argsort permute, "
                      "torch._grouped_mm x2, SwiGLU, unpermute, all_to_all_single combine, shared experts, "
                      "weighted sum as one bmm (bf16)",
              "peer_precision": "bf16",
              "timing": {"warmup": args.warmup, "iters": args.iters, "ceiling_warmup": args.ceiling_warmup,
                         "ceiling_iters": args.ceiling_iters,
                         "median": "sorted[n//2] over iterations of the slowest rank's CUDA-event time"},
              "check": None, "forward": None, "ranks": None, "ceilings": {}, "skipped": {}, "errors": {}}
    ok = True
    try:
        work = RankWork(os.path.join(args.work_dir, f"rank{rank}"), torch.device("cuda", local))
        result["shape"], result["problem"] = work.doc["shape"], work.doc["problem"]
        tol = checks.tolerance(work.doc["problem"]["precision"])
        stats = checks.compare(work.forward().float(), work.y_ref.float(), torch)
        stats["passes"] = checks.passes(stats, tol)
        slots = checks.compare(work.slots.float(), work.slots_ref.float(), torch)
        slots["passes"] = checks.passes(slots, tol)
        stats["slots"] = slots
        stats["passes"] = stats["passes"] and slots["passes"]
        all_stats = [None] * world
        dist.all_gather_object(all_stats, stats)
        result["check"] = {"passes": all(s["passes"] for s in all_stats),
                           "max_abs": max(s["max_abs"] for s in all_stats),
                           "rel": max(s["rel"] for s in all_stats), "ranks": all_stats, "tolerance": tol}
        if result["check"]["passes"]:
            mine, end = time_rank(work.forward, args.warmup, args.iters)
            per_rank = gather_floats(mine, world)
            result["forward"] = checks.summarize_ms(checks.slowest_per_iteration(per_rank))
            result["forward"]["window_unix_s"] = checks.timed_window(mine, end)
            result["ranks"] = [checks.summarize_ms(t) for t in per_rank]
        else:
            ok = False
            result["skipped"]["forward"] = "the peer failed its forward check"
        del work
        torch.cuda.empty_cache()
        result["ceilings"]["nccl_all_to_all"] = nccl_all_to_all(
            int(args.a2a_mib * (1 << 20)), args.ceiling_warmup, args.ceiling_iters, world)
        if rank == 0:
            result["ceilings"]["dense_bf16"] = ceiling_dense_bf16(args.gemm_n, args.ceiling_warmup,
                                                                  args.ceiling_iters)
    except Exception as exc:  # this rank's failure: its own traceback, and a non-zero exit
        traceback.print_exc()
        print(f"peer_dist.py: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        # The launcher stops the other ranks (possibly stuck in a collective) when this exits
        # non-zero; run.py records the peer as failed when no peer.json appears.
        return 1
    # Every rank reached here: rank 0 writes the group's verdict, then all leave together (an
    # early exit would get rank 0 stopped before it writes).
    if rank == 0:
        path = workdir.write_peer_json(args.work_dir, result)
        fwd = result["forward"]["median_ms"] if result["forward"] else None
        print(f"peer_dist.py: {world} ranks, check {'PASS' if (result['check'] or {}).get('passes') else 'FAIL'}, "
              f"forward median {fwd} ms (slowest rank per iteration); wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok or rank != 0 else 1


if __name__ == "__main__":
    sys.exit(main())
