"""mok from Python: the MoE layer through libmok.so's C interface (include/mok/c_api.h).

Tensors are numpy arrays (CPU backend) or PyTorch tensors (CPU, or CUDA for the cuda
backend); nothing is copied, the layer reads and writes them where they are. bf16 data is a
torch.bfloat16 tensor, or a numpy uint16 array of bf16 bit patterns (numpy has no bf16).

    import mok
    layer = mok.Layer(mok.Problem(num_experts=8, hidden=256, intermediate=128, top_k=2,
                                  shared_intermediate=[128], ep_size=2, tokens_per_rank=64))
    layer.forward([{"x": x0, "top_experts": ids0, "router_weights": w0, "w_gate": g0,
                    "w_up": u0, "w_down": d0, "shared": [(gs, us, ds)], "y": y0}, ...])

The rules (shapes, dtypes, which ranks a mode takes) are mok::Layer's (include/mok/layer.h);
a broken one raises MokError naming the argument, as the C++ API does. On the cuda backend a
call is asynchronous on the layer's stream (`cuda_stream`, a cudaStream_t handle such as
torch.cuda.current_stream().cuda_stream): keep the stream alive until the layer is closed
(closing waits on it). PyTorch CUDA tensors a call was given are marked as used on the
layer's stream (Tensor.record_stream, outside CUDA graph captures), so PyTorch's caching
allocator does not hand their memory out again, when the caller drops them, before the
queued work has run; other memory (a numpy array's, another allocator's) the caller keeps
until synchronize() or the stream's own ordering says the work is done. Without `cuda_stream` the layer runs on the
legacy default stream, which PyTorch's side streams (non-blocking) are not ordered with:
tensors written on one are read too early unless that stream is the layer's.

Under torch.compile, call layer.forward_op(ranks) (PyTorch tensors): the same forward as the
operator torch.ops.mok.forward, traced as one node that writes y, without a graph break.

Outputs (y, the gradients) are written in place, outside autograd: an output that requires
grad is refused, and so is any tensor whose memory holds other numbers than its values (a
sparse tensor, a lazily negated or conjugated view, a masked or misaligned numpy array). A written tensor's version
counter is bumped, so an autograd graph that saved it fails loudly instead of using stale
values. For the same reason forward() and forward_op() refuse, while autograd is on, an input
that requires grad (an nn.Parameter, say), as PyTorch refuses out= arguments: y would carry no
graph back to it, and its gradient would silently miss the layer's part. Call them under
torch.no_grad() (or pass .detach()); Layer.backward gives the gradients.

Calls on one Layer from several threads run one at a time (close() included).

The library is found at $MOK_LIBRARY, else in the package's directory (`pip install .` puts
it there; `pip install -e .` too, in site-packages), else in the repository's build
directories (build/lib, build-cuda/lib).
"""
import atexit
import copy
import ctypes
import gc
import itertools
import math
import operator
import os
import sys
import threading
import typing
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["MokError", "MokTypeError", "PeerWaitError", "Problem", "Layer", "cuda_available", "library_path", "shapes"]

ABI_VERSION = 4
_MAX_DIMS = 4
_MAX_SHARED = 8
_OK, _ERROR, _PEER_WAIT_ERROR = 0, 1, 4
_BF16, _F32, _I32, _I64 = 0, 1, 2, 3
_CPU, _CUDA = 0, 1
_BACKENDS = {"cpu": 0, "cuda": 1}
_EP_MODES = {"all_ranks": 0, "rank_slice": 1, "distributed": 2}
_PRECISIONS = {"bf16": 0, "mxfp8": 1}


class MokError(RuntimeError):
    """mok::Error: an argument broke a rule, or the layer failed (the message says which)."""


class MokTypeError(MokError, TypeError):
    """An argument of the wrong kind for the C interface (a dtype, a container, a layout): a
    MokError like every broken rule, and a TypeError."""


class PeerWaitError(MokError):
    """mok::PeerWaitError: a rank of a distributed group gave up waiting for its peers."""


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("device_index", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.c_int64 * _MAX_DIMS), ("strides", ctypes.c_int64 * _MAX_DIMS)]


class _Problem(ctypes.Structure):
    _fields_ = [("num_experts", ctypes.c_int32), ("hidden", ctypes.c_int32), ("intermediate", ctypes.c_int32),
                ("top_k", ctypes.c_int32), ("ep_size", ctypes.c_int32), ("tokens_per_rank", ctypes.c_int32),
                ("precision", ctypes.c_int32), ("num_shared", ctypes.c_int32),
                ("shared_intermediate", ctypes.c_int32 * _MAX_SHARED), ("has_swiglu_limit", ctypes.c_int32),
                ("swiglu_limit", ctypes.c_float)]


class _Config(ctypes.Structure):
    _fields_ = [("minibatch_rows", ctypes.c_int32), ("macrobatch_rows", ctypes.c_int32),
                ("schedule_capacity_factor", ctypes.c_double), ("forward_comm_sms", ctypes.c_int32),
                ("backward_comm_sms", ctypes.c_int32), ("tile_rows", ctypes.c_int32),
                ("task_band_tiles", ctypes.c_int32), ("task_pairs", ctypes.c_int32)]


class _Options(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int32), ("ep_mode", ctypes.c_int32), ("active_rank", ctypes.c_int32),
                ("cpu_threads", ctypes.c_int32), ("cuda_device", ctypes.c_int32), ("cuda_stream", ctypes.c_void_p)]


class _SharedWeights(ctypes.Structure):
    _fields_ = [("w_gate", _Tensor), ("w_up", _Tensor), ("w_down", _Tensor)]


_WEIGHT_FIELDS = [("x", _Tensor), ("top_experts", _Tensor), ("router_weights", _Tensor), ("w_gate", _Tensor),
                  ("w_up", _Tensor), ("w_down", _Tensor), ("num_shared", ctypes.c_int32),
                  ("shared", _SharedWeights * _MAX_SHARED)]


class _RankForward(ctypes.Structure):
    _fields_ = _WEIGHT_FIELDS + [("y", _Tensor)]


class _RankBackward(ctypes.Structure):
    _fields_ = _WEIGHT_FIELDS + [("dy", _Tensor), ("dx", _Tensor), ("d_router_weights", _Tensor),
                                 ("d_w_gate", _Tensor), ("d_w_up", _Tensor), ("d_w_down", _Tensor),
                                 ("d_shared", _SharedWeights * _MAX_SHARED)]


def library_path():
    """The libmok.so this module loads: $MOK_LIBRARY, else the one installed in the package's
    directory, else the first of the repository's build directories that holds one."""
    if os.environ.get("MOK_LIBRARY"):
        return os.environ["MOK_LIBRARY"]
    # (Every directory of the package: an editable install, pip install -e, keeps this module
    # in the checkout and the library in site-packages.)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tried = [os.path.join(os.path.abspath(d), "libmok.so") for d in __path__] + \
        [os.path.join(repo, d, "lib", "libmok.so") for d in ("build", "build-cuda")]
    for path in tried:
        if os.path.exists(path):
            return path
    raise MokError("libmok.so not found (tried " + ", ".join(tried) + "): pip install mok's checkout, build it "
                   "(scripts/setup.sh), or set MOK_LIBRARY to its path")


_lib_handle = None


def _lib():
    global _lib_handle
    if _lib_handle is None:
        path = library_path()
        lib = ctypes.CDLL(path)
        lib.mok_c_abi_version.restype = ctypes.c_int
        if lib.mok_c_abi_version() != ABI_VERSION:
            raise MokError(f"{path} has C ABI version {lib.mok_c_abi_version()}, this module speaks {ABI_VERSION}: "
                           "rebuild mok, or use the python/ directory of the same checkout")
        lib.mok_last_error.restype = ctypes.c_char_p
        lib.mok_layer_create.argtypes = [ctypes.POINTER(_Problem), ctypes.POINTER(_Config), ctypes.POINTER(_Options),
                                         ctypes.POINTER(ctypes.c_void_p)]
        lib.mok_layer_destroy.argtypes = [ctypes.c_void_p]
        lib.mok_layer_destroy.restype = None
        lib.mok_layer_destroy_after_error.argtypes = [ctypes.c_void_p]
        lib.mok_layer_destroy_after_error.restype = None
        lib.mok_layer_abandon_group.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.mok_layer_group_aborted.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
        lib.mok_layer_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(_RankForward), ctypes.c_int32]
        lib.mok_layer_backward.argtypes = [ctypes.c_void_p, ctypes.POINTER(_RankBackward), ctypes.c_int32]
        lib.mok_layer_synchronize.argtypes = [ctypes.c_void_p]
        lib.mok_layer_config.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Config)]
        lib.mok_layer_combine_slots.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(_Tensor)]
        lib.mok_shape_count.argtypes = []
        lib.mok_shape_count.restype = ctypes.c_int32
        lib.mok_shape_name.argtypes = [ctypes.c_int32]
        lib.mok_shape_name.restype = ctypes.c_char_p
        lib.mok_problem_from_shape.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32,
                                               ctypes.POINTER(_Problem)]
        lib.mok_default_config.argtypes = [ctypes.POINTER(_Config)]
        lib.mok_default_config.restype = None
        _lib_handle = lib
    return _lib_handle


def _check(status):
    if status == _OK:
        return
    message = _lib().mok_last_error().decode("utf-8", "replace")
    raise (PeerWaitError if status == _PEER_WAIT_ERROR else MokError)(message)


_INT32_MAX = 2**31 - 1


def _c_string(value, name):
    """`value` (a str) as the bytes of a C string; MokTypeError naming `name` for anything else
    (str() of None or of bytes would be sent as the text 'None' or "b'...'"), MokError when
    it holds a NUL character (C would end the string there and silently drop the rest)."""
    if not isinstance(value, str):
        raise MokTypeError(f"{name} = {value!r}: must be a str, got a {type(value).__name__}")
    text = value
    if "\0" in text:
        raise MokError(f"{name} = {text!r}: holds a NUL character, where the C interface would cut it short")
    try:
        return text.encode()
    except UnicodeEncodeError as exc:  # (a lone surrogate, say: no UTF-8 for it)
        raise MokError(f"{name} = {text!r}: is not valid UTF-8 text ({exc.reason} at index {exc.start})") from None


def _int32(value, name):
    """`value` (an int, or an integer scalar such as numpy's) as a C int32, or MokError naming
    `name` (ctypes would wrap it silently)."""
    try:
        if _is_bool(value):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise MokError(f"{name} = {value!r}: must be an int32") from None
    if not -2**31 <= value <= _INT32_MAX:
        raise MokError(f"{name} = {value!r}: must be an int32")
    return value


def cuda_available():
    """Whether the library has the cuda backend and a GPU it runs on (Hopper, sm_90)."""
    return bool(_lib().mok_cuda_available())


def version():
    """The library's version (CMake's project version, e.g. "0.1.0", also the pip package's)."""
    return _static_string(_lib().mok_version)


def build_commit():
    """The commit the library was built from: 12 hex digits, "-dirty" appended when tracked
    files differed from it, or "unknown" when built outside a git checkout."""
    return _static_string(_lib().mok_build_commit)


def _static_string(fn):
    """A C API function's static string. (Typed at the call: a libmok.so of the same ABI built
    before the function existed still loads, and only this call fails.)"""
    fn.restype = ctypes.c_char_p
    return fn().decode()


def shapes():
    """The named shapes' names (`mok shapes` lists them with their dimensions)."""
    count = _lib().mok_shape_count()
    names = [] if count < 0 else [_lib().mok_shape_name(i) for i in range(count)]
    if count < 0 or None in names:  # (listing them failed: the library's message says why)
        _check(_ERROR)
    return [name.decode() for name in names]


@dataclass
class Problem:
    """mok::Problem (include/mok/problem.h): what the layer computes."""
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    shared_intermediate: list = field(default_factory=list)
    ep_size: int = 1
    tokens_per_rank: int = 0
    precision: str = "bf16"
    swiglu_limit: float = None

    @classmethod
    def from_shape(cls, name, ep_size=0, tokens_per_rank=0):
        """A named shape (shapes()) at `ep_size` ranks of `tokens_per_rank` tokens (0: the
        shape's own, e.g. EP-64 and 2048 tokens for MoK's shapes)."""
        p = _Problem()
        _check(_lib().mok_problem_from_shape(_c_string(name, "name"), _int32(ep_size, "ep_size"),
                                             _int32(tokens_per_rank, "tokens_per_rank"), ctypes.byref(p)))
        precision = {v: k for k, v in _PRECISIONS.items()}[p.precision]
        return cls(p.num_experts, p.hidden, p.intermediate, p.top_k,
                   [p.shared_intermediate[s] for s in range(p.num_shared)], p.ep_size, p.tokens_per_rank, precision,
                   p.swiglu_limit if p.has_swiglu_limit else None)

    def _c(self):
        # (Ordered: a set's order is arbitrary, and the order pairs each width with its weights.)
        if isinstance(self.shared_intermediate, (str, bytes, Mapping, set, frozenset)) or \
                not hasattr(self.shared_intermediate, "__len__"):
            raise MokTypeError(f"Problem.shared_intermediate = {self.shared_intermediate!r}: a list of the shared "
                               "experts' widths (empty: none)")
        if len(self.shared_intermediate) > _MAX_SHARED:
            raise MokError(f"Problem.shared_intermediate: at most {_MAX_SHARED} shared experts through the C "
                           f"interface, got {len(self.shared_intermediate)}")
        if not isinstance(self.precision, str) or self.precision not in _PRECISIONS:
            raise MokError(f"Problem.precision = {self.precision!r}: must be one of {sorted(_PRECISIONS)}")
        dims = [_int32(getattr(self, f), f"Problem.{f}") for f in ("num_experts", "hidden", "intermediate",
                                                                    "top_k", "ep_size", "tokens_per_rank")]
        p = _Problem(*dims, _PRECISIONS[self.precision], len(self.shared_intermediate))
        for s, w in enumerate(self.shared_intermediate):
            p.shared_intermediate[s] = _int32(w, f"Problem.shared_intermediate[{s}]")
        if self.swiglu_limit is not None:
            try:
                if _is_bool(self.swiglu_limit) or isinstance(self.swiglu_limit, (str, bytes)):
                    raise TypeError
                limit = float(self.swiglu_limit)
            except (TypeError, ValueError, OverflowError):
                raise MokError(f"Problem.swiglu_limit = {self.swiglu_limit!r}: must be a number or None") from None
            as_f32 = ctypes.c_float(limit).value  # (the C interface's type: out of range would read as inf or 0)
            if (math.isinf(as_f32) and not math.isinf(limit)) or (as_f32 == 0 and limit != 0):
                raise MokError(f"Problem.swiglu_limit = {self.swiglu_limit!r}: outside float32's range (the layer "
                               "holds it as a float32)")
            p.has_swiglu_limit, p.swiglu_limit = 1, limit
        return p


def _is_bool(value):
    """Whether `value` is a Python bool or numpy's bool scalar (np.True_), without importing numpy."""
    np = sys.modules.get("numpy")
    return isinstance(value, bool) or (np is not None and isinstance(value, np.bool_))


def _refuse_nested_or_elsewhere(a, name):
    """Refuses, naming it, a torch tensor mok cannot view: a nested one (its sizes are no
    strided tensor's) or one off cpu and cuda (a meta tensor has no memory at all)."""
    if a.is_nested:
        raise MokTypeError(f"{name}: a nested tensor; mok takes dense (strided) tensors")
    if a.device.type not in ("cuda", "cpu"):
        raise MokTypeError(f"{name}: tensors on {a.device} are not supported (cpu or cuda)")


def _numpy_array(a):
    """Whether `a` is a numpy array (a subclass's included), without importing numpy."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(a, np.ndarray)


def _tensor(a, name, output=False):
    """A _Tensor viewing `a` (numpy array or torch tensor; None: none), without a copy.
    `output`: the layer writes it, so a read-only array is refused."""
    t = _Tensor()
    if a is None:
        return t
    torch = sys.modules.get("torch")
    if _numpy_array(a):
        import numpy as np
        kinds = {np.dtype(np.uint16): _BF16, np.dtype(np.float32): _F32, np.dtype(np.int32): _I32,
                 np.dtype(np.int64): _I64}
        if a.dtype not in kinds:
            raise MokTypeError(f"{name}: numpy dtype {a.dtype} is not one mok takes (uint16 bf16 bit patterns, "
                               "float32, int32, int64)")
        if isinstance(a, np.ma.MaskedArray):
            raise MokTypeError(f"{name}: a masked array, whose mask the layer would ignore; pass a plain array "
                               "(np.ma.filled(a, value), or a.data to use the masked entries as they are)")
        if any(s % a.itemsize for s in a.strides):
            raise MokTypeError(f"{name}: strides {a.strides} are not whole elements")
        if not a.flags.aligned:
            raise MokError(f"{name}: the data is not aligned to its {a.itemsize}-byte elements (np.frombuffer with "
                           "an odd offset, say); pass an aligned copy (a.copy())")
        if output and not a.flags.writeable:
            raise MokError(f"{name}: the layer writes this output, and the array is read-only")
        t.data, t.dtype, t.device = a.ctypes.data, kinds[a.dtype], _CPU
        shape, strides = a.shape, [s // a.itemsize for s in a.strides]
    elif torch is not None and isinstance(a, torch.Tensor):  # (a subclass's too)
        kinds = {torch.bfloat16: _BF16, torch.float32: _F32, torch.int32: _I32, torch.int64: _I64}
        if a.dtype not in kinds:
            raise MokTypeError(f"{name}: torch dtype {a.dtype} is not one mok takes (bfloat16, float32, int32, "
                               "int64)")
        if a.layout != torch.strided:
            raise MokTypeError(f"{name}: a {a.layout} tensor; mok takes dense (strided) tensors (.to_dense())")
        _refuse_nested_or_elsewhere(a, name)  # (before the pointer: a meta tensor has none)
        if a.is_neg() or a.is_conj():
            raise MokError(f"{name}: a lazily negated or conjugated view, whose memory holds other numbers; pass "
                           ".resolve_neg() / .resolve_conj() of it")
        if output and a.requires_grad:
            raise MokError(f"{name}: the layer writes this output in place, outside autograd, and it requires "
                           "grad (its gradient would be wrong); pass a tensor that does not (torch.empty, or "
                           ".detach() of it)")
        try:
            a.data_ptr()
        except RuntimeError as exc:  # (a tensor without storage: inside torch.func's vmap or grad, say)
            raise MokTypeError(f"{name}: its memory cannot be read ({exc}); mok takes plain tensors, not the "
                               "wrappers of torch.func transforms (vmap, grad)") from None
        if a.data_ptr() == 0:  # (torch gives an empty tensor no memory: it would read as "missing")
            raise MokError(f"{name}: an empty tensor (shape {list(a.shape)}); no tensor of the layer is empty")
        if a.data_ptr() % a.element_size():
            raise MokError(f"{name}: the data is not aligned to its {a.element_size()}-byte elements "
                           "(torch.frombuffer with an odd offset, say); pass an aligned copy (.clone())")
        t.data, t.dtype = a.data_ptr(), kinds[a.dtype]
        if a.device.type == "cuda":
            t.device, t.device_index = _CUDA, a.device.index or 0
        else:  # (cpu: _refuse_nested_or_elsewhere has refused the rest)
            t.device = _CPU
        shape, strides = tuple(a.shape), a.stride()
    else:
        raise MokTypeError(f"{name}: a {type(a).__name__} is not a numpy array or torch tensor")
    if len(shape) > _MAX_DIMS:
        raise MokTypeError(f"{name}: {len(shape)} dimensions, at most {_MAX_DIMS}")
    t.ndim = len(shape)
    for d, (n, s) in enumerate(zip(shape, strides)):
        t.shape[d], t.strides[d] = n, s
    return t


def _shared_triple(entry):
    """A shared expert's (w_gate, w_up, w_down), given as a triple or a dict of those keys."""
    return (entry["w_gate"], entry["w_up"], entry["w_down"]) if isinstance(entry, Mapping) else tuple(entry)


def _shared_list(entries, name):
    """A list of shared experts, each as a (w_gate, w_up, w_down) tuple, from a list (or any
    iterable) of triples or dicts. Made once per call and kept by the caller until the C call
    returns: entries made on the fly (a generator) must outlive the raw pointers taken from
    them, and be read the same way twice (the call, then autograd)."""
    if entries is None:
        return []
    if isinstance(entries, Mapping) or not hasattr(entries, "__iter__"):
        raise MokTypeError(f"{name}: a list of shared experts, each a (w_gate, w_up, w_down) triple or a dict of "
                           f"those keys; got a {type(entries).__name__}")
    out = []
    for s, entry in enumerate(entries):
        if not isinstance(entry, Mapping) and not hasattr(entry, "__iter__"):
            raise MokTypeError(f"{name}[{s}]: a (w_gate, w_up, w_down) triple or a dict of those keys, got a "
                               f"{type(entry).__name__}")
        if isinstance(entry, Mapping):
            unknown = set(entry) - {"w_gate", "w_up", "w_down"}
            if unknown:
                # (Refused, not dropped: a misspelt key would leave its tensor unused.)
                raise MokError(f"{name}[{s}]: unknown key(s) {sorted(unknown, key=repr)}; the keys are "
                               "w_gate, w_up, w_down")
        try:
            triple = _shared_triple(entry)
        except KeyError as exc:
            raise MokError(f"{name}[{s}]: no {exc.args[0]!r} (the keys are w_gate, w_up, w_down)") from None
        if len(triple) != 3:
            raise MokError(f"{name}[{s}]: {len(triple)} tensors, a shared expert has 3 (w_gate, w_up, w_down)")
        out.append(triple)
    return out


def _shared(entries, name, output=False):
    """_shared_list's (w_gate, w_up, w_down) tuples (None: none) -> (count, ctypes array)."""
    entries = entries or []
    if len(entries) > _MAX_SHARED:
        raise MokError(f"{name}: at most {_MAX_SHARED} shared experts through the C interface")
    out = (_SharedWeights * _MAX_SHARED)()
    for s, (g, u, d) in enumerate(entries):
        n = f"{name}[{s}]"
        out[s] = _SharedWeights(_tensor(g, n + ".w_gate", output), _tensor(u, n + ".w_up", output),
                                _tensor(d, n + ".w_down", output))
    return len(entries), out


_FORWARD_KEYS = {"x", "top_experts", "router_weights", "w_gate", "w_up", "w_down", "shared", "y"}
_BACKWARD_KEYS = (_FORWARD_KEYS - {"y"}) | {"dy", "dx", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down",
                                             "d_shared"}


_GRADIENT_KEYS = ("dx", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down")


def _written(tensors):
    """Tells PyTorch's autograd that the layer wrote these tensors in place, as an in-place op
    would: a tensor an earlier op saved for its backward then fails that backward ("modified by
    an inplace operation") instead of giving wrong gradients. numpy arrays, None and inference
    tensors (no version counter) are passed over."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_inference():
            torch.autograd.graph.increment_version(t)


def _named_values(rank, keys):
    """(name, value) of `rank`'s (a _rank_dicts dict) entries `keys`, then of its shared experts'
    tensors ("shared[s].w_up"), None included."""
    names = ("w_gate", "w_up", "w_down")
    return [(key, rank.get(key)) for key in keys] + \
        [(f"shared[{s}].{names[i]}", w) for s, triple in enumerate(rank.get("shared") or [])
         for i, w in enumerate(triple)]


def _refuse_inputs_that_require_grad(rank, n, call):
    """MokError naming the first input of `rank` (a _rank_dicts dict, named `n`) that requires
    grad while autograd is on: `call` writes y outside autograd, so no gradient would flow back
    to it through the layer, and nothing would say so (torch refuses out= arguments alike)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return
    for key, value in _named_values(rank, _OP_INPUT_KEYS):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise MokError(f"{n}.{key}: requires grad while autograd is on, and {call} runs outside autograd: "
                           "no gradient would reach it through the layer (PyTorch refuses out= arguments the "
                           "same way); call it under torch.no_grad() or pass .detach() (the gradients: "
                           "Layer.backward, on the cpu backend for now, inside a torch.autograd.Function say)")


def _fill_common(c, rank, n):
    for key in ("x", "top_experts", "router_weights", "w_gate", "w_up", "w_down"):
        setattr(c, key, _tensor(rank.get(key), f"{n}.{key}"))
    c.num_shared, c.shared = _shared(rank.get("shared"), n + ".shared")


def _rank_dicts(ranks, keys, num_shared=None):
    """`ranks` as a list of dicts (a fresh one each) whose keys are all among `keys`, their
    shared experts as lists of (w_gate, w_up, w_down) tuples (_shared_list), each list empty or
    of `num_shared` entries (the layer's problem's count; None: not checked); else MokError
    naming the rank and key."""
    if isinstance(ranks, Mapping) or not hasattr(ranks, "__iter__"):
        raise MokTypeError(f"ranks: a list of dicts, one per rank held here; got a {type(ranks).__name__}")
    ranks = list(ranks)
    for r, rank in enumerate(ranks):
        if not isinstance(rank, Mapping):
            raise MokTypeError(f"ranks[{r}]: a dict of the rank's tensors, got a {type(rank).__name__}")
        unknown = set(rank) - keys
        if unknown:
            # (key=repr: keys of mixed types, 0 beside "x", cannot be compared)
            raise MokError(f"ranks[{r}]: unknown key(s) {sorted(unknown, key=repr)}; the keys are {sorted(keys)}")
    # (Shared experts as lists of tuples, kept with the rank: see _shared_list. Written plainly,
    # without dict(rank, **...), which torch.compile before 2.6 cannot trace.)
    out = []
    for r, rank in enumerate(ranks):
        fresh = dict(rank)
        for key in ("shared", "d_shared"):
            if rank.get(key) is not None:
                fresh[key] = _shared_list(rank[key], f"ranks[{r}].{key}")
                # (Empty is as if left out: the layer names the missing tensors. Checked here,
                # by the Python names, before the C interface's limit or forward_op's lists.)
                if num_shared is not None and len(fresh[key]) not in (0, num_shared):
                    raise MokError(f"ranks[{r}].{key}: {len(fresh[key])} shared expert(s), the layer's problem has "
                                   f"{num_shared} (Problem.shared_intermediate)")
        out.append(fresh)
    return out


def _ranks(ranks, struct, keys, fill, num_shared):
    """The ctypes array for `ranks`, and the list of rank dicts, which the caller keeps until
    the C call returns: the array holds raw pointers only (tensors made on the fly, in a
    generator say, live as long as that list). That is long enough on the cpu backend only: a
    cuda call returns with its work queued: Layer._used_on_stream marks PyTorch's tensors as
    used there (the module's notes)."""
    ranks = _rank_dicts(ranks, keys, num_shared)
    array = (struct * max(1, len(ranks)))()
    for r, rank in enumerate(ranks):
        n = f"ranks[{r}]"
        _fill_common(array[r], rank, n)
        fill(array[r], rank, n, r)
    return array, len(ranks), ranks


# CUDA layers closed, or whose last holder went, while this thread's current stream was
# capturing a CUDA graph through PyTorch: a destroy then (cudaFree, NCCL) would break the
# capture, so they wait here for the next call on any Layer, or the interpreter's exit.
# (handle, distributed, after_error) triples.
# What this cannot see: a capture on another thread or stream (PyTorch's default "global"
# capture mode forbids a cudaFree from any thread), or one not made through PyTorch; drop
# views and close layers outside captures.
_parked = []


def _capturing():
    try:
        torch = sys.modules.get("torch")
        # (is_initialized: a capture through torch implies it; asking is_available() would
        # initialise the driver in a process that never used CUDA.)
        return torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    except Exception:  # (a torch too old or too broken to say: not capturing through it)
        return False


def _destroy(handle, distributed, after_error):
    lib = _lib()
    if distributed and after_error is None:
        # Garbage collection picks no moment a group's peers agree on: abandon it, so the
        # destroy waits for no peer, and say why. Its queued forwards read the peers' memory,
        # which the abort unmaps: let them finish first (within the group's wait limits; a
        # failure there is the layer's last, and nobody is left to tell).
        lib.mok_layer_synchronize(handle)
        lib.mok_layer_abandon_group(handle, b"the Python Layer was garbage-collected without close()")
        after_error = True
    (lib.mok_layer_destroy_after_error if after_error else lib.mok_layer_destroy)(handle)


def _drain_parked():
    while _parked and not _capturing():
        try:
            handle, distributed, after_error = _parked.pop()
        except IndexError:  # (another thread took the last one)
            break
        _destroy(handle, distributed, after_error)


atexit.register(_drain_parked)


# ---- the forward as a PyTorch operator (Layer.forward_op) -----------------------------------
# torch.ops.mok.forward: an opaque operator that writes its y tensors, so that torch.compile
# traces a model calling the layer as one node (fullgraph too) instead of breaking its graph
# at the ctypes call. Its arguments are tensors and ints only: the layer travels as an id into
# _op_layers, and the rank dicts as one flat list of the tensors present plus their places.
_OP_INPUT_KEYS = ("x", "top_experts", "router_weights", "w_gate", "w_up", "w_down")
_op_layers = weakref.WeakValueDictionary()  # Layer._op_id -> Layer (closed and dropped: gone)
_op_ids = itertools.count(1)
_torch_ops = None  # torch.ops, once mok::forward is registered
_register_lock = threading.Lock()  # (two threads' first forward_op must not both register it)


def _register_forward_op():
    """Registers torch.ops.mok.forward (once per process; torch must be importable)."""
    global _torch_ops
    with _register_lock:
        if _torch_ops is None:
            _torch_ops = _define_forward_op()


def _define_forward_op():
    import torch
    import inspect

    # The layer runs on its own stream, which a CUDA graph that torch.compile records on its
    # own (mode="reduce-overhead") does not capture: the replays would leave y as it was.
    # Tagged cudagraph_unsafe, the operator runs outside those graphs (PyTorch >= 2.8 knows
    # the tag; an older one skips graphs that write their inputs, as this one does).
    extra = {}
    if hasattr(torch.Tag, "cudagraph_unsafe") and "tags" in inspect.signature(torch.library.custom_op).parameters:
        extra["tags"] = (torch.Tag.cudagraph_unsafe,)

    # (typing.List, not list[...]: torch's schema inference reads the builtin form only from 2.7 on.)
    @torch.library.custom_op("mok::forward", mutates_args=("y",), **extra)
    def forward(layer_id: int, inputs: typing.List[torch.Tensor], places: typing.List[int],
                y: typing.List[torch.Tensor]) -> None:
        layer = _op_layers.get(layer_id)
        if layer is None:
            raise MokError(f"torch.ops.mok.forward: layer {layer_id} was closed or dropped")
        layer.forward(_op_ranks(inputs, places, y))

    @forward.register_fake
    def _(layer_id, inputs, places, y):  # (what tracing sees: y written in place, nothing returned)
        return None

    return torch.ops


def _op_places(ranks):
    """The flat argument lists of torch.ops.mok.forward for `ranks` (dicts of tensors): the
    inputs present, in rank order; their places: the rank count, then per rank its number of
    inputs, its number of shared experts, a (key, shared index) pair for each input (key 6 + i:
    a shared expert's i-th tensor) and 1 if it has a y, else 0; and the y tensors present. (The
    shared count travels: a shared expert given with no tensor at all is forward()'s to name,
    not the operator's to drop.)"""
    inputs, places, y = [], [len(ranks)], []
    for rank in ranks:
        pairs = []
        for k, key in enumerate(_OP_INPUT_KEYS):
            if rank.get(key) is not None:
                inputs.append(rank[key])
                pairs += [k, 0]
        for s, triple in enumerate(rank.get("shared") or []):
            for i, w in enumerate(triple):
                if w is not None:  # (a missing one is forward()'s to name, when the operator runs)
                    inputs.append(w)
                    pairs += [len(_OP_INPUT_KEYS) + i, s]
        places += [len(pairs) // 2, len(rank.get("shared") or [])] + pairs + [int(rank.get("y") is not None)]
        if rank.get("y") is not None:
            y.append(rank["y"])
    return inputs, places, y


def _op_tensors_only(ranks):
    """Refuses, naming it, a value of `ranks` (_rank_dicts' dicts) that is not a PyTorch
    tensor: the operator's schema takes tensors alone, and torch's own error would not say which."""
    import torch
    for r, rank in enumerate(ranks):
        for key, value in _named_values(rank, _OP_INPUT_KEYS + ("y",)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise MokTypeError(f"ranks[{r}].{key}: forward_op takes PyTorch tensors, got a "
                                   f"{type(value).__name__} (forward() takes numpy arrays too)")
            # (A meta tensor sends the call to the operator's fake kernel, which checks and
            # writes nothing: refused here, as forward() refuses it.)
            if value is not None:
                _refuse_nested_or_elsewhere(value, f"ranks[{r}].{key}")


def _op_ranks(inputs, places, y):
    """The rank dicts back from _op_places' lists. torch.ops.mok.forward is public, so they are
    checked whole: a list that _op_places could not have made is a MokError naming where, never
    an IndexError, a huge allocation or a tensor left unused."""
    def bad(why):
        return MokError(f"torch.ops.mok.forward: places {list(places)[:16]}{'...' if len(places) > 16 else ''} "
                        f"({len(inputs)} inputs, {len(y)} y): {why} (Layer.forward_op makes these lists)")

    def take(pos, what, lo, hi):
        if pos >= len(places):
            raise bad(f"ends where {what} should be (entry {pos})")
        if not lo <= places[pos] <= hi:
            raise bad(f"entry {pos}, {what}, is {places[pos]}: must be in [{lo}, {hi}]")
        return places[pos]

    n_keys = len(_OP_INPUT_KEYS)
    ranks, pos, used_inputs, used_y = [], 1, 0, 0
    for r in range(take(0, "the rank count", 1, max(1, (len(places) - 1) // 3))):  # (a rank: 3 entries at least)
        rank, shared = {}, []
        count = take(pos, f"rank {r}'s input count", 0, len(inputs) - used_inputs)
        n_shared = take(pos + 1, f"rank {r}'s shared expert count", 0, _MAX_SHARED)
        shared = [[None] * 3 for _ in range(n_shared)]
        pos += 2
        for _ in range(count):
            key = take(pos, f"rank {r}'s input key", 0, n_keys + 2 if n_shared else n_keys - 1)
            s = take(pos + 1, f"rank {r}'s shared index", 0, n_shared - 1 if key >= n_keys else 0)
            pos += 2
            tensor, used_inputs = inputs[used_inputs], used_inputs + 1
            if key < n_keys:
                if _OP_INPUT_KEYS[key] in rank:
                    raise bad(f"rank {r} names {_OP_INPUT_KEYS[key]} twice")
                rank[_OP_INPUT_KEYS[key]] = tensor
            else:
                if shared[s][key - n_keys] is not None:
                    raise bad(f"rank {r} names shared[{s}][{key - n_keys}] twice")
                shared[s][key - n_keys] = tensor
        if shared:
            rank["shared"] = [tuple(triple) for triple in shared]
        if take(pos, f"rank {r}'s y flag", 0, 1 if used_y < len(y) else 0):
            rank["y"], used_y = y[used_y], used_y + 1
        ranks.append(rank)
        pos += 1
    if pos != len(places) or used_inputs != len(inputs) or used_y != len(y):
        raise bad(f"{len(places) - pos} entries, {len(inputs) - used_inputs} inputs and {len(y) - used_y} y "
                  "left over")
    return ranks


class _Native:
    """The C layer. Layer.close() destroys it at once, or, while combine_slots views still point
    into its memory (cuda backend), leaves that to the end of the last of them: each view holds
    this object, and its __del__ destroys the layer (later, if a CUDA graph is being captured
    then: _parked).

    A view holds this object only, not its Layer, so that a view kept on the Layer (a cycle
    through torch's storage, which the garbage collector cannot see) does not keep both."""

    def __init__(self, handle, distributed, cuda):
        self.handle = handle
        self.distributed = distributed
        self.cuda = cuda
        self.views = weakref.WeakSet()  # the combine_slots views alive

    def aborted(self):
        flag = ctypes.c_int32()
        _check(_lib().mok_layer_group_aborted(self.handle, ctypes.byref(flag)))
        return bool(flag.value)

    def destroy(self, after_error):
        """Destroys the layer now, or, inside a CUDA graph capture on this thread's stream,
        parks it (_parked) for the next call or the interpreter's exit."""
        if self.handle:
            handle, self.handle = self.handle, None
            if self.cuda and _capturing():
                _parked.append((handle, self.distributed, after_error))
            else:
                _destroy(handle, self.distributed, after_error)

    def __del__(self):
        # Reached when nothing holds the layer any more: after a close() that left it to its
        # views, or when a Layer is garbage-collected.
        try:
            self.destroy(after_error=None)
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class Layer:
    """mok::Layer (include/mok/layer.h). `config`: a dict of mok::Config fields to change
    from the library's defaults (0 where the library chooses)."""

    def __init__(self, problem, backend="cpu", ep_mode="all_ranks", active_rank=0, cpu_threads=0,
                 cuda_device=0, cuda_stream=None, config=None):
        # Calls from several threads run one at a time, close() included (the library
        # serialises calls on one layer too, but not a destroy racing a call).
        self._lock = threading.RLock()
        self._native = None
        lib = _lib()
        if not isinstance(problem, Problem):
            raise MokTypeError(f"problem: a mok.Problem, got a {type(problem).__name__}")
        if cuda_stream is not None and (isinstance(cuda_stream, bool) or not isinstance(cuda_stream, int)):
            raise MokTypeError(f"cuda_stream = {cuda_stream!r}: a cudaStream_t handle as an int (e.g. "
                               "torch.cuda.current_stream().cuda_stream) or None")
        if cuda_stream is not None and not 0 <= cuda_stream < 2**(8 * ctypes.sizeof(ctypes.c_void_p)):
            raise MokError(f"cuda_stream = {cuda_stream!r}: a cudaStream_t handle is an address, in [0, "
                           f"2**{8 * ctypes.sizeof(ctypes.c_void_p)}) (0 or None: the default stream)")
        if not isinstance(backend, str) or backend not in _BACKENDS:
            raise MokError(f"backend = {backend!r}: must be one of {sorted(_BACKENDS)}")
        if not isinstance(ep_mode, str) or ep_mode not in _EP_MODES:
            raise MokError(f"ep_mode = {ep_mode!r}: must be one of {sorted(_EP_MODES)}")
        if config is not None and not isinstance(config, Mapping):
            raise MokTypeError(f"config: a dict of mok::Config fields ({[f for f, _ in _Config._fields_]}), got a "
                               f"{type(config).__name__}")
        c = _Config()
        lib.mok_default_config(ctypes.byref(c))
        for key, value in (config or {}).items():
            kind = dict(_Config._fields_).get(key)
            if kind is None:
                raise MokError(f"config.{key}: not a mok::Config field ({[f for f, _ in _Config._fields_]})")
            if key == "task_pairs" and _is_bool(value):
                value = int(value)  # (a switch: True/False as well as 1/0, numpy's np.True_ too)
            if kind is ctypes.c_int32:
                value = _int32(value, f"config.{key}")
            else:
                try:
                    if _is_bool(value) or isinstance(value, (str, bytes)):  # (as the int fields, swiglu_limit)
                        raise TypeError
                    value = float(value)
                except (TypeError, ValueError, OverflowError):
                    raise MokError(f"config.{key} = {value!r}: must be a number") from None
            setattr(c, key, value)
        options = _Options(_BACKENDS[backend], _EP_MODES[ep_mode], _int32(active_rank, "active_rank"),
                           _int32(cpu_threads, "cpu_threads"), _int32(cuda_device, "cuda_device"), cuda_stream)
        problem_c = problem._c()  # (first: it names a bad field, which a copy of it would fail on unnamed)
        self._problem = copy.deepcopy(problem)  # (the caller's object may change; the layer's does not)
        self._cuda_stream = cuda_stream  # (None or 0: the legacy default stream)
        self._ep_mode, self._active_rank = ep_mode, active_rank
        _drain_parked()
        handle = ctypes.c_void_p()
        _check(lib.mok_layer_create(ctypes.byref(problem_c), ctypes.byref(c), ctypes.byref(options),
                                    ctypes.byref(handle)))
        self._native = _Native(handle, distributed=ep_mode == "distributed", cuda=backend == "cuda")
        self._op_id = next(_op_ids)  # (forward_op's handle on this layer)
        _op_layers[self._op_id] = self
        # The operator is registered now where PyTorch is loaded: a first forward_op inside
        # torch.compile(fullgraph=True) could not register it (dynamo does not trace the lock).
        # (A PyTorch without torch.library.custom_op, before 2.4, fails here: forward() does not
        # need the operator, so that failure is left to forward_op(), which raises it.)
        if "torch" in sys.modules:
            try:
                _register_forward_op()
            except Exception:
                pass

    def _num_shared(self):
        return len(self._problem.shared_intermediate)

    def _live(self):
        _drain_parked()
        if self._native is None:
            raise MokError("Layer: used after close()")
        return self._native.handle

    def forward(self, ranks):
        """mok::Layer::forward: one dict per rank held here (keys: x, top_experts,
        router_weights, w_gate, w_up, w_down, shared = [(w_gate, w_up, w_down), ...], y)."""
        with self._lock:
            def fill(c, rank, name, r):
                # (In a rank slice the other ranks' y, if given, is neither checked nor written,
                # so it is not refused as an output: read-only, say.)
                written = self._ep_mode != "rank_slice" or r == self._active_rank
                c.y = _tensor(rank.get("y"), name + ".y", written)
                _refuse_inputs_that_require_grad(rank, name, "forward()")
            array, n, kept = _ranks(ranks, _RankForward, _FORWARD_KEYS, fill, self._num_shared())
            _check(_lib().mok_layer_forward(self._live(), array, n))
            self._used_on_stream(kept)
            _written(rank.get("y") for rank in self._written_ranks(kept))

    def forward_op(self, ranks):
        """forward() through the PyTorch operator torch.ops.mok.forward, for PyTorch tensors:
        torch.compile traces it as one node that writes y (fullgraph=True too), where
        forward()'s ctypes call breaks the graph. The checks and errors are forward()'s, raised
        when the operator runs. Forward only: the operator has no autograd formula. (The
        operator is registered when a Layer is made with PyTorch loaded, else by the first
        forward_op, which must then run outside torch.compile. Under fullgraph=True an error
        raised while tracing, an input that requires grad say, reaches the caller as dynamo's
        Unsupported, with mok's message in its text.)"""
        if _torch_ops is None:
            _register_forward_op()
        # (forward()'s checks of the containers and keys first: the operator's arguments carry
        # only the tensors, so an unknown key would otherwise be dropped without a word.)
        ranks = _rank_dicts(ranks, _FORWARD_KEYS, self._num_shared())
        _op_tensors_only(ranks)
        # (Here, not in the operator: autograd runs an operator's body with grad mode off.)
        for r, rank in enumerate(ranks):
            _refuse_inputs_that_require_grad(rank, f"ranks[{r}]", "forward_op()")
        inputs, places, y = _op_places(ranks)
        _torch_ops.mok.forward(self._op_id, inputs, places, y)

    def backward(self, ranks):
        """mok::Layer::backward: the forward's keys but y, and dy in; dx, d_router_weights,
        d_w_gate, d_w_up, d_w_down, d_shared = [(d_w_gate, d_w_up, d_w_down), ...] out."""
        with self._lock:
            def fill(c, rank, name, r):
                c.dy = _tensor(rank.get("dy"), name + ".dy")
                for key in _GRADIENT_KEYS:
                    setattr(c, key, _tensor(rank.get(key), f"{name}.{key}", True))
                # (Its count, empty or the problem's, checked by _rank_dicts; empty: the layer
                # names the missing gradients.)
                _, c.d_shared = _shared(rank.get("d_shared"), name + ".d_shared", True)
            array, n, kept = _ranks(ranks, _RankBackward, _BACKWARD_KEYS, fill, self._num_shared())
            _check(_lib().mok_layer_backward(self._live(), array, n))
            self._used_on_stream(kept)
            _written(t for rank in self._written_ranks(kept) for t in [rank.get(key) for key in _GRADIENT_KEYS] +
                     [w for entry in (rank.get("d_shared") or []) for w in entry])

    def _used_on_stream(self, kept):
        """Marks every PyTorch CUDA tensor of the call's rank dicts as used on the layer's
        stream (Tensor.record_stream), so that the caching allocator reuses none of them, once
        the caller drops it, before the work queued there by now has run: a tensor made on the
        fly (`x.bfloat16()`) on another stream would otherwise be handed out again at once.
        Not inside a CUDA graph capture (the graph's memory pool keeps its tensors), nor on the
        cpu backend."""
        torch = sys.modules.get("torch")
        if torch is None or not self._native.cuda or _capturing():
            return
        stream = None
        for rank in kept:
            for value in rank.values():
                for t in (w for entry in value for w in entry) if isinstance(value, list) else (value,):
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        if stream is None:
                            stream = (torch.cuda.ExternalStream(self._cuda_stream, device=t.device)
                                      if self._cuda_stream else torch.cuda.default_stream(t.device))
                        t.record_stream(stream)

    def _written_ranks(self, kept):
        """The rank dicts whose outputs a call wrote: all, but in a rank slice only the active
        rank's (the others' outputs, if given, are left alone)."""
        return [rank for r, rank in enumerate(kept) if self._ep_mode != "rank_slice" or r == self._active_rank]

    def synchronize(self):
        """Waits for the layer's device work and raises what failed there (no-op on the CPU)."""
        with self._lock:
            _check(_lib().mok_layer_synchronize(self._live()))

    def abandon_group(self, why=None):
        """mok::Layer::abandon_group: a distributed layer's rank gives up on its group, waiting
        for no peer (its communicator is aborted; later calls raise saying why; closing it waits
        for no peer). A call in progress on another thread finishes first (calls run one at a
        time): it cannot interrupt one. Without a group (other modes, the cpu backend) nothing
        changes."""
        with self._lock:
            _check(_lib().mok_layer_abandon_group(self._live(), None if why is None else _c_string(why, "why")))

    @property
    def problem(self):
        """The Problem the layer was built with (a copy: changing it changes nothing)."""
        return copy.deepcopy(self._problem)

    @property
    def group_aborted(self):
        """mok::Layer::group_aborted: whether this distributed layer's communicator was aborted
        (abandon_group, a failed call), so that closing it waits for no peer; False without a group."""
        with self._lock:
            self._live()
            return self._native.aborted()

    def combine_slots(self, rank):
        """mok::Layer::combine_slots: rank `rank`'s combine slots, bf16 [T*k, H]. On the cuda backend
        a torch.bfloat16 CUDA tensor viewing the layer's memory: in a rank slice, the rows other
        ranks would push to the active rank are written here before its forward. Its memory
        outlives close() and the Layer object: the layer is destroyed once the last view is
        gone. On the cpu backend a numpy uint16 copy of the last forward's slots."""
        with self._lock:
            t = _Tensor()
            _check(_lib().mok_layer_combine_slots(self._live(), _int32(rank, "rank"), ctypes.byref(t)))
            shape = tuple(t.shape[d] for d in range(t.ndim))
            n = 1
            for d in shape:
                n *= d
            if t.device == _CPU:  # (a copy: a numpy view could not keep the layer's memory alive)
                import numpy as np
                slots = np.frombuffer((ctypes.c_uint16 * n).from_address(t.data), dtype=np.uint16)
                return slots.reshape(shape).copy()
            import torch

            class _CudaView:  # __cuda_array_interface__ (v3) over the layer's device memory
                def __init__(self, native):
                    # (torch holds this object as long as the tensor's storage lives.)
                    self.native = native
                    self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i2", "data": (t.data, False),
                                                     "version": 3, "strides": None}
            view = _CudaView(self._native)
            self._native.views.add(view)
            return torch.as_tensor(view, device=f"cuda:{t.device_index}").view(torch.bfloat16)

    @property
    def config(self):
        """The mok::Config the layer runs with (the library's choices filled in), as a dict."""
        with self._lock:
            c = _Config()
            _check(_lib().mok_layer_config(self._live(), ctypes.byref(c)))
            return {name: getattr(c, name) for name, _ in _Config._fields_}

    def close(self, after_error=False):
        """Ends the layer's use and destroys it. In a distributed group this is collective (it
        waits for the peers), as in C++; `after_error` aborts the group's communicator instead,
        as C++ does for a Layer destroyed while an exception propagates (leaving a `with` block
        on an exception does that). While combine_slots views are alive their memory stays, and
        the last of them destroys the layer. A distributed layer's collective destroy cannot
        wait for them: closing one whose group is not aborted (abandon_group, an earlier
        failure) then raises and leaves it open, unless `after_error` abandons the group
        (views that nothing uses any more, say in a reference cycle, are collected first)."""
        with self._lock:
            _drain_parked()
            native = self._native
            if native is None:
                return
            views = len(native.views)
            collective = native.distributed and not native.aborted()
            if views and collective and not after_error:
                # A view dropped inside a reference cycle stays in the WeakSet until the
                # collector runs; collect once so that only views still in use refuse.
                gc.collect()
                views = len(native.views)
            if views and collective and not after_error:
                raise MokError(f"close(): {views} combine_slots view(s) of this distributed layer are alive, and "
                               "its destroy is collective (it happens now, on every rank): delete them first, or "
                               "close(after_error=True), which abandons the group")
            self._native = None
            if views:
                # (Abandoned first, the destroy the views leave to their end waits for no peer.)
                if collective:
                    _check(_lib().mok_layer_abandon_group(native.handle, b"closed after an error"))
                return
            native.destroy(after_error)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        self.close(after_error=exc_type is not None)
