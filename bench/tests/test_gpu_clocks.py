"""gpu_clocks.py: parsing, window summaries, the tensor peak, and the sampler driven by a fake
nvidia-smi (tests/fake_nvidia_smi.py) put on PATH."""
import datetime
import os
import shutil
import tempfile
import time
import types
import unittest

import helpers

import gpu_clocks

FAKE_SMI = os.path.join(helpers.TESTS_DIR, "fake_nvidia_smi.py")


def with_fake_smi(test):
    """Runs `test(self)` with a PATH whose nvidia-smi is the fake one (and nothing else of it)."""
    def wrapped(self):
        with tempfile.TemporaryDirectory() as d:
            os.symlink(FAKE_SMI, os.path.join(d, "nvidia-smi"))
            old = os.environ["PATH"]
            os.environ["PATH"] = d + os.pathsep + old
            try:
                test(self)
            finally:
                os.environ["PATH"] = old
                os.environ.pop("FAKE_SMI_MISSING", None)
                os.environ.pop("FAKE_SMI_GPUS", None)
    return wrapped


def sample(t, mhz, watts=None, index=0, cap=None):
    return {"t": t, "index": index, "sm_mhz": mhz, "power_w": watts, "sw_power_cap": cap}


class Parsing(unittest.TestCase):
    def test_values(self):
        self.assertEqual(gpu_clocks.parse_value("sm_mhz", " 1410"), 1410.0)
        self.assertEqual(gpu_clocks.parse_value("power_w", "693.12 "), 693.12)
        self.assertEqual(gpu_clocks.parse_value("index", "3"), 3)
        self.assertIs(gpu_clocks.parse_value("sw_power_cap", " Active"), True)
        self.assertIs(gpu_clocks.parse_value("sw_power_cap", "Not Active"), False)
        for missing in ("[N/A]", "[Not Supported]", "N/A", ""):
            self.assertIsNone(gpu_clocks.parse_value("power_w", missing))
        with self.assertRaises(ValueError):
            gpu_clocks.parse_value("sm_mhz", "fast")

    def test_timestamp_is_local_time(self):
        now = datetime.datetime(2026, 12, 4, 3, 50, 12, 345000)
        self.assertAlmostEqual(gpu_clocks.parse_timestamp("2026/12/04 03:50:12.345"), now.timestamp(), places=6)


class Windows(unittest.TestCase):
    SAMPLES = [sample(9.9, 1980, 300), sample(10.0, 1500, 690, cap=True), sample(10.5, 1400, 700, cap=True),
               sample(10.6, 1410, 695, cap=False), sample(10.6, 900, 200, index=1), sample(11.01, 1980, 100)]

    def test_median_of_the_samples_inside(self):
        s = gpu_clocks.window_summary(self.SAMPLES, (10.0, 11.0), gpus={0})
        self.assertEqual(s["samples"], 3)
        self.assertEqual(s["sm_mhz_median"], 1410)
        self.assertEqual((s["sm_mhz_min"], s["sm_mhz_max"]), (1400, 1500))
        self.assertEqual(s["power_w_median"], 695)
        self.assertAlmostEqual(s["sw_power_cap_share"], 2 / 3)
        self.assertIsNone(s["hw_slowdown_share"])  # no sample has the field
        self.assertAlmostEqual(s["window_s"], 1.0)

    def test_every_gpu_when_none_is_named(self):
        self.assertEqual(gpu_clocks.window_summary(self.SAMPLES, (10.0, 11.0))["samples"], 4)

    def test_empty_and_missing_windows(self):
        self.assertEqual(gpu_clocks.window_summary(self.SAMPLES, (20.0, 21.0))["samples"], 0)
        self.assertIsNone(gpu_clocks.window_summary(self.SAMPLES, None))

    def test_timed_windows_from_the_programs_json(self):
        mok = {"timing": {"window_unix_s": [1.0, 2.0]}}
        peer = {"forward": {"window_unix_s": [3.0, 4.0]}, "grouped_gemms": {"median_ms": 1.0},
                "ceilings": {"dense_bf16": {"window_unix_s": [6.0, 5.0]}}}  # reversed: not a window
        self.assertEqual(gpu_clocks.timed_windows(mok, peer), {"mok_forward": (1.0, 2.0),
                                                               "pytorch_forward": (3.0, 4.0)})
        self.assertEqual(gpu_clocks.timed_windows({}, None), {})


class Following(unittest.TestCase):
    """Iteration times paired with the clock sampled inside each, and whether the spread is the clock's."""

    def test_each_sample_pairs_with_the_iteration_it_fell_in(self):
        # Iterations of 100, 200 and 300 ms from t = 10 s: [10.0, 10.1], (10.1, 10.3], (10.3, 10.6].
        samples = [sample(10.05, 1500), sample(10.2, 1400), sample(10.25, 1410, index=1), sample(10.5, 1300),
                   sample(10.7, 1980), sample(9.9, 1980), sample(10.4, None)]
        pairs = gpu_clocks.iteration_clock_pairs(samples, (10.0, 10.6), [100, 200, 300], gpus={0})
        self.assertEqual(pairs, [(100.0, 1500.0), (200.0, 1400.0), (300.0, 1300.0)])
        self.assertEqual(len(gpu_clocks.iteration_clock_pairs(samples, (10.0, 10.6), [100, 200, 300])), 4)
        self.assertEqual(gpu_clocks.iteration_clock_pairs(samples, None, [100]), [])
        self.assertEqual(gpu_clocks.iteration_clock_pairs(samples, (10.0, 10.6), []), [])

    def test_a_spread_the_clock_makes(self):
        # Every iteration takes 4.5M cycles; the clock alone moves its time.
        mhz = [1200 + 20 * i for i in range(20)]
        f = gpu_clocks.clock_following([(4500.0 / m, float(m)) for m in mhz])
        self.assertEqual(f["pairs"], 20)
        self.assertGreater(f["ms_spread"], 0.2)
        self.assertAlmostEqual(f["cycles_spread"], 0.0, places=12)
        self.assertAlmostEqual(f["r_ms_vs_clock_period"], 1.0, places=9)

    def test_a_spread_the_work_makes(self):
        # The clock holds still while the times spread: no correlation to speak of.
        f = gpu_clocks.clock_following([(3.0 + 0.05 * i, 1400.0) for i in range(12)])
        self.assertIsNone(f["r_ms_vs_clock_period"])
        self.assertAlmostEqual(f["ms_spread"], f["cycles_spread"])
        self.assertGreater(f["ms_spread"], 0.1)

    def test_too_few_pairs(self):
        self.assertIsNone(gpu_clocks.clock_following([(1.0, 1400.0)] * 9))

    def test_zero_times_give_no_spread_not_a_division_by_zero(self):
        f = gpu_clocks.clock_following([(0.0, 1400.0)] * 12)
        self.assertEqual((f["pairs"], f["ms_spread"], f["cycles_spread"]), (12, None, None))


class Peak(unittest.TestCase):
    def test_h200_published_peak(self):
        # 132 SMs x 4096 x 1830 MHz = NVIDIA's 989.4 TFLOP/s for H100/H200 SXM.
        self.assertAlmostEqual(gpu_clocks.tensor_peak_tflops("9.0", 132, 1830), 989.4, delta=0.1)
        self.assertAlmostEqual(gpu_clocks.tensor_peak_tflops("9.0", 132, 1410), 762.3, delta=0.1)

    def test_unknown(self):
        self.assertIsNone(gpu_clocks.tensor_peak_tflops("12.0", 132, 1410))
        self.assertIsNone(gpu_clocks.tensor_peak_tflops(None, 132, 1410))
        self.assertIsNone(gpu_clocks.tensor_peak_tflops("9.0", 132, None))


class Probe(unittest.TestCase):
    def test_asked_once_per_path(self):
        calls = []

        def fake_run(cmd, **kw):
            calls.append(cmd)
            field = cmd[1].split("=", 1)[1]
            ok = field not in ("power.draw.instant",)
            return types.SimpleNamespace(returncode=0 if ok else 2, stdout="1\n" if ok else "")

        first = gpu_clocks.probe_fields("/probe/test/nvidia-smi", run=fake_run)
        n = len(calls)
        self.assertEqual(first["power_w"], "power.draw")
        self.assertEqual(gpu_clocks.probe_fields("/probe/test/nvidia-smi", run=fake_run), first)
        self.assertEqual(len(calls), n)  # the second answer came from the cache


class SamplerRuns(unittest.TestCase):
    @with_fake_smi
    def test_samples_with_timestamps(self):
        t0 = time.time()
        with gpu_clocks.Sampler(period_ms=5) as s:
            # Until six samples came (not a fixed 0.3 s: under load the fake's start-up alone
            # can take that long), within 20 s.
            deadline = time.time() + 20
            while len(s.samples) <= 5 and time.time() < deadline:
                time.sleep(0.05)
        t1 = time.time()
        self.assertIsNone(s.error)
        self.assertGreater(len(s.samples), 5)
        self.assertEqual(s.fields["power_w"], "power.draw.instant")
        # The fake stamps at millisecond resolution.
        self.assertTrue(all(t0 - 0.002 <= x["t"] <= t1 + 0.002 for x in s.samples))
        self.assertEqual({x["sm_mhz"] for x in s.samples}, {1410.0})
        self.assertTrue(all(x["sw_power_cap"] is True and x["hw_slowdown"] is False for x in s.samples))

    @with_fake_smi
    def test_older_field_names_are_used_when_the_new_ones_are_refused(self):
        os.environ["FAKE_SMI_MISSING"] = "power.draw.instant,clocks_event_reasons.sw_power_cap"
        with gpu_clocks.Sampler(period_ms=5) as s:
            deadline = time.time() + 20  # (until a sample came: see test_samples_with_timestamps)
            while not s.samples and time.time() < deadline:
                time.sleep(0.05)
        self.assertEqual(s.fields["power_w"], "power.draw")
        self.assertEqual(s.fields["sw_power_cap"], "clocks_throttle_reasons.sw_power_cap")
        self.assertTrue(s.samples)

    @with_fake_smi
    def test_a_required_field_missing_is_an_error_not_a_sample(self):
        os.environ["FAKE_SMI_MISSING"] = "clocks.sm"
        with gpu_clocks.Sampler(period_ms=5) as s:
            pass
        self.assertIn("clocks.sm", s.error)
        self.assertEqual(s.samples, [])

    def test_no_nvidia_smi(self):
        s = gpu_clocks.Sampler(smi="nvidia-smi-that-does-not-exist").start()
        self.assertEqual(s.stop(), [])
        self.assertIn("not found", s.error)


if __name__ == "__main__":
    unittest.main()
