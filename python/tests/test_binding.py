"""python/mok on the CPU backend with numpy arrays: the layer through libmok.so's C interface
against a numpy model of the layer (MISSION.md, "The layer, exactly"), with MoK's bars stated
up front: forward max-abs <= 0.5 and sum|diff|/sum|ref| <= 0.01 (BF16), NaN never passing;
backward gradients' cosine >= 0.9999. Also: bitwise determinism, and errors that name the
argument.

    MOK_LIBRARY=build/lib/libmok.so python3 -m unittest discover -s python/tests

Every run draws fresh random inputs from one seed, printed when the module loads and added to
every failing test's error: MOK_TEST_SEED=<that number> reruns those inputs (as for the C++
tests, tests/gpu/gpu_util.h's test_seed()).

With MOK_TEST_INSTALLED=1 the `mok` under test is the one installed in this Python (pip
install ., tests/install_python.sh) and its own libmok.so, not this checkout's python/.
"""
import functools
import os
import re
import secrets
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# scripts/host_sanitizers.sh runs these tests with libasan preloaded.
UNDER_ASAN = "asan" in os.environ.get("LD_PRELOAD", "")
TEST_INSTALLED = os.environ.get("MOK_TEST_INSTALLED") == "1"
if not TEST_INSTALLED:
    sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))  # MoK's bars and the bf16 helpers, shared
import checks  # noqa: E402
import mok  # noqa: E402
import workdir  # noqa: E402

if TEST_INSTALLED:  # (else a checkout's module or library could pass for the installed ones)
    _package = os.path.dirname(os.path.abspath(mok.__file__))
    if os.path.commonpath([_package, os.path.dirname(HERE)]) == os.path.dirname(HERE) or \
            os.environ.get("MOK_LIBRARY") or mok.library_path() != os.path.join(_package, "libmok.so"):
        raise RuntimeError(f"MOK_TEST_INSTALLED=1 but mok is {mok.__file__} with {mok.library_path()}: not an "
                           "installed package with its own libmok.so")


def _base_seed():
    """MOK_TEST_SEED when set (to rerun a failure's inputs), else a fresh seed, handed down
    through the environment to the processes these tests start (test_binding_torch's fresh
    interpreters), so that they draw the same inputs."""
    given = os.environ.get("MOK_TEST_SEED", "")
    if given:
        if not re.fullmatch(r"[0-9]+", given) or int(given) >= 2**64:
            raise ValueError(f"MOK_TEST_SEED={given!r}: must be a decimal number in [0, 2^64) "
                             "(or unset, for a fresh seed)")
        return int(given)
    seed = secrets.randbits(64)
    os.environ["MOK_TEST_SEED"] = str(seed)
    return seed


BASE_SEED = _base_seed()
print(f"[seed] python/tests: random inputs from MOK_TEST_SEED={BASE_SEED} (set it to rerun these inputs)",
      file=sys.stderr, flush=True)


def case_rng(case):
    """The random numbers of test case `case` (a small int naming it): this run's BASE_SEED and
    the case, so each case has its own inputs, fresh every run and the same for the same seed.
    (No test here needs one fixed input: a test that takes a case twice, as
    test_what_the_binding_refuses does, relies only on getting the same inputs again.)"""
    return np.random.default_rng([BASE_SEED, case])


def _noting_the_seed(test):
    @functools.wraps(test)
    def run(self, *args, **kwargs):
        try:
            return test(self, *args, **kwargs)
        except unittest.SkipTest:
            raise
        except Exception as e:
            note = f"[seed] {self.id()} failed on the inputs of MOK_TEST_SEED={BASE_SEED}"
            if hasattr(e, "add_note"):  # (Python 3.11: printed with the error, by unittest and pytest)
                e.add_note(note)
            else:
                print(note, file=sys.stderr, flush=True)
            raise
    return run


class SeededTest(unittest.TestCase):
    """A TestCase whose failing tests say the seed of their inputs."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, f in list(vars(cls).items()):
            if name.startswith("test") and callable(f):
                setattr(cls, name, _noting_the_seed(f))


TOL, COS = checks.tolerance("bf16"), 0.9999
to_bf16 = workdir.f32_to_bf16_bits  # float -> bf16 bit patterns (uint16), round to nearest even
from_bf16 = workdir.bf16_bits_to_f32


def rnd(a):
    """Rounded to bf16, as float64."""
    return workdir.round_bf16(a).astype(np.float64)


def silu(g):
    return g / (1.0 + np.exp(-g))


def make_inputs(p, case):
    """Every rank's inputs, weights and outputs for `p`, as the layer takes them: random, from
    case_rng(case) (the same for the same case within a run)."""
    rng = case_rng(case)
    R, T, H, I, k, E = p.ep_size, p.tokens_per_rank, p.hidden, p.intermediate, p.top_k, p.num_experts
    El = E // R
    shared = [(to_bf16(rng.normal(0, 1 / np.sqrt(H), (w, H))), to_bf16(rng.normal(0, 1 / np.sqrt(H), (w, H))),
               to_bf16(rng.normal(0, 1 / np.sqrt(w), (H, w)))) for w in p.shared_intermediate]
    ranks = []
    for _ in range(R):
        logits = rng.normal(size=(T, E))
        top = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
        w = np.exp(np.take_along_axis(logits, top, 1))
        ranks.append({
            "x": to_bf16(rng.normal(size=(T, H))),
            "top_experts": np.ascontiguousarray(top),
            "router_weights": (w / w.sum(1, keepdims=True)).astype(np.float32),
            "w_gate": to_bf16(rng.normal(0, 1 / np.sqrt(H), (El, I, H))),
            "w_up": to_bf16(rng.normal(0, 1 / np.sqrt(H), (El, I, H))),
            "w_down": to_bf16(rng.normal(0, 1 / np.sqrt(I), (El, H, I))),
            "shared": shared,
            "y": np.zeros((T, H), np.uint16),
        })
    return ranks


def expert_parts(x, wg, wu, wd):
    """One expert on rows x (float64): gate and up (bf16), the SwiGLU rows (bf16), the output (bf16)."""
    g, u = rnd(x @ from_bf16(wg).T), rnd(x @ from_bf16(wu).T)
    a = rnd(rnd(silu(g)) * u)
    return g, u, a, rnd(a @ from_bf16(wd).T)


def reference_forward(p, ranks):
    """y of every rank, float64, from the definition."""
    El = p.num_experts // p.ep_size
    ys = []
    for rank in ranks:
        x = from_bf16(rank["x"]).astype(np.float64)
        acc = np.zeros_like(x)
        for wg, wu, wd in rank["shared"]:
            acc += expert_parts(x, wg, wu, wd)[3]
        for t in range(p.tokens_per_rank):
            for j in range(p.top_k):
                e = int(rank["top_experts"][t, j])
                owner = ranks[e // El]
                o = expert_parts(x[t:t + 1], owner["w_gate"][e % El], owner["w_up"][e % El],
                                 owner["w_down"][e % El])[3]
                acc[t] += float(rank["router_weights"][t, j]) * o[0]
        ys.append(acc)
    return ys


def close(got, ref):
    """MoK's check (bench/checks.py): (passes, its numbers as text); NaN never passes."""
    st = checks.compare(np.asarray(got, np.float64), np.asarray(ref, np.float64), np)
    return checks.passes(st, TOL), f"max_abs={st['max_abs']:.4g} rel={st['rel']:.4g} non_finite={st['non_finite']}"


def cosine(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


def norm_ratio(a, b):
    """|a| / |b|: the scale a cosine cannot see (a gradient twice too large has cosine 1)."""
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(np.linalg.norm(a) / max(np.linalg.norm(b), 1e-300))


SMALL = mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, shared_intermediate=[64], ep_size=2,
                    tokens_per_rank=16)


class Forward(SeededTest):
    def test_matches_the_definition_and_repeats_bit_for_bit(self):
        for problem, case in ((SMALL, 1),
                              (mok.Problem(num_experts=4, hidden=64, intermediate=128, top_k=4, ep_size=1,
                                           tokens_per_rank=8), 2)):
            ranks = make_inputs(problem, case)
            with mok.Layer(problem, cpu_threads=2) as layer:
                layer.forward(ranks)
                layer.synchronize()
                first = [r["y"].copy() for r in ranks]
                ok = [close(from_bf16(r["y"]), ref) for r, ref in zip(ranks, reference_forward(problem, ranks))]
                for r, (passed, stats) in enumerate(ok):
                    self.assertTrue(passed, f"{problem}: rank {r}: {stats}")
                for r in ranks:
                    r["y"][:] = 0
                layer.forward(ranks)
                for r, y in zip(ranks, first):
                    self.assertTrue(np.array_equal(r["y"], y), "a second forward changed bits")

    def test_combine_slots_hold_each_experts_row(self):
        ranks = make_inputs(SMALL, 9)
        El, k, H = SMALL.num_experts // SMALL.ep_size, SMALL.top_k, SMALL.hidden
        with mok.Layer(SMALL) as layer:
            layer.forward(ranks)
            slots = layer.combine_slots(1)  # (the cpu backend's: a copy)
        self.assertEqual(slots.shape, (SMALL.tokens_per_rank * k, H))
        rank = ranks[1]
        x = from_bf16(rank["x"]).astype(np.float64)
        want = np.zeros((SMALL.tokens_per_rank * k, H))
        for t in range(SMALL.tokens_per_rank):
            for j in range(k):
                e = int(rank["top_experts"][t, j])
                owner = ranks[e // El]
                want[t * k + j] = expert_parts(x[t:t + 1], owner["w_gate"][e % El], owner["w_up"][e % El],
                                               owner["w_down"][e % El])[3][0]
        ok, stats = close(from_bf16(slots), want)
        self.assertTrue(ok, stats)
        self.assertFalse(close(from_bf16(slots)[::-1], want)[0])
        with mok.Layer(SMALL) as other:
            with self.assertRaisesRegex(mok.MokError, "combine_slots"):
                other.combine_slots(5)

    def test_abandoning_without_a_group_changes_nothing(self):
        ranks = make_inputs(SMALL, 17)
        with mok.Layer(SMALL) as layer:
            layer.forward(ranks)
            want = [r["y"].copy() for r in ranks]
            layer.abandon_group("no group here")
            layer.abandon_group()
            self.assertFalse(layer.group_aborted)
            for r in ranks:
                r["y"][:] = 0
            layer.forward(ranks)
        for r, w in zip(ranks, want):
            self.assertTrue(np.array_equal(r["y"], w), "a forward after abandon_group changed bits")
        with self.assertRaisesRegex(mok.MokError, "after close"):
            layer.abandon_group()

    def test_the_check_can_fail(self):
        ranks = make_inputs(SMALL, 3)
        with mok.Layer(SMALL) as layer:
            layer.forward(ranks)
        ref = reference_forward(SMALL, ranks)
        wrong = from_bf16(ranks[0]["y"])[::-1]  # tokens out of order
        self.assertFalse(close(wrong, ref[0])[0])
        nan = from_bf16(ranks[0]["y"]).copy()
        nan[0, 0] = np.nan
        self.assertFalse(close(nan, ref[0])[0])


class Backward(SeededTest):
    def assertGradient(self, got, want, what):
        """Direction (cosine >= 0.9999, MoK's bf16 bar) and scale (norms within 1%)."""
        self.assertGreaterEqual(cosine(got, want), COS, what)
        self.assertAlmostEqual(norm_ratio(got, want), 1.0, delta=0.01, msg=f"{what}: |got| / |want|")

    def test_gradients_match_the_definition(self):
        p = mok.Problem(num_experts=4, hidden=64, intermediate=96, top_k=2, shared_intermediate=[32], ep_size=2,
                        tokens_per_rank=8)
        ranks = make_inputs(p, 4)
        rng = case_rng(5)
        El, T, H, I, k = p.num_experts // p.ep_size, p.tokens_per_rank, p.hidden, p.intermediate, p.top_k
        args = []
        for rank in ranks:
            b = {key: rank[key] for key in ("x", "top_experts", "router_weights", "w_gate", "w_up", "w_down",
                                            "shared")}
            b.update(dy=to_bf16(rng.normal(size=(T, H))), dx=np.zeros((T, H), np.uint16),
                     d_router_weights=np.zeros((T, k), np.float32),
                     d_w_gate=np.zeros((El, I, H), np.float32), d_w_up=np.zeros((El, I, H), np.float32),
                     d_w_down=np.zeros((El, H, I), np.float32),
                     d_shared=[tuple(np.zeros(w.shape, np.float32) for w in s) for s in rank["shared"]])
            args.append(b)
        with mok.Layer(p) as layer:
            layer.backward(args)
        # The definition's gradients (float64; bf16 rounding of the forward's intermediates).
        def expert_backward(x, do, wg, wu, wd):
            """(dx, d_w_gate, d_w_up, d_w_down) of expert(x) given d expert(x) = do."""
            g, u, a, _ = expert_parts(x, wg, wu, wd)
            da = do @ from_bf16(wd)
            sig = 1 / (1 + np.exp(-g))
            dg, du = da * u * sig * (1 + g * (1 - sig)), da * silu(g)
            return dg @ from_bf16(wg) + du @ from_bf16(wu), dg.T @ x, du.T @ x, do.T @ a

        d_w = [[np.zeros((El, I, H)), np.zeros((El, I, H)), np.zeros((El, H, I))] for _ in args]
        for r, b in enumerate(args):
            x = from_bf16(b["x"]).astype(np.float64)
            dy = from_bf16(b["dy"]).astype(np.float64)
            dx = np.zeros_like(x)
            drw = np.zeros((T, k))
            for s, (wg, wu, wd) in enumerate(b["shared"]):
                ddx, dwg, dwu, dwd = expert_backward(x, dy, wg, wu, wd)
                dx += ddx
                for got, want, what in zip(b["d_shared"][s], (dwg, dwu, dwd), ("w_gate", "w_up", "w_down")):
                    self.assertGradient(got, want, f"rank {r} shared {s} d_{what}")
            for t in range(T):
                for j in range(k):
                    e = int(b["top_experts"][t, j])
                    owner = args[e // El]
                    wg, wu, wd = owner["w_gate"][e % El], owner["w_up"][e % El], owner["w_down"][e % El]
                    drw[t, j] = float(expert_parts(x[t:t + 1], wg, wu, wd)[3][0] @ dy[t])
                    ddx, dwg, dwu, dwd = expert_backward(x[t:t + 1], float(b["router_weights"][t, j]) * dy[t:t + 1],
                                                         wg, wu, wd)
                    dx[t] += ddx[0]
                    for acc, d in zip(d_w[e // El], (dwg, dwu, dwd)):
                        acc[e % El] += d
            self.assertGradient(from_bf16(b["dx"]), dx, f"rank {r} dx")
            self.assertGradient(b["d_router_weights"], drw, f"rank {r} d_router_weights")
        for r, b in enumerate(args):
            for got, want, what in zip((b["d_w_gate"], b["d_w_up"], b["d_w_down"]), d_w[r],
                                       ("d_w_gate", "d_w_up", "d_w_down")):
                self.assertGradient(got, want, f"rank {r} {what}")
            self.assertLess(cosine(b["d_w_gate"], d_w[r][1]), COS, "the check tells gate from up")


class Errors(SeededTest):
    def test_a_bad_argument_is_named(self):
        ranks = make_inputs(SMALL, 6)
        ranks[1]["x"] = ranks[1]["x"][:, :64].copy()
        with mok.Layer(SMALL) as layer:
            with self.assertRaisesRegex(mok.MokError, r"x\[rank 1\].*shape"):
                layer.forward(ranks)

    def test_what_the_binding_refuses(self):
        ranks = make_inputs(SMALL, 7)
        ranks[0]["router_weights"] = ranks[0]["router_weights"].astype(np.float64)
        with mok.Layer(SMALL) as layer:
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[0\]\.router_weights: numpy dtype float64"):
                layer.forward(ranks)
            ranks = make_inputs(SMALL, 7)
            # An output the layer would write into read-only memory (it crashed the process).
            y = np.zeros_like(ranks[1]["y"])
            y.flags.writeable = False
            ranks[1]["y"] = y
            with self.assertRaisesRegex(mok.MokError, r"ranks\[1\]\.y: the layer writes this output, and the "
                                                      "array is read-only"):
                layer.forward(ranks)
            self.assertFalse(y.any(), "a refused call wrote the read-only y")
            with self.assertRaisesRegex(mok.MokError, r"ranks\[0\]: unknown key\(s\) \['why'\]"):
                layer.forward([{"why": 1}])
            # Keys of mixed types (which sorted() alone cannot order) are named too.
            with self.assertRaisesRegex(mok.MokError, r"ranks\[1\]: unknown key\(s\) \['xx', 0\]"):
                layer.forward([ranks[0], dict(ranks[1], **{"xx": 2}) | {0: 1}])
        with self.assertRaisesRegex(mok.MokError, "backend = 'tpu'"):
            mok.Layer(SMALL, backend="tpu")
        with self.assertRaisesRegex(mok.MokError, "top_k"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=0, tokens_per_rank=16))
        layer = mok.Layer(SMALL)
        layer.close()
        with self.assertRaisesRegex(mok.MokError, "after close"):
            layer.synchronize()

    def test_values_ctypes_would_wrap_and_mismatched_gradients_are_refused(self):
        with self.assertRaisesRegex(mok.MokError, r"Problem.hidden = 4294967552: must be an int32"):
            mok.Layer(mok.Problem(num_experts=8, hidden=2**32 + 256, intermediate=64, top_k=2, tokens_per_rank=16))
        with self.assertRaisesRegex(mok.MokError, "active_rank"):
            mok.Layer(SMALL, active_rank=2**40)
        # (Outside a rank slice an active rank would be ignored: both ranks' y written.)
        with self.assertRaisesRegex(mok.MokError, r"LayerOptions.active_rank = 1: only a rank slice"):
            mok.Layer(SMALL, active_rank=1)
        with self.assertRaisesRegex(mok.MokError, r"ep_size = 4294967298: must be an int32"):
            mok.Problem.from_shape("qwen3-30b-a3b", ep_size=2**32 + 2)
        with self.assertRaisesRegex(mok.MokError, r"config.minibatch_rows = 4294967552: must be an int32"):
            mok.Layer(SMALL, config={"minibatch_rows": 2**32 + 256})
        with self.assertRaisesRegex(mok.MokError, r"config.schedule_capacity_factor = 'x': must be a number"):
            mok.Layer(SMALL, config={"schedule_capacity_factor": "x"})
        # A number spelled as text, a bool or one beyond float's range is refused too, as the
        # int fields refuse them, naming the field (not float()'s conversion or OverflowError).
        for bad in ("0.5", b"0.5", True, 10**400):
            with self.assertRaisesRegex(mok.MokError, r"config.schedule_capacity_factor = .*: must be a number"):
                mok.Layer(SMALL, config={"schedule_capacity_factor": bad})
        with self.assertRaisesRegex(mok.MokError, r"Problem.swiglu_limit = .*: must be a number or None"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  swiglu_limit=10**400))
        # Options of the wrong kind are named, not raised as Python's own TypeError/AttributeError.
        with self.assertRaisesRegex(mok.MokError, r"backend = \['cpu'\]: must be one of"):
            mok.Layer(SMALL, backend=["cpu"])
        with self.assertRaisesRegex(mok.MokError, r"ep_mode = \{\}: must be one of"):
            mok.Layer(SMALL, ep_mode={})
        with self.assertRaisesRegex(mok.MokTypeError, r"config: a dict of mok::Config fields"):
            mok.Layer(SMALL, config=[("tile_rows", 64)])
        with self.assertRaisesRegex(mok.MokError, r"Problem.precision = \['bf16'\]: must be one of"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  precision=["bf16"]))
        with self.assertRaisesRegex(mok.MokTypeError, r"Problem.shared_intermediate = \{64: 'x'\}: a list"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  shared_intermediate={64: "x"}))
        # A set has no order to pair each width with its weights by.
        with self.assertRaisesRegex(mok.MokTypeError, r"Problem.shared_intermediate = \{64\}: a list"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  shared_intermediate={64}))
        # Text arguments are str: str() of None or bytes would be sent as 'None' or "b'...'".
        for bad in (None, b"tiny", 7):
            with self.assertRaisesRegex(mok.MokTypeError, r"name = .*: must be a str"):
                mok.Problem.from_shape(bad)
        with mok.Layer(SMALL) as layer:
            with self.assertRaisesRegex(mok.MokTypeError, r"why = b'x': must be a str"):
                layer.abandon_group(b"x")
            with self.assertRaisesRegex(mok.MokError, r"rank = 4294967297: must be an int32"):
                layer.combine_slots(2**32 + 1)
        # Integer scalars from numpy are ints; bools are not.
        self.assertEqual(mok.Layer(mok.Problem(num_experts=np.int64(8), hidden=np.int32(128), intermediate=64,
                                               top_k=2, tokens_per_rank=16)).problem.hidden, 128)
        self.assertEqual(mok.Layer(SMALL, config={"task_pairs": True}).config["task_pairs"], 1)
        self.assertEqual(mok.Layer(SMALL, config={"task_pairs": np.True_}).config["task_pairs"], 1)
        self.assertEqual(mok.Layer(SMALL, config={"task_pairs": np.False_}).config["task_pairs"], 0)
        with self.assertRaisesRegex(mok.MokError, r"Problem.top_k = True: must be an int32"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=True, tokens_per_rank=16))
        # numpy's bools are no numbers either (float(np.True_) would read as 1.0).
        with self.assertRaisesRegex(mok.MokError, r"config.schedule_capacity_factor = (np.)?True_?: must be a number"):
            mok.Layer(SMALL, config={"schedule_capacity_factor": np.True_})
        with self.assertRaisesRegex(mok.MokError, r"Problem.swiglu_limit = (np.)?True_?: must be a number or None"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  swiglu_limit=np.True_))
        with self.assertRaisesRegex(mok.MokError, r"Problem.top_k = (np.)?True_?: must be an int32"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=np.True_, tokens_per_rank=16))
        ranks = make_inputs(SMALL, 10)
        b = {key: ranks[0][key] for key in ("x", "top_experts", "router_weights", "w_gate", "w_up", "w_down",
                                            "shared")}
        with mok.Layer(SMALL) as layer:
            # A count of shared experts (or of their gradients) other than the problem's is
            # refused by the Python name, before the C interface's limit of 8 could blame a field
            # the caller never set; an empty list is as if left out (the layer names what is missing).
            d_one = tuple(np.zeros(w.shape, np.float32) for w in b["shared"][0])
            with self.assertRaisesRegex(mok.MokError, r"ranks\[0\]\.d_shared: 2 shared expert\(s\), the layer's "
                                                      r"problem has 1 \(Problem.shared_intermediate\)"):
                layer.backward([dict(b, d_shared=[d_one, d_one])])
            for count in (2, 9):
                with self.assertRaisesRegex(mok.MokError, rf"ranks\[1\]\.shared: {count} shared expert\(s\), the "
                                                          r"layer's problem has 1"):
                    layer.forward([ranks[0], dict(ranks[1], shared=ranks[1]["shared"] * count)])
            with self.assertRaisesRegex(mok.MokError, r"weights.shared\[rank 0\]: holds 0 shared experts"):
                layer.forward([dict(ranks[0], shared=[]), ranks[1]])
            # A shared expert's dict with a key it does not know (misspelt, say) is refused, not
            # read for its three known keys with the rest dropped.
            g, u, d = ranks[0]["shared"][0]
            with self.assertRaisesRegex(mok.MokError, r"ranks\[0\]\.shared\[0\]: unknown key\(s\) \['bogus'\]"):
                layer.forward([dict(ranks[0], shared=[dict(w_gate=g, w_up=u, w_down=d, bogus=1)]), ranks[1]])

    def test_inputs_the_c_interface_would_misread_are_refused(self):
        ranks = make_inputs(SMALL, 11)
        with mok.Layer(SMALL) as layer:
            # A masked array's mask would be ignored; a misaligned array read through a float*.
            masked = dict(ranks[0], x=np.ma.masked_array(ranks[0]["x"], mask=True))
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[0\]\.x: a masked array"):
                layer.forward([masked, ranks[1]])
            raw = np.zeros(ranks[1]["router_weights"].nbytes + 1, np.uint8)
            odd = np.frombuffer(raw.data, np.float32, count=ranks[1]["router_weights"].size, offset=1)
            odd = odd.reshape(ranks[1]["router_weights"].shape)
            self.assertFalse(odd.flags.aligned)
            with self.assertRaisesRegex(mok.MokError, r"ranks\[1\]\.router_weights: the data is not aligned"):
                layer.forward([ranks[0], dict(ranks[1], router_weights=odd)])
            # A NUL would end the C string early and drop the rest silently.
            with self.assertRaisesRegex(mok.MokError, r"why = 'a\\x00b': holds a NUL character"):
                layer.abandon_group("a\0b")
            # The layer's problem is its own: changing the returned one changes nothing.
            seen = layer.problem
            seen.tokens_per_rank = 999
            self.assertEqual(layer.problem.tokens_per_rank, SMALL.tokens_per_rank)
        with self.assertRaisesRegex(mok.MokError, r"name = 'qwen3-30b-a3b\\x00x': holds a NUL character"):
            mok.Problem.from_shape("qwen3-30b-a3b\0x")
        # Text with no UTF-8 form (a lone surrogate) is named, not a bare UnicodeEncodeError.
        with self.assertRaisesRegex(mok.MokError, r"name = 'tiny\\udc80': is not valid UTF-8 text"):
            mok.Problem.from_shape("tiny\udc80")
        with mok.Layer(SMALL) as layer:
            with self.assertRaisesRegex(mok.MokError, r"why = 'x\\ud800': is not valid UTF-8 text"):
                layer.abandon_group("x\ud800")
        # A bad field is named before the layer copies the problem (a generator cannot be copied).
        with self.assertRaisesRegex(mok.MokTypeError, r"Problem.shared_intermediate = <generator .*: a list"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  shared_intermediate=(w for w in [64])))
        with self.assertRaisesRegex(mok.MokError, r"Problem.hidden = <generator .*: must be an int32"):
            mok.Layer(mok.Problem(num_experts=8, hidden=(h for h in [128]), intermediate=64, top_k=2,
                                  tokens_per_rank=16))
        with self.assertRaisesRegex(mok.MokError, r"Problem.swiglu_limit = 'x': must be a number or None"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  swiglu_limit="x"))
        # Beyond float32 (the layer's type) a limit would read as inf or 0: named as given.
        for limit in (1e39, 1e-50):
            with self.assertRaisesRegex(mok.MokError, rf"Problem.swiglu_limit = {re.escape(repr(limit))}: outside float32's range"):
                mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                      swiglu_limit=limit))
        # A subnormal float32 limit would keep fewer digits than were given: the library's rule.
        with self.assertRaisesRegex(mok.MokError, r"Problem.swiglu_limit = .*: must be finite and at least "
                                                  r".* \(a positive normal float\)"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  swiglu_limit=1e-40))
        with self.assertRaisesRegex(mok.MokTypeError, r"Problem.shared_intermediate = 5: a list"):
            mok.Layer(mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, tokens_per_rank=16,
                                  shared_intermediate=5))
        for stream in (-1, 2**64, 2**70):
            with self.assertRaisesRegex(mok.MokError, rf"cuda_stream = {stream}: a cudaStream_t handle is an address"):
                mok.Layer(SMALL, cuda_stream=stream)

    def test_ranks_from_a_generator_live_through_the_call(self):
        ranks = make_inputs(SMALL, 16)
        with mok.Layer(SMALL) as layer:
            layer.forward(ranks)
            want = [r["y"].copy() for r in ranks]
            ys = [np.zeros_like(r["y"]) for r in ranks]
            # Every input made on the fly: only the binding's list keeps them alive.
            layer.forward({**{key: (v.copy() if hasattr(v, "copy") else v) for key, v in r.items()}, "y": y}
                          for r, y in zip(ranks, ys))
        for y, w in zip(ys, want):
            self.assertTrue(np.array_equal(y, w))

    def test_shared_experts_from_a_generator_live_through_the_call(self):
        """A shared expert's weights made on the fly (a generator of generators) were freed
        before the C call read them: the call returned OK with a wrong y."""
        ranks = make_inputs(SMALL, 17)
        with mok.Layer(SMALL) as layer:
            layer.forward(ranks)
            want = [r["y"].copy() for r in ranks]
            for r in ranks:
                r["y"][:] = 0
                triples = r["shared"]
                r["shared"] = ((w.copy() for w in t) for t in triples)
            layer.forward(ranks)
        for r, w in zip(ranks, want):
            self.assertTrue(np.array_equal(r["y"], w), "shared experts from a generator changed y")

    def test_containers_of_the_wrong_kind_are_named(self):
        ranks = make_inputs(SMALL, 18)
        with mok.Layer(SMALL) as layer:
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks: a list of dicts, one per rank held here; got a "
                                                          r"dict"):
                layer.forward(ranks[0])
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[1\]: a dict of the rank's tensors, got a list"):
                layer.forward([ranks[0], list(ranks[1].values())])
            one = dict(ranks[0], shared={"w_gate": 1, "w_up": 2, "w_down": 3})
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[0\]\.shared: a list of shared experts"):
                layer.forward([one, ranks[1]])
            two = dict(ranks[0], shared=[ranks[0]["shared"][0][:2]])
            with self.assertRaisesRegex(mok.MokError, r"ranks\[0\]\.shared\[0\]: 2 tensors, a shared expert has 3"):
                layer.forward([two, ranks[1]])
        with self.assertRaisesRegex(mok.MokTypeError, "problem: a mok.Problem, got a dict"):
            mok.Layer({"num_experts": 8})
        with self.assertRaisesRegex(mok.MokTypeError, "cuda_stream = 'abc'"):
            mok.Layer(SMALL, cuda_stream="abc")
        with self.assertRaisesRegex(mok.MokError, "config.task_pairs = 7: must be 0 or 1"):
            mok.Layer(SMALL, config={"task_pairs": 7})
        with self.assertRaisesRegex(mok.MokError, "ep_size = -5: must be >= 0"):
            mok.Problem.from_shape("tiny", ep_size=-5)

    def _in_a_child(self, code):
        """Runs `code` in a fresh Python that imports this mok (the same sys.path) and returns
        the finished process: each case may hang, crash or exhaust memory without this one."""
        import subprocess
        return subprocess.run([sys.executable, "-c", self._CHILD_PRELUDE.format(path=sys.path[:3]) + code],
                              capture_output=True, text=True, timeout=120)

    # What every child script starts with: this mok, and two helpers of the memory-limit tests.
    _CHILD_PRELUDE = (
        "import sys; sys.path[:0] = {path!r}; import numpy as np, mok, resource\n"
        "def limit_address_space(headroom):  # (this process's size now, plus headroom bytes)\n"
        "    size = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))\n"
        "def attempt(label, call):  # (prints '<label> ran' or '<label> refused: <the MokError>')\n"
        "    try:\n"
        "        call()\n"
        "        print(label, 'ran')\n"
        "    except mok.MokError as e:\n"
        "        print(label, 'refused:', e)\n")

    def test_a_layer_used_in_a_forked_child_runs_there(self):
        """multiprocessing forks by default on Linux: the CPU backend's threads stay in the parent,
        and the children's calls (and their exits, which destroy the layer) used to wait for them
        for ever."""
        r = self._in_a_child(
            "import multiprocessing as mp\n"
            "p = mok.Problem(num_experts=8, hidden=128, intermediate=64, top_k=2, shared_intermediate=[64],\n"
            "                ep_size=2, tokens_per_rank=16)\n"
            "rng = np.random.default_rng(5)\n"
            "bits = lambda *s: (rng.normal(0, 0.1, s).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)\n"
            "ranks = [dict(x=bits(16, 128), top_experts=np.stack([rng.permutation(8)[:2] for _ in range(16)])\n"
            "              .astype(np.int32), router_weights=rng.random((16, 2), np.float32),\n"
            "              w_gate=bits(4, 64, 128), w_up=bits(4, 64, 128), w_down=bits(4, 128, 64),\n"
            "              shared=[(bits(64, 128), bits(64, 128), bits(128, 64))],\n"
            "              y=np.zeros((16, 128), np.uint16)) for _ in range(2)]\n"
            "layer = mok.Layer(p, cpu_threads=3)\n"
            "layer.forward(ranks)\n"
            "want = [r['y'].copy() for r in ranks]\n"
            "def child(_):\n"
            "    mine = [dict(r, y=np.full_like(r['y'], 0xFFFF)) for r in ranks]\n"
            "    layer.forward(mine)\n"
            "    return all(np.array_equal(m['y'], w) for m, w in zip(mine, want))\n"
            "with mp.get_context('fork').Pool(2) as pool:\n"
            "    print('children', pool.map(child, range(4), chunksize=1))\n")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("children [True, True, True, True]", r.stdout)

    @unittest.skipIf(UNDER_ASAN, "AddressSanitizer ends the process where operator new runs out of memory")
    def test_running_out_of_host_memory_is_named(self):
        """std::bad_alloc's own text names nothing: the error says what ran out."""
        r = self._in_a_child(
            "p = mok.Problem(num_experts=256, hidden=1024, intermediate=64, top_k=200, shared_intermediate=[],\n"
            "                ep_size=1, tokens_per_rank=4096)\n"
            "ranks = [dict(x=np.zeros((4096, 1024), np.uint16),\n"
            "              top_experts=np.tile(np.arange(200, dtype=np.int32), (4096, 1)),\n"
            "              router_weights=np.full((4096, 200), 0.005, np.float32),\n"
            "              w_gate=np.zeros((256, 64, 1024), np.uint16), w_up=np.zeros((256, 64, 1024), np.uint16),\n"
            "              w_down=np.zeros((256, 1024, 64), np.uint16), y=np.zeros((4096, 1024), np.uint16))]\n"
            "layer = mok.Layer(p, cpu_threads=1)\n"
            "limit_address_space(1 << 30)\n"
            "attempt('forward', lambda: layer.forward(ranks))\n"
            "print('y untouched:', not ranks[0]['y'].any())\n")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("refused: out of host memory (std::bad_alloc)", r.stdout)
        self.assertIn("y untouched: True", r.stdout)

    @unittest.skipIf(UNDER_ASAN, "AddressSanitizer ends the process where operator new runs out of memory")
    def test_slots_are_not_offered_after_a_forward_that_failed_part_way(self):
        """The CPU backend writes the combine slots in place: a forward that ran out of host
        memory part way left them part written, and combine_slots handed them out as whole."""
        r = self._in_a_child(
            "p = mok.Problem(num_experts=4, hidden=1024, intermediate=64, top_k=2, shared_intermediate=[],\n"
            "                ep_size=2, tokens_per_rank=4096)\n"
            "rng = np.random.default_rng(3)\n"
            "ranks = [dict(x=np.full((4096, 1024), 0x3f80, np.uint16),\n"
            "              top_experts=np.stack([rng.permutation(4)[:2] for _ in range(4096)]).astype(np.int32),\n"
            "              router_weights=np.full((4096, 2), 0.5, np.float32),\n"
            "              w_gate=np.full((2, 64, 1024), 0x3c00, np.uint16), w_up=np.full((2, 64, 1024), 0x3c00, np.uint16),\n"
            "              w_down=np.full((2, 1024, 64), 0x3c00, np.uint16), y=np.zeros((4096, 1024), np.uint16))\n"
            "         for _ in range(2)]\n"
            "layer = mok.Layer(p, cpu_threads=1)\n"
            "layer.forward(ranks)\n"
            "print('slots before:', layer.combine_slots(0).any())\n"
            "limit_address_space(4 << 20)\n"
            "attempt('forward', lambda: layer.forward(ranks))\n"
            "attempt('slots', lambda: layer.combine_slots(0))\n"
            "resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "layer.forward(ranks)\n"
            "print('slots after:', layer.combine_slots(0).any())\n")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("slots before: True", r.stdout)
        self.assertIn("forward refused: out of host memory", r.stdout)
        self.assertIn("slots refused: combine_slots: the latest forward failed part way", r.stdout)
        self.assertIn("slots after: True", r.stdout)

    def test_calls_from_several_threads_run_one_at_a_time(self):
        """ctypes releases the GIL during a call: threads calling one layer overlapped in the
        library (they hung in the CPU backend's thread pool, or gave a wrong y)."""
        import threading
        ranks = make_inputs(SMALL, 19)
        failures = []
        with mok.Layer(SMALL, cpu_threads=4) as layer:
            layer.forward(ranks)
            want = [r["y"].copy() for r in ranks]

            def run(i):
                mine = [dict(r, y=np.zeros_like(r["y"])) for r in ranks]
                for c in range(20):
                    for m in mine:  # (every call must write y: the last call's right y would pass)
                        m["y"].fill(0xFFFF)
                    layer.forward(mine)
                    if not all(np.array_equal(m["y"], w) for m, w in zip(mine, want)):
                        failures.append(f"thread {i} call {c}")
                        return
            threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            self.assertFalse(any(t.is_alive() for t in threads), "a thread is still in its calls after 60 s")
        self.assertEqual(failures, [])

    def test_a_device_error_on_the_cpu_backend_is_raised_by_the_call(self):
        ranks = make_inputs(SMALL, 8)
        ranks[0]["top_experts"][3, 1] = 99
        with mok.Layer(SMALL) as layer:
            with self.assertRaisesRegex(mok.MokError, r"top_experts\[rank 0\]\[token 3, slot 1\] = 99"):
                layer.forward(ranks)

    def test_named_shapes(self):
        self.assertIn("qwen3.5-397b-a17b", mok.shapes())
        q = mok.Problem.from_shape("qwen3.5-397b-a17b")
        self.assertEqual((q.num_experts, q.hidden, q.intermediate, q.top_k, q.shared_intermediate, q.ep_size,
                          q.tokens_per_rank), (512, 4096, 1024, 10, [1024], 64, 2048))
        self.assertEqual(mok.Problem.from_shape("qwen3-30b-a3b", ep_size=2, tokens_per_rank=256).ep_size, 2)
        with self.assertRaisesRegex(mok.MokError, "qwen3.5-397b-a17b"):  # the error lists the known names
            mok.Problem.from_shape("qwen9")

    def test_the_operators_flat_arguments_give_back_the_rank_dicts(self):
        # Layer.forward_op's encoding (tensors and ints only) loses no tensor and no place: a
        # rank slice's other ranks without weights or y, two shared experts, an empty one, and
        # a shared expert given with no tensor at all (forward() names it; dropping it would
        # hand forward() one expert fewer than given).
        ranks = [{"x": "x0", "top_experts": "t0", "router_weights": "w0", "shared": []},
                 {"x": "x1", "top_experts": "t1", "router_weights": "w1", "w_gate": "g1", "w_up": "u1",
                  "w_down": "d1", "shared": [("sg0", "su0", "sd0"), ("sg1", "su1", "sd1")], "y": "y1"},
                 {"x": "x2", "top_experts": "t2", "router_weights": "w2", "y": "y2", "w_gate": None},
                 {"x": "x3", "top_experts": "t3", "router_weights": "w3",
                  "shared": [(None, "su0", None), (None, None, None)]}]
        inputs, places, y = mok._op_places(ranks)
        self.assertEqual(y, ["y1", "y2"])
        self.assertTrue(all(isinstance(v, int) for v in places))
        back = mok._op_ranks(inputs, places, y)
        want = [{k: v for k, v in r.items() if v is not None and v != []} for r in ranks]
        self.assertEqual(back, want)
        self.assertNotEqual(mok._op_ranks(inputs[::-1], places, y), want)  # (the check can fail)

    def test_version_is_the_projects(self):
        # The library's version is the one CMakeLists.txt declares (pip's, through pyproject.toml).
        import re
        with open(os.path.join(HERE, "..", "..", "CMakeLists.txt")) as f:
            declared = re.search(r"project\(mok LANGUAGES CXX VERSION ([0-9.]+)\)", f.read()).group(1)
        self.assertEqual(mok.version(), declared)
        self.assertRegex(mok.build_commit(), r"^([0-9a-f]{12}(-dirty)?|unknown)$")

    def test_the_config_has_the_librarys_choices(self):
        with mok.Layer(SMALL, config={"schedule_capacity_factor": 1.0}) as layer:
            c = layer.config
        self.assertEqual(c["schedule_capacity_factor"], 1.0)
        self.assertEqual(c["tile_rows"], 128)
        with self.assertRaisesRegex(mok.MokError, "config.tile_size"):
            mok.Layer(SMALL, config={"tile_size": 64})


if __name__ == "__main__":
    unittest.main()
