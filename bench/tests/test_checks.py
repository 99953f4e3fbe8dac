import unittest

import numpy as np

import helpers  # noqa: F401  (sets sys.path)

import checks
import workdir


class Compare(unittest.TestCase):
    def test_exact(self):
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        st = checks.compare(a, a.copy(), np)
        self.assertEqual(st, {"max_abs": 0.0, "rel": 0.0, "non_finite": 0, "count": 12})
        self.assertTrue(checks.passes(st, checks.tolerance("bf16")))

    def test_numbers(self):
        ref = np.array([1.0, -2.0, 3.0, 4.0], dtype=np.float32)
        out = np.array([1.5, -2.0, 3.0, 3.75], dtype=np.float32)
        st = checks.compare(out, ref, np)
        self.assertEqual(st["max_abs"], 0.5)
        self.assertAlmostEqual(st["rel"], 0.75 / 10.0)
        self.assertFalse(checks.passes(st, checks.tolerance("bf16")))  # rel 0.075 > 0.01
        self.assertTrue(checks.passes(st, checks.tolerance("mxfp8")))  # 0.5 <= 1.0, 0.075 <= 0.1

    def test_bars(self):
        self.assertEqual(checks.tolerance("bf16"), {"max_abs": 0.5, "rel": 0.01})
        self.assertEqual(checks.tolerance("mxfp8"), {"max_abs": 1.0, "rel": 0.1})
        with self.assertRaises(ValueError):
            checks.tolerance("fp4")

    def test_nan_never_passes(self):
        ref = np.ones(4, dtype=np.float32)
        out = ref.copy()
        out[2] = np.nan
        st = checks.compare(out, ref, np)
        self.assertEqual(st["non_finite"], 1)
        self.assertFalse(checks.passes(st, {"max_abs": 1e9, "rel": 1e9}))
        out[2] = np.inf
        self.assertFalse(checks.passes(checks.compare(out, ref, np), {"max_abs": 1e9, "rel": 1e9}))
        self.assertFalse(checks.passes({"max_abs": float("nan"), "rel": 0.0, "non_finite": 0}, {"max_abs": 1, "rel": 1}))
        self.assertFalse(checks.passes({"max_abs": 0.0, "rel": float("nan"), "non_finite": 0}, {"max_abs": 1, "rel": 1}))

    def test_nonfinite_reference_fails(self):
        # A NaN or Inf in the reference checks nothing: it counts and fails (as mok's compare),
        # and stays out of max_abs and rel.
        ref = np.array([1.0, np.nan, 2.0], dtype=np.float32)
        out = np.array([1.0, 5.0, 2.0], dtype=np.float32)
        st = checks.compare(out, ref, np)
        self.assertEqual((st["max_abs"], st["rel"], st["non_finite"]), (0.0, 0.0, 1))
        self.assertFalse(checks.passes(st, checks.tolerance("bf16")))
        # An all-NaN reference used to pass with count > 0.
        nan = np.full(4, np.nan, dtype=np.float32)
        st = checks.compare(np.ones(4, dtype=np.float32), nan, np)
        self.assertEqual((st["non_finite"], st["count"]), (4, 4))
        self.assertFalse(checks.passes(st, checks.tolerance("bf16")))
        # NaN in both does not agree; nor do opposite infinities, nor an infinity against a number.
        with np.errstate(invalid="ignore"):
            self.assertEqual(checks.compare(nan, nan, np)["non_finite"], 4)
            inf = np.array([np.inf, -np.inf, np.inf], dtype=np.float32)
            self.assertEqual(checks.compare(np.array([-np.inf, np.inf, 1.0], dtype=np.float32), inf, np)["non_finite"], 3)

    def test_same_infinity_in_both_agrees(self):
        ref = np.array([1.0, np.inf, -np.inf, 2.0], dtype=np.float32)
        with np.errstate(invalid="ignore"):
            st = checks.compare(ref.copy(), ref, np)
        self.assertEqual(st, {"max_abs": 0.0, "rel": 0.0, "non_finite": 0, "count": 4})
        self.assertTrue(checks.passes(st, checks.tolerance("bf16")))

    def test_zero_reference(self):
        z = np.zeros(3, dtype=np.float32)
        self.assertEqual(checks.compare(z, z, np)["rel"], 0.0)
        self.assertEqual(checks.compare(z + 1, z, np)["rel"], float("inf"))

    def test_shape_mismatch(self):
        with self.assertRaises(ValueError):
            checks.compare(np.zeros(3, np.float32), np.zeros(4, np.float32), np)


class Timing(unittest.TestCase):
    def test_slowest_rank_per_iteration(self):
        self.assertEqual(checks.slowest_per_iteration([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]), [3.0, 5.0, 2.5])

    def test_contract_is_the_timing_default(self):
        import argparse
        ap = argparse.ArgumentParser()
        checks.add_timing_options(ap)
        args = ap.parse_args([])
        self.assertEqual((args.warmup, args.iters), (checks.WARMUP, checks.ITERS))
        self.assertEqual((checks.WARMUP, checks.ITERS), (500, 100))

    def test_summary(self):
        self.assertEqual(checks.summarize_ms([3.0, 1.0, 2.0]),
                         {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "samples": 3})
        # Even count: sorted[n // 2], as `mok run` does.
        self.assertEqual(checks.summarize_ms([4.0, 1.0, 3.0, 2.0])["median_ms"], 3.0)
        with self.assertRaises(ValueError):
            checks.summarize_ms([])


class Bf16(unittest.TestCase):
    def test_round_trip_and_rounding(self):
        x = np.array([1.0, -2.5, 3.140625, 0.0, 65280.0], dtype=np.float32)  # all exact in bf16
        bits = workdir.f32_to_bf16_bits(x)
        self.assertEqual(bits.dtype, np.uint16)
        np.testing.assert_array_equal(workdir.bf16_bits_to_f32(bits), x)
        self.assertEqual(int(workdir.f32_to_bf16_bits(np.float32(1.0))), 0x3F80)
        # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even -> 1.0
        self.assertEqual(float(workdir.round_bf16(np.float32(1.0 + 2 ** -8))), 1.0)
        # 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even -> 1 + 2^-6
        self.assertEqual(float(workdir.round_bf16(np.float32(1.0 + 3 * 2 ** -8))), 1.0 + 2 ** -6)
        self.assertTrue(np.isnan(workdir.round_bf16(np.float32(np.nan))))


if __name__ == "__main__":
    unittest.main()
