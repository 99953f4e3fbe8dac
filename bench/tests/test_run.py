"""run.py without a GPU, and driven end to end by a fake `mok bench` and a fake torch.

No real torch is needed or imported: a fake `torch` package on PYTHONPATH either fails to
import, reports no CUDA, or reports a CUDA device (for the --no-peer end-to-end run).
"""
import contextlib
import glob
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import unittest
from unittest import mock

import helpers

import checks
import records
import run

RUN_PY = os.path.join(helpers.BENCH_DIR, "run.py")
PEER_PY = os.path.join(helpers.BENCH_DIR, "peer_torch.py")
FAKE_MOK = os.path.join(helpers.TESTS_DIR, "fake_mok.py")
FAKE_MOK_CMD = shlex.join([sys.executable, FAKE_MOK])  # (--mok-bin is split like a shell would)

FAKE_TORCH = {
    "missing": "raise ImportError('simulated: no torch here')\n",
    "no_cuda": "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n",
    "cuda": ("class cuda:\n    @staticmethod\n    def is_available():\n        return True\n"
             "    @staticmethod\n    def get_device_name(i=0):\n        return 'FAKE-GPU (test)'\n"),
}


def run_with_fake_torch(kind, args, extra_env=None, script=RUN_PY):
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "torch"))
        with open(os.path.join(d, "torch", "__init__.py"), "w") as f:
            f.write(FAKE_TORCH[kind])
        e = dict(os.environ, PYTHONPATH=d + os.pathsep + os.environ.get("PYTHONPATH", ""))
        e.update(extra_env or {})
        return subprocess.run([sys.executable, script] + args, capture_output=True, text=True, env=e, timeout=600)


def peer_writing_fixture(exit_code):
    """A stand-in for the peer's process (run_one's subprocess.call of it): writes the fixture's
    passing peer.json into the work directory, then exits with `exit_code`. Its GPU is the fake
    mok's (a peer on another GPU than mok fails the record)."""
    def peer(work):
        doc = helpers.fixture("fixture_peer_qwen35_slice.json")
        doc["env"]["gpu"] = helpers.read_json(os.path.join(work, "mok.json"))["gpu"]["name"]
        with open(os.path.join(work, "peer.json"), "w") as f:
            json.dump(doc, f)
        return exit_code
    return peer


class NoGpu(unittest.TestCase):
    def test_flag(self):
        r = subprocess.run([sys.executable, RUN_PY, "--assume-no-gpu"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("no CUDA GPU", r.stderr)

    def test_torch_missing(self):
        r = run_with_fake_torch("missing", [])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("run.py: no CUDA GPU: PyTorch cannot be imported", r.stderr)
        self.assertIn("bench/README.md", r.stderr)
        self.assertEqual(r.stdout, "")

    def test_cuda_unavailable(self):
        r = run_with_fake_torch("no_cuda", ["--shapes", "glm-5.2"])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("torch.cuda.is_available() is False", r.stderr)

    def test_peer_without_gpu(self):
        r = run_with_fake_torch("missing", ["/nonexistent"], script=PEER_PY)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("no CUDA GPU", r.stderr)

    def test_peer_refuses_a_bad_work_directory_by_name(self):
        # A CUDA "GPU" (the fake torch) and a work directory without mok.json: a named error and
        # exit 1, no traceback, no peer.json.
        with tempfile.TemporaryDirectory() as d:
            r = run_with_fake_torch("cuda", [d], script=PEER_PY)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn(f"peer_torch.py: {d}: not a usable work directory: {d}/mok.json: missing", r.stderr)
            self.assertNotIn("Traceback", r.stderr)
            self.assertEqual(os.listdir(d), [])


def ns(**kw):
    base = dict(shapes=None, sweep=False, sweep_tokens=None, ep_mode=None, ep=None, tokens=None, launch=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


class Plan(unittest.TestCase):
    def test_repeat_runs_the_whole_list_pass_after_pass(self):
        once = run.plan_runs(ns(shapes="glm-5.2,qwen3-30b-a3b"))
        self.assertEqual(run.plan_runs(ns(shapes="glm-5.2,qwen3-30b-a3b", repeat=2)), once + once)
        sweep = run.plan_runs(ns(shapes="qwen3.5-397b-a17b", sweep=True, sweep_tokens="512,1024", repeat=3))
        self.assertEqual([r[3] for r in sweep], [512, 1024] * 3)

    def test_defaults(self):
        runs = run.plan_runs(ns())
        self.assertEqual(runs, [("qwen3.5-397b-a17b", "slice", 64, 2048), ("deepseek-v4-pro", "slice", 64, 2048),
                                ("kimi-k2.7-code", "slice", 64, 2048), ("glm-5.2", "slice", 64, 2048),
                                ("qwen3-30b-a3b", "all", 1, 16384), ("mixtral-8x7b", "all", 1, 4096),
                                ("gpt-oss-20b", "all", 1, 4096)])

    def test_overrides_and_unknown_shape(self):
        self.assertEqual(run.plan_runs(ns(shapes="glm-5.2,medium", tokens=512)),
                         [("glm-5.2", "slice", 64, 512), ("medium", None, None, 512)])
        self.assertEqual(run.plan_runs(ns(shapes="glm-5.2", ep_mode="all", ep=8)), [("glm-5.2", "all", 8, 2048)])

    def test_sweep(self):
        runs = run.plan_runs(ns(shapes="qwen3.5-397b-a17b", sweep=True))
        self.assertEqual([r[3] for r in runs], [512, 1024, 2048, 4096, 8192, 16384])
        self.assertTrue(all(r[:3] == ("qwen3.5-397b-a17b", "slice", 64) for r in runs))
        self.assertEqual([r[3] for r in run.plan_runs(ns(shapes="qwen3-30b-a3b", sweep=True, sweep_tokens="512,1024"))],
                         [512, 1024])
        with self.assertRaises(SystemExit):
            run.plan_runs(ns(sweep=True))

    def test_launch_refuses_the_options_that_choose_other_runs(self):
        self.assertEqual(run.plan_runs(ns(launch=2, shapes="glm-5.2")), [("glm-5.2", "distributed", 2, 2048)])
        for kw in (dict(sweep=True), dict(sweep_tokens="512"), dict(ep=8), dict(ep_mode="slice")):
            with self.assertRaises(SystemExit) as cm:
                run.plan_runs(ns(launch=2, shapes="glm-5.2", **kw))
            self.assertIn("does not apply with --launch", str(cm.exception))

    def test_mok_command(self):
        args = types.SimpleNamespace(mok_bin="build/bin/mok", dtype=None, routing="zipf:1.2", warmup=500, iters=100,
                                     mok_arg=["--comm-sms 32"], no_peer=False)
        self.assertEqual(run.mok_command(args, "glm-5.2", "slice", 64, 2048, "/w"),
                         ["build/bin/mok", "bench", "--shape", "glm-5.2", "--ep-mode", "slice", "--ep", "64",
                          "--tokens", "2048", "--routing", "zipf:1.2", "--warmup", "500", "--iters", "100",
                          "--work-dir", "/w", "--comm-sms", "32"])
        args.dtype = "mxfp8"
        args.mok_bin = "python3 fake.py"
        cmd = run.mok_command(args, "medium", None, None, None, "/w")
        self.assertEqual(cmd[:5], ["python3", "fake.py", "bench", "--shape", "medium"])
        self.assertIn("--dtype", cmd)
        self.assertNotIn("--ep", cmd)
        args.mok_bin = "build/bin/mok"
        cmd = run.mok_command(args, "qwen3.5-397b-a17b", "distributed", 8, 2048, "/w")
        self.assertEqual(cmd[:11], ["build/bin/mok", "launch", "-n", "8", "--timeout", str(run.LAUNCH_TIMEOUT_S),
                                    "--", "build/bin/mok", "bench", "--shape", "qwen3.5-397b-a17b"])
        args.ceiling_warmup, args.ceiling_iters, args.no_backward, args.profile_peer = 1, 2, True, 3
        peer = run.peer_command(args, "/w", "distributed", 8)
        self.assertEqual(peer[:7], ["build/bin/mok", "launch", "-n", "8", "--timeout", str(run.LAUNCH_TIMEOUT_S),
                                    "--"])
        self.assertTrue(peer[8].endswith("peer_dist.py"))
        self.assertNotIn("--no-backward", peer)
        self.assertNotIn("--profile", peer)
        peer = run.peer_command(args, "/w", "slice", 64)
        self.assertTrue(peer[1].endswith("peer_torch.py"))
        self.assertIn("--no-backward", peer)
        self.assertEqual(peer[peer.index("--profile") + 1], "3")


class Options(unittest.TestCase):
    """Bad options are refused by name before anything runs (here: before the GPU check, which
    the fake torch would fail with exit 2 and 'no CUDA GPU')."""

    def refused(self, args, message, rc=2):
        r = run_with_fake_torch("missing", args)
        self.assertEqual(r.returncode, rc, r.stdout + r.stderr)
        self.assertIn(message, r.stderr)
        self.assertNotIn("no CUDA GPU", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_zero_is_refused_not_the_default(self):
        for opt in ("--tokens", "--ep", "--launch", "--ceiling-iters", "--iters", "--repeat"):
            self.refused([opt, "0"], f"{opt} must be >= 1 (got 0)")
        for opt in ("--ceiling-warmup", "--warmup", "--profile-peer"):
            self.refused([opt, "-1"], f"{opt} must be >= 0 (got -1)")
        self.refused(["--launch", "2", "--profile-peer", "5"], "--profile-peer profiles the one-process peer")
        self.refused(["--no-peer", "--profile-peer", "5"], "--profile-peer profiles the peer, which --no-peer")

    def test_options_that_do_not_apply_are_refused(self):
        self.refused(["--shapes", "glm-5.2", "--sweep-tokens", "512"], "--sweep-tokens applies only with --sweep", 1)
        self.refused(["--shapes", "glm-5.2", "--sweep", "--tokens", "64"], "--tokens does not apply with --sweep", 1)
        self.refused(["--shapes", "glm-5.2", "--sweep", "--sweep-tokens", "512,abc"],
                     "--sweep-tokens: 'abc' is not a whole number >= 1", 1)
        self.refused(["--shapes", "glm-5.2", "--sweep", "--sweep-tokens", "512,0"],
                     "--sweep-tokens: '0' is not a whole number >= 1", 1)

    def test_shape_names_are_checked_before_anything_runs(self):
        # A shape name is joined onto --work-root, which run.py deletes and recreates: a path
        # ("/tmp/x", "../x") would have deleted /tmp/x_all_1_64 or a sibling of the work root.
        self.refused(["--shapes", "/tmp/x"], "--shapes: '/tmp/x' is not a shape name")
        self.refused(["--shapes", "glm-5.2,../x"], "--shapes: '../x' is not a shape name")
        self.refused(["--shapes", ".hidden"], "--shapes: '.hidden' is not a shape name")
        self.refused(["--shapes=-x"], "--shapes: '-x' is not a shape name")
        for empty in ("a,,b", ",", "", "glm-5.2,"):
            self.refused(["--shapes", empty], "an empty name")
        self.refused(["--shapes", "glm-5.2, glm-5.2"], "--shapes: 'glm-5.2' is given twice")
        self.assertEqual(run.shape_errors(" glm-5.2 , mixtral-8x7b "), [])
        self.assertEqual(run.shape_errors(None), [])
        # Blanks around a name are stripped (" glm-5.2" is glm-5.2, not an unknown shape).
        self.assertEqual(run.plan_runs(ns(shapes=" glm-5.2 , mixtral-8x7b ")),
                         [("glm-5.2", "slice", 64, 2048), ("mixtral-8x7b", "all", 1, 4096)])

    def test_a_mok_arg_may_not_set_what_run_py_sets(self):
        # What run.py passes to mok bench, with every optional part present: exactly these
        # options are refused in --mok-arg (else a record would claim settings it was not
        # measured with: --mok-arg "--iters 5" beside a record's 100).
        args = types.SimpleNamespace(mok_bin="mok", dtype="bf16", routing="gaussian", warmup=500, iters=100, mok_arg=[],
                                     no_peer=True)
        cmd = run.mok_command(args, "glm-5.2", "slice", 64, 2048, "/w")
        own = {a for a in cmd[cmd.index("bench") + 1:] if a.startswith("--")}
        self.assertEqual(own, set(run.MOK_OPTIONS_RUN_PY_SETS))
        for opt, instead in run.MOK_OPTIONS_RUN_PY_SETS.items():
            for given in (f"{opt} 5", f"{opt}=5", f"--comm-sms 32 {opt} 5"):
                errors = run.mok_arg_errors([given])
                self.assertEqual(len(errors), 1, (given, errors))
                self.assertIn(f"{opt} is set by run.py itself", errors[0])
                self.assertIn(instead, errors[0])
                self.assertIn(repr(given), errors[0])
        self.assertIn("run.py's --work-root", run.mok_arg_errors(["--work-dir=/elsewhere"])[0])
        self.assertIn("--launch", run.mok_arg_errors(["--ep-mode distributed"])[0])
        # The options run.py does not set pass; so does a value that merely contains a name.
        self.assertEqual(run.mok_arg_errors(["--comm-sms 32", "--active-rank=3", "--seed 7 --pairs",
                                             "--capacity 0.5", "--routing-notes x"]), [])
        self.assertIn("cannot be split like a shell would", " ".join(run.mok_arg_errors(['--comm-sms "32'])))
        # From the command line: refused before anything runs, naming the option and what to use.
        self.refused(["--mok-arg", "--iters 5"], "--iters is set by run.py itself (use run.py's --iters)")
        self.refused(["--mok-arg=--warmup=0"], "--warmup is set by run.py itself (use run.py's --warmup)")
        self.refused(["--mok-arg", "--tokens 64", "--mok-arg", "--work-dir /tmp/w"], "use run.py's --work-root")
        self.refused(["--mok-arg=--no-peer-inputs"], "--no-peer-inputs is set by run.py itself (use run.py's --no-peer)")

    def test_a_mok_bin_that_cannot_be_split_is_refused_by_name(self):
        self.refused(["--mok-bin", "'unbalanced"], "--mok-bin \"'unbalanced\": cannot be split like a shell would")
        self.assertEqual(run.mok_bin_errors(FAKE_MOK_CMD), [])

    def test_repeat_has_an_upper_bound(self):
        self.refused(["--repeat", "1000000000"], f"--repeat must be <= {run.MAX_REPEAT} (got 1000000000)")
        given = types.SimpleNamespace(iters=None, warmup=None, ceiling_iters=None, ceiling_warmup=None, tokens=None,
                                      ep=None, launch=None, repeat=run.MAX_REPEAT, clock_period_ms=None, profile_peer=0,
                                      no_peer=False, shapes=None)
        self.assertEqual(run.option_errors(given), [])

    def test_a_results_dir_and_work_root_that_overlap_are_refused_naming_both(self):
        with tempfile.TemporaryDirectory() as d:
            work = os.path.join(d, "work")
            for results, why in ((work, "lies inside --work-root"),
                                 (os.path.join(work, "results"), "lies inside --work-root"),
                                 (os.path.join(work, "glm-5.2_slice_64_2048"), "lies inside --work-root"),
                                 (d, "lies inside --results-dir")):
                self.refused(["--results-dir", results, "--work-root", work],
                             f"--results-dir {results}" if "--work-root" in why else f"--work-root {work}")
                errors = run.folder_errors(results, work)
                self.assertEqual(len(errors), 1, errors)
                self.assertIn(why, errors[0])
                self.assertIn(results, errors[0])
                self.assertIn(work, errors[0])
            # A link to a folder inside the work root is inside it too (real paths).
            os.makedirs(os.path.join(work, "kept"))
            os.symlink(os.path.join(work, "kept"), os.path.join(d, "link"))
            self.assertIn("lies inside --work-root", run.folder_errors(os.path.join(d, "link"), work)[0])
            # Siblings (the defaults: bench/results and bench/work) are fine.
            self.assertEqual(run.folder_errors(os.path.join(d, "results"), work), [])
            self.assertEqual(run.folder_errors(run.records.RESULTS_DIR, os.path.join(helpers.BENCH_DIR, "work")), [])
            self.assertFalse(os.path.exists(os.path.join(d, "results")))

    def test_plan_keeps_a_given_value(self):
        # `args.tokens or default` read 0 as "not given"; main refuses 0 before planning.
        self.assertEqual(run.plan_runs(ns(shapes="glm-5.2", tokens=0, ep=0)), [("glm-5.2", "slice", 0, 0)])
        with self.assertRaises(SystemExit):
            run.plan_runs(ns(shapes="glm-5.2", sweep_tokens="512"))


class WorkDirectories(unittest.TestCase):
    def test_nothing_outside_the_work_root_is_deleted(self):
        with tempfile.TemporaryDirectory() as d:
            root = os.path.join(d, "work")
            os.makedirs(root)
            victim = os.path.join(d, "x_all_1_64")
            os.makedirs(victim)
            with open(os.path.join(victim, "keep"), "w") as f:
                f.write("precious")
            args = types.SimpleNamespace(work_root=root)
            # run_one with a name that escapes the root (option checking refuses it; this is the
            # guard behind it): refused before any rmtree.
            with self.assertRaises(ValueError) as cm:
                run.run_one(args, "../x", "all", 1, 64)
            self.assertIn("is not inside --work-root", str(cm.exception))
            self.assertTrue(os.path.exists(os.path.join(victim, "keep")))
            # A link inside the root that leads out of it: its real path decides.
            os.symlink(victim, os.path.join(root, "glm-5.2_all_1_64"))
            with self.assertRaises(ValueError):
                run.remove_work(os.path.join(root, "glm-5.2_all_1_64"), root)
            with self.assertRaises(ValueError):  # nor the root itself
                run.remove_work(os.path.join(root, "."), root)
            self.assertTrue(os.path.exists(os.path.join(victim, "keep")))
            inside = os.path.join(root, "glm-5.2_slice_64_64")
            os.makedirs(os.path.join(inside, "sub"))
            run.remove_work(inside, root)
            self.assertFalse(os.path.exists(inside))

    def test_work_directory_names_a_pass_of_repeat(self):
        args = types.SimpleNamespace(work_root="/w")
        self.assertEqual(run.work_dir(args, "glm-5.2", "slice", 64, 2048), "/w/glm-5.2_slice_64_2048")
        self.assertEqual(run.work_dir(args, "glm-5.2", "slice", 64, 2048, 0), "/w/glm-5.2_slice_64_2048_pass1")
        self.assertEqual(run.work_dir(args, "glm-5.2", "slice", 64, 2048, 1), "/w/glm-5.2_slice_64_2048_pass2")


class SampledGpus(unittest.TestCase):
    def test_from_cuda_visible_devices(self):
        self.assertEqual(run.sampled_gpus("slice", 64, visible=""), [0])
        self.assertEqual(run.sampled_gpus("all", 1, visible="3,1"), [3])
        self.assertEqual(run.sampled_gpus("distributed", 2, visible="3,1,0"), [3, 1])
        self.assertEqual(run.sampled_gpus("distributed", 4, visible=""), [0, 1, 2, 3])
        # UUIDs: counted from 0.
        self.assertEqual(run.sampled_gpus("all", 1, visible="GPU-1234"), [0])


class EndToEnd(unittest.TestCase):
    """run.py -> fake mok bench -> record, with --no-peer (the peer needs a real GPU)."""

    def test_records_and_summary(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            args = ["--shapes", "glm-5.2,qwen3-30b-a3b,mixtral-8x7b", "--tokens", "64", "--no-peer",
                    "--warmup", "0", "--iters", "1", "--mok-bin", FAKE_MOK_CMD,
                    "--work-root", os.path.join(d, "work"), "--results-dir", results]
            r = run_with_fake_torch("cuda", args, {"FAKE_MOK_FAIL_SHAPE": "qwen3-30b-a3b"})
            # One run failed: exit non-zero, the others still produced records.
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            files = sorted(glob.glob(os.path.join(results, "*.json")))
            self.assertEqual(len(files), 2, files)
            shapes = sorted(helpers.read_json(f)["shape"] for f in files)
            self.assertEqual(shapes, ["glm-5.2", "mixtral-8x7b"])
            for f in files:
                rec = helpers.read_json(f)
                self.assertEqual(rec["gpu"]["name"], "SYNTHETIC-GPU (test fixture)")
                self.assertEqual(rec["mok"]["forward"]["median_ms"], 0.5)
                # --no-peer: mok's check passed, but a record without a peer is no pass.
                self.assertEqual(rec["check"], {"mok": True, "pytorch": None, "peer_ran": False, "passes": False})
            # The summary table comes last.
            tail = r.stdout.strip().splitlines()
            self.assertIn("0 of 3 runs passed; 2 timed mok alone (no peer: not a pass)", r.stdout)
            self.assertIn("no peer (mok PASS)", tail[-3])
            self.assertTrue(tail[-4].startswith("run "), tail[-4:])
            self.assertIn("mok ms", tail[-4])
            self.assertIn("% GEMM ceil", tail[-4])
            self.assertIn("ERROR: mok bench exited 3", r.stdout.splitlines()[-2])
            # --no-peer: mok bench writes no peer inputs (the record needs mok.json only).
            self.assertIn("--work-dir " + os.path.join(d, "work", "glm-5.2_slice_64_64") + " --no-peer-inputs",
                          r.stdout)
            # Successful work directories are removed; the failed one is kept.
            self.assertEqual(sorted(os.listdir(os.path.join(d, "work"))), ["qwen3-30b-a3b_all_1_64"])

    def test_launched_group_takes_the_slowest_rank_per_iteration(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            args = ["--launch", "3", "--shapes", "qwen3.5-397b-a17b", "--tokens", "64", "--no-peer",
                    "--warmup", "0", "--iters", "5", "--mok-bin", FAKE_MOK_CMD,
                    "--work-root", os.path.join(d, "work"), "--results-dir", results]
            r = run_with_fake_torch("cuda", args)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("launch -n 3 --", r.stdout)
            files = glob.glob(os.path.join(results, "*.json"))
            self.assertEqual(len(files), 1)
            rec = helpers.read_json(files[0])
            self.assertEqual(rec["ep_mode"], "distributed")
            # Rank 2 is the slowest (0.5 * 1.2 ms + 0.01 ms per iteration): median of 5 = iteration 2.
            self.assertAlmostEqual(rec["mok"]["forward"]["median_ms"], 0.6 + 0.02)
            self.assertEqual([x["rank"] for x in rec["mok"]["ranks"]], [0, 1, 2])

    def test_a_group_peer_that_dies_is_recorded_as_failed(self):
        # The fake torch has no distributed package: peer_dist.py dies on every rank before
        # writing peer.json. The record must say the peer failed, not that it passed.
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            args = ["--launch", "2", "--shapes", "qwen3.5-397b-a17b", "--tokens", "64", "--warmup", "0",
                    "--iters", "2", "--mok-bin", FAKE_MOK_CMD,
                    "--work-root", os.path.join(d, "work"), "--results-dir", results]
            r = run_with_fake_torch("cuda", args)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            files = glob.glob(os.path.join(results, "*.json"))
            self.assertEqual(len(files), 1)
            rec = helpers.read_json(files[0])
            self.assertEqual(rec["check"], {"mok": True, "pytorch": False, "peer_ran": True, "passes": False})
            self.assertEqual(rec["errors"], ["peer_dist.py exited 1"])
            self.assertIn("FAIL (pytorch FAIL, peer_dist.py exited 1)", r.stdout)

    def test_failed_mok_check_is_recorded(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            args = ["--shapes", "glm-5.2", "--tokens", "64", "--no-peer", "--mok-bin", FAKE_MOK_CMD,
                    "--work-root", os.path.join(d, "work"), "--results-dir", results]
            r = run_with_fake_torch("cuda", args, {"FAKE_MOK_CHECK_FAIL_SHAPE": "glm-5.2"})
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            files = glob.glob(os.path.join(results, "*.json"))
            self.assertEqual(len(files), 1)
            rec = helpers.read_json(files[0])
            self.assertEqual(rec["check"], {"mok": False, "pytorch": None, "peer_ran": False, "passes": False})
            self.assertEqual(rec["errors"], ["mok bench exited 3"])
            self.assertIn("FAIL (mok FAIL, no peer, mok bench exited 3)", r.stdout.splitlines()[-1])

    def test_mok_bench_exiting_non_zero_after_its_json_fails_the_record(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            args = ["--shapes", "glm-5.2", "--tokens", "64", "--no-peer", "--mok-bin", FAKE_MOK_CMD,
                    "--work-root", os.path.join(d, "work"), "--results-dir", results, "--no-clocks"]
            r = run_with_fake_torch("cuda", args, {"FAKE_MOK_EXIT_SHAPE": "glm-5.2"})
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            (f,) = glob.glob(os.path.join(results, "*.json"))
            rec = helpers.read_json(f)
            self.assertTrue(rec["check"]["mok"])  # mok.json's own check passed ...
            self.assertEqual(rec["errors"], ["mok bench exited 4"])  # ... but the process failed
            self.assertFalse(rec["check"]["passes"])
            self.assertIn("FAIL (no peer, mok bench exited 4)", r.stdout.splitlines()[-1])

    def _run_with_peer(self, d, peer):
        """run.run_one on a glm-5.2 slice made to the contract, subprocess calls faked: mok
        bench writes a synthetic work directory, the peer is `peer(work)` (its exit status)."""
        from synth_workdir import make_workdir

        def call(cmd):
            work = cmd[cmd.index("--work-dir") + 1] if "--work-dir" in cmd else cmd[2]
            if cmd[1].endswith("peer_torch.py"):
                return peer(work)
            make_workdir(work, shape="glm-5.2", tokens=16, warmup=500, iters=100, forward_ms=0.5)
            return 0

        args = types.SimpleNamespace(
            mok_bin="mok", dtype=None, routing="gaussian", warmup=500, iters=100, ceiling_warmup=500,
            ceiling_iters=200, mok_arg=[], no_backward=False, profile_peer=0, no_peer=False, no_clocks=True,
            keep_work=False,
            work_root=os.path.join(d, "work"), results_dir=os.path.join(d, "results"))
        with mock.patch.object(run, "call_child", side_effect=call), \
                contextlib.redirect_stdout(io.StringIO()):
            return run.run_one(args, "glm-5.2", "slice", 2, 16)

    def test_peer_exiting_non_zero_after_its_json_fails_the_record(self):
        # The peer wrote a passing peer.json, then exited 1: the record keeps the exit and fails.
        peer = peer_writing_fixture(exit_code=1)
        with tempfile.TemporaryDirectory() as d:
            row = self._run_with_peer(d, peer)
            rec = row["record"]
            self.assertEqual(rec["errors"], ["peer_torch.py exited 1"])
            self.assertEqual(rec["check"], {"mok": True, "pytorch": True, "peer_ran": True, "passes": False})
            self.assertEqual(row["error"], "peer_torch.py exited 1")
            self.assertFalse(row["ok"])
            self.assertEqual(helpers.read_json(row["path"])["errors"], ["peer_torch.py exited 1"])

    def test_a_peer_dying_without_peer_json_is_a_failed_contract_record(self):
        # A peer that refused its work directory (or crashed) writes no peer.json: the record
        # fails, and it stays a contract record (shown as FAIL), not an off-contract one that
        # would leave an older passing record standing for the shape.
        with tempfile.TemporaryDirectory() as d:
            rec = self._run_with_peer(d, lambda work: 1)["record"]
            self.assertFalse(rec["check"]["passes"])
            self.assertEqual(rec["errors"], ["peer_torch.py exited 1"])
            self.assertEqual(records.contract_breaks(rec), [])
            # Today's peer failed: the record is today's FAIL, not one against an earlier peer
            # that an older passing record would outrank in the report.
            self.assertEqual(rec["peers"]["pytorch_pipeline"]["code"], checks.peer_code("peer_torch"))

    def test_a_commit_that_disagrees_with_the_binary_is_that_runs_error(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            args = ["--shapes", "glm-5.2,mixtral-8x7b", "--tokens", "64", "--no-peer", "--mok-bin",
                    FAKE_MOK_CMD, "--work-root", os.path.join(d, "work"), "--results-dir", results,
                    "--no-clocks"]
            r = run_with_fake_torch("cuda", args, {"FAKE_MOK_BUILD_COMMIT": "0123456789ab",
                                                   "MOK_BENCH_COMMIT": "fedcba9876", "MOK_BENCH_DIRTY": "0"})
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertNotIn("Traceback", r.stdout + r.stderr)
            self.assertEqual(glob.glob(os.path.join(results, "*.json")), [])  # no record names a guessed commit
            tail = r.stdout.splitlines()
            for line in tail[-2:]:
                self.assertIn("ERROR: commit: MOK_BENCH_COMMIT=fedcba9876 names another commit than the timed "
                              "binary's stamp (mok.json build.commit 0123456789ab)", line)
            # The same commit (abbreviated): the binary's stamp is recorded.
            r = run_with_fake_torch("cuda", args[:1] + ["glm-5.2"] + args[2:],
                                    {"FAKE_MOK_BUILD_COMMIT": "0123456789ab", "MOK_BENCH_COMMIT": "0123456"})
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            (f,) = glob.glob(os.path.join(results, "*.json"))
            self.assertEqual(helpers.read_json(f)["commit"]["sha"], "0123456789ab")

    def run_with_fake_smi(self, d, extra_args=(), extra_env=None):
        """One --no-peer run whose fake mok "times" for 0.3 s while a fake nvidia-smi samples."""
        bin_dir = os.path.join(d, "bin")
        os.makedirs(bin_dir)
        os.symlink(os.path.join(helpers.TESTS_DIR, "fake_nvidia_smi.py"), os.path.join(bin_dir, "nvidia-smi"))
        results = os.path.join(d, "results")
        args = ["--shapes", "glm-5.2", "--tokens", "64", "--no-peer", "--mok-bin", FAKE_MOK_CMD,
                "--work-root", os.path.join(d, "work"), "--results-dir", results, "--clock-period-ms", "5",
                *extra_args]
        env = {"PATH": bin_dir + os.pathsep + os.environ["PATH"], "FAKE_MOK_TIMED_S": "0.3",
               "CUDA_VISIBLE_DEVICES": ""}
        env.update(extra_env or {})
        r = run_with_fake_torch("cuda", args, env)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        files = glob.glob(os.path.join(results, "*.json"))
        self.assertEqual(len(files), 1)
        return helpers.read_json(files[0])

    def test_clocks_sampled_inside_mok_timed_loop(self):
        with tempfile.TemporaryDirectory() as d:
            c = self.run_with_fake_smi(d)["clocks"]
            self.assertIsNone(c["error"])
            self.assertEqual(c["gpus"], [0])
            mok = c["mok_forward"]
            self.assertGreater(mok["samples"], 5)
            self.assertLess(mok["samples"], 0.3 / 0.005 + 5)  # only the window's samples
            self.assertEqual(mok["sm_mhz_median"], 1410)
            self.assertEqual(mok["power_w_median"], 690.5)
            self.assertEqual(mok["sw_power_cap_share"], 1.0)
            self.assertNotIn("pytorch_forward", c)  # --no-peer: no peer window
            # The synthetic GPU has no compute capability: no peak is made up for it.
            self.assertIsNone(c["tensor_peak_bf16_tflops_at_mok_clock"])

    def test_clocks_of_the_visible_gpu_only(self):
        with tempfile.TemporaryDirectory() as d:
            c = self.run_with_fake_smi(d, extra_env={"FAKE_SMI_GPUS": "2", "CUDA_VISIBLE_DEVICES": "1"})["clocks"]
            self.assertEqual(c["gpus"], [1])
            self.assertEqual(c["mok_forward"]["sm_mhz_median"], 1300)

    def test_no_clocks(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertIsNone(self.run_with_fake_smi(d, ["--no-clocks"])["clocks"])

    def test_repeat_with_keep_work_keeps_every_pass(self):
        with tempfile.TemporaryDirectory() as d:
            results, work = os.path.join(d, "results"), os.path.join(d, "work")
            args = ["--shapes", "glm-5.2,mixtral-8x7b", "--tokens", "64", "--no-peer", "--repeat", "2",
                    "--keep-work", "--no-clocks", "--mok-bin", FAKE_MOK_CMD, "--work-root", work,
                    "--results-dir", results]
            r = run_with_fake_torch("cuda", args)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertEqual(sorted(os.listdir(work)), ["glm-5.2_slice_64_64_pass1", "glm-5.2_slice_64_64_pass2",
                                                        "mixtral-8x7b_all_1_64_pass1", "mixtral-8x7b_all_1_64_pass2"])
            for name in os.listdir(work):
                self.assertTrue(os.path.exists(os.path.join(work, name, "mok.json")), name)
            self.assertEqual(len(glob.glob(os.path.join(results, "*.json"))), 4)
            self.assertIn("glm-5.2 slice EP=64 T=64 pass 2", r.stdout)

    def _refused_before_anything_runs(self, option, message):
        """run.py with `option` (--results-dir or --work-root) a file, or a path under one: refused
        naming the option with `message`, before any run; the other folder is left as it was."""
        with tempfile.TemporaryDirectory() as d:
            blocker = os.path.join(d, "file")
            with open(blocker, "w") as f:
                f.write("not a folder")
            other = "--work-root" if option == "--results-dir" else "--results-dir"
            other_path = os.path.join(d, "other")
            for bad in (blocker, os.path.join(blocker, "sub")):
                r = run_with_fake_torch("cuda", ["--shapes", "glm-5.2", "--tokens", "64", "--no-peer", "--mok-bin",
                                                 FAKE_MOK_CMD, option, bad, other, other_path])
                self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
                self.assertIn(f"run.py: {option} {bad}: {message}", r.stderr)
                self.assertNotIn("Traceback", r.stderr)
                self.assertNotIn("===", r.stdout)  # (no run started)
                self.assertFalse(os.path.exists(other_path) and os.listdir(other_path))

    def test_an_unwritable_results_dir_is_refused_before_anything_runs(self):
        self._refused_before_anything_runs("--results-dir", "records cannot be written there")

    def _main_quietly(self, argv):
        """run.main in this process (a CUDA GPU assumed), the fake mok's output discarded."""
        def call(cmd):
            return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(run, "cuda_status", return_value=(True, "FAKE-GPU (test)")), \
                mock.patch.object(run, "call_child", side_effect=call), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = run.main(argv)
        return rc, out.getvalue(), err.getvalue()

    def test_a_fixture_record_never_lands_in_the_repositorys_results(self):
        # The fake mok's record, with no --results-dir: the default (the repository's results,
        # here a temporary stand-in) refuses it; the run fails, and the record is kept in the
        # work directory, named.
        with tempfile.TemporaryDirectory() as d:
            results, work = os.path.join(d, "results"), os.path.join(d, "work")
            with mock.patch.object(records, "RESULTS_DIR", results):
                rc, out, err = self._main_quietly(["--shapes", "glm-5.2", "--tokens", "64", "--no-peer", "--no-clocks",
                                                   "--mok-bin", FAKE_MOK_CMD, "--work-root", work])
            self.assertEqual(rc, 1, out + err)
            self.assertEqual(os.listdir(results), [])
            saved = os.path.join(work, "glm-5.2_slice_64_64", "record.json")
            self.assertIn("SYNTHETIC-GPU (test fixture)", err)
            self.assertIn(f"the record is saved as {saved}", err)
            self.assertEqual(helpers.read_json(saved)["gpu"]["name"], "SYNTHETIC-GPU (test fixture)")
            self.assertIn("ERROR: record not written", out)

    def test_a_record_that_cannot_be_written_is_kept_in_the_work_directory(self):
        peer = peer_writing_fixture(exit_code=0)
        with tempfile.TemporaryDirectory() as d:
            with mock.patch.object(run.records, "write_record", side_effect=OSError(28, "No space left on device")), \
                    contextlib.redirect_stderr(io.StringIO()) as err:
                row = self._run_with_peer(d, peer)
            work = os.path.join(d, "work", "glm-5.2_slice_2_16")
            self.assertFalse(row["ok"])
            self.assertIn("record not written ([Errno 28] No space left on device)", row["error"])
            self.assertIn(os.path.join(work, "record.json"), row["error"])
            self.assertIn(os.path.join(work, "record.json"), err.getvalue())
            saved = helpers.read_json(os.path.join(work, "record.json"))
            self.assertEqual(saved, json.loads(json.dumps(row["record"])))
            self.assertTrue(saved["check"]["passes"])  # (a good run: its work directory is kept all the same)
            self.assertTrue(os.path.exists(os.path.join(work, "mok.json")))

    def test_an_unreadable_peer_json_is_a_failed_peer_named(self):
        for content, why in (("{\"check\": {\"passes\": tru", "not valid JSON"),
                             (json.dumps({"check": {"passes": "false"}}), "'check.passes' must be true or false")):
            def peer(work, content=content):
                with open(os.path.join(work, "peer.json"), "w") as f:
                    f.write(content)
                return 0

            with tempfile.TemporaryDirectory() as d:
                row = self._run_with_peer(d, peer)
                rec = row["record"]
                self.assertEqual(rec["check"], {"mok": True, "pytorch": False, "peer_ran": True, "passes": False})
                peer_json = os.path.join(d, "work", "glm-5.2_slice_2_16", "peer.json")
                self.assertEqual(len(rec["errors"]), 1, rec["errors"])
                self.assertIn(f"peer.json could not be read: {peer_json}: {why}", rec["errors"][0])
                self.assertIn(why, rec["peers"]["pytorch_pipeline"]["errors"]["peer"])
                self.assertEqual(row["error"], rec["errors"][0])
                self.assertEqual(helpers.read_json(row["path"])["errors"], rec["errors"])

    def test_an_unusable_work_root_is_refused_before_anything_runs(self):
        self._refused_before_anything_runs("--work-root", "work directories cannot be made there")

    def test_a_record_saved_in_a_work_directory_is_never_deleted(self):
        with tempfile.TemporaryDirectory() as d:
            work, results = os.path.join(d, "work"), os.path.join(d, "results")
            rescued = os.path.join(work, "glm-5.2_slice_64_64", "record.json")
            os.makedirs(os.path.dirname(rescued))
            with open(rescued, "w") as f:
                f.write('{"a record": "an earlier run could not write"}')
            r = run_with_fake_torch("cuda", ["--shapes", "glm-5.2,mixtral-8x7b", "--tokens", "64", "--no-peer",
                                             "--no-clocks", "--mok-bin", FAKE_MOK_CMD, "--work-root", work,
                                             "--results-dir", results])
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertNotIn("Traceback", r.stderr)
            self.assertEqual(helpers.read_text(rescued), '{"a record": "an earlier run could not write"}')
            self.assertIn(f"{rescued} holds a record an earlier run could not write: import it "
                          f"(`python3 bench/records.py import {rescued}`) or move it", r.stderr)
            self.assertIn(f"ERROR: {rescued} holds a record", r.stdout)
            # The other run went on (and its record was written).
            self.assertEqual([helpers.read_json(p)["shape"] for p in glob.glob(os.path.join(results, "*.json"))],
                             ["mixtral-8x7b"])
            # remove_work itself refuses, whoever calls it.
            with self.assertRaisesRegex(ValueError, "holds a record an earlier run could not write"):
                run.remove_work(os.path.dirname(rescued), work)
            self.assertTrue(os.path.exists(rescued))

    def _stopped(self, signum):
        """run.py on two runs whose second one's mok hangs, sent `signum` (to run.py alone) once that
        mok runs: (returncode, stdout, stderr, the hung mok's pid, results folder)."""
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d, True)
        os.makedirs(os.path.join(d, "torch"))
        with open(os.path.join(d, "torch", "__init__.py"), "w") as f:
            f.write(FAKE_TORCH["cuda"])
        work, results = os.path.join(d, "work"), os.path.join(d, "results")
        e = dict(os.environ, PYTHONPATH=d + os.pathsep + os.environ.get("PYTHONPATH", ""),
                 FAKE_MOK_HANG_SHAPE="mixtral-8x7b")
        pid_file = os.path.join(work, "mixtral-8x7b_all_1_64", "fake_mok.pid")
        proc = subprocess.Popen([sys.executable, RUN_PY, "--shapes", "glm-5.2,mixtral-8x7b,gpt-oss-20b", "--tokens",
                                 "64", "--no-peer", "--no-clocks", "--mok-bin", FAKE_MOK_CMD, "--work-root", work,
                                 "--results-dir", results], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=e, start_new_session=True)
        try:
            for _ in range(600):
                if os.path.exists(pid_file):
                    break
                time.sleep(0.1)
            with open(pid_file) as f:
                child = int(f.read())
            proc.send_signal(signum)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode, out, err, child, results

    def assert_gone(self, pid):
        for _ in range(50):  # (a child killed by its group's signal may take a moment to go)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        self.fail(f"the mok child {pid} is still running after run.py ended")

    def test_ctrl_c_and_sigterm_stop_the_child_and_print_what_finished(self):
        for signum, rc, name in ((signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")):
            code, out, err, child, results = self._stopped(signum)
            self.assertEqual(code, rc, out + err)
            self.assertNotIn("Traceback", err)
            self.assert_gone(child)
            (written,) = glob.glob(os.path.join(results, "*.json"))
            self.assertIn(f"run.py: interrupted by {name}: 1 record(s) written\n  {written}", err)
            self.assertIn("mixtral-8x7b all EP=1 T=64 was cut short (no record); 1 run(s) not started", err)
            tail = out.strip().splitlines()
            self.assertIn("0 of 2 runs passed; 1 timed mok alone (no peer: not a pass)", out)
            self.assertIn("glm-5.2 slice EP=64 T=64", tail[-2])
            self.assertIn("no peer (mok PASS)", tail[-2])
            self.assertIn(f"mixtral-8x7b all EP=1 T=64", tail[-1])
            self.assertIn(f"ERROR: interrupted by {name}", tail[-1])

    def test_missing_binary(self):
        with tempfile.TemporaryDirectory() as d:
            r = run_with_fake_torch("cuda", ["--mok-bin", os.path.join(d, "nope"), "--results-dir", d])
            self.assertEqual(r.returncode, 1)
            self.assertIn("does not exist", r.stderr)


if __name__ == "__main__":
    unittest.main()
