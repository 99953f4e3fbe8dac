import contextlib
import copy
import io
import json
import os
import subprocess
import tempfile
import unittest
from unittest import mock

import helpers  # noqa: F401  (sets sys.path)
from helpers import env, fixture

import records
import workdir
from synth_workdir import make_workdir

QWEN = {"num_experts": 512, "hidden": 4096, "intermediate": 1024, "top_k": 10, "shared_intermediate": [1024],
        "ep_size": 64, "tokens_per_rank": 2048, "precision": "bf16", "swiglu_limit": None}
# A small problem whose byte counts are worked out by hand below.
SMALL = {"num_experts": 4, "hidden": 8, "intermediate": 4, "top_k": 2, "shared_intermediate": [2],
         "ep_size": 2, "tokens_per_rank": 3, "precision": "bf16", "swiglu_limit": None}


class Arithmetic(unittest.TestCase):
    def test_mok_tflops_qwen(self):
        # 6 * (2048 + 2048*10) * 4096 * 1024 = 566,935,683,072 FLOPs
        self.assertEqual(records.mok_flops(QWEN), 566935683072.0)
        self.assertAlmostEqual(records.tflops(records.mok_flops(QWEN), 1.0), 566.935683072, places=9)
        self.assertAlmostEqual(records.tflops(records.mok_flops(QWEN, backward=True), 2.0), 566.935683072, places=9)
        self.assertAlmostEqual(records.tflops(records.mok_flops(QWEN), 4.0), 141.733920768, places=9)

    def test_mok_tflops_counts_shared_even_without_one(self):
        # MoK's formula counts T rows for the shared expert whatever the shape has.
        p = dict(QWEN, shared_intermediate=[])
        self.assertEqual(records.mok_flops(p), records.mok_flops(QWEN))
        self.assertEqual(records.performed_flops(p, 20480), 6.0 * 20480 * 4096 * 1024)
        self.assertEqual(records.performed_flops(QWEN, 20480), records.mok_flops(QWEN))

    def test_mission_reference_numbers(self):
        # MISSION.md: the PyTorch grouped GEMMs on one EP=64 Qwen3.5 rank (20480 rows) took
        # 0.80 ms = 646 TFLOP/s; that is 6*N*H*I (routed rows only).
        self.assertAlmostEqual(records.tflops(records.grouped_gemm_flops(QWEN, 20480), 0.80), 644.2, delta=0.1)

    def test_no_time_no_rate(self):
        self.assertIsNone(records.tflops(records.mok_flops(QWEN), None))
        self.assertIsNone(records.tflops(records.mok_flops(QWEN), 0))
        self.assertIsNone(records.gbps(100, None))
        self.assertIsNone(records.ratio(1.0, None))
        self.assertIsNone(records.ratio(1.0, 0))

    def test_hbm_bytes_small_by_hand(self):
        # N=5 rows, H=8, I=4, E_loc=2, one shared width 2, T=3, k=2, bf16:
        #   routed x rows read     5*8*2      =  80
        #   routed weights         3*2*4*8*2  = 384
        #   shared weights         3*2*8*2    =  96
        #   x_local for shared     3*8*2      =  48
        #   combine rows written   5*8*2      =  80
        #   epilogue reads         3*2*8*2    =  96
        #   y written              3*8*2      =  48   -> 832
        self.assertEqual(records.hbm_bytes_forward(SMALL, 5), 832)
        # Without a shared expert there are no shared weights and no x_local read for them.
        self.assertEqual(records.hbm_bytes_forward(dict(SMALL, shared_intermediate=[]), 5), 832 - 96 - 48)
        # Two shared experts of widths 2 and 6: 3*(2+6)*8*2 = 384 of shared weights.
        self.assertEqual(records.hbm_bytes_forward(dict(SMALL, shared_intermediate=[2, 6]), 5), 832 - 96 + 384)

    def test_link_bytes_small_by_hand(self):
        self.assertEqual(records.link_bytes_forward(SMALL, 3), 2 * 3 * 8 * 2)
        self.assertEqual(records.link_bytes_forward(SMALL, 0), 0)


class MakeRecord(unittest.TestCase):
    def setUp(self):
        self.mok = fixture("fixture_mok_qwen35_slice.json")
        self.peer = fixture("fixture_peer_qwen35_slice.json")
        self.rec = records.make_record(self.mok, self.peer, env())

    def test_a_peer_without_a_check_or_with_errors_fails_the_record(self):
        for change in ({"check": None}, {"errors": {"forward": "RuntimeError: CUDA out of memory"}}):
            peer = dict(copy.deepcopy(self.peer), **change)
            rec = records.make_record(self.mok, peer, env())
            self.assertIs(rec["check"]["pytorch"], False, change)
            self.assertFalse(rec["check"]["passes"], change)
        # No peer at all (--no-peer): not a pass (test_no_peer_is_not_a_pass).
        self.assertFalse(records.make_record(self.mok, None, env())["check"]["passes"])

    def test_no_peer_is_not_a_pass(self):
        # --no-peer: mok's check passed, but nothing was measured beside it; the record says no
        # peer ran and does not pass, and the report and run.py say "no peer", not PASS.
        rec = records.make_record(self.mok, None, env())
        self.assertEqual(rec["check"], {"mok": True, "pytorch": None, "peer_ran": False, "passes": False})
        self.assertFalse(records.peer_ran(rec))
        self.assertFalse(records.record_passes(rec))
        self.assertEqual(records.check_text(rec), "no peer (mok PASS)")
        failed = copy.deepcopy(self.mok)
        failed["check"]["forward"]["passes"] = False
        self.assertEqual(records.check_text(records.make_record(failed, None, env())), "FAIL (mok FAIL, no peer)")
        # Records before "peer_ran": a peer ran when the record has peers.
        old = json.loads(json.dumps(self.rec))
        del old["check"]["peer_ran"]
        self.assertTrue(records.peer_ran(old))
        self.assertEqual(records.check_text(old), "PASS")
        old["peers"] = {}
        self.assertFalse(records.peer_ran(old))

    def test_process_errors_fail_the_record(self):
        # mok bench (or the peer) exited non-zero after writing its JSON: the record keeps why
        # and fails, whatever the JSON's own check says.
        rec = records.make_record(self.mok, self.peer, env(), errors=["mok bench exited 4"])
        self.assertEqual(rec["errors"], ["mok bench exited 4"])
        self.assertFalse(rec["check"]["passes"])
        self.assertFalse(records.record_passes(rec))
        self.assertEqual(records.check_text(rec), "FAIL (mok bench exited 4)")
        self.assertEqual(self.rec["errors"], [])
        # A record whose check says it passed but which carries errors is not a pass either.
        forged = dict(self.rec, errors=["peer_torch.py exited 1"])
        self.assertFalse(records.record_passes(forged))
        self.assertEqual(records.check_text(forged), "FAIL (peer_torch.py exited 1)")

    def test_a_verdict_that_is_not_a_real_bool_is_refused_naming_the_file_and_key(self):
        # bool("false") is True: such a verdict must never read as PASS.
        for value in ("false", "true", 1, None, [False]):
            mok = copy.deepcopy(self.mok)
            mok["check"]["forward"]["passes"] = value
            with self.assertRaises(ValueError) as cm:
                records.make_record(mok, self.peer, env())
            self.assertIn("mok.json: 'check.forward.passes' must be true or false", str(cm.exception))
            peer = copy.deepcopy(self.peer)
            peer["check"]["passes"] = value
            with self.assertRaises(ValueError) as cm:
                records.make_record(self.mok, peer, env())
            self.assertIn("peer.json: 'check.passes' must be true or false", str(cm.exception))
        mok = copy.deepcopy(self.mok)
        mok["check"]["forward"] = "passed"
        with self.assertRaisesRegex(ValueError, "mok.json: 'check.forward' must be an object"):
            records.make_record(mok, self.peer, env())
        # A check without a verdict does not pass (nor does the record).
        mok = copy.deepcopy(self.mok)
        del mok["check"]["forward"]["passes"]
        rec = records.make_record(mok, self.peer, env())
        self.assertEqual((rec["check"]["mok"], rec["check"]["passes"]), (False, False))
        # A group: a rank whose verdict is not true does not pass.
        ranks = [copy.deepcopy(self.mok) for _ in range(2)]
        for m in ranks:
            m["forward_iters_ms"] = [1.0]
        ranks[1]["check"]["forward"]["passes"] = "true"
        self.assertIs(records.merge_group(ranks)["check"]["forward"]["passes"], False)

    def test_backward_performed_tflops(self):
        peer = dict(copy.deepcopy(self.peer), backward={"median_ms": 4.0, "min_ms": 4.0, "max_ms": 4.0})
        rec = records.make_record(self.mok, peer, env())
        perf = rec["flops"]["performed_forward"]
        self.assertAlmostEqual(rec["peers"]["pytorch_pipeline"]["backward"]["tflops_performed"],
                               2 * perf / 4e-3 / 1e12)

    def test_identity_fields(self):
        r = self.rec
        self.assertEqual(r["schema"], records.SCHEMA)
        self.assertEqual(r["shape"], "qwen3.5-397b-a17b")
        self.assertEqual(r["ep_mode"], "slice")
        self.assertEqual(r["tokens_per_rank"], 2048)
        self.assertEqual(r["precision"], "bf16")
        self.assertEqual(r["routing"]["spec"], "gaussian")
        self.assertEqual(r["routing"]["max_over_mean_expert"], 1.5)
        self.assertEqual(r["commit"], {"sha": "0123456789abcdef0123456789abcdef01234567", "short": "0123456",
                                       "dirty": False, "source": "test"})
        self.assertEqual(r["date"], "2001-02-03T04:05:06Z")
        self.assertEqual(r["gpu"]["name"], "FIXTURE-GPU")
        self.assertEqual(r["gpu"]["driver"], "0.0-fixture")
        self.assertEqual(r["gpu"]["torch"], "0.0-fixture")
        self.assertEqual(r["rows"], {"real": 20480, "remote": 20160, "padded": 20992})

    def test_timings_and_tflops(self):
        r = self.rec
        self.assertEqual(r["mok"]["forward"]["median_ms"], 1.0)
        self.assertAlmostEqual(r["mok"]["forward"]["tflops"], 566.935683072, places=6)
        self.assertAlmostEqual(r["mok"]["backward"]["tflops"], 2 * 566.935683072 / 4, places=6)
        pipe = r["peers"]["pytorch_pipeline"]
        self.assertAlmostEqual(pipe["forward"]["tflops"], 566.935683072 / 3, places=6)
        self.assertAlmostEqual(pipe["backward"]["tflops"], 2 * 566.935683072 / 8, places=6)
        gg = r["peers"]["pytorch_grouped_gemms"]["forward"]
        self.assertAlmostEqual(gg["tflops"], 6.0 * 20480 * 4096 * 1024 / 1e-3 / 1e12, places=6)
        self.assertEqual(r["peers"]["pytorch_grouped_gemms"]["gate_up"]["median_ms"], 0.625)

    def test_ratios(self):
        q = self.rec["ratios"]
        self.assertAlmostEqual(q["speedup_forward_vs_pytorch"], 3.0)
        self.assertAlmostEqual(q["speedup_backward_vs_pytorch"], 2.0)
        self.assertAlmostEqual(q["mok_forward_of_dense_ceiling"], 0.566935683072, places=9)
        # Qwen3.5 fixture: N = T*k routed rows and one shared expert of width I: MoK's count.
        self.assertAlmostEqual(q["mok_forward_performed_of_dense_ceiling"], 0.566935683072, places=9)
        self.assertAlmostEqual(q["pytorch_pipeline_over_grouped_gemms"], 3.0)
        self.assertAlmostEqual(q["mok_over_grouped_gemms"], 1.0)
        self.assertEqual(self.rec["ceilings"]["dense_bf16_tflops"], 1000.0)
        self.assertEqual(self.rec["ceilings"]["fp8_e4m3_tflops"], 2000.0)
        self.assertEqual(self.rec["ceilings"]["fp8_e4m3_exact_accum_tflops"], 1250.0)
        self.assertEqual(self.rec["ceilings"]["copy_gbps"], 4000.0)

    def test_bytes(self):
        b = self.rec["bytes"]
        H, I, T, k = 4096, 1024, 2048, 10
        want = 20480 * H * 2 + 3 * 8 * I * H * 2 + 3 * I * H * 2 + T * H * 2 + 20480 * H * 2 + T * k * H * 2 + T * H * 2
        self.assertEqual(b["hbm_forward"], want)
        self.assertEqual(b["link_forward"], 2 * 20160 * H * 2)
        self.assertAlmostEqual(b["mok_hbm_gbps"], want / 1e-3 / 1e9)
        self.assertAlmostEqual(b["mok_hbm_of_copy_ceiling"], want / 1e-3 / 1e9 / 4000.0)

    def test_check_passes(self):
        self.assertEqual(self.rec["check"], {"mok": True, "pytorch": True, "peer_ran": True, "passes": True})
        self.assertEqual(records.check_text(self.rec), "PASS")

    def test_failed_peer(self):
        rec = records.make_record(fixture("fixture_mok_mixtral_all.json"),
                                  fixture("fixture_peer_mixtral_all_failed.json"), env())
        self.assertEqual(rec["check"], {"mok": True, "pytorch": False, "peer_ran": True, "passes": False})
        self.assertEqual(records.check_text(rec), "FAIL (pytorch FAIL)")
        self.assertIsNone(rec["peers"]["pytorch_pipeline"]["forward"])
        self.assertIsNone(rec["ratios"]["speedup_forward_vs_pytorch"])
        self.assertIsNone(rec["ceilings"]["fp8_e4m3_tflops"])
        self.assertIn("forward", rec["peers"]["pytorch_pipeline"]["skipped"])
        self.assertIsNone(rec["mok"]["backward"])
        self.assertAlmostEqual(rec["ratios"]["mok_forward_of_dense_ceiling"],
                               6.0 * (4096 + 8192) * 4096 * 14336 / 2e-3 / 1e12 / 1000.0)
        # No shared expert: the work done is the N routed rows, not MoK's T + T*k.
        n_rows = rec["rows"]["real"]
        self.assertAlmostEqual(rec["ratios"]["mok_forward_performed_of_dense_ceiling"],
                               6.0 * n_rows * 4096 * 14336 / 2e-3 / 1e12 / 1000.0)

    def test_mok_alone(self):
        rec = records.make_record(self.mok, None, env())
        self.assertEqual(rec["peers"], {})
        self.assertEqual(rec["check"], {"mok": True, "pytorch": None, "peer_ran": False, "passes": False})
        self.assertIsNone(rec["ceilings"]["dense_bf16_tflops"])

    def test_failed_mok_check(self):
        mok = copy.deepcopy(self.mok)
        mok["check"]["forward"]["passes"] = False
        rec = records.make_record(mok, self.peer, env())
        self.assertFalse(rec["check"]["passes"])

    def test_record_is_json(self):
        json.loads(json.dumps(self.rec))


class Clocks(unittest.TestCase):
    """The record's clocks: each timed loop's samples, and the tensor peak at mok's clock."""

    def setUp(self):
        self.mok = copy.deepcopy(fixture("fixture_mok_qwen35_slice.json"))
        self.peer = copy.deepcopy(fixture("fixture_peer_qwen35_slice.json"))
        self.mok["timing"]["window_unix_s"] = [100.0, 101.0]
        self.peer["forward"]["window_unix_s"] = [102.0, 103.0]
        self.peer["ceilings"]["dense_bf16"]["window_unix_s"] = [104.0, 105.0]
        self.peer["env"]["capability"] = "9.0"
        self.mok["gpu"]["sms"] = 132
        self.samples = ([{"t": 100.0 + i / 10, "index": 0, "sm_mhz": 1400.0 + i, "power_w": 690.0,
                          "sw_power_cap": True} for i in range(11)]
                        + [{"t": 102.5, "index": 0, "sm_mhz": 1500.0, "power_w": 650.0, "sw_power_cap": False}]
                        + [{"t": 104.5, "index": 0, "sm_mhz": 1830.0, "power_w": 700.0, "sw_power_cap": True}])

    def test_each_loop_and_the_peak_at_mok_clock(self):
        rec = records.make_record(self.mok, self.peer, env(),
                                  {"samples": self.samples, "gpus": [0], "period_ms": 10, "error": None})
        c = rec["clocks"]
        self.assertEqual(c["mok_forward"]["samples"], 11)
        self.assertEqual(c["mok_forward"]["sm_mhz_median"], 1405.0)
        self.assertEqual(c["pytorch_forward"]["sm_mhz_median"], 1500.0)
        self.assertEqual(c["pytorch_forward"]["sw_power_cap_share"], 0.0)
        self.assertEqual(c["dense_bf16_ceiling"]["samples"], 1)
        self.assertNotIn("pytorch_grouped_gemms", c)  # the fixture's grouped GEMMs have no window
        peak = 132 * 4096 * 1405e6 / 1e12
        self.assertAlmostEqual(c["tensor_peak_bf16_tflops_at_mok_clock"], peak)
        self.assertAlmostEqual(c["mok_forward_performed_of_tensor_peak"],
                               rec["mok"]["forward"]["tflops_performed"] / peak)
        # The fixture's dense ceiling (1000 TFLOP/s) over the peak at 1830 MHz (989.4).
        self.assertAlmostEqual(c["dense_bf16_of_tensor_peak_at_its_clock"], 1000.0 / (132 * 4096 * 1830e6 / 1e12))
        self.assertEqual(rec["gpu"]["capability"], "9.0")
        # Energy per FLOP: mok's median power (690 W) over its performed rate; the ceiling's 700 W
        # over 1000 TFLOP/s = 0.7 pJ.
        self.assertAlmostEqual(c["mok_forward_pj_per_flop"], 690.0 / rec["mok"]["forward"]["tflops_performed"])
        self.assertAlmostEqual(c["dense_bf16_pj_per_flop"], 0.7)

    def test_mok_capability_when_there_is_no_peer(self):
        self.mok["gpu"]["capability"] = "9.0"
        rec = records.make_record(self.mok, None, env(),
                                  {"samples": self.samples, "gpus": [0], "period_ms": 10, "error": None})
        self.assertEqual(rec["gpu"]["capability"], "9.0")
        self.assertIsNotNone(rec["clocks"]["tensor_peak_bf16_tflops_at_mok_clock"])

    def test_samples_of_another_gpu_do_not_count(self):
        rec = records.make_record(self.mok, self.peer, env(),
                                  {"samples": self.samples, "gpus": [1], "period_ms": 10, "error": None})
        self.assertEqual(rec["clocks"]["mok_forward"], {"samples": 0, "window_s": 1.0})
        self.assertIsNone(rec["clocks"]["tensor_peak_bf16_tflops_at_mok_clock"])

    def test_a_groups_ceiling_is_read_on_the_gpu_that_ran_it(self):
        # A group of two: the dense GEMM runs on rank 0's GPU (index 0) while GPU 1 idles at a
        # high clock and low power; the ceiling's loop is summarised over GPU 0 alone, mok's
        # over both.
        idle = [dict(s, index=1, sm_mhz=1980.0, power_w=120.0) for s in self.samples]
        rec = records.make_record(self.mok, self.peer, env(),
                                  {"samples": self.samples + idle, "gpus": [0, 1], "period_ms": 10, "error": None})
        c = rec["clocks"]
        self.assertEqual(c["dense_bf16_ceiling"]["samples"], 1)
        self.assertEqual(c["dense_bf16_ceiling"]["sm_mhz_median"], 1830.0)
        self.assertAlmostEqual(c["dense_bf16_pj_per_flop"], 0.7)
        self.assertEqual(c["mok_forward"]["samples"], 22)

    def test_iterations_against_the_clock(self):
        # mok's 100 forwards fill its window [100, 101] s; each 10 ms iteration holds the sample
        # at its middle, whose clock sets its time (the same cycles each), so the spread is the
        # clock's. The peer's iterations come from its forward's iters_ms.
        mhz = [1200.0 + 5 * i for i in range(100)]
        self.mok["forward_iters_ms"] = [10.0 * 1300.0 / m for m in mhz]
        total = sum(self.mok["forward_iters_ms"]) / 1e3
        self.mok["timing"]["window_unix_s"] = [101.0 - total, 101.0]
        starts = [101.0 - total + sum(self.mok["forward_iters_ms"][:i]) / 1e3 for i in range(100)]
        samples = [{"t": t + self.mok["forward_iters_ms"][i] / 2e3, "index": 0, "sm_mhz": mhz[i], "power_w": 690.0,
                    "sw_power_cap": True} for i, t in enumerate(starts)]
        self.peer["forward"]["iters_ms"] = [0.1] * 10  # (no sample inside: too few pairs)
        rec = records.make_record(self.mok, self.peer, env(),
                                  {"samples": samples, "gpus": [0], "period_ms": 10, "error": None})
        it = rec["clocks"]["mok_forward"]["iterations"]
        self.assertEqual(it["pairs"], 100)
        self.assertAlmostEqual(it["cycles_spread"], 0.0, places=9)
        self.assertGreater(it["ms_spread"], 0.2)
        self.assertAlmostEqual(it["r_ms_vs_clock_period"], 1.0, places=6)
        self.assertIsNone(rec["clocks"]["pytorch_forward"]["iterations"])
        self.assertEqual(records.structure_errors(rec), [])
        rec["clocks"]["mok_forward"]["iterations"]["ms_spread"] = "wide"
        self.assertEqual(records.structure_errors(rec),
                         ["'clocks.mok_forward.iterations.ms_spread' must be a finite number or null (got \"wide\")"])

    def test_a_groups_loops_are_not_paired_with_the_clock(self):
        # A group's times are each iteration's slowest rank and its loop pauses every 50 calls:
        # its iterations cannot be placed in time, so no pairs (the loop's summary stays).
        self.mok["forward_iters_ms"] = [10.0] * 100
        self.mok["ep_mode"] = "distributed"
        samples = [{"t": 100.0 + i / 100 + 0.005, "index": 0, "sm_mhz": 1400.0, "power_w": 690.0,
                    "sw_power_cap": True} for i in range(100)]
        self.mok["timing"]["window_unix_s"] = [100.0, 101.0]
        rec = records.make_record(self.mok, self.peer, env(),
                                  {"samples": samples, "gpus": [0], "period_ms": 10, "error": None})
        self.assertEqual(rec["clocks"]["mok_forward"]["samples"], 100)
        self.assertNotIn("iterations", rec["clocks"]["mok_forward"])
        self.mok["ep_mode"] = "slice"
        rec = records.make_record(self.mok, self.peer, env(),
                                  {"samples": samples, "gpus": [0], "period_ms": 10, "error": None})
        self.assertEqual(rec["clocks"]["mok_forward"]["iterations"]["pairs"], 100)

    def test_not_sampled(self):
        self.assertIsNone(records.make_record(self.mok, self.peer, env())["clocks"])
        rec = records.make_record(self.mok, self.peer, env(),
                                  {"samples": [], "gpus": [0], "period_ms": 10, "error": "nvidia-smi not found"})
        self.assertEqual(rec["clocks"]["error"], "nvidia-smi not found")
        self.assertEqual(rec["clocks"]["mok_forward"]["samples"], 0)


class Files(unittest.TestCase):
    def setUp(self):
        self.rec = records.make_record(fixture("fixture_mok_qwen35_slice.json"),
                                       fixture("fixture_peer_qwen35_slice.json"), env())

    def test_name(self):
        self.assertEqual(records.record_basename(self.rec), "2001-02-03_qwen3.5-397b-a17b_slice_0123456")
        odd = dict(self.rec, shape="loaded:/tmp/x y")
        self.assertEqual(records.record_basename(odd), "2001-02-03_loaded-tmp-x-y_slice_0123456")

    def test_never_overwrites(self):
        with tempfile.TemporaryDirectory() as d:
            p1 = records.write_record(self.rec, d)
            p2 = records.write_record(self.rec, d)
            p3 = records.write_record(self.rec, d)
            self.assertEqual(os.path.basename(p1), "2001-02-03_qwen3.5-397b-a17b_slice_0123456.json")
            self.assertEqual(os.path.basename(p2), "2001-02-03_qwen3.5-397b-a17b_slice_0123456_2.json")
            self.assertEqual(os.path.basename(p3), "2001-02-03_qwen3.5-397b-a17b_slice_0123456_3.json")
            self.assertEqual(records.load_record(p1), json.loads(json.dumps(self.rec)))
            self.assertEqual(sorted(os.listdir(d)), sorted(os.path.basename(p) for p in (p1, p2, p3)))

    def test_creates_results_dir(self):
        with tempfile.TemporaryDirectory() as d:
            p = records.write_record(self.rec, os.path.join(d, "a", "b"))
            self.assertTrue(os.path.exists(p))

    def test_load_rejects_other_json(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "x.json")
            with open(p, "w") as f:
                json.dump({"hello": 1}, f)
            with self.assertRaises(ValueError):
                records.load_record(p)

    def test_load_rejects_peer_json_and_records_missing_a_key(self):
        # peer.json has the record's schema number and a "shape": it is not a record.
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "peer.json")
            with open(p, "w") as f:
                json.dump(fixture("fixture_peer_qwen35_slice.json"), f)
            with self.assertRaises(ValueError) as cm:
                records.load_record(p)
            self.assertIn("not a mok benchmark record", str(cm.exception))
            good = json.loads(json.dumps(self.rec))
            for path, why in ((("ep_mode",), "'ep_mode' must be a string (missing)"),
                              (("tokens_per_rank",), "'tokens_per_rank' must be a whole number (missing)"),
                              (("check",), "'check' must be an object"), (("date",), "'date'"),
                              (("commit", "short"), "'commit.short' must be a string")):
                bad = copy.deepcopy(good)
                parent = bad
                for key in path[:-1]:
                    parent = parent[key]
                del parent[path[-1]]
                p = os.path.join(d, "bad.json")
                with open(p, "w") as f:
                    json.dump(bad, f)
                with self.assertRaises(ValueError) as cm:
                    records.load_record(p)
                self.assertIn(why, str(cm.exception))
                self.assertIn(p, str(cm.exception))

    def write_json(self, d, value, name="r.json"):
        p = os.path.join(d, name)
        with open(p, "w") as f:
            json.dump(value, f)
        return p

    def test_load_refuses_hand_made_records_naming_the_file_and_key(self):
        good = json.loads(json.dumps(self.rec))
        good["gpu"]["name"] = "NVIDIA H100 80GB HBM3"

        def with_(path, value):
            bad = copy.deepcopy(good)
            parent = bad
            for key in path[:-1]:
                parent = parent[key]
            if value is KeyError:
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
            return bad

        cases = [
            (("gpu", "name"), "", "'gpu.name' must be a non-empty string"),
            (("gpu", "name"), None, "'gpu.name' must be a non-empty string"),
            (("gpu", "name"), KeyError, "'gpu.name' must be a non-empty string"),
            (("commit", "sha"), "XYZ1234", "'commit.sha' must be 7 to 40 lower-case hex digits or \"unknown\""),
            (("commit", "sha"), "012345", "'commit.sha'"),
            (("commit", "sha"), "0123456789ABCDEF", "'commit.sha'"),
            (("check", "passes"), "false", "'check.passes' must be true or false (got \"false\")"),
            (("check", "passes"), 1, "'check.passes' must be true or false"),
            (("check", "peer_ran"), None, "'check.peer_ran' must be true or false"),
            (("check", "mok"), "true", "'check.mok' must be true or false (or null)"),
            (("check", "pytorch"), 0, "'check.pytorch' must be true or false (or null)"),
            (("mok", "forward", "median_ms"), 0, "'mok.forward.median_ms' must be a finite number > 0"),
            (("mok", "forward", "median_ms"), -1.0, "'mok.forward.median_ms' must be a finite number > 0"),
            (("mok", "forward", "median_ms"), float("nan"), "'mok.forward.median_ms' must be a finite number > 0"),
            (("mok", "forward", "median_ms"), float("inf"), "'mok.forward.median_ms' must be a finite number > 0"),
            (("mok", "forward", "median_ms"), "1.0", "'mok.forward.median_ms' must be a finite number > 0"),
            (("mok", "forward", "median_ms"), True, "'mok.forward.median_ms' must be a finite number > 0"),
            (("mok", "forward"), None, "'mok.forward' must be an object with median_ms"),
            (("mok", "forward", "min_ms"), 1.5, "'mok.forward' must have min_ms <= median_ms <= max_ms"),
            (("mok", "forward", "max_ms"), 0.5, "'mok.forward' must have min_ms <= median_ms <= max_ms"),
            (("mok", "forward", "max_ms"), float("nan"), "'mok.forward.max_ms' must be a finite number"),
            (("peers", "pytorch_pipeline", "forward", "median_ms"), -3.0,
             "'peers.pytorch_pipeline.forward.median_ms' must be a finite number > 0"),
            (("peers", "pytorch_grouped_gemms", "forward", "min_ms"), 99.0,
             "'peers.pytorch_grouped_gemms.forward' must have min_ms <= median_ms <= max_ms"),
            (("date",), "2001-02-03", "'date' must be an ISO-8601 UTC time"),
            (("date",), "2001-02-03T04:05:06+02:00", "'date' must be an ISO-8601 UTC time"),
            (("date",), "2001-02-30T04:05:06Z", "'date' must be an ISO-8601 UTC time"),
            (("date",), "2999-01-01T00:00:00Z", "'date' 2999-01-01T00:00:00Z is in the future"),
        ]
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(records.load_record(self.write_json(d, good)), good)
            for path, value, why in cases:
                p = self.write_json(d, with_(path, value))
                with self.assertRaises(ValueError, msg=(path, value)) as cm:
                    records.load_record(p)
                self.assertIn(why, str(cm.exception), (path, value))
                self.assertTrue(str(cm.exception).startswith(p + ": "), str(cm.exception))
            # What is allowed: an unknown commit, null verdicts (no peer, mok unchecked: with the
            # parts that say so), a peer whose forward was skipped, no min/max.
            for path, value in ((("commit", "sha"), "unknown"),
                                (("mok", "forward", "min_ms"), KeyError), (("check", "peer_ran"), KeyError)):
                records.load_record(self.write_json(d, with_(path, value)))
            unchecked_mok = fixture("fixture_mok_qwen35_slice.json")
            del unchecked_mok["check"]
            for mok, peer in ((fixture("fixture_mok_qwen35_slice.json"), None),
                              (unchecked_mok, fixture("fixture_peer_qwen35_slice.json"))):
                rec = json.loads(json.dumps(records.make_record(mok, peer, env())))
                self.assertIsNone(rec["check"]["pytorch" if peer is None else "mok"])
                records.load_record(self.write_json(d, rec))
            skipped = fixture("fixture_peer_qwen35_slice.json")
            del skipped["forward"]
            skipped["skipped"] = {"forward": "fixture: skipped"}
            rec = json.loads(json.dumps(records.make_record(fixture("fixture_mok_qwen35_slice.json"), skipped, env())))
            rec["gpu"]["name"] = rec["gpu"]["peer_gpu"] = "NVIDIA H100 80GB HBM3"
            self.assertIsNone(records.load_record(self.write_json(d, rec))["peers"]["pytorch_pipeline"]["forward"])
            # A file that is not JSON is named.
            p = os.path.join(d, "cut.json")
            with open(p, "w") as f:
                f.write(json.dumps(good)[:100])
            with self.assertRaises(ValueError) as cm:
                records.load_record(p)
            self.assertTrue(str(cm.exception).startswith(f"{p}: not valid JSON: "), str(cm.exception))
            # write_record refuses what load_record would, writing nothing.
            out = os.path.join(d, "out")
            with self.assertRaises(ValueError) as cm:
                records.write_record(with_(("mok", "forward", "median_ms"), float("nan")), out)
            self.assertIn(f"record not written to {out}: 'mok.forward.median_ms'", str(cm.exception))
            self.assertFalse(os.path.exists(out))

    def test_records_are_strict_json(self):
        # A non-finite figure (a check's rel over a zero reference) is kept as a string, and
        # the file has no NaN or Infinity, which strict JSON readers refuse.
        peer = fixture("fixture_peer_qwen35_slice.json")
        peer["check"]["rel"] = float("inf")
        peer["check"]["max_abs"] = float("nan")
        peer["check"]["passes"] = False
        rec = records.make_record(fixture("fixture_mok_qwen35_slice.json"), peer, env())
        self.assertEqual((rec["peers"]["pytorch_pipeline"]["check"]["rel"],
                          rec["peers"]["pytorch_pipeline"]["check"]["max_abs"]), ("inf", "nan"))
        self.assertEqual(records.fmt("inf", ".3f"), "inf")
        with tempfile.TemporaryDirectory() as d:
            p = records.write_record(rec, d)
            with open(p) as f:
                text = f.read()

            def refuse(name):
                raise ValueError(name)
            self.assertEqual(json.loads(text, parse_constant=refuse), rec)
        # json.dump itself is told to refuse one (allow_nan=False) should any get through.
        with mock.patch.object(records, "strict_json", side_effect=lambda v: v), \
                mock.patch.object(records, "record_errors", return_value=[]):
            bad = records.make_record(fixture("fixture_mok_qwen35_slice.json"), peer, env())
            with tempfile.TemporaryDirectory() as d:
                with self.assertRaises(ValueError):
                    records.write_record(bad, d)
                self.assertEqual(os.listdir(d), [])

    def test_write_is_atomic_and_leaves_no_temporary_file(self):
        with tempfile.TemporaryDirectory() as d:
            # The link to the final name fails (a file system without hard links, a full disk):
            # no record, no temporary file.
            with mock.patch.object(records.os, "link", side_effect=OSError(28, "No space left on device")):
                with self.assertRaises(OSError):
                    records.write_record(self.rec, d)
            self.assertEqual(os.listdir(d), [])
            # The write fails half-way: nothing either.
            with mock.patch.object(records.os, "fsync", side_effect=OSError(5, "Input/output error")):
                with self.assertRaises(OSError):
                    records.write_record(self.rec, d)
            self.assertEqual(os.listdir(d), [])
            # A name taken meanwhile (another writer) is never replaced: the next one is used.
            base = records.record_basename(self.rec)
            taken = os.path.join(d, base + ".json")
            real_link = os.link

            def link(src, dst):
                if dst == taken and not os.path.exists(taken):
                    with open(taken, "w") as f:
                        f.write("another writer's record")
                return real_link(src, dst)
            with mock.patch.object(records.os, "link", side_effect=link):
                p = records.write_record(self.rec, d)
            self.assertEqual(os.path.basename(p), base + "_2.json")
            self.assertEqual(helpers.read_text(taken), "another writer's record")
            self.assertEqual(sorted(os.listdir(d)), [base + ".json", base + "_2.json"])
            self.assertEqual(records.load_record(p), json.loads(json.dumps(self.rec)))

    def test_fixture_records_never_go_into_the_repositorys_results(self):
        # records.RESULTS_DIR stands for bench/results/ (a temporary folder here).
        with tempfile.TemporaryDirectory() as d:
            results, elsewhere = os.path.join(d, "results"), os.path.join(d, "elsewhere")
            with mock.patch.object(records, "RESULTS_DIR", results):
                fixture_rec = self.rec  # "FIXTURE-GPU"
                synthetic = dict(self.rec, gpu=dict(self.rec["gpu"], name="SYNTHETIC-GPU (test fixture)"))
                real = dict(self.rec, gpu=dict(self.rec["gpu"], name="NVIDIA H200"))
                for rec in (fixture_rec, synthetic, dict(self.rec, gpu=dict(self.rec["gpu"], name="a Synthetic one"))):
                    for target in (None, results, os.path.join(results, ".")):
                        with self.assertRaises(ValueError) as cm:
                            records.write_record(rec, target)
                        self.assertIn("is a test fixture's GPU", str(cm.exception))
                self.assertFalse(os.path.exists(results))  # (not even the folder)
                # Elsewhere (a test's own folder, a device's $OUT) they are written and read.
                p = records.write_record(synthetic, elsewhere)
                self.assertEqual(records.load_record(p)["gpu"]["name"], "SYNTHETIC-GPU (test fixture)")
                # A real GPU's record goes in; a fixture's copied in by hand is refused on reading.
                records.write_record(real, results)
                sneaked = os.path.join(results, "sneaked.json")
                with open(p) as src, open(sneaked, "w") as dst:
                    dst.write(src.read())
                with self.assertRaises(ValueError) as cm:
                    records.load_record(sneaked)
                self.assertIn(f"{sneaked}: refused: 'gpu.name' 'SYNTHETIC-GPU (test fixture)' is a test fixture's GPU",
                              str(cm.exception))
                os.remove(sneaked)
                # The import refuses it too, and imports nothing beside it.
                good = records.write_record(dict(real, date="2001-02-03T05:00:00Z"), elsewhere)
                with contextlib.redirect_stderr(io.StringIO()) as err:
                    self.assertEqual(records.main(["import", good, p]), 1)
                self.assertIn("is a test fixture's GPU", err.getvalue())
                self.assertEqual(len(os.listdir(results)), 1)

    def test_default_results_dir_is_bench_results(self):
        self.assertEqual(records.RESULTS_DIR, os.path.join(helpers.BENCH_DIR, "results"))


class Group(unittest.TestCase):
    def rank(self, times, remote, passes=True, max_abs=0.01):
        m = copy.deepcopy(fixture("fixture_mok_qwen35_slice.json"))
        m["forward_iters_ms"] = times
        m["forward"] = {"median_ms": sorted(times)[len(times) // 2], "min_ms": min(times), "max_ms": max(times)}
        m["rows"]["remote"] = remote
        m["check"]["forward"].update({"passes": passes, "max_abs": max_abs})
        return m

    def test_merge_takes_the_slowest_rank_per_iteration(self):
        merged = records.merge_group([self.rank([1.0, 5.0, 2.0], 10), self.rank([3.0, 1.0, 2.5], 30)])
        self.assertEqual(merged["forward_iters_ms"], [3.0, 5.0, 2.5])
        self.assertEqual(merged["forward"], {"median_ms": 3.0, "min_ms": 2.5, "max_ms": 5.0, "samples": 3})
        self.assertEqual(merged["ep_mode"], "distributed")
        self.assertEqual(merged["rows"]["remote"], 30)
        self.assertTrue(merged["check"]["forward"]["passes"])
        self.assertEqual(len(merged["ranks"]), 2)

    def test_rows_come_from_the_rank_with_the_most_rows_remote_from_the_most_remote(self):
        a, b = self.rank([1.0], 500), self.rank([1.0], 100)
        a["rows"]["real"], b["rows"]["real"] = 1000, 3000
        merged = records.merge_group([a, b])
        self.assertEqual(merged["rows"]["real"], 3000)   # b sets the pace (performed FLOPs, HBM bytes)
        self.assertEqual(merged["rows"]["remote"], 500)  # a moved the most over the link

    def test_merge_fails_when_any_rank_fails_or_lacks_times(self):
        merged = records.merge_group([self.rank([1.0], 1), self.rank([1.0], 1, passes=False, max_abs=3.0)])
        self.assertFalse(merged["check"]["forward"]["passes"])
        self.assertEqual(merged["check"]["forward"]["max_abs"], 3.0)
        with self.assertRaises(ValueError):
            records.merge_group([self.rank([1.0, 2.0], 1), self.rank([1.0], 1)])
        with self.assertRaises(ValueError):
            records.merge_group([])

    def test_link_rate_against_nccl_all_to_all(self):
        mok = records.merge_group([self.rank([2.0], 1000), self.rank([2.0], 1000)])
        peer = {"ceilings": {"nccl_all_to_all": {"busbw_gbps": 100.0}}}
        rec = records.make_record(mok, peer, env())
        H = rec["problem"]["hidden"]
        link = 2 * 1000 * H * 2
        self.assertEqual(rec["bytes"]["link_forward"], link)
        self.assertAlmostEqual(rec["bytes"]["mok_link_gbps"], link / 2e-3 / 1e9)
        self.assertAlmostEqual(rec["bytes"]["mok_link_of_nccl_all_to_all"], link / 2e-3 / 1e9 / 100.0)
        self.assertEqual(rec["ceilings"]["nccl_all_to_all_busbw_gbps"], 100.0)


def with_phases(mok, **ms):
    m = copy.deepcopy(mok)
    m["forward_phases"] = {"iters": 20, "method": "events", "median_ms": ms}
    return m


class Phases(unittest.TestCase):
    def test_phases_carried_into_the_record(self):
        mok = with_phases(fixture("fixture_mok_qwen35_slice.json"), setup=0.01, schedule=0.06, megakernel=1.0,
                          epilogue=0.05)
        rec = records.make_record(mok, None, env())
        self.assertEqual(rec["mok"]["forward_phases"]["median_ms"],
                         {"setup": 0.01, "schedule": 0.06, "megakernel": 1.0, "epilogue": 0.05})
        self.assertEqual(rec["mok"]["forward_phases"]["iters"], 20)
        self.assertNotIn("timed_after_ms", rec["mok"]["forward_phases"])  # (older binaries)
        mok["forward_phases"]["timed_after_ms"] = 1.04
        self.assertEqual(records.make_record(mok, None, env())["mok"]["forward_phases"]["timed_after_ms"], 1.04)

    def test_missing_or_malformed_phases_are_none(self):
        mok = fixture("fixture_mok_qwen35_slice.json")
        self.assertIsNone(records.make_record(mok, None, env())["mok"]["forward_phases"])
        for bad in ({"median_ms": {"setup": "fast"}}, {"median_ms": {"setup": -1.0}}, {"median_ms": [1.0]},
                    {"median_ms": {"setup": True}}, "x", {"median_ms": {"setup": 1.0}, "timed_after_ms": "1"},
                    {"median_ms": {"setup": 1.0}, "timed_after_ms": -1.0},
                    {"median_ms": {"setup": 1.0}, "timed_after_ms": float("nan")},
                    {"median_ms": {"setup": 1.0}, "timed_after_ms": float("inf")},
                    {"median_ms": {"setup": float("inf")}}, {"median_ms": {"setup": 1.0, "epilogue": float("nan")}}):
            m = copy.deepcopy(mok)
            m["forward_phases"] = bad
            self.assertIsNone(records.forward_phases(m), bad)

    def test_group_takes_each_phase_of_the_slowest_rank(self):
        g = Group()
        a = with_phases(g.rank([1.0], 1), schedule=0.05, megakernel=1.2, epilogue=0.04)
        b = with_phases(g.rank([1.0], 1), schedule=0.07, megakernel=1.1, epilogue=0.06)
        merged = records.merge_group([a, b])
        self.assertEqual(merged["forward_phases"]["median_ms"], {"schedule": 0.07, "megakernel": 1.2, "epilogue": 0.06})
        self.assertNotIn("timed_after_ms", merged["forward_phases"])
        # The forwards timed after the pass: the slowest rank's, when every rank has them.
        a["forward_phases"]["timed_after_ms"], b["forward_phases"]["timed_after_ms"] = 1.3, 1.25
        self.assertEqual(records.merge_group([a, b])["forward_phases"]["timed_after_ms"], 1.3)
        del b["forward_phases"]["timed_after_ms"]
        self.assertNotIn("timed_after_ms", records.merge_group([a, b])["forward_phases"])
        # A rank without the split (or with other phases): no group split at all.
        self.assertNotIn("forward_phases", records.merge_group([a, g.rank([1.0], 1)]))


@contextlib.contextmanager
def commit_env(sha=None, dirty=None):
    """MOK_BENCH_COMMIT / MOK_BENCH_DIRTY set to these values (unset where None) inside."""
    with mock.patch.dict(os.environ):
        for name, value in (("MOK_BENCH_COMMIT", sha), ("MOK_BENCH_DIRTY", dirty)):
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
        yield


class Environment(unittest.TestCase):
    def test_git_commit(self):
        with commit_env():
            e = records.collect_env()
        self.assertRegex(e["date"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=records.REPO_ROOT, capture_output=True, text=True)
        if head.returncode != 0:
            self.skipTest("not a git checkout")
        self.assertEqual(e["commit"]["sha"], head.stdout.strip())
        self.assertEqual(e["commit"]["source"], "git")
        self.assertIn(e["commit"]["dirty"], (True, False))

    def test_binary_build_commit_wins_over_git(self):
        # A copy of the tree can carry an older .git than the binary it times.
        with commit_env():
            e = records.collect_env(records.REPO_ROOT, {"build": {"commit": "0123456789ab", "dirty": False}})
        self.assertEqual(e["commit"], {"sha": "0123456789ab", "dirty": False, "source": "mok.json build"})
        # A binary built outside git: this tree's HEAD is not taken for it; the variable is.
        with commit_env():
            e = records.collect_env(records.REPO_ROOT, {"build": {"commit": "unknown", "dirty": True}})
        self.assertEqual(e["commit"], {"sha": "unknown", "dirty": True, "source": "mok.json build"})
        with commit_env("abcdef1234", "0"):
            e = records.collect_env(records.REPO_ROOT, {"build": {"commit": "unknown", "dirty": True}})
        self.assertEqual(e["commit"], {"sha": "abcdef1234", "dirty": False, "source": "MOK_BENCH_COMMIT"})

    def test_a_commit_is_named_as_records_hold_it(self):
        # Lower-case hex (what load_record takes), and a stamp that is no sha is refused before
        # the peer runs rather than after, when the record could not be written.
        with commit_env("ABCDEF1234", "1"):
            e = records.collect_env(records.REPO_ROOT, None)
        self.assertEqual(e["commit"]["sha"], "abcdef1234")
        with commit_env():
            e = records.collect_env(records.REPO_ROOT, {"build": {"commit": "0123456789AB", "dirty": False}})
            self.assertEqual(e["commit"]["sha"], "0123456789ab")
            with self.assertRaisesRegex(ValueError, "mok.json build.commit 'v1.2-dirty' is not a commit's hex sha"):
                records.collect_env(records.REPO_ROOT, {"build": {"commit": "v1.2-dirty", "dirty": False}})

    def test_no_git_fallbacks(self):
        with tempfile.TemporaryDirectory() as d, commit_env():
            e = records.collect_env(d, {"build": {"commit": "feedface" * 5, "dirty": True}})
            self.assertEqual(e["commit"], {"sha": "feedface" * 5, "dirty": True, "source": "mok.json build"})
            e = records.collect_env(d, {})
            self.assertEqual(e["commit"], {"sha": "unknown", "dirty": None, "source": "none"})
        with tempfile.TemporaryDirectory() as d, commit_env("abcdef1234", "0"):
            # No stamp in mok.json (an older binary): the variable names the commit.
            e = records.collect_env(d, {})
            self.assertEqual(e["commit"], {"sha": "abcdef1234", "dirty": False, "source": "MOK_BENCH_COMMIT"})

    def test_binary_stamp_wins_over_MOK_BENCH_COMMIT(self):
        stamp = {"build": {"commit": "0123456789ab", "dirty": False}}
        with tempfile.TemporaryDirectory() as d:
            # The same commit, shorter or longer (the stamp has 12 digits): the stamp is kept.
            for given in ("0123456", "0123456789AB", "0123456789abcdef0123456789abcdef01234567"):
                with commit_env(given, "1"):
                    e = records.collect_env(d, stamp)
                self.assertEqual(e["commit"], {"sha": "0123456789ab", "dirty": False, "source": "mok.json build"}, given)
            # Another commit: one of them is wrong, and the error names both.
            with commit_env("abcdef1234"), self.assertRaises(ValueError) as cm:
                records.collect_env(d, stamp)
            self.assertIn("MOK_BENCH_COMMIT=abcdef1234", str(cm.exception))
            self.assertIn("0123456789ab", str(cm.exception))

    def test_MOK_BENCH_COMMIT_without_MOK_BENCH_DIRTY_is_unknown_not_clean(self):
        with tempfile.TemporaryDirectory() as d:
            with commit_env("abcdef1234"):
                e = records.collect_env(d, {})
            self.assertEqual(e["commit"], {"sha": "abcdef1234", "dirty": None, "source": "MOK_BENCH_COMMIT"})
            for sha, dirty, named in (("abc", None, "MOK_BENCH_COMMIT"), ("not-a-sha", None, "MOK_BENCH_COMMIT"),
                                      ("abcdef1234", "yes", "MOK_BENCH_DIRTY")):
                with commit_env(sha, dirty), self.assertRaises(ValueError) as cm:
                    records.collect_env(d, {})
                self.assertIn(named, str(cm.exception))

    def test_unknown_commit_name(self):
        rec = records.make_record(fixture("fixture_mok_qwen35_slice.json"), None,
                                  {"date": "2001-02-03T04:05:06Z",
                                   "commit": {"sha": "unknown", "dirty": None, "source": "none"}})
        self.assertEqual(records.record_basename(rec), "2001-02-03_qwen3.5-397b-a17b_slice_unknown")


class JsonFiles(unittest.TestCase):
    """The work directory's JSON files as run.py reads them (records.load_peer_json,
    records.load_mok_json) and the atomic write of a record kept in a work directory."""

    def test_a_json_file_is_written_whole_or_not_at_all(self):
        with tempfile.TemporaryDirectory() as d:
            path = records.write_json_atomic(os.path.join(d, "peer.json"),
                                             {"check": {"passes": True}, "forward": {"median_ms": 1.0}})
            self.assertEqual(path, os.path.join(d, "peer.json"))
            before = helpers.read_text(path)
            # The dump fails half-way (a value JSON cannot hold): the old file stays whole, no
            # temporary file is left.
            with self.assertRaises(TypeError):
                records.write_json_atomic(path, {"check": {"passes": True}, "forward": {"median_ms": object()}})
            self.assertEqual(helpers.read_text(path), before)
            self.assertEqual(os.listdir(d), ["peer.json"])
            with mock.patch.object(records.os, "replace", side_effect=OSError(28, "No space left on device")):
                with self.assertRaises(OSError):
                    records.write_json_atomic(path, {"check": {"passes": False}})
            self.assertEqual(helpers.read_text(path), before)
            self.assertEqual(os.listdir(d), ["peer.json"])
            self.assertEqual(records.load_peer_json(d)["check"], {"passes": True})

    def test_unreadable_json_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "peer.json"), "w") as f:
                f.write('{"check": {"passes": tr')
            with self.assertRaises(ValueError) as cm:
                records.load_peer_json(d)
            self.assertTrue(str(cm.exception).startswith(os.path.join(d, "peer.json") + ": not valid JSON: "))
            for doc, why in (([1], "must be a JSON object"), ({"check": "ok"}, "'check' must be an object"),
                             ({"check": {"passes": "false"}}, "'check.passes' must be true or false")):
                records.write_json_atomic(os.path.join(d, "peer.json"), doc)
                with self.assertRaises(ValueError) as cm:
                    records.load_peer_json(d)
                self.assertIn(f"peer.json: {why}", str(cm.exception))
            make_workdir(d)
            with open(os.path.join(d, "mok.json"), "w") as f:
                f.write("{")
            with self.assertRaises(workdir.ContractError) as cm:
                records.load_mok_json(d)
            self.assertTrue(str(cm.exception).startswith(os.path.join(d, "mok.json") + ": not valid JSON: "))

    def test_a_mok_verdict_that_is_not_a_real_bool_is_a_contract_error(self):
        with tempfile.TemporaryDirectory() as d:
            doc = make_workdir(d)
            path = os.path.join(d, "mok.json")
            for value in ("false", "true", 0, None):
                bad = dict(doc, check={"forward": dict(doc["check"]["forward"], passes=value)})
                with open(path, "w") as f:
                    json.dump(bad, f)
                with self.assertRaises(workdir.ContractError) as cm:
                    records.load_mok_json(d)
                self.assertIn(f"{path}: 'check.forward.passes' must be true or false", str(cm.exception))
            with open(path, "w") as f:
                json.dump(dict(doc, check={"forward": "yes"}), f)
            with self.assertRaisesRegex(workdir.ContractError, "'check.forward' must be an object"):
                records.load_mok_json(d)
            # No check at all is allowed (the record says FAIL), and a real bool is read as it is.
            without = dict(doc)
            del without["check"]
            with open(path, "w") as f:
                json.dump(without, f)
            self.assertNotIn("check", records.load_mok_json(d))


class RecordFigures(unittest.TestCase):
    """Every figure a report divides by or shows is a finite number > 0 (or null), and every
    figure a record stores agrees with its medians; a comparison across GPUs, or with a peer
    that has no forward median, never passes."""

    def setUp(self):
        self.mok = fixture("fixture_mok_qwen35_slice.json")
        self.peer = fixture("fixture_peer_qwen35_slice.json")
        self.mok["backward"] = {"median_ms": 4.0, "min_ms": 3.9, "max_ms": 4.1}
        rec = json.loads(json.dumps(records.make_record(self.mok, self.peer, env())))
        rec["gpu"]["name"] = rec["gpu"]["peer_gpu"] = "NVIDIA H100 80GB HBM3"  # (a real GPU's name)
        self.good = rec

    def edited(self, path, value):
        rec = copy.deepcopy(self.good)
        parent = rec
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        return rec

    def load(self, rec):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "r.json")
            with open(p, "w") as f:
                json.dump(rec, f)
            return records.load_record(p)

    def test_every_timing_and_ceiling_is_finite_and_positive_when_loaded_and_written(self):
        nan, inf = float("nan"), float("inf")
        cases = [
            (("mok", "backward", "median_ms"), nan, "'mok.backward.median_ms' must be a finite number > 0"),
            (("mok", "backward", "median_ms"), -8.0, "'mok.backward.median_ms' must be a finite number > 0"),
            (("mok", "backward"), {"median_ms": -2.0, "min_ms": -3.0, "max_ms": -1.0},
             "'mok.backward.median_ms' must be a finite number > 0"),
            (("peers", "pytorch_pipeline", "backward", "median_ms"), nan,
             "'peers.pytorch_pipeline.backward.median_ms' must be a finite number > 0"),
            (("peers", "pytorch_grouped_gemms", "gate_up", "median_ms"), 0,
             "'peers.pytorch_grouped_gemms.gate_up.median_ms' must be a finite number > 0"),
            (("peers", "pytorch_grouped_gemms", "down", "median_ms"), "0.3",
             "'peers.pytorch_grouped_gemms.down.median_ms' must be a finite number > 0"),
            (("mok", "forward", "tflops"), nan, "'mok.forward.tflops' must be a finite number > 0 or null"),
            (("mok", "forward", "tflops_performed"), -1.0,
             "'mok.forward.tflops_performed' must be a finite number > 0 or null"),
            (("ceilings", "dense_bf16_tflops"), "inf", "'ceilings.dense_bf16_tflops' must be a finite number > 0"),
            (("ceilings", "dense_bf16_tflops"), inf, "'ceilings.dense_bf16_tflops' must be a finite number > 0"),
            (("ceilings", "dense_bf16_tflops"), -5.0, "'ceilings.dense_bf16_tflops' must be a finite number > 0"),
            (("ceilings", "copy_gbps"), 0, "'ceilings.copy_gbps' must be a finite number > 0"),
            (("ceilings", "fp8_e4m3_tflops"), True, "'ceilings.fp8_e4m3_tflops' must be a finite number > 0"),
        ]
        self.assertEqual(self.load(self.good), self.good)
        for path, value, why in cases:
            with self.assertRaises(ValueError, msg=(path, value)) as cm:
                self.load(self.edited(path, value))
            self.assertIn(why, str(cm.exception), (path, value))
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "out")
                with self.assertRaises(ValueError, msg=(path, value)) as cm:
                    records.write_record(self.edited(path, value), out)
                self.assertIn(why, str(cm.exception))
                self.assertFalse(os.path.exists(out))

    def test_make_record_refuses_a_bad_timing_or_ceiling_naming_the_file_and_key(self):
        nan = float("nan")
        for side, key, value, why in (
                ("mok", "backward", {"median_ms": nan}, "mok.json: 'backward.median_ms' must be a finite number > 0"),
                ("mok", "backward", {"median_ms": -8.0}, "mok.json: 'backward.median_ms'"),
                ("peer", "backward", {"median_ms": nan}, "peer.json: 'backward.median_ms'"),
                ("peer", "grouped_gemms", {"median_ms": 0.0}, "peer.json: 'grouped_gemms.median_ms'"),
                ("peer", "gate_up_gemm", {"median_ms": -1.0}, "peer.json: 'gate_up_gemm.median_ms'"),
                ("peer", "down_gemm", {"median_ms": float("inf")}, "peer.json: 'down_gemm.median_ms'"),
                ("peer", "ceilings", {"dense_bf16": {"tflops": float("inf")}},
                 "peer.json: 'ceilings.dense_bf16.tflops' must be a finite number > 0 or null"),
                ("peer", "ceilings", {"copy": {"gbps": -1.0}}, "peer.json: 'ceilings.copy.gbps'")):
            mok, peer = copy.deepcopy(self.mok), copy.deepcopy(self.peer)
            (mok if side == "mok" else peer)[key] = value
            with self.assertRaises(ValueError, msg=(side, key)) as cm:
                records.make_record(mok, peer, env())
            self.assertIn(why, str(cm.exception))
        # And run.py's readers of the work directory refuse them too, naming the file.
        with tempfile.TemporaryDirectory() as d:
            records.write_json_atomic(os.path.join(d, "peer.json"), dict(self.peer, backward={"median_ms": nan}))
            with self.assertRaisesRegex(ValueError, "peer.json: 'backward.median_ms' must be a finite number > 0"):
                records.load_peer_json(d)
            doc = make_workdir(d)
            with open(os.path.join(d, "mok.json"), "w") as f:
                json.dump(dict(doc, backward={"median_ms": -8.0}), f)
            with self.assertRaisesRegex(workdir.ContractError, "mok.json: 'backward.median_ms' must be a finite"):
                records.load_mok_json(d)

    def test_a_stored_figure_its_medians_contradict_is_refused(self):
        rec = self.good
        for path, value in ((("ratios", "speedup_forward_vs_pytorch"), 50.0),
                            (("ratios", "speedup_backward_vs_pytorch"), 9.0),
                            (("ratios", "mok_forward_of_dense_ceiling"), 0.99),
                            (("ratios", "speedup_forward_vs_pytorch"), None),
                            (("ratios", "speedup_forward_vs_pytorch"), "inf"),
                            (("mok", "forward", "tflops"), 2 * rec["mok"]["forward"]["tflops"]),
                            (("peers", "pytorch_pipeline", "backward", "tflops_performed"), 1.0),
                            (("peers", "pytorch_grouped_gemms", "forward", "tflops"), 9999.0),
                            (("flops", "performed_forward"), 1.0),
                            (("bytes", "mok_hbm_gbps"), 1.0),
                            (("bytes", "hbm_forward"), 1)):
            with self.assertRaises(ValueError, msg=path) as cm:
                self.load(self.edited(path, value))
            self.assertIn(f"'{'.'.join(path)}' is ", str(cm.exception))
            self.assertIn("but the record's medians, ceilings and problem give", str(cm.exception))
        # Rounding is no contradiction; a figure an older records.py did not store is not asked for.
        speedup = rec["ratios"]["speedup_forward_vs_pytorch"]
        self.load(self.edited(("ratios", "speedup_forward_vs_pytorch"), speedup * (1 + 1e-9)))
        older = copy.deepcopy(rec)
        del older["ratios"]["mok_forward_performed_of_dense_ceiling"], older["mok"]["forward"]["tflops_performed"]
        self.load(older)

    def test_parts_the_report_reads_as_objects_are_refused_when_they_are_not(self):
        for path, value, why in ((("routing",), "gaussian", "'routing' must be an object or null"),
                                 (("routing", "spec"), 5, "'routing.spec' must be a string or null"),
                                 (("config",), "x", "'config' must be an object or null"),
                                 (("config", "env"), ["MOK_X=1"], "'config.env' must be an object or null"),
                                 (("timing",), "x", "'timing' must be an object or null"),
                                 (("timing", "mok"), "x", "'timing.mok' must be an object or null"),
                                 (("mok_args",), [1, None], "'mok_args' must be a list of strings"),
                                 (("errors",), "boom", "'errors' must be a list of strings or null"),
                                 (("peers", "pytorch_pipeline", "code"), 5,
                                  "'peers.pytorch_pipeline.code' must be a string or null"),
                                 (("mok", "forward_phases"), {"median_ms": {"megakernel": "x"}},
                                  "'mok.forward_phases.median_ms.megakernel' must be a finite number >= 0"),
                                 (("mok", "forward_phases"), {"median_ms": {}, "timed_after_ms": "x"},
                                  "'mok.forward_phases.timed_after_ms' must be a finite number >= 0"),
                                 (("clocks",), {"mok_forward": "x"}, "'clocks.mok_forward' must be an object or null"),
                                 (("clocks",), {"mok_forward": {"sm_mhz_median": "x"}},
                                  "'clocks.mok_forward.sm_mhz_median' must be a finite number or null")):
            with self.assertRaises(ValueError, msg=path) as cm:
                self.load(self.edited(path, value))
            self.assertIn(why, str(cm.exception))

    def test_a_verdict_its_parts_contradict_is_refused(self):
        # A failed check (mok's, the peer's, or a peer that raised) with its summary flags set
        # to pass: refused, never shown as PASS.
        for path, value, flags in ((("mok", "check", "passes"), False, ("mok", "passes")),
                                   (("peers", "pytorch_pipeline", "check", "passes"), False, ("pytorch", "passes")),
                                   (("peers", "pytorch_pipeline", "errors"), {"backward": "RuntimeError"},
                                    ("pytorch", "passes"))):
            with self.assertRaises(ValueError, msg=path) as cm:
                self.load(self.edited(path, value))
            for flag in flags:
                self.assertIn(f"'check.{flag}' is true, but its parts give false", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            self.load(self.edited(("check", "peer_ran"), False))
        self.assertIn("'check.peer_ran' is false, but its parts give true", str(cm.exception))
        # The record as make_record wrote it, failed parts and all, loads.
        failed = copy.deepcopy(self.peer)
        failed["check"]["passes"] = False
        rec = records.make_record(self.mok, failed, env())
        self.assertFalse(records.record_passes(self.load(rec)))

    def test_keys_the_report_groups_by_must_be_the_problems_and_counts_whole(self):
        rec = self.good
        for path, value, why in ((("tokens_per_rank",), 2 * rec["problem"]["tokens_per_rank"],
                                  "'tokens_per_rank' ("),
                                 (("precision",), "mxfp8", "must equal 'problem.precision'"),
                                 (("rows", "real"), float(rec["rows"]["real"]), "'rows.real' must be a whole number"),
                                 (("rows", "remote"), rec["rows"]["real"] + 1, "must be at most 'rows.real'"),
                                 (("timing", "peer", "ceiling_warmup"), 500.0,
                                  "'timing.peer.ceiling_warmup' must be a whole number"),
                                 (("mok", "forward", "min_ms"), 0.0, "'mok.forward.min_ms' must be > 0")):
            with self.assertRaises(ValueError, msg=path) as cm:
                self.load(self.edited(path, value))
            self.assertIn(why, str(cm.exception))

    def test_a_peer_on_another_gpu_never_passes(self):
        peer = copy.deepcopy(self.peer)
        peer["env"]["gpu"] = "NVIDIA H200"
        mok = copy.deepcopy(self.mok)
        mok["gpu"]["name"] = "NVIDIA H100 80GB HBM3"
        rec = records.make_record(mok, peer, env())
        self.assertFalse(rec["check"]["passes"])
        self.assertFalse(records.record_passes(rec))
        why = "the PyTorch peer ran on 'NVIDIA H200', mok on 'NVIDIA H100 80GB HBM3': no comparison across GPUs"
        self.assertEqual(rec["errors"], [why])
        self.assertIn(why, records.check_text(rec))
        # A record that says it passed beside two GPUs (made before this rule, or edited) is no pass.
        edited = self.edited(("gpu", "peer_gpu"), "NVIDIA H200")
        self.assertTrue(edited["check"]["passes"])
        loaded = self.load(edited)
        self.assertFalse(records.record_passes(loaded))
        self.assertEqual(records.check_text(loaded), "FAIL (" + why + ")")
        self.assertEqual(records.check_text(self.good), "PASS")

    def test_a_peer_on_another_card_of_the_same_model_never_passes(self):
        peer, mok = copy.deepcopy(self.peer), copy.deepcopy(self.mok)
        mok["gpu"]["uuid"] = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
        peer["env"]["uuid"] = "0A1B2C3D-0000-1111-2222-333344445555"  # (torch's spelling: one card)
        rec = records.make_record(mok, peer, env())
        self.assertEqual(rec["errors"], [])
        self.assertEqual((rec["gpu"]["uuid"], rec["gpu"]["peer_uuid"]), (mok["gpu"]["uuid"], peer["env"]["uuid"]))
        peer["env"]["uuid"] = "0a1b2c3d-0000-1111-2222-333344445556"
        rec = records.make_record(mok, peer, env())
        self.assertFalse(rec["check"]["passes"])
        self.assertEqual(len(rec["errors"]), 1)
        self.assertIn("two cards of one model", rec["errors"][0])
        # An unreadable UUID compares nothing (as an unknown name does).
        self.assertIsNone(records.gpu_mismatch("H100", "H100", "GPU-xyz", peer["env"]["uuid"]))

    def test_a_peer_without_a_forward_median_never_passes(self):
        peer = copy.deepcopy(self.peer)
        del peer["forward"]
        rec = records.make_record(self.mok, peer, env())
        self.assertEqual(rec["check"]["pytorch"], True)
        self.assertFalse(rec["check"]["passes"])
        self.assertEqual(rec["errors"], [records.NO_PEER_FORWARD])
        edited = self.edited(("peers", "pytorch_pipeline", "forward"), None)
        for key in ("speedup_forward_vs_pytorch", "pytorch_forward_of_dense_ceiling",
                    "pytorch_pipeline_over_grouped_gemms"):
            edited["ratios"][key] = None
        edited["bytes"]["pytorch_hbm_gbps"] = edited["bytes"]["pytorch_hbm_of_copy_ceiling"] = None
        loaded = self.load(edited)
        self.assertTrue(loaded["check"]["passes"])
        self.assertFalse(records.record_passes(loaded))
        self.assertIn(records.NO_PEER_FORWARD, records.check_text(loaded))


if __name__ == "__main__":
    unittest.main()


class Import(unittest.TestCase):
    def test_records_of_another_run_never_overwrite_and_non_records_stop_it(self):
        rec = records.make_record(fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json"),
                                  env(date="2001-02-03T04:05:06Z"))
        with tempfile.TemporaryDirectory() as d:
            results, out = os.path.join(d, "results"), os.path.join(d, "out")
            first = records.write_record(rec, results)
            elsewhere = records.write_record(rec, out)  # the same name, made by another device run
            self.assertEqual(os.path.basename(first), os.path.basename(elsewhere))
            # The same content already there: not copied again (it would read as a repeat run).
            self.assertEqual(records.main(["import", elsewhere, "--results-dir", results]), 0)
            self.assertEqual(os.listdir(results), [os.path.basename(first)])
            # Another run's record of the same name: kept beside it, never over it.
            other = dict(rec, date="2001-02-03T09:09:09Z")
            elsewhere2 = records.write_record(other, os.path.join(d, "out2"))
            self.assertEqual(records.main(["import", elsewhere2, "--results-dir", results]), 0)
            self.assertEqual(sorted(os.listdir(results)), [os.path.basename(first),
                                                           os.path.basename(first)[:-5] + "_2.json"])
            self.assertEqual(records.main(["import", elsewhere2, elsewhere, "--results-dir", results]), 0)
            self.assertEqual(len(os.listdir(results)), 2)
            junk = os.path.join(d, "peer.json")
            with open(junk, "w") as f:
                json.dump({"shape": "x"}, f)
            self.assertEqual(records.main(["import", elsewhere, junk, "--results-dir", results]), 1)
            self.assertEqual(len(os.listdir(results)), 2)  # nothing imported
