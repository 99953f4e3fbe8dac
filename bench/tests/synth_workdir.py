"""Writes a SYNTHETIC work directory in the layout `mok bench` writes (bench/README.md).

Test fixture only: a small random problem, a numpy reference computed the way mok's CPU
reference does (fp32 accumulation, the SwiGLU output rounded to bf16), and a mok.json whose
timings and GPU are made up and say so. Used by the CPU tests (the loader, run.py driven by
fake_mok.py) and, on the device, to exercise peer_torch.py before the real `mok bench`
exists. Never a benchmark result.

    python3 bench/tests/synth_workdir.py DIR [--tokens 64] [--ep 2] [--ep-mode slice]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workdir import f32_to_bf16_bits, round_bf16  # noqa: E402

SYNTHETIC_GPU = {"name": "SYNTHETIC-GPU (test fixture)", "sms": 1, "driver": "0.0-fixture",
                 "cuda_runtime": "0.0-fixture"}


def _ffn(x, wg, wu, wd, limit):
    """One SwiGLU FFN on rows x [n, H] (float32 values of bf16 numbers) -> float32 [n, H]."""
    g = x @ wg.T
    u = x @ wu.T
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    with np.errstate(over="ignore"):
        a = round_bf16(g / (1.0 + np.exp(-g)) * u)
    return a @ wd.T


def make_workdir(work_dir, *, num_experts=8, hidden=256, intermediate=128, top_k=2, shared=(128,),
                 ep_size=2, tokens=64, ep_mode="slice", active_rank=0, swiglu_limit=None,
                 precision="bf16", shape="synthetic-fixture", routing="gaussian", seed=1,
                 warmup=0, iters=1, forward_ms=1.0, backward_ms=None, top_experts=None):
    """top_experts: int [R*T, k], every token's experts (else drawn at random)."""
    E, H, I, k, R, T = num_experts, hidden, intermediate, top_k, ep_size, tokens
    if E % R:
        raise ValueError("num_experts must be a multiple of ep_size")
    El = E // R
    rng = np.random.default_rng(seed)
    os.makedirs(work_dir, exist_ok=True)

    def save(name, a):
        np.save(os.path.join(work_dir, name), a)

    x = round_bf16(rng.standard_normal((R * T, H), dtype=np.float32))
    top = np.argsort(rng.random((R * T, E)), axis=1)[:, :k].astype(np.int32)
    if top_experts is not None:
        top = np.ascontiguousarray(top_experts, dtype=np.int32)
        if top.shape != (R * T, k):
            raise ValueError(f"top_experts must be [{R * T}, {k}], got {list(top.shape)}")
    w = rng.random((R * T, k), dtype=np.float32) + np.float32(0.05)
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    wg = round_bf16(rng.standard_normal((E, I, H), dtype=np.float32) / np.float32(np.sqrt(H)))
    wu = round_bf16(rng.standard_normal((E, I, H), dtype=np.float32) / np.float32(np.sqrt(H)))
    wd = round_bf16(rng.standard_normal((E, H, I), dtype=np.float32) / np.float32(np.sqrt(I)))
    sw = []
    for width in shared:
        sw.append((round_bf16(rng.standard_normal((width, H), dtype=np.float32) / np.float32(np.sqrt(H))),
                   round_bf16(rng.standard_normal((width, H), dtype=np.float32) / np.float32(np.sqrt(H))),
                   round_bf16(rng.standard_normal((H, width), dtype=np.float32) / np.float32(np.sqrt(width)))))

    # Every (token, slot)'s expert output, rounded to bf16 as mok's combine slots hold it.
    expert_out = np.zeros((R * T, k, H), dtype=np.float32)
    for e in range(E):
        n, j = np.nonzero(top == e)
        if len(n):
            expert_out[n, j] = round_bf16(_ffn(x[n], wg[e], wu[e], wd[e], swiglu_limit))

    # The active rank's rows in arrival order: source rank, token, slot.
    a = active_rank
    lo, hi = a * El, (a + 1) * El
    n_idx, j_idx = np.nonzero((top >= lo) & (top < hi))  # row-major: token then slot
    row_source = n_idx.astype(np.int64)
    row_expert = (top[n_idx, j_idx] - lo).astype(np.int32)
    row_weight = w[n_idx, j_idx].astype(np.float32)
    rows_ref = expert_out[n_idx, j_idx]

    tok = np.arange(a * T, (a + 1) * T)
    x_local = x[tok]
    combine_local = expert_out[tok].reshape(T * k, H)
    # The rows of the rank's own tokens name their slots; those slots are NaN in the file (the
    # peer fills them), as mok bench writes them.
    own = row_source // T == a
    row_slot = np.where(own, (row_source - a * T) * k + j_idx, -1).astype(np.int64)
    peer_slots = combine_local.copy()
    peer_slots[row_slot[own]] = np.nan
    y = np.zeros((T, H), dtype=np.float32)
    for (g_, u_, d_) in sw:
        y += _ffn(x_local, g_, u_, d_, swiglu_limit)
    for j in range(k):
        y += w[tok, j][:, None] * expert_out[tok, j]
    y_ref = round_bf16(y)
    dy_local = round_bf16(rng.standard_normal((T, H), dtype=np.float32))

    b = f32_to_bf16_bits
    save("x_all.npy", b(x))
    save("row_source.npy", row_source)
    save("row_expert.npy", row_expert)
    save("row_weight.npy", row_weight)
    save("w_gate.npy", b(wg[lo:hi]))
    save("w_up.npy", b(wu[lo:hi]))
    save("w_down.npy", b(wd[lo:hi]))
    for s, (g_, u_, d_) in enumerate(sw):
        save(f"shared{s}_w_gate.npy", b(g_))
        save(f"shared{s}_w_up.npy", b(u_))
        save(f"shared{s}_w_down.npy", b(d_))
    save("x_local.npy", b(x_local))
    save("router_weights.npy", w[tok])
    save("row_slot.npy", row_slot)
    save("combine_local.npy", b(peer_slots))
    save("rows_ref.npy", b(rows_ref))
    save("y_ref.npy", b(y_ref))
    save("dy_local.npy", b(dy_local))

    counts = np.bincount(row_expert, minlength=El)
    padded = int(sum(-(-int(c) // 64) * 64 for c in counts))
    remote = int(np.count_nonzero(row_source // T != a))
    loads = np.bincount(top.ravel(), minlength=E).astype(np.float64)
    rank_loads = loads.reshape(R, El).sum(axis=1)
    timing = lambda ms: None if ms is None else {"median_ms": ms, "min_ms": ms * 0.9, "max_ms": ms * 1.2}
    doc = {
        "tool": "mok bench",
        "shape": shape,
        "problem": {"num_experts": E, "hidden": H, "intermediate": I, "top_k": k,
                    "shared_intermediate": list(shared), "ep_size": R, "tokens_per_rank": T,
                    "precision": precision, "swiglu_limit": swiglu_limit},
        "ep_mode": ep_mode,
        "active_rank": a,
        "peer_inputs": True,
        "routing": {"spec": routing, "max_over_mean_expert": float(loads.max() / loads.mean()),
                    "max_over_mean_rank": float(rank_loads.max() / rank_loads.mean())},
        "rows": {"real": int(len(row_source)), "remote": remote, "padded": padded},
        "config": {"note": "synthetic fixture"},
        "gpu": dict(SYNTHETIC_GPU),
        "timing": {"warmup": warmup, "iters": iters},
        "forward": timing(forward_ms),
        "backward": timing(backward_ms),
        "check": {"forward": {"max_abs": 0.0, "rel": 0.0, "passes": True}},
    }
    with open(os.path.join(work_dir, "mok.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return doc



def rank_dir_from_single(work_dir, rank_dir):
    """A group rank's directory (what `mok bench --ep-mode distributed` writes for peer_dist.py)
    made from a synthetic EP = 1 work directory: at EP = 1 the rank's tokens are all the rows
    and every slot holds exactly one."""
    import shutil
    os.makedirs(rank_dir)
    for name in ("mok.json", "w_gate.npy", "w_up.npy", "w_down.npy", "x_local.npy", "router_weights.npy",
                 "y_ref.npy") + tuple(f for f in os.listdir(work_dir) if f.startswith("shared")):
        shutil.copy(os.path.join(work_dir, name), rank_dir)
    load = lambda n: np.load(os.path.join(work_dir, n))  # noqa: E731
    slot, expert, rows = load("row_slot.npy"), load("row_expert.npy"), load("rows_ref.npy")
    with open(os.path.join(work_dir, "mok.json")) as f:
        k = json.load(f)["problem"]["top_k"]
    assert np.array_equal(np.sort(slot), np.arange(slot.size)), "an EP = 1 work directory fills every slot once"
    top = np.empty(slot.size, np.int32)
    top[slot] = expert
    np.save(os.path.join(rank_dir, "top_experts.npy"), top.reshape(-1, k))
    slots_ref = np.empty_like(rows)
    slots_ref[slot] = rows
    np.save(os.path.join(rank_dir, "slots_ref.npy"), slots_ref)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work_dir")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--ep-mode", default="slice")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--shared", default="128", help="comma list of widths, or 'none'")
    ap.add_argument("--swiglu-limit", type=float, default=None)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    shared = () if args.shared == "none" else tuple(int(s) for s in args.shared.split(","))
    make_workdir(args.work_dir, num_experts=args.experts, hidden=args.hidden, intermediate=args.intermediate,
                 top_k=args.topk, shared=shared, ep_size=args.ep, tokens=args.tokens, ep_mode=args.ep_mode,
                 swiglu_limit=args.swiglu_limit, seed=args.seed)
    print(f"synthetic work directory written to {args.work_dir}")


if __name__ == "__main__":
    main()
