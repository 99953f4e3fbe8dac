"""bench/peer_torch.py's pipeline on PyTorch's CPU backend, on synthetic work directories:
its routed rows and y pass the check, and a pipeline that does not place its own rows in their
combine slots fails it. Skipped where PyTorch is not installed (CI installs numpy and
matplotlib only); the GPU runs the same code through bench/run.py."""
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
import workdir  # noqa: E402
from synth_workdir import make_workdir  # noqa: E402

try:
    import torch
except ImportError:
    torch = None


@unittest.skipIf(torch is None or not hasattr(torch, "_grouped_mm"),
                 "PyTorch (with torch._grouped_mm) is not installed: peer_torch CPU test skipped")
class PeerOnCpu(unittest.TestCase):
    def setUp(self):
        import peer_torch
        self.peer = peer_torch
        # (check_forward waits for the GPU; on the CPU there is nothing to wait for.)
        self.saved_sync, torch.cuda.synchronize = torch.cuda.synchronize, lambda *a, **k: None

    def tearDown(self):
        torch.cuda.synchronize = self.saved_sync

    def test_the_pipeline_passes_and_must_place_its_own_rows(self):
        cases = ({}, {"ep_size": 1, "ep_mode": "all", "shared": (), "num_experts": 4, "top_k": 2},
                 {"shared": (128, 64), "swiglu_limit": 0.5, "active_rank": 1})
        for kw in cases:
            with self.subTest(**{k: str(v) for k, v in kw.items()}), tempfile.TemporaryDirectory() as d:
                make_workdir(d, **kw)
                doc, arrays = workdir.load_work(d)
                tol = checks.tolerance(doc["problem"]["precision"])
                res = self.peer.check_forward(self.peer.Work(doc, arrays, "cpu"), tol)
                self.assertTrue(res["passes"], res)
                # y from the file's slots alone (the rank's own rows not placed) fails.
                w = self.peer.Work(doc, arrays, "cpu")
                y = self.peer.local_y(w.x_local, w.shared, w.router_weights, w.combine_local, w.limit)
                st = checks.compare(y.float(), w.y_ref.float(), torch)
                self.assertFalse(checks.passes(st, tol), st)
                self.assertGreater(st["non_finite"], 0)

    def test_rows_that_arrive_in_any_order_are_unpermuted_to_where_they_go(self):
        # mok bench writes the rows in expert order (the argsort is then the identity); the
        # same rows shuffled must give the same check, so that the unpermute's inverse is used.
        import numpy as np
        for kw in ({}, {"ep_size": 1, "ep_mode": "all", "shared": (), "num_experts": 4, "top_k": 2}):
            with self.subTest(**{k: str(v) for k, v in kw.items()}), tempfile.TemporaryDirectory() as d:
                make_workdir(d, **kw)
                doc, arrays = workdir.load_work(d)
                perm = np.random.default_rng(5).permutation(len(arrays["row_source"]))
                self.assertFalse(np.array_equal(perm, np.arange(len(perm))))
                for name in ("row_source", "row_expert", "row_weight", "row_slot", "rows_ref"):
                    arrays[name] = np.ascontiguousarray(arrays[name][perm])
                tol = checks.tolerance(doc["problem"]["precision"])
                res = self.peer.check_forward(self.peer.Work(doc, arrays, "cpu"), tol)
                self.assertTrue(res["passes"], res)

    def test_a_slice_whose_slots_are_all_its_own_still_sends_the_remote_rows(self):
        # Every token of both ranks routed to rank 0's experts (worst-case routing, E/R >= k):
        # rank 0's own rows fill all of its T*k slots, and rank 1's rows still arrive and must
        # go back through the send buffer. (The one-gather shortcut is for EP = 1 alone.)
        import numpy as np
        T, k = 64, 2
        top = np.stack([np.arange(2 * T) % 4, (np.arange(2 * T) + 1) % 4], axis=1)
        with tempfile.TemporaryDirectory() as d:
            make_workdir(d, tokens=T, top_k=k, top_experts=top)
            doc, arrays = workdir.load_work(d)
            w = self.peer.Work(doc, arrays, "cpu")
            self.assertEqual(int(w.own_rows.numel()), T * k)
            self.assertEqual(int(w.remote_rows.numel()), T * k)
            res = self.peer.check_forward(w, checks.tolerance(doc["problem"]["precision"]))
            self.assertTrue(res["passes"], res)
            sent = w.routed_out()[w.remote_rows]
            ref = w.rows_ref[w.remote_rows]
            self.assertTrue(torch.isfinite(sent.float()).all())
            st = checks.compare(sent.float(), ref.float(), torch)
            self.assertTrue(checks.passes(st, checks.tolerance(doc["problem"]["precision"])), st)

    def test_the_profile_lists_where_a_forward_goes(self):
        with tempfile.TemporaryDirectory() as d:
            make_workdir(d)
            doc, arrays = workdir.load_work(d)
            prof = self.peer.profile_forward(self.peer.Work(doc, arrays, "cpu"), 2)
        self.assertEqual((prof["iters"], prof["what"]), (2, "CPU operators' self time"))
        self.assertTrue(prof["top"], prof)
        names = [r["name"] for r in prof["top"]]
        self.assertTrue(any("grouped_mm" in n for n in names), names)  # (the pipeline's GEMMs ran)
        self.assertTrue(all(r["us_per_forward"] > 0 and r["calls_per_forward"] > 0 for r in prof["top"]))
        self.assertEqual([r["us_per_forward"] for r in prof["top"]],
                         sorted((r["us_per_forward"] for r in prof["top"]), reverse=True))
        self.assertGreaterEqual(prof["total_us_per_forward"], sum(r["us_per_forward"] for r in prof["top"]) - 1e-6)


@unittest.skipIf(torch is None, "PyTorch is not installed: peer_torch's run order test skipped")
class RunOrder(unittest.TestCase):
    def test_the_profile_runs_after_every_timing_the_ceilings_included(self):
        # A profiler may leave later launches slower (CUPTI stays set up): nothing timed may follow it.
        import argparse
        from unittest import mock
        import peer_torch
        calls = []

        def part(name, value=None):
            return lambda *a, **k: calls.append(name) or value

        args = argparse.Namespace(work_dir="w", warmup=1, iters=1, ceiling_warmup=1, ceiling_iters=1, gemm_n=64,
                                  copy_gib=0.001, seed=1, no_backward=False, no_ceilings=False, profile=2)
        with mock.patch.multiple(peer_torch, gpu_env=lambda: {}, Work=part("work", object()),
                                 measure_peer=part("forward, grouped GEMMs, backward", True),
                                 ceiling_dense_bf16=part("dense"), ceiling_fp8=part("fp8"),
                                 ceiling_copy=part("copy"), profile_forward=part("profile", {"iters": 2})), \
                mock.patch.object(torch.cuda, "empty_cache", lambda: None):
            result, ok = peer_torch.run(args, {"shape": "s", "problem": {}}, {})
            self.assertTrue(ok)
            self.assertEqual(calls, ["work", "forward, grouped GEMMs, backward", "dense", "fp8", "fp8", "copy",
                                     "profile"])
            self.assertEqual(result["profile"], {"iters": 2})
            calls.clear()
            args.profile = 0
            result, _ = peer_torch.run(args, {"shape": "s", "problem": {}}, {})
            self.assertNotIn("profile", calls)
            self.assertNotIn("profile", result)


if __name__ == "__main__":
    unittest.main()
