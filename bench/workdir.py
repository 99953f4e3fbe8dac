"""Reads the work directory that `mok bench` writes (see bench/README.md, "The contract").

numpy only; peer_torch.py turns the arrays into torch tensors on the GPU. bf16 tensors are
stored as '<u2' raw bit patterns; the helpers below convert between them and float32 so
the tests (and synthetic work directories) need no torch.
"""
import json
import os

import numpy as np

MOK_JSON = "mok.json"
PEER_JSON = "peer.json"

BF16 = "bf16"
F32 = "f32"
I32 = "i32"
I64 = "i64"

_DESCR = {BF16: np.dtype("<u2"), F32: np.dtype("<f4"), I32: np.dtype("<i4"), I64: np.dtype("<i8")}


class ContractError(ValueError):
    """The work directory does not follow the contract with `mok bench`."""


def bf16_bits_to_f32(bits):
    """'<u2' bf16 bit patterns -> float32 (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x):
    """float32 -> bf16 bit patterns, round to nearest even (NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    x = np.ascontiguousarray(x).reshape(-1)
    u = x.view(np.uint32)
    rounding = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + rounding) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out.reshape(shape)


def round_bf16(x):
    """float32 values rounded to the nearest bf16 value, as float32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_peer_json(work_dir, result):
    """Writes a peer's result as DIR/peer.json (what run.py reads), whole or not at all: the JSON
    is made first (a value it cannot hold fails before any file), written to a temporary file in
    DIR, flushed and fsynced, then os.replace'd over peer.json; the temporary file is removed on
    any failure. A peer stopped or failing mid-write must not leave half a peer.json that reads
    as a verdict, nor spoil one written before. Returns the path."""
    path = os.path.join(work_dir, PEER_JSON)
    tmp = synced_tmp(work_dir, PEER_JSON, json.dumps(result, indent=1))
    try:
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def synced_tmp(folder, base, text):
    """`text` in a new, exclusively created temporary file in `folder` (".<base>.<pid>.<random>.tmp":
    not *.json, so report.py's glob never reads it), flushed and fsynced; its path. Removed again
    if writing fails. (os.open with 0o666, not mkstemp's 0o600: the file keeps the umask's mode.)"""
    while True:
        path = os.path.join(folder, f".{base}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    return path


def load_mok_json(work_dir):
    path = os.path.join(work_dir, MOK_JSON)
    if not os.path.exists(path):
        raise ContractError(f"{path}: missing (mok bench writes it)")
    doc = read_json(path)
    for key in ("shape", "problem", "ep_mode", "active_rank", "rows", "forward"):
        if key not in doc:
            raise ContractError(f"{path}: key '{key}' missing")
    for key in ("num_experts", "hidden", "intermediate", "top_k", "shared_intermediate", "ep_size",
                "tokens_per_rank", "precision"):
        if key not in doc["problem"]:
            raise ContractError(f"{path}: key 'problem.{key}' missing")
    return doc


def require_peer_inputs(doc, work_dir):
    """A ContractError when mok bench wrote this DIR with --no-peer-inputs (mok.json's
    "peer_inputs": false): it holds no inputs for a peer to run on. Records written before the
    key existed always had them."""
    if doc.get("peer_inputs", True) is False:
        raise ContractError(f"{os.path.join(work_dir, MOK_JSON)}: written by mok bench --no-peer-inputs, so "
                            "the directory holds no peer inputs (run mok bench without that option)")


def _load(work_dir, name, kind, shape):
    path = os.path.join(work_dir, name)
    if not os.path.exists(path):
        raise ContractError(f"{path}: missing")
    a = np.load(path, allow_pickle=False)
    want = _DESCR[kind]
    if a.dtype != want:
        if kind == BF16 and a.dtype == np.dtype("<f4"):
            a = f32_to_bf16_bits(a)  # tolerated, as mok's own npy reader does
        elif kind == I64 and a.dtype == np.dtype("<i4"):
            a = a.astype(np.int64)
        elif kind == I32 and a.dtype == np.dtype("<i8"):
            a = a.astype(np.int32)
        else:
            raise ContractError(f"{path}: dtype '{a.dtype.str}', expected '{want.str}' ({kind})")
    if tuple(a.shape) != tuple(shape):
        raise ContractError(f"{path}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def _load_expert_weights(work_dir, El, H, I):
    """The rank's routed experts' w_gate, w_up [El, I, H] and w_down [El, H, I]."""
    return {"w_gate": _load(work_dir, "w_gate.npy", BF16, (El, I, H)),
            "w_up": _load(work_dir, "w_up.npy", BF16, (El, I, H)),
            "w_down": _load(work_dir, "w_down.npy", BF16, (El, H, I))}


def _load_shared(work_dir, H, widths):
    """Each shared expert's w_gate, w_up [w, H] and w_down [H, w], in order."""
    return [{"w_gate": _load(work_dir, f"shared{s}_w_gate.npy", BF16, (w, H)),
             "w_up": _load(work_dir, f"shared{s}_w_up.npy", BF16, (w, H)),
             "w_down": _load(work_dir, f"shared{s}_w_down.npy", BF16, (H, w))} for s, w in enumerate(widths)]


def problem_dims(problem):
    """(R, T, H, I, k, E_loc, shared widths) of a mok.json problem."""
    R = int(problem["ep_size"])
    E = int(problem["num_experts"])
    if E % R:
        raise ContractError(f"num_experts {E} is not a multiple of ep_size {R}")
    return (R, int(problem["tokens_per_rank"]), int(problem["hidden"]), int(problem["intermediate"]),
            int(problem["top_k"]), E // R, [int(w) for w in problem["shared_intermediate"]])


def load_work(work_dir, need_backward=True):
    """Loads and validates every peer input. Returns (mok_json, dict of numpy arrays).

    bf16 tensors stay as uint16 bit patterns.
    """
    doc = load_mok_json(work_dir)
    require_peer_inputs(doc, work_dir)
    R, T, H, I, k, El, shared = problem_dims(doc["problem"])
    rs_path = os.path.join(work_dir, "row_source.npy")
    if not os.path.exists(rs_path):
        raise ContractError(f"{rs_path}: missing")
    rs_shape = np.load(rs_path, mmap_mode="r", allow_pickle=False).shape
    if len(rs_shape) != 1:
        raise ContractError(f"{rs_path}: shape {rs_shape}, expected [N]")
    N = int(rs_shape[0])
    real = int(doc["rows"].get("real", N))
    if real != N:
        raise ContractError(f"mok.json rows.real = {real} but row_source.npy has {N} rows")
    a = {
        "x_all": _load(work_dir, "x_all.npy", BF16, (R * T, H)),
        "row_source": _load(work_dir, "row_source.npy", I64, (N,)),
        "row_expert": _load(work_dir, "row_expert.npy", I32, (N,)),
        "row_weight": _load(work_dir, "row_weight.npy", F32, (N,)),
        "row_slot": _load(work_dir, "row_slot.npy", I64, (N,)),
        **_load_expert_weights(work_dir, El, H, I),
        "x_local": _load(work_dir, "x_local.npy", BF16, (T, H)),
        "router_weights": _load(work_dir, "router_weights.npy", F32, (T, k)),
        "combine_local": _load(work_dir, "combine_local.npy", BF16, (T * k, H)),
        "rows_ref": _load(work_dir, "rows_ref.npy", BF16, (N, H)),
        "y_ref": _load(work_dir, "y_ref.npy", BF16, (T, H)),
    }
    if need_backward:
        a["dy_local"] = _load(work_dir, "dy_local.npy", BF16, (T, H))
    a["shared"] = _load_shared(work_dir, H, shared)
    if N:
        if a["row_source"].min() < 0 or a["row_source"].max() >= R * T:
            raise ContractError(f"row_source.npy: values must lie in [0, {R * T})")
        if a["row_expert"].min() < 0 or a["row_expert"].max() >= El:
            raise ContractError(f"row_expert.npy: values must lie in [0, {El})")
        slots = np.asarray(a["row_slot"])
        if slots.min() < -1 or slots.max() >= T * k:
            raise ContractError(f"row_slot.npy: values must lie in [-1, {T * k}) (-1: another rank's token)")
        own = slots[slots >= 0]
        if len(np.unique(own)) != len(own):
            raise ContractError("row_slot.npy: a slot of the active rank is named by two rows")
    return doc, a


def load_rank_work(rank_dir):
    """Loads and validates one rank's peer inputs in a real group's directory (what `mok bench
    --ep-mode distributed` writes for peer_dist.py): (mok_json, dict of numpy arrays), each
    array of the dtype and shape the problem gives (load_work's rules), and every top-k id a
    global expert. bf16 tensors stay as uint16 bit patterns."""
    doc = load_mok_json(rank_dir)
    require_peer_inputs(doc, rank_dir)
    R, T, H, I, k, El, shared = problem_dims(doc["problem"])
    a = {
        "x_local": _load(rank_dir, "x_local.npy", BF16, (T, H)),
        "top_experts": _load(rank_dir, "top_experts.npy", I32, (T, k)),
        "router_weights": _load(rank_dir, "router_weights.npy", F32, (T, k)),
        "y_ref": _load(rank_dir, "y_ref.npy", BF16, (T, H)),
        "slots_ref": _load(rank_dir, "slots_ref.npy", BF16, (T * k, H)),
        **_load_expert_weights(rank_dir, El, H, I),
        "shared": _load_shared(rank_dir, H, shared),
    }
    top = a["top_experts"]
    if top.size and (top.min() < 0 or top.max() >= R * El):
        raise ContractError(f"{os.path.join(rank_dir, 'top_experts.npy')}: values must lie in [0, {R * El})")
    return doc, a
