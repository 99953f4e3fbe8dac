"""python/mok with PyTorch CUDA tensors on the cuda backend: the same layer as the CPU
backend within MoK's BF16 bar (max-abs <= 0.5, sum|diff|/sum|ref| <= 0.01), bit for bit
run to run, under CUDA-graph capture and replay through torch.cuda.graph, and as a real
NCCL group of this one process (ep_mode="distributed", bitwise equal to virtual ranks). Skips, saying
why, without torch, a GPU, or a libmok.so built with the cuda backend; scripts/device_check.sh
runs it on the device and fails when it skips.
"""
import contextlib
import gc
import os
import re
import sys
import unittest
import weakref

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mok  # noqa: E402
# (make_inputs: fresh random inputs every run, from test_binding's MOK_TEST_SEED; SeededTest
# adds that seed to a failing test's error.)
from test_binding import SeededTest, close, from_bf16, make_inputs, reference_forward  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

PROBLEM = mok.Problem(num_experts=8, hidden=256, intermediate=128, top_k=2, shared_intermediate=[128], ep_size=2,
                      tokens_per_rank=64)


def to_torch(rank, device):
    """A rank's numpy arrays as torch tensors on `device` (bf16 bit patterns as torch.bfloat16)."""
    def one(a):
        if a.dtype == np.uint16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(a.copy()).to(device)
    out = {key: one(a) for key, a in rank.items() if key != "shared"}
    out["shared"] = [tuple(one(w) for w in s) for s in rank["shared"]]
    return out


def y_bits(rank):
    return rank["y"].view(torch.int16).cpu().numpy().view(np.uint16)


def expect_replays_give(test, graph, stream, ranks, want, times, fill):
    """Replays `graph` `times` times on `stream`, each time after filling every rank's y with
    `fill`, and checks that each replay leaves y with the bits `want` (a list per rank)."""
    for n in range(times):
        with torch.cuda.stream(stream):
            for r in ranks:
                r["y"].fill_(fill)
            graph.replay()
        stream.synchronize()
        for i, r in enumerate(ranks):
            test.assertTrue(np.array_equal(y_bits(r), want[i]), f"replay {n}, rank {i}: the graph's y differs")


@contextlib.contextmanager
def group_of_one_env():
    """What torchrun or `mok launch` would set for a group of one (mok reads MOK_* first)."""
    launcher = {"MOK_RANK": "0", "MOK_WORLD_SIZE": "1", "MOK_LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in launcher}
    os.environ.update(launcher)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TorchCpu(SeededTest):
    """What the binding refuses in torch tensors, on the cpu backend (no GPU needed)."""

    @classmethod
    def setUpClass(cls):
        if torch is None:
            raise unittest.SkipTest("PyTorch is not installed: torch binding test skipped")

    def test_tensors_the_layer_would_misread_or_write_behind_autograd_are_refused(self):
        ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 14)]
        with mok.Layer(PROBLEM) as layer:
            layer.forward(ranks)  # (the tensors as made are taken)
            # An output that requires grad: written in place outside autograd, its gradient would be wrong.
            graded = torch.zeros_like(ranks[0]["y"]).requires_grad_()
            with self.assertRaisesRegex(mok.MokError, r"ranks\[0\]\.y: .* requires grad"):
                layer.forward([dict(ranks[0], y=graded), ranks[1]])
            self.assertFalse(graded.detach().any(), "a refused call wrote y")
            # Memory that holds other numbers than the tensor's: a sparse tensor, a lazy negation.
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[1\]\.router_weights: a torch.sparse_coo tensor"):
                layer.forward([ranks[0], dict(ranks[1], router_weights=ranks[1]["router_weights"].to_sparse())])
            with self.assertRaisesRegex(mok.MokError, r"ranks\[0\]\.x: a lazily negated"):
                layer.forward([dict(ranks[0], x=torch._neg_view(ranks[0]["x"])), ranks[1]])
            # Data not aligned to its elements (read through a float*): refused, as for numpy.
            w = ranks[0]["router_weights"]
            buf = bytearray(w.numel() * 4 + 1)
            odd = torch.frombuffer(buf, dtype=torch.float32, offset=1, count=w.numel()).view(w.shape)
            odd.copy_(w)
            with self.assertRaisesRegex(mok.MokError, r"ranks\[0\]\.router_weights: the data is not aligned"):
                layer.forward([dict(ranks[0], router_weights=odd), ranks[1]])

            # A meta tensor (no memory at all) is named by its device, not as empty.
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[1\]\.x: tensors on meta are not supported"):
                layer.forward([ranks[0], dict(ranks[1], x=torch.empty_like(ranks[1]["x"], device="meta"))])

            # An empty tensor (no memory in torch) is named as empty, not as missing.
            with self.assertRaisesRegex(mok.MokError, r"ranks\[1\]\.x: an empty tensor \(shape \[0, 256\]\)"):
                layer.forward([ranks[0], dict(ranks[1], x=torch.empty(0, 256, dtype=torch.bfloat16))])

            # A subclass of torch.Tensor is a tensor.
            class Tagged(torch.Tensor):
                pass
            layer.forward([dict(ranks[0], x=ranks[0]["x"].as_subclass(Tagged)), ranks[1]])


    def test_forward_op_is_forward_eagerly_and_under_torch_compile(self):
        # torch.ops.mok.forward: the bits of forward(), called eagerly and traced by
        # torch.compile as one node (fullgraph: no graph break), y written in place.
        ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 21)]
        with mok.Layer(PROBLEM, cpu_threads=2) as layer:
            layer.forward(ranks)
            want = [r["y"].clone() for r in ranks]

            def run(rs):
                layer.forward_op(rs)
                return [r["y"] + 0 for r in rs]

            for name, fn in (("eager", run), ("aot_eager", torch.compile(run, fullgraph=True, backend="aot_eager")),
                             ("inductor", torch.compile(run, fullgraph=True))):
                for r in ranks:
                    r["y"].fill_(float("nan"))
                out = fn(ranks)
                for i, r in enumerate(ranks):
                    self.assertTrue(torch.equal(r["y"], want[i]), f"{name}: rank {i}'s y differs from forward()'s")
                    self.assertTrue(torch.equal(out[i], want[i]), f"{name}: rank {i}'s y as traced differs")
            torch._dynamo.reset()
            # forward()'s errors, raised when the operator runs.
            bad = [dict(r) for r in ranks]
            bad[1]["top_experts"] = ranks[1]["top_experts"].clone()
            bad[1]["top_experts"][2, 1] = 77
            with self.assertRaisesRegex(mok.MokError, r"top_experts\[rank 1\]\[token 2, slot 1\] = 77"):
                layer.forward_op(bad)
        with self.assertRaisesRegex(mok.MokError, "used after close"):
            layer.forward_op(ranks)

    def test_forward_op_takes_and_refuses_what_forward_does(self):
        ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 23)]
        with mok.Layer(PROBLEM, cpu_threads=2) as layer:
            layer.forward(ranks)
            want = [r["y"].clone() for r in ranks]
            # Shared experts as dicts, as forward() takes them.
            as_dicts = [dict(r, shared=[dict(zip(("w_gate", "w_up", "w_down"), s)) for s in r["shared"]])
                        for r in ranks]
            for r in as_dicts:
                r["y"].fill_(float("nan"))
            layer.forward_op(as_dicts)
            for i, r in enumerate(as_dicts):
                self.assertTrue(torch.equal(r["y"], want[i]), f"rank {i}'s y differs from forward()'s")
            # An unknown key is refused, not dropped; so is a missing shared tensor, by forward()'s rule.
            with self.assertRaisesRegex(mok.MokError, r"ranks\[1\]: unknown key\(s\) \['bias'\]"):
                layer.forward_op([ranks[0], dict(ranks[1], bias=ranks[1]["x"])])
            holed = [ranks[0], dict(ranks[1], shared=[(ranks[1]["shared"][0][0], None, ranks[1]["shared"][0][2])])]
            with self.assertRaisesRegex(mok.MokError, r"w_up"):
                layer.forward_op(holed)
            # A shared expert more than the problem's, even one with no tensor at all (once
            # dropped on the way to the operator), or more than the C interface's 8: named.
            for extra in ([(None, None, None)], ranks[1]["shared"] * 8):
                for call in (layer.forward, layer.forward_op):
                    with self.assertRaisesRegex(mok.MokError, r"ranks\[1\]\.shared: \d+ shared expert\(s\), the "
                                                              r"layer's problem has 1"):
                        call([ranks[0], dict(ranks[1], shared=ranks[1]["shared"] + extra)])
            # A numpy array (forward() takes it; the operator's schema does not) is named.
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[0\]\.router_weights: forward_op takes PyTorch"):
                layer.forward_op([dict(ranks[0], router_weights=ranks[0]["router_weights"].numpy()), ranks[1]])
            # A meta tensor sent the call to the operator's fake kernel, which wrote nothing and said
            # nothing: refused as forward() refuses it, y untouched.
            for r in ranks:
                r["y"].fill_(float("nan"))
            meta = [ranks[0], dict(ranks[1], w_down=ranks[1]["w_down"].to("meta"))]
            with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[1\]\.w_down: tensors on meta are not supported"):
                layer.forward_op(meta)
            self.assertTrue(all(r["y"].isnan().all() for r in ranks), "a refused call wrote y")
            # A nested tensor (its sizes cannot be read as a strided tensor's) is named, in both.
            nested = [dict(ranks[0], x=torch.nested.nested_tensor([ranks[0]["x"]])), ranks[1]]
            for call in (layer.forward, layer.forward_op):
                with self.assertRaisesRegex(mok.MokTypeError, r"ranks\[0\]\.x: a nested tensor"):
                    call(nested)

    def test_the_public_operator_checks_its_flat_lists(self):
        # torch.ops.mok.forward can be called directly: lists Layer.forward_op could not have
        # made are refused naming where, never an IndexError, a huge allocation or an unused tensor.
        ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 24)]
        with mok.Layer(PROBLEM) as layer:
            layer.forward(ranks)
            want = [r["y"].clone() for r in ranks]
            inputs, places, y = mok._op_places(mok._rank_dicts(ranks, mok._FORWARD_KEYS))
            op = torch.ops.mok.forward
            x = ranks[0]["x"]
            for args, message in (
                    (([x], [1, 1, 1, 6, 2**31 - 1, 0], []), r"entry 4, rank 0's shared index, is 2147483647: must be in \[0, 0\]"),
                    (([x], [1, 1, 9, 6, 0, 0], []), r"entry 2, rank 0's shared expert count, is 9: must be in \[0, 8\]"),
                    (([x], [1, 1, 0, 6, 0, 0], []), r"entry 3, rank 0's input key, is 6: must be in \[0, 5\]"),
                    (([], [5, 3, 0], []), r"rank count, is 5: must be in \[1, 1\]"),
                    (([x], [1, 1, 0, 99, 0, 0], []), r"entry 3, rank 0's input key, is 99"),
                    (([x], [1, 1, 0, 0, 0, 1], []), r"entry 5, rank 0's y flag, is 1: must be in \[0, 0\]"),
                    (([x, x], [1, 2, 0, 0, 0, 0, 0, 0], []), r"rank 0 names x twice"),
                    ((inputs + [x], places, y), r"0 entries, 1 inputs and 0 y left over"),
                    ((inputs, places, y + [ranks[0]["y"]]), r"0 entries, 0 inputs and 1 y left over"),
                    ((inputs, places + [0], y), r"1 entries, 0 inputs and 0 y left over")):
                with self.assertRaisesRegex(mok.MokError, r"torch.ops.mok.forward: places .*" + message):
                    op(layer._op_id, *args)
            # The lists forward_op makes are taken as they are.
            for r in ranks:
                r["y"].fill_(float("nan"))
            op(layer._op_id, inputs, places, y)
            for i, r in enumerate(ranks):
                self.assertTrue(torch.equal(r["y"], want[i]), f"rank {i}'s y differs from forward()'s")

    def test_an_input_that_requires_grad_is_refused_while_autograd_is_on(self):
        # y carries no graph back to the layer's inputs, so with autograd on an input that requires
        # grad (an nn.Parameter) would silently get no gradient from the layer: refused, by both
        # entry points, naming it (PyTorch's out= rule), and nothing is written. Under no_grad, or
        # detached, the same tensors run and give forward()'s bits.
        ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 24)]
        with mok.Layer(PROBLEM, cpu_threads=2) as layer:
            layer.forward(ranks)
            want = [r["y"].clone() for r in ranks]
            cases = [(1, "w_down", lambda r: dict(r, w_down=torch.nn.Parameter(r["w_down"]))),
                     (0, "x", lambda r: dict(r, x=r["x"].clone().requires_grad_())),
                     (1, r"shared\[0\]\.w_up",
                      lambda r: dict(r, shared=[(r["shared"][0][0], torch.nn.Parameter(r["shared"][0][1]),
                                                 r["shared"][0][2])] + list(r["shared"][1:])))]
            for rank, key, make in cases:
                graded = [make(r) if i == rank else dict(r) for i, r in enumerate(ranks)]
                for name, call in (("forward()", layer.forward), ("forward_op()", layer.forward_op)):
                    for r in graded:
                        r["y"].fill_(float("nan"))
                    with self.assertRaisesRegex(mok.MokError, rf"ranks\[{rank}\]\.{key}: requires grad while "
                                                              rf"autograd is on, and {re.escape(name)} runs outside"):
                        call(graded)
                    for i, r in enumerate(graded):
                        self.assertTrue(bool(r["y"].isnan().all()), f"{name} {key}: a refused call wrote rank {i}'s y")
                    with torch.no_grad():
                        call(graded)
                    for i, r in enumerate(graded):
                        self.assertTrue(torch.equal(r["y"], want[i]), f"{name} {key}: rank {i}'s y under no_grad")
            detached = [dict(r, w_gate=torch.nn.Parameter(r["w_gate"]).detach()) for r in ranks]
            layer.forward(detached)
            for i, r in enumerate(detached):
                self.assertTrue(torch.equal(r["y"], want[i]), f"rank {i}'s y with a detached parameter")

    def run_fresh_process(self, body):
        """Runs `body` (Python source) in a fresh interpreter with mok, the tests' helpers and torch
        imported; fails the test, with its output, unless it exits 0."""
        import subprocess
        import textwrap
        paths = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                 os.path.dirname(os.path.abspath(__file__))]
        script = f"import sys\nsys.path[:0] = {paths!r}\nimport torch, mok\n" + \
            "from test_binding import make_inputs\nfrom test_binding_torch import PROBLEM, to_torch\n" + \
            textwrap.dedent(body)
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)

    def test_a_first_forward_op_under_torch_compile_fullgraph_runs(self):
        # (A fresh process: the operator is registered when the Layer is made with torch loaded,
        # so a process's first forward_op may be inside a fullgraph trace, which cannot register it.)
        self.run_fresh_process("""
            ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 25)]
            layer = mok.Layer(PROBLEM, cpu_threads=2)
            torch.compile(lambda rs: layer.forward_op(rs), fullgraph=True, backend="aot_eager")(ranks)
            want = [dict(r, y=torch.full_like(r["y"], float("nan"))) for r in ranks]
            layer.forward(want)
            for i, (r, w) in enumerate(zip(ranks, want)):
                assert torch.equal(r["y"], w["y"]), f"rank {i}: the compiled first forward_op's y differs"
        """)

    def test_a_torch_without_custom_ops_still_makes_layers_and_runs_forward(self):
        # (A fresh process whose torch lacks torch.library.custom_op, as before 2.4: making a Layer
        # registers the operator where it can; forward() needs none, forward_op() says why not.)
        self.run_fresh_process("""
            del torch.library.custom_op
            ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 26)]
            layer = mok.Layer(PROBLEM, cpu_threads=2)
            for r in ranks:  # (NaN before the call: a forward that wrote nothing would leave it)
                r["y"].fill_(float("nan"))
            layer.forward(ranks)
            assert not any(bool(r["y"].isnan().any()) for r in ranks), "forward() left NaN"
            try:
                layer.forward_op(ranks)
            except AttributeError as e:
                assert "custom_op" in str(e), e
            else:
                raise AssertionError("forward_op ran without torch.library.custom_op")
        """)

    def test_two_threads_first_forward_op_register_the_operator_once(self):
        # (A fresh process: the operator is registered by a process's first Layer made with torch
        # loaded, here eight at once, each then running its first forward_op.)
        self.run_fresh_process("""
            import threading
            layers = [None] * 8
            inputs = [[to_torch(r, "cpu") for r in make_inputs(PROBLEM, 30 + i)] for i in range(8)]
            barrier, errors = threading.Barrier(8), []
            def first_call(i):
                barrier.wait()
                try:
                    layers[i] = mok.Layer(PROBLEM)
                    layers[i].forward_op(inputs[i])
                except BaseException as e:
                    errors.append(repr(e))
            threads = [threading.Thread(target=first_call, args=(i,)) for i in range(8)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            print("errors:", errors)
            sys.exit(1 if errors else 0)
        """)


class TorchCuda(SeededTest):
    @classmethod
    def setUpClass(cls):
        if torch is None:
            raise unittest.SkipTest("PyTorch is not installed: torch binding test skipped")
        if not torch.cuda.is_available():
            raise unittest.SkipTest("no CUDA GPU for PyTorch: torch binding test skipped")
        if not mok.cuda_available():
            raise unittest.SkipTest(f"{mok.library_path()} has no cuda backend or sees no GPU: test skipped")

    def test_cuda_forward_matches_the_cpu_backend_and_replays_in_a_graph(self):
        ranks = make_inputs(PROBLEM, 11)
        with mok.Layer(PROBLEM) as cpu_layer:  # the reference backend, numpy arrays
            cpu_layer.forward(ranks)
        stream = torch.cuda.Stream()
        gpu = [to_torch(r, "cuda") for r in ranks]
        for r in gpu:
            r["y"].fill_(float("nan"))
        with mok.Layer(PROBLEM, backend="cuda", cuda_stream=stream.cuda_stream) as layer:
            with torch.cuda.stream(stream):
                layer.forward(gpu)
            layer.synchronize()
            first = [y_bits(r) for r in gpu]
            refs = reference_forward(PROBLEM, ranks)
            for i, (bits, cpu, ref) in enumerate(zip(first, ranks, refs)):
                ok, stats = close(from_bf16(bits), from_bf16(cpu["y"]))
                self.assertTrue(ok, f"rank {i}: cuda vs cpu backend: {stats}")
                ok, stats = close(from_bf16(bits), ref)
                self.assertTrue(ok, f"rank {i}: cuda vs the definition: {stats}")

            with torch.cuda.stream(stream):
                for r in gpu:
                    r["y"].zero_()
                layer.forward(gpu)
            layer.synchronize()
            for i, r in enumerate(gpu):
                self.assertTrue(np.array_equal(y_bits(r), first[i]), f"rank {i}: a second forward changed bits")

            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                layer.forward(gpu)
            expect_replays_give(self, graph, stream, gpu, first, times=3, fill=0.0)
            layer.synchronize()

    def test_the_callers_tensors_are_marked_used_on_the_layers_stream(self):
        # A tensor made on the fly on the caller's stream and dropped at once must not be handed
        # out again before the layer's stream has read it: record_stream on every CUDA tensor
        # of the call (the shared experts' too), with the layer's stream; none in a capture.
        ranks = [to_torch(r, "cuda") for r in make_inputs(PROBLEM, 21)]
        stream = torch.cuda.Stream()
        seen = []
        original = torch.Tensor.record_stream

        def spy(t, s):
            seen.append((t.data_ptr(), s.cuda_stream))
            return original(t, s)

        torch.Tensor.record_stream = spy
        try:
            with mok.Layer(PROBLEM, backend="cuda", cuda_stream=stream.cuda_stream) as layer:
                layer.forward(ranks)
                layer.synchronize()
                want = {(t.data_ptr(), stream.cuda_stream) for r in ranks for key, v in r.items()
                        for t in ([w for e in v for w in e] if key == "shared" else [v])}
                self.assertEqual(set(seen), want)
                seen.clear()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    layer.forward(ranks)
                self.assertEqual(seen, [], "record_stream inside a capture")
                graph.replay()
                layer.synchronize()
            with mok.Layer(PROBLEM, backend="cuda") as layer:  # the legacy default stream
                layer.forward(ranks)
                layer.synchronize()
                self.assertTrue(seen and all(s == torch.cuda.default_stream().cuda_stream for _, s in seen), seen)
        finally:
            torch.Tensor.record_stream = original

    def test_a_fresh_y_per_call_and_then_a_graph_with_its_own_y(self):
        """A training loop's allocator hands out a new y per call: after more than the layer's 8
        argument slots, a capture with yet another y (allocated in the graph's pool) takes the
        least recently used slot, as an eager call does."""
        ranks = make_inputs(PROBLEM, 12)
        stream = torch.cuda.Stream()
        gpu = [to_torch(r, "cuda") for r in ranks]
        with mok.Layer(PROBLEM, backend="cuda", cuda_stream=stream.cuda_stream) as layer:
            with torch.cuda.stream(stream):
                layer.forward(gpu)
            layer.synchronize()
            first = [y_bits(r) for r in gpu]
            kept = []
            with torch.cuda.stream(stream):
                for _ in range(10):
                    fresh = [dict(r, y=torch.full_like(r["y"], float("nan"))) for r in gpu]
                    layer.forward(fresh)
                    kept.append(fresh)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                in_graph = [dict(r, y=torch.empty_like(r["y"])) for r in gpu]
                layer.forward(in_graph)
            layer.synchronize()
            for n, fresh in enumerate(kept):
                for i, r in enumerate(fresh):
                    self.assertTrue(np.array_equal(y_bits(r), first[i]), f"eager call {n}, rank {i}: bits changed")
            expect_replays_give(self, graph, stream, in_graph, first, times=2, fill=float("nan"))
            layer.synchronize()

    def test_autograd_sees_the_layers_writes(self):
        """y is written in place: a tensor an earlier op saved for its backward must fail that
        backward (as after an in-place op) rather than give wrong gradients; inference tensors,
        which have no version counter, are written without complaint."""
        gpu = [to_torch(r, "cuda") for r in make_inputs(PROBLEM, 19)]
        w = torch.ones(PROBLEM.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        z = (gpu[0]["y"] * w).sum()  # (mul saves y for w's gradient)
        stream = torch.cuda.current_stream()
        with mok.Layer(PROBLEM, backend="cuda", cuda_stream=stream.cuda_stream) as layer:
            layer.forward(gpu)
            layer.synchronize()
            with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
                z.backward()
            with torch.inference_mode():
                served = [dict(r, y=torch.full_like(r["y"], float("nan"))) for r in gpu]
                layer.forward(served)
            layer.synchronize()
            for a, b in zip(gpu, served):
                self.assertTrue(torch.equal(a["y"], b["y"]))

    def test_forward_op_under_torch_compile_gives_forwards_bits(self):
        gpu = [to_torch(r, "cuda") for r in make_inputs(PROBLEM, 22)]
        stream = torch.cuda.current_stream()
        with mok.Layer(PROBLEM, backend="cuda", cuda_stream=stream.cuda_stream) as layer:
            layer.forward(gpu)
            layer.synchronize()
            want = [y_bits(r) for r in gpu]
            compiled = torch.compile(lambda rs: layer.forward_op(rs), fullgraph=True)
            for r in gpu:
                r["y"].fill_(float("nan"))
            compiled(gpu)
            layer.synchronize()
            for i, r in enumerate(gpu):
                self.assertTrue(np.array_equal(y_bits(r), want[i]), f"rank {i}: the compiled operator's y differs")
        torch._dynamo.reset()

    def test_forward_op_under_reduce_overhead_runs_the_layer_every_call(self):
        # torch.compile(mode="reduce-overhead") records CUDA graphs on its own stream, which
        # the layer's does not join: each call must still run the layer on its inputs of the
        # moment (two input sets alternating in the same tensors), never replay a stale y.
        gpu = [to_torch(r, "cuda") for r in make_inputs(PROBLEM, 24)]
        # (The same weights, other tokens and routing.)
        other = [dict(g, **{k: v for k, v in to_torch(r, "cuda").items() if k in ("x", "top_experts",
                                                                                 "router_weights", "y")})
                 for g, r in zip(gpu, make_inputs(PROBLEM, 25))]
        stream = torch.cuda.current_stream()
        with mok.Layer(PROBLEM, backend="cuda", cuda_stream=stream.cuda_stream) as layer:
            want = []
            for inputs in (gpu, other):
                layer.forward(inputs)
                layer.synchronize()
                want.append([y_bits(r) for r in inputs])
            saved = [{k: v.clone() for k, v in r.items() if isinstance(v, torch.Tensor)} for r in gpu]

            def run(rs):
                layer.forward_op(rs)
                return [r["y"] * 1 for r in rs]
            compiled = torch.compile(run, mode="reduce-overhead", fullgraph=True)
            for call in range(6):
                which = call % 2
                source = saved if which == 0 else other
                for r, s in zip(gpu, source):
                    for key in ("x", "top_experts", "router_weights"):
                        r[key].copy_(s[key])
                    r["y"].fill_(float("nan"))
                out = compiled(gpu)
                layer.synchronize()
                torch.cuda.synchronize()
                for i, r in enumerate(gpu):
                    self.assertTrue(np.array_equal(y_bits(r), want[which][i]),
                                    f"call {call}, rank {i}: y is not the layer's for these inputs")
                    got = out[i].view(torch.int16).cpu().numpy().view(np.uint16)
                    self.assertTrue(np.array_equal(got, want[which][i]), f"call {call}, rank {i}: returned y differs")
        torch._dynamo.reset()

    def test_a_rank_slice_with_its_slots_filled_gives_the_bits_of_virtual_ranks(self):
        ranks = make_inputs(PROBLEM, 15)
        virtual = [to_torch(r, "cuda") for r in ranks]
        with mok.Layer(PROBLEM, backend="cuda") as layer:
            layer.forward(virtual)
            layer.synchronize()
            pushed_to_1 = layer.combine_slots(1).clone()  # what every rank pushed to rank 1
        active = 1
        sliced = [to_torch(r, "cuda") for r in ranks]
        for r, rank in enumerate(sliced):
            if r != active:  # another rank of the group: its inputs only
                for key in ("w_gate", "w_up", "w_down", "y"):
                    rank[key] = None
                rank["shared"] = []
        layer = mok.Layer(PROBLEM, backend="cuda", ep_mode="rank_slice", active_rank=active)
        native = weakref.ref(layer._native)
        slots = layer.combine_slots(active)
        slots.copy_(pushed_to_1)
        # The rows the active rank computes for itself: NaN, so that y matches only if the slice
        # computed them (the copy above holds them from the virtual run).
        experts_per_rank = PROBLEM.num_experts // PROBLEM.ep_size
        own = torch.from_numpy(ranks[active]["top_experts"].reshape(-1) // experts_per_rank == active).to("cuda")
        self.assertTrue(bool(own.any()), "the active rank routes no token to its own experts")
        slots[own] = float("nan")
        torch.cuda.synchronize()
        # Another rank's y, when given, is neither checked nor written: one that requires grad
        # (refused as an output the layer writes) is taken here and left as it was.
        sliced[0]["y"] = torch.zeros(PROBLEM.tokens_per_rank, PROBLEM.hidden, dtype=torch.bfloat16, device="cuda",
                                     requires_grad=True)
        layer.forward(sliced)
        layer.synchronize()
        self.assertFalse(bool(sliced[0]["y"].detach().any()), "a slice wrote another rank's y")
        del layer
        gc.collect()
        self.assertIsNotNone(native(), "the layer went while a view of its slots was alive")
        del slots
        gc.collect()
        self.assertIsNone(native(), "the layer outlived the last view of its slots")
        self.assertTrue(np.array_equal(y_bits(sliced[active]), y_bits(virtual[active])),
                        "the slice's y differs from virtual ranks'")

    def test_a_device_error_is_raised_by_synchronize_and_y_is_nan(self):
        ranks = make_inputs(PROBLEM, 12)
        ranks[1]["top_experts"][5, 0] = 123
        gpu = [to_torch(r, "cuda") for r in ranks]
        with mok.Layer(PROBLEM, backend="cuda") as layer:
            layer.forward(gpu)
            with self.assertRaisesRegex(mok.MokError, r"top_experts\[rank 1\]\[token 5, slot 0\] = 123"):
                layer.synchronize()
        self.assertTrue(torch.isnan(gpu[0]["y"].float()).all().item())

    def test_close_leaves_live_slot_views_valid_and_the_last_one_destroys_the_layer(self):
        gpu = [to_torch(r, "cuda") for r in make_inputs(PROBLEM, 18)]
        layer = mok.Layer(PROBLEM, backend="cuda")
        layer.forward(gpu)
        layer.synchronize()
        slots = layer.combine_slots(1)
        want = slots.clone()
        native = weakref.ref(layer._native)
        layer.close()
        with self.assertRaisesRegex(mok.MokError, "after close"):
            layer.combine_slots(1)
        gc.collect()
        self.assertIsNotNone(native(), "close() destroyed the layer under a live view of its slots")
        self.assertTrue(torch.equal(slots, want))
        slots.fill_(0)
        torch.cuda.synchronize()
        del slots
        gc.collect()
        self.assertIsNone(native(), "the layer outlived the last view of its slots")

    def test_a_slot_view_handed_back_as_y_is_refused(self):
        gpu = [to_torch(r, "cuda") for r in make_inputs(PROBLEM, 19)]
        with mok.Layer(PROBLEM, backend="cuda") as layer:
            bad = [dict(r) for r in gpu]
            bad[0]["y"] = layer.combine_slots(1)[:PROBLEM.tokens_per_rank]
            with self.assertRaisesRegex(mok.MokError, r"combine_slots\(1\).*must not share bytes"):
                layer.forward(bad)
            layer.forward(gpu)  # the refused call launched nothing
            layer.synchronize()

    def test_a_view_kept_on_its_layer_does_not_keep_the_layer(self):
        # The tensor -> view edge is inside torch's storage, unseen by the garbage collector:
        # a view holding its Layer would make an uncollectable cycle here.
        layer = mok.Layer(PROBLEM, backend="cuda")
        native = weakref.ref(layer._native)
        layer.kept = layer.combine_slots(0)
        del layer
        gc.collect()
        self.assertIsNone(native(), "a layer holding a view of its own slots was never destroyed")

    def _expect_destroy_waits_for_the_capture(self, handle, inside, after=None):
        """Runs `inside` within a torch.cuda.graph capture (beside a small captured add), where
        a destroy (cudaFree) would break the capture: the layer `handle` must be parked, the
        graph replay, `after` (if any) run, and the next Layer call destroy it."""
        stream = torch.cuda.Stream()
        a = torch.zeros(256, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            a.add_(1)  # (warm-up outside the capture)
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                a.add_(1)
                inside()
        self.assertIn(handle, [h.value for h, _, _ in mok._parked], "the layer was not left for after the capture")
        if after is not None:
            after()
        graph.replay()
        torch.cuda.synchronize()
        self.assertEqual(a[0].item(), 2.0)
        mok.Layer(PROBLEM, backend="cuda").close()  # the next Layer call destroys it
        self.assertNotIn(handle, [h.value for h, _, _ in mok._parked])

    def test_a_view_dropped_inside_a_graph_capture_destroys_its_layer_after_it(self):
        layer = mok.Layer(PROBLEM, backend="cuda")
        views = [layer.combine_slots(0)]
        handle = layer._native.handle.value
        layer.close()
        # (The last view dropped inside the capture.)
        self._expect_destroy_waits_for_the_capture(handle, views.clear)

    def test_a_layer_closed_inside_a_graph_capture_is_destroyed_after_it(self):
        # close() (or leaving a `with` block) inside torch.cuda.graph: the destroy (cudaFree)
        # would break the capture, so it waits for the next call, as a dropped last view does.
        layer = mok.Layer(PROBLEM, backend="cuda")

        def used_after_close():
            with self.assertRaisesRegex(mok.MokError, "used after close"):
                layer.synchronize()
        self._expect_destroy_waits_for_the_capture(layer._native.handle.value, layer.close, used_after_close)

    def _group_of_one(self, p):
        """A distributed layer of this one process, or a skip without a usable NCCL; call it with
        the launcher's variables set (group_of_one_env)."""
        try:
            return mok.Layer(p, backend="cuda", ep_mode="distributed")
        except mok.MokError as e:
            if "NCCL" in str(e) and ("libnccl" in str(e) or "MOK_NCCL_LIBRARY" in str(e)):
                self.skipTest(f"no usable NCCL (scripts/group_env.sh finds PyTorch's): {e}")
            raise

    def test_a_group_of_one_process_through_nccl_gives_the_bits_of_virtual_ranks(self):
        with group_of_one_env():
            p = mok.Problem(num_experts=8, hidden=256, intermediate=128, top_k=2, shared_intermediate=[128],
                            ep_size=1, tokens_per_rank=64)
            ranks = make_inputs(p, 14)
            virtual, group = [to_torch(r, "cuda") for r in ranks], [to_torch(r, "cuda") for r in ranks]
            with mok.Layer(p, backend="cuda") as layer:
                layer.forward(virtual)
                layer.synchronize()
            with self._group_of_one(p) as layer:
                layer.forward(group)
                layer.synchronize()
            self.assertTrue(np.array_equal(y_bits(group[0]), y_bits(virtual[0])),
                            "a group of one's y differs from virtual ranks'")
            ok, stats = close(from_bf16(y_bits(group[0])), reference_forward(p, ranks)[0])
            self.assertTrue(ok, stats)

    def test_a_group_is_abandoned_on_request_and_never_destroyed_collectively_under_live_views(self):
        with group_of_one_env():
            p = mok.Problem(num_experts=8, hidden=256, intermediate=128, top_k=2, ep_size=1, tokens_per_rank=64)
            group = [to_torch(r, "cuda") for r in make_inputs(p, 19)]
            layer = self._group_of_one(p)
            layer.forward(group)
            layer.synchronize()
            slots = layer.combine_slots(0)
            # The collective destroy cannot wait for the view: close() refuses and the layer goes on.
            with self.assertRaisesRegex(mok.MokError, r"1 combine_slots view\(s\) of this distributed layer"):
                layer.close()
            layer.forward(group)
            layer.synchronize()
            want = slots.clone()
            self.assertFalse(layer.group_aborted)
            layer.abandon_group("the test gave up")
            self.assertTrue(layer.group_aborted)
            with self.assertRaisesRegex(mok.MokError, "abandoned the group: the test gave up"):
                layer.forward(group)
            native = weakref.ref(layer._native)
            layer.close()  # (aborted: no collective destroy, so it may wait for the view)
            gc.collect()
            self.assertIsNotNone(native())
            self.assertTrue(torch.equal(slots, want), "the view's memory changed under it after close()")
            del slots
            gc.collect()
            self.assertIsNone(native(), "the layer outlived the last view of its slots")
            # close(after_error=True) with a live view abandons the group itself.
            layer = self._group_of_one(p)
            slots = layer.combine_slots(0)
            native = weakref.ref(layer._native)
            layer.close(after_error=True)
            gc.collect()
            self.assertIsNotNone(native())
            del slots
            gc.collect()
            self.assertIsNone(native())
            with self._group_of_one(p) as again:  # the process can build a new group
                again.forward(group)
                again.synchronize()

    def test_a_dropped_view_in_a_reference_cycle_does_not_block_a_collective_close(self):
        with group_of_one_env():
            p = mok.Problem(num_experts=8, hidden=256, intermediate=128, top_k=2, ep_size=1, tokens_per_rank=64)
            layer = self._group_of_one(p)
            native = weakref.ref(layer._native)
            holder = {"slots": layer.combine_slots(0)}
            holder["self"] = holder  # unreachable after the del, but alive until the collector runs
            gc.disable()
            try:
                del holder
                self.assertEqual(len(layer._native.views), 1, "the cycle did not keep the view")
                layer.close()  # collective, not aborted: would refuse if it counted the dead view
            finally:
                gc.enable()
            self.assertIsNone(native(), "close() left the layer alive")
            # A view still in use is refused as before.
            layer = self._group_of_one(p)
            slots = layer.combine_slots(0)
            with self.assertRaisesRegex(mok.MokError, r"1 combine_slots view\(s\) of this distributed layer"):
                layer.close()
            del slots
            layer.close()

    def test_tensors_on_the_wrong_device_are_named(self):
        ranks = [to_torch(r, "cpu") for r in make_inputs(PROBLEM, 13)]
        with mok.Layer(PROBLEM, backend="cuda") as layer:
            with self.assertRaisesRegex(mok.MokError, r"x\[rank 0\].*cuda"):
                layer.forward(ranks)


if __name__ == "__main__":
    unittest.main()
