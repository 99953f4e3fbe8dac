import contextlib
import copy
import glob
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import helpers
from helpers import read_text, env, fixture, set_median

import records
import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(test, path):
    with open(path, "rb") as f:
        data = f.read()
    test.assertEqual(data[:8], PNG_MAGIC, path)
    test.assertEqual(data[12:16], b"IHDR", path)
    width, height = struct.unpack(">II", data[16:24])
    test.assertGreater(width, 100)
    test.assertGreater(height, 100)
    test.assertEqual(data[-8:-4], b"IEND", path)


def fixture_records(d):
    """Writes fixture-derived records into d; returns their paths."""
    qwen = (fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json"))
    mix = (fixture("fixture_mok_mixtral_all.json"), fixture("fixture_peer_mixtral_all_failed.json"))
    paths = []
    # An old qwen record that a newer one with the same key replaces.
    old_mok = copy.deepcopy(qwen[0])
    set_median(old_mok["forward"], 10.0)
    paths.append(records.write_record(records.make_record(old_mok, qwen[1], env(date="2001-01-01T00:00:00Z")), d))
    paths.append(records.write_record(records.make_record(*qwen, env(date="2001-02-03T04:05:06Z")), d))
    paths.append(records.write_record(records.make_record(*mix, env()), d))
    # A tokens-per-rank sweep of the qwen shape (mok time proportional to tokens).
    for t in (512, 1024, 4096):
        m, p = copy.deepcopy(qwen[0]), copy.deepcopy(qwen[1])
        m["problem"]["tokens_per_rank"] = t
        m["rows"]["real"], m["rows"]["remote"] = t * 10, t * 10 * 63 // 64  # (a slice's: 63 of 64 remote)
        set_median(m["forward"], t / 2048)
        paths.append(records.write_record(records.make_record(m, p, env()), d))
    return paths


def results_with_strays(d, name, edit):
    """A results folder in d holding the fixture records and two files that are no records: a
    peer's peer.json and `name`, the second fixture record as `edit` (a function) leaves it.
    Returns the folder."""
    results = os.path.join(d, "results")
    paths = fixture_records(results)
    with open(os.path.join(results, "peer.json"), "w") as f:
        json.dump(fixture("fixture_peer_qwen35_slice.json"), f)
    stray = helpers.read_json(paths[1])
    edit(stray)
    with open(os.path.join(results, name), "w") as f:
        json.dump(stray, f)
    return results


class Report(unittest.TestCase):
    def test_generate(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            fixture_records(results)
            out = os.path.join(d, "REPORT.md")
            plots = os.path.join(d, "plots")
            report.main(["--results-dir", results, "--out", out, "--plots-dir", plots])
            text = helpers.read_text(out)
            table = [line for line in text.splitlines() if line.startswith("| qwen3.5") or line.startswith("| mixtral")]
            first = text.splitlines().index(next(line for line in text.splitlines() if line.startswith("| shape")))
            main_rows = []
            for line in text.splitlines()[first + 2:]:
                if not line.startswith("|"):
                    break
                main_rows.append(line)
            # 4 qwen token counts (the old 2048 record replaced) + mixtral
            self.assertEqual(len(main_rows), 5, main_rows)
            q2048 = [r for r in main_rows if r.startswith("| qwen3.5-397b-a17b | slice (EP=64) | gaussian | 2048 |")]
            self.assertEqual(len(q2048), 1)
            cells = [c.strip() for c in q2048[0].strip("|").split("|")]
            # Speedup at ceiling: 566.9 GFLOP at the fixture's 1000 TFLOP/s ceiling take 0.567 ms;
            # PyTorch's 3 ms over that is 5.29x.
            self.assertEqual(cells[5:], ["1.000", "566.9", "566.9", "3.000", "189.0", "1.000", "3.00x", "5.29x", "56.7%",
                                         "56.7%", "PASS", "earlier (unrecorded)", "0123456", "FIXTURE-GPU"])
            mix = [r for r in main_rows if r.startswith("| mixtral-8x7b")]
            self.assertEqual(len(mix), 1)
            self.assertIn("FAIL (pytorch FAIL)", mix[0])
            self.assertIn("| all (EP=1) |", mix[0])
            # No shared expert: MoK's formula counts (T + T*k) rows, the kernel does T*k (k = 2).
            mix_cells = [c.strip() for c in mix[0].strip("|").split("|")]
            mok_pct, performed_pct = (float(c.rstrip("%")) for c in mix_cells[13:15])
            self.assertAlmostEqual(mok_pct / performed_pct, 1.5, places=2)
            # Shapes in run.py's order; sweep rows by tokens.
            self.assertEqual([r.split("|")[4].strip() for r in main_rows], ["512", "1024", "2048", "4096", "4096"])
            self.assertTrue(main_rows[-1].startswith("| mixtral-8x7b"))
            self.assertTrue(table)
            # Plots exist, are PNGs, and are linked relative to the markdown.
            names = sorted(os.listdir(plots))
            self.assertIn("tflops_per_shape.png", names)
            self.assertIn("dense_ceiling_fraction.png", names)
            sweeps = [n for n in names if n.startswith("sweep_")]
            self.assertEqual(sweeps, ["sweep_qwen3.5-397b-a17b_slice64_gaussian_bf16_FIXTURE-GPU.png"])
            for n in names:
                assert_png(self, os.path.join(plots, n))
                self.assertIn(f"(plots/{n})", text)
            self.assertIn("## Backward", text)
            self.assertIn("| qwen3.5-397b-a17b | slice (EP=64) | gaussian | 2048 | 4.000 | 283.5 | 8.000 | 141.7 | 141.7 "
                          "| 2.00x |",
                          text)
            self.assertIn("| qwen3.5-397b-a17b | 2048 | 500 / 200 | 1000 | 2000 / 1250 | 4000 |", text)
            # The routing and how unbalanced it was, per record.
            self.assertIn("## Routing", text)
            self.assertIn("| qwen3.5-397b-a17b | slice (EP=64) | 2048 | gaussian | 1.50 | 1.25 |", text)
            self.assertIn("| mixtral-8x7b | all (EP=1) | 4096 | gaussian | 1.25 | 1.00 |", text)

    def test_phase_table_and_plot(self):
        with tempfile.TemporaryDirectory() as d:
            qwen = (fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json"))
            mok = copy.deepcopy(qwen[0])
            mok["forward_phases"] = {"iters": 20, "method": "events",
                                     "median_ms": {"setup": 0.01, "schedule": 0.06, "megakernel": 0.85,
                                                   "epilogue": 0.08}}
            paths = [records.write_record(records.make_record(mok, qwen[1], env()), d)]
            out, plots = os.path.join(d, "REPORT.md"), os.path.join(d, "plots")
            report.generate(paths, out, plots)
            text = read_text(out)
            self.assertIn("## Where mok's forward time goes", text)
            self.assertIn("| setup ms | schedule ms | megakernel ms | epilogue ms | sum ms |", text)
            self.assertIn("| 0.010 | 0.060 | 0.850 | 0.080 | 1.000 | – | 1.000 | 85.0% | one at a time |", text)
            # Newer records time forwards right after the pass too.
            mok["forward_phases"]["timed_after_ms"] = 0.975
            report.generate([records.write_record(records.make_record(mok, qwen[1], env()), d)], out, plots)
            self.assertIn("| sum ms | timed after ms | timed median ms |", read_text(out))
            self.assertIn("| 0.080 | 1.000 | 0.975 | 1.000 | 85.0% |", read_text(out))
            # mok bench's method string says how and when the pass ran its forwards: back to back
            # after the check (records before 2026-12-06), or right after the timed run.
            mok["forward_phases"]["method"] = "cuda events between the forward's phases, forwards back to back"
            report.generate([records.write_record(records.make_record(mok, qwen[1], env()), d)], out, plots)
            self.assertIn("| 85.0% | back to back, after the check |", read_text(out))
            mok["forward_phases"]["method"] = ("cuda events between the forward's phases, forwards back to back, "
                                               "right after the timed run")
            report.generate([records.write_record(records.make_record(mok, qwen[1], env()), d)], out, plots)
            self.assertIn("| 85.0% | right after the timed run |", read_text(out))
            assert_png(self, os.path.join(plots, "forward_phases.png"))
            self.assertIn("(plots/forward_phases.png)", text)
        with tempfile.TemporaryDirectory() as d:  # records without the split: no section, no plot
            out, plots = os.path.join(d, "REPORT.md"), os.path.join(d, "plots")
            report.generate(fixture_records(d), out, plots)
            self.assertNotIn("forward time goes", read_text(out))
            self.assertNotIn("forward_phases.png", os.listdir(plots))

    def test_clock_table(self):
        with tempfile.TemporaryDirectory() as d:
            mok, peer = (copy.deepcopy(fixture("fixture_mok_qwen35_slice.json")),
                         copy.deepcopy(fixture("fixture_peer_qwen35_slice.json")))
            mok["timing"]["window_unix_s"] = [100.0, 101.0]
            peer["forward"]["window_unix_s"] = [102.0, 103.0]
            peer["env"]["capability"] = "9.0"
            mok["gpu"]["sms"] = 132
            samples = [{"t": 100.5, "index": 0, "sm_mhz": 1410.0, "power_w": 693.0, "sw_power_cap": True},
                       {"t": 102.5, "index": 0, "sm_mhz": 1500.0, "power_w": 650.0, "sw_power_cap": False}]
            clocks = {"samples": samples, "gpus": [0], "period_ms": 10, "error": None}
            paths = [records.write_record(records.make_record(mok, peer, env(), clocks), d)]
            out, plots = os.path.join(d, "REPORT.md"), os.path.join(d, "plots")
            report.generate(paths, out, plots)
            text = read_text(out)
            self.assertIn("## Clocks and power in the timed loops", text)
            # mok: 1410 MHz, 693 W, one sample; the peer 1500 / 650; no grouped-GEMM or ceiling window;
            # the SW power cap held mok's one sample; peak 132 x 4096 x 1410 MHz = 762 TFLOP/s.
            self.assertIn("| qwen3.5-397b-a17b | slice (EP=64) | 2048 | 1410 / 693 (1) | 1500 / 650 (1) | – | – "
                          "| 100.0% | 762 | 74.4% | – | 1.22 | – |", text)
            # A run that could not sample says why.
            clocks = {"samples": [], "gpus": [0], "period_ms": 10, "error": "nvidia-smi not found"}
            report.generate([records.write_record(records.make_record(mok, peer, env(), clocks), d)], out, plots)
            self.assertIn("| not sampled: nvidia-smi not found |", read_text(out))
            self.assertNotIn("## Spread against the clock", read_text(out))  # (no iteration pairs)
            # Ten of mok's iterations, each with a sample inside, at a clock that sets its time.
            mok["forward_iters_ms"] = [100.0 * 1400.0 / (1400.0 + 10 * i) for i in range(10)]
            ends = [100.0 + sum(mok["forward_iters_ms"][:i + 1]) / 1e3 for i in range(10)]
            mok["timing"]["window_unix_s"] = [100.0, ends[-1]]
            samples = [{"t": e - 0.001, "index": 0, "sm_mhz": 1400.0 + 10 * i, "power_w": 690.0, "sw_power_cap": True}
                       for i, e in enumerate(ends)]
            clocks = {"samples": samples, "gpus": [0], "period_ms": 10, "error": None}
            report.generate([records.write_record(records.make_record(mok, peer, env(), clocks), d)], out, plots)
            text = read_text(out)
            self.assertIn("## Spread against the clock", text)
            self.assertRegex(text, r"\| qwen3.5-397b-a17b \| slice \(EP=64\) \| 2048 \| 10 \| 5\.\d% \| 0\.0% \| 1\.00 \| "
                                   r"– \| – \| – \| – \|")
        with tempfile.TemporaryDirectory() as d:  # records without clocks: no section
            out, plots = os.path.join(d, "REPORT.md"), os.path.join(d, "plots")
            report.generate(fixture_records(d), out, plots)
            self.assertNotIn("## Clocks", read_text(out))
            self.assertNotIn("## Spread against the clock", read_text(out))

    def test_newest_wins(self):
        with tempfile.TemporaryDirectory() as d:
            paths = fixture_records(d)
            recs = report.newest_per_key(report.load_records(paths))
            q = [r for r in recs if r["shape"] == "qwen3.5-397b-a17b" and r["tokens_per_rank"] == 2048]
            self.assertEqual(len(q), 1)
            self.assertEqual(q[0]["mok"]["forward"]["median_ms"], 1.0)
            # Same date: the later file name (the _2 suffix) wins.
            mok = fixture("fixture_mok_mixtral_all.json")
            set_median(mok["forward"], 7.0)  # (a record's own figures must agree with its medians)
            p = records.write_record(records.make_record(mok, None, env()), d)
            self.assertTrue(p.endswith("_2.json"))
            recs = report.newest_per_key(report.load_records(paths + [p]))
            m = [r for r in recs if r["shape"] == "mixtral-8x7b"]
            self.assertEqual(m[0]["mok"]["forward"]["median_ms"], 7.0)

    def test_keys_separate_ep_sizes_and_gpus_and_sweeps_keep_one_commit(self):
        with tempfile.TemporaryDirectory() as d:
            loaded = report.load_records(fixture_records(d))
            q = [r for _, r in loaded if r["shape"] == "qwen3.5-397b-a17b" and r["tokens_per_rank"] == 2048][-1]
            ep8, h100 = copy.deepcopy(q), copy.deepcopy(q)
            ep8["problem"]["ep_size"] = 8
            h100["gpu"]["name"] = "NVIDIA H100"
            keys = {report.record_key(r) for r in (q, ep8, h100)}
            self.assertEqual(len(keys), 3, "EP size and GPU are part of what a record measures")
            # A newer commit's single 1024-token point does not join the fixture commit's sweep.
            newer = copy.deepcopy([r for _, r in loaded if r["tokens_per_rank"] == 1024][0])
            newer["commit"] = {"sha": "fedcba9876543", "short": "fedcba9", "dirty": False}
            newer["date"] = "2099-01-01T00:00:00Z"
            newer["mok"]["forward"]["median_ms"] = 99.0
            (series, group), = report.sweep_groups(loaded + [("newer", newer)]).items()
            self.assertEqual({r["commit"]["short"] for r in group}, {q["commit"]["short"]})
            self.assertNotIn(99.0, [r["mok"]["forward"]["median_ms"] for r in group])

    def test_commit_cell_names_the_environment_knobs_a_run_set(self):
        mok, peer = fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json")
        mok = copy.deepcopy(mok)
        mok.setdefault("config", {})["env"] = {"MOK_STORE_WARP": "0", "MOK_PULL_GROUPS": "3"}
        rec = records.make_record(mok, peer, env())
        self.assertEqual(report.commit_text(rec), "0123456 MOK_PULL_GROUPS=3 MOK_STORE_WARP=0")
        plain = records.make_record(fixture("fixture_mok_qwen35_slice.json"), peer, env())
        self.assertEqual(report.commit_text(plain), "0123456")
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            records.write_record(rec, results)
            out = os.path.join(d, "REPORT.md")
            report.main(["--results-dir", results, "--out", out, "--plots-dir", os.path.join(d, "plots")])
            self.assertIn("| 0123456 MOK_PULL_GROUPS=3 MOK_STORE_WARP=0 |", helpers.read_text(out))

    def test_repeat_runs_of_one_commit(self):
        with tempfile.TemporaryDirectory() as d:
            paths = fixture_records(d)
            loaded = report.load_records(paths)
            groups = report.repeat_groups(loaded)
            # The two qwen 2048-token records share a commit; nothing else repeats.
            self.assertEqual(len(groups), 1)
            (key, recs), = groups.items()
            self.assertEqual((key[0], key[2], key[4]), ("qwen3.5-397b-a17b", 64, 2048))
            # Another config (a --mok-arg) of the same commit is not a repeat.
            other = copy.deepcopy(loaded[1][1])
            other["config"] = dict(other["config"] or {}, task_band_tiles=8)
            self.assertEqual(len(report.repeat_groups(loaded + [("x", other)])), 1)
            # Nor is a run with other mok bench options (another active rank: other work), whose
            # config is the same.
            moved = copy.deepcopy(loaded[1][1])
            moved["mok_args"] = ["--active-rank", "3"]
            self.assertEqual([len(v) for v in report.repeat_groups(loaded + [("y", moved)]).values()], [2])
            self.assertEqual([r["mok"]["forward"]["median_ms"] for r in recs], [10.0, 1.0])
            self.assertAlmostEqual(report.spread([10.0, 1.0]), 9.0)
            self.assertIsNone(report.spread([1.0]))
            text = "\n".join(report.repeat_lines(loaded))
            self.assertIn("10.000 / 1.000", text)
            self.assertIn("900.0%", text)
            # The ceiling measured with each record is compared across the runs too.
            self.assertIn("| ceiling spread |", text)
            dense = [r["ceilings"]["dense_bf16_tflops"] for r in recs]
            self.assertIn(" / ".join(f"{v:.0f}" for v in dense), text)
            self.assertTrue(text.splitlines()[-1].endswith("| ? |"), text)  # (the fixtures keep no GPU UUID)
            self.assertEqual(report.cards_text(recs), "?")
            for rec, uuid in zip(recs, ("GPU-00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000001")):
                rec["gpu"]["uuid"] = uuid
            self.assertEqual(report.cards_text(recs), "1")  # (one card, however spelt)
            recs[1]["gpu"]["uuid"] = "GPU-00000000-0000-0000-0000-000000000002"
            self.assertEqual(report.cards_text(recs), "2")
            self.assertEqual(report.cards_text(recs + [{"gpu": {"name": "H100"}}]), "2 + ?")
            self.assertIn("No shape has been measured twice", "\n".join(report.repeat_lines(loaded[2:3])))
            # A failed run is no measure of agreement: it does not join the repeats.
            failed = copy.deepcopy(recs[0])
            failed["check"]["mok"] = False
            failed["check"]["passes"] = False
            self.assertEqual([len(v) for v in report.repeat_groups(loaded + [("f", failed)]).values()], [2])

    def test_copies_of_one_record_count_once_in_the_repeat_table(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            paths = fixture_records(results)
            # The second qwen 2048 record copied under two other names (a `cp`, an import from
            # another folder), one of them written out again with other formatting.
            shutil.copy(paths[1], os.path.join(results, "copied.json"))
            with open(os.path.join(results, "rewritten.json"), "w") as f:
                json.dump(helpers.read_json(paths[1]), f, indent=4, sort_keys=True)
            loaded = report.load_records(sorted(glob.glob(os.path.join(results, "*.json"))))
            (key, recs), = report.repeat_groups(loaded).items()
            self.assertEqual([r["mok"]["forward"]["median_ms"] for r in recs], [10.0, 1.0])
            self.assertEqual(len(report.duplicate_runs(loaded)), 2)
            # One file given twice is one run too (report.py FILE FILE).
            self.assertEqual(report.repeat_groups(loaded + loaded), report.repeat_groups(loaded))
            # Another run of the same second (other timings) is another run, not a copy.
            other = copy.deepcopy(recs[1])
            set_median(other["mok"]["forward"], 1.5)
            self.assertEqual([len(v) for v in report.repeat_groups(loaded + [("o", other)]).values()], [3])
            out = os.path.join(d, "R.md")
            r = self.run_report(["--results-dir", results, "--out", out, "--plots-dir", os.path.join(d, "plots")])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("holds the same run as", r.stderr)
            row, = [line for line in helpers.read_text(out).split("## Repeat runs")[1].split("\n## ")[0].splitlines()
                    if line.startswith("| qwen3.5")]
            self.assertEqual([c.strip() for c in row.strip("|").split("|")][4:6], ["2", "10.000 / 1.000"])

    def test_builds_of_a_modified_tree_are_no_repeats(self):
        with tempfile.TemporaryDirectory() as d:
            loaded = report.load_records(fixture_records(d))
            ((_, clean),) = report.repeat_groups(loaded).items()
            self.assertEqual(len(clean), 2)
            base = clean[1]
            def build(dirty, ms, sha=None):
                rec = copy.deepcopy(base)
                rec["commit"]["dirty"] = dirty
                if sha:
                    rec["commit"].update(sha=sha, short=sha[:7])
                set_median(rec["mok"]["forward"], ms)
                return ("x", rec)
            # Two dirty builds of the commit (two different edits, perhaps) are not a repeat of
            # each other, nor of the clean ones; nor are builds whose state is unknown, or
            # binaries of no known commit.
            extra = [build(True, 2.0), build(True, 3.0), build(None, 4.0), build(None, 5.0),
                     build(False, 6.0, "unknown"), build(False, 7.0, "unknown")]
            groups = report.repeat_groups(loaded + extra)
            self.assertEqual([[r["mok"]["forward"]["median_ms"] for r in v] for v in groups.values()], [[10.0, 1.0]])
            self.assertEqual(report.repeat_groups(extra), {})
            text = "\n".join(report.repeat_lines(loaded + extra))
            self.assertIn("+dirty", text)  # (the rule is said, in words)
            self.assertNotIn("| 2.000", text)
            self.assertIn("clean", "\n".join(report.repeat_lines(extra)))

    def test_a_verdict_its_parts_contradict_is_not_a_pass(self):
        with tempfile.TemporaryDirectory() as d:
            rec = copy.deepcopy(report.load_records(fixture_records(d))[0][1])
        self.assertTrue(records.record_passes(rec))
        self.assertEqual(records.check_text(rec), "PASS")
        for part, value in (("mok", False), ("mok", None), ("pytorch", False), ("pytorch", None)):
            bad = copy.deepcopy(rec)
            bad["check"][part] = value  # (check.passes still says True)
            self.assertFalse(records.record_passes(bad), (part, value))
            self.assertTrue(records.check_text(bad).startswith(("FAIL", "no peer")), (part, value))

    def test_a_sweep_against_todays_peer_wins_over_a_wider_one_against_an_earlier_peer(self):
        today = report.checks.peer_code("peer_torch")
        with tempfile.TemporaryDirectory() as d:
            loaded = report.load_records(fixture_records(d))
            (key, old_group), = report.sweep_groups(loaded).items()
            self.assertFalse(any(report.todays_peer(r) for r in old_group))  # (the fixtures': none recorded)
            # Two points of a newer commit against today's peer: fewer than the fixture's sweep.
            new = []
            for r in old_group[:2]:
                n = copy.deepcopy(r)
                n["commit"] = {"sha": "fedcba9876543", "short": "fedcba9", "dirty": False}
                n["peers"]["pytorch_pipeline"]["code"] = today
                new.append(("n%d" % len(new), n))
            self.assertGreater(len(old_group), len(new))
            (_, group), = report.sweep_groups(loaded + new).items()
            self.assertEqual({r["commit"]["short"] for r in group}, {"fedcba9"})
            self.assertEqual(report.peer_text(group[0]), "today's")

    def test_noisy_timings_are_listed(self):
        with tempfile.TemporaryDirectory() as d:
            loaded = report.load_records(fixture_records(d))
            rec = copy.deepcopy(loaded[1][1])
            steady = copy.deepcopy(rec)
            steady["mok"]["forward"].update(median_ms=1.0, min_ms=0.99, max_ms=1.2)
            steady["peers"]["pytorch_pipeline"]["forward"].update(median_ms=2.0, min_ms=1.98)
            self.assertEqual(report.noise_lines([steady]),
                             ["## Noisy timings", "",
                              "Every shown median is within 5% of its fastest timed iteration.", ""])
            # mok's median 8% above its fastest iteration (the gpt-oss record of 78a4207): listed,
            # with its min, max and ratio; the steady PyTorch timing of the same record is not.
            noisy = copy.deepcopy(steady)
            noisy["mok"]["forward"].update(median_ms=1.8655, min_ms=1.71386, max_ms=2.25056)
            text = "\n".join(report.noise_lines([steady, noisy]))
            rows = [line for line in text.splitlines() if line.startswith("| " + rec["shape"])]
            self.assertEqual(len(rows), 1, text)
            self.assertIn("| mok | 1.865 | 1.714 | 2.251 | 1.088 |", rows[0])
            # A PyTorch median 6% above its fastest iteration is listed too; missing minima are not.
            noisy["peers"]["pytorch_pipeline"]["forward"].update(median_ms=2.12, min_ms=2.0)
            del steady["mok"]["forward"]["min_ms"]
            text = "\n".join(report.noise_lines([steady, noisy]))
            self.assertIn("| PyTorch | 2.120 | 2.000 |", text)
            self.assertEqual(len([l for l in text.splitlines() if l.startswith("| " + rec["shape"])]), 2, text)

    def test_real_groups_table(self):
        m = copy.deepcopy(fixture("fixture_mok_qwen35_slice.json"))
        m["forward_iters_ms"] = [2.0]
        m["rows"]["remote"] = 1000
        mok = records.merge_group([m, copy.deepcopy(m)])
        rec = records.make_record(mok, {"ceilings": {"nccl_all_to_all": {"busbw_gbps": 100.0}},
                                        "forward": {"median_ms": 5.0, "min_ms": 5.0, "max_ms": 5.0}}, env())
        lines = report.group_lines([rec])
        self.assertIn("## Real EP groups (one process per GPU, NVLink)", lines[0])
        row = [c.strip() for c in lines[-2].strip("|").split("|")]
        self.assertEqual(row[0], "qwen3.5-397b-a17b")
        self.assertEqual(row[3:6], ["2.000", "5.000", "2.50x"])
        self.assertEqual(row[8], "100")
        self.assertEqual(report.group_lines([records.make_record(fixture("fixture_mok_qwen35_slice.json"), None,
                                                                 env())]), [])

    def test_given_files_only_and_empty(self):
        with tempfile.TemporaryDirectory() as d:
            paths = fixture_records(os.path.join(d, "results"))
            out, plots = os.path.join(d, "R.md"), os.path.join(d, "p")
            recs = report.generate(paths[1:2], out, plots)
            self.assertEqual([r["shape"] for r in recs], ["qwen3.5-397b-a17b"])
            self.assertEqual(sorted(os.listdir(plots)), ["dense_ceiling_fraction.png", "tflops_per_shape.png"])
            # The mixtral record failed: it is in the table as FAIL, and no plot draws it.
            recs = report.generate(paths[2:3], out, plots)
            self.assertEqual([r["shape"] for r in recs], ["mixtral-8x7b"])
            self.assertEqual(os.listdir(plots), [])
            self.assertIn("FAIL (pytorch FAIL)", helpers.read_text(out))
            self.assertNotIn("## Plots", helpers.read_text(out))
            recs = report.generate([], out, plots)
            self.assertEqual(recs, [])
            self.assertIn("No records yet", helpers.read_text(out))
            self.assertEqual(os.listdir(plots), [])

    def test_failed_records_are_not_plotted(self):
        with tempfile.TemporaryDirectory() as d:
            loaded = report.load_records(fixture_records(d))
            recs = report.newest_per_key(loaded)
            self.assertIn("mixtral-8x7b", [r["shape"] for r in recs])  # the table shows its FAIL
            self.assertNotIn("mixtral-8x7b", [r["shape"] for r in report.bar_records(recs)])
            # A sweep point that failed is left off the line (and one that errored, too).
            failed = copy.deepcopy([r for _, r in loaded if r["tokens_per_rank"] == 1024][0])
            failed["check"]["passes"] = False
            failed["date"] = "2099-01-01T00:00:00Z"
            errored = copy.deepcopy([r for _, r in loaded if r["tokens_per_rank"] == 4096][0])
            errored["errors"] = ["mok bench exited 4"]
            errored["date"] = "2099-01-01T00:00:00Z"
            rest = [(p, r) for p, r in loaded if r["tokens_per_rank"] not in (1024, 4096)]
            (_, group), = report.sweep_groups(rest + [("f", failed), ("e", errored)]).items()
            self.assertEqual([r["tokens_per_rank"] for r in group], [512, 2048])

    def test_the_plots_set_performed_flops_side_by_side(self):
        # The pipeline's and mok's performed figures use one FLOP count (the record's
        # performed_forward), so equal times give equal bars; MoK's formula would not for a shape
        # without a shared expert.
        mok, peer = fixture("fixture_mok_mixtral_all.json"), fixture("fixture_peer_qwen35_slice.json")
        rec = records.make_record(mok, peer, env())
        rec["peers"]["pytorch_pipeline"]["forward"] = dict(rec["mok"]["forward"])  # same time as mok
        v = report.values(rec)
        flops = rec["flops"]["performed_forward"]
        self.assertAlmostEqual(v["pt_tflops_performed"], flops / (rec["mok"]["forward"]["median_ms"] * 1e9))
        self.assertAlmostEqual(v["pt_tflops_performed"], v["mok_tflops_performed"], places=6)
        self.assertAlmostEqual(v["pt_frac_performed"], v["mok_frac_performed"], places=6)
        self.assertGreater(v["mok_frac"], 1.4 * v["mok_frac_performed"])  # (MoK's count: k+1 over k, k = 2)

    def test_records_of_one_shape_on_two_gpus_are_told_apart(self):
        # An H100's and an H200's record of one shape are two bar groups and two rows of every
        # table: the plots' labels and the tables' run column name the GPU (and an earlier peer).
        with tempfile.TemporaryDirectory() as d:
            loaded = report.load_records(fixture_records(d))
        q = [r for _, r in loaded if r["shape"] == "qwen3.5-397b-a17b" and r["tokens_per_rank"] == 2048][-1]
        q = copy.deepcopy(q)
        q["gpu"]["name"] = "NVIDIA H200"
        q["peers"]["pytorch_pipeline"]["code"] = report.checks.peer_code("peer_torch")
        q["mok"]["forward_phases"] = {"median_ms": {"megakernel": 1.0}, "method": "back to back"}
        h100 = copy.deepcopy(q)
        h100["gpu"]["name"] = "NVIDIA H100 80GB HBM3"
        self.assertEqual((report.gpu_short(q), report.gpu_short(h100)), ("H200", "H100"))
        labels = [report._label(r, False) for r in (q, h100)]
        self.assertEqual([lab.splitlines()[-1] for lab in labels], ["H200", "H100"])
        earlier = copy.deepcopy(h100)
        earlier["peers"]["pytorch_pipeline"]["code"] = "peer_torch:000000000000"
        self.assertEqual(report._label(earlier, False).splitlines()[-1], "H100, earlier peer")
        for lines in (report.routing_lines([q, h100]), report.phase_lines([q, h100])):
            rows = [line for line in lines if line.startswith("| qwen3.5-397b-a17b")]
            self.assertEqual(len(rows), 2, lines)
            self.assertTrue(rows[0].endswith(", H200 |") and rows[1].endswith(", H100 |"), rows)

    def test_a_sweep_draws_every_line_by_the_flops_performed(self):
        # (gg_tflops is the grouped GEMMs' own figure, 6*N*H*I: performed FLOPs already.)
        self.assertEqual([k for _, k in report.SWEEP_SERIES],
                         ["mok_tflops_performed", "pt_tflops_performed", "gg_tflops",
                          "mok_bwd_tflops_performed", "pt_bwd_tflops_performed"])

    def test_a_record_against_todays_peer_stands_for_its_shape(self):
        # Three records of one key: the oldest against today's peer (its code id as the peer
        # files in this checkout hash), a newer one against an earlier peer, the newest with no
        # id (before records kept one). The main table shows today's, marked so; without it,
        # the newest is shown and marked as an earlier peer.
        qwen = (fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json"))
        today = report.checks.peer_code("peer_torch")
        self.assertRegex(today, r"^peer_torch:[0-9a-f]{12}$")

        def with_peer(code, ms, date):
            m, p = copy.deepcopy(qwen[0]), copy.deepcopy(qwen[1])
            set_median(m["forward"], ms)
            if code is not None:
                p["peer_code"] = code
            return records.make_record(m, p, env(date=date))

        for keep_today in (True, False):
            with tempfile.TemporaryDirectory() as d:
                recs = [with_peer("peer_torch:000000000000", 2.0, "2001-01-02T00:00:00Z"),
                        with_peer(None, 3.0, "2001-01-03T00:00:00Z")]
                if keep_today:
                    recs.append(with_peer(today, 1.0, "2001-01-01T00:00:00Z"))
                paths = [records.write_record(r, d) for r in recs]
                loaded = report.load_records(paths)
                shown = report.newest_per_key(loaded)
                self.assertEqual(len(shown), 1)
                self.assertEqual(shown[0]["mok"]["forward"]["median_ms"], 1.0 if keep_today else 3.0)
                self.assertEqual(report.peer_text(shown[0]), "today's" if keep_today else "earlier (unrecorded)")
        self.assertEqual(report.peer_text(with_peer("peer_torch:000000000000", 2.0, "2001-01-02T00:00:00Z")),
                         "earlier: 000000000000")
        # A newer record made with extra mok bench options stands beside the default one, not
        # for it, and says so; the bars keep the default.
        with tempfile.TemporaryDirectory() as d:
            plain = with_peer(today, 1.0, "2001-01-01T00:00:00Z")
            tuned = with_peer(today, 0.5, "2001-01-05T00:00:00Z")
            tuned["mok_args"] = ["--comm-sms", "32"]
            loaded = report.load_records([records.write_record(r, d) for r in (plain, tuned)])
            shown = report.newest_per_key(loaded)
            self.assertEqual(sorted(r["mok"]["forward"]["median_ms"] for r in shown), [0.5, 1.0])
            self.assertIn("--comm-sms 32", report.commit_text(next(r for r in shown if r.get("mok_args"))))
            self.assertEqual([r["mok"]["forward"]["median_ms"] for r in report.bar_records(shown)], [1.0])
        # So does one made with a megakernel knob in its environment (config.env), even when
        # it is the newest and slower.
        with tempfile.TemporaryDirectory() as d:
            plain = with_peer(today, 1.0, "2001-01-01T00:00:00Z")
            knob = with_peer(today, 1.3, "2001-01-05T00:00:00Z")
            knob.setdefault("config", {})["env"] = {"MOK_STORE_WARP": "0"}
            loaded = report.load_records([records.write_record(r, d) for r in (plain, knob)])
            shown = report.newest_per_key(loaded)
            self.assertEqual(sorted(r["mok"]["forward"]["median_ms"] for r in shown), [1.0, 1.3])
            self.assertIn("MOK_STORE_WARP=0", report.commit_text(next(r for r in shown if report.variant_of(r))))
            self.assertEqual([r["mok"]["forward"]["median_ms"] for r in report.bar_records(shown)], [1.0])
            self.assertEqual(report.sweep_groups(loaded), {})
        # A wait limit changes no kernel: a newer record that set one stands for the key.
        with tempfile.TemporaryDirectory() as d:
            plain = with_peer(today, 1.0, "2001-01-01T00:00:00Z")
            limit = with_peer(today, 1.1, "2001-01-05T00:00:00Z")
            limit.setdefault("config", {})["env"] = {"MOK_GROUP_START_TIMEOUT_MS": "300000"}
            loaded = report.load_records([records.write_record(r, d) for r in (plain, limit)])
            self.assertEqual([r["mok"]["forward"]["median_ms"] for r in report.newest_per_key(loaded)], [1.1])
        # A changed peer file changes the id.
        with tempfile.TemporaryDirectory() as d:
            bench = os.path.dirname(os.path.abspath(report.__file__))
            for name in report.checks.PEER_FILES["peer_torch"]:
                with open(os.path.join(bench, name), "rb") as src, open(os.path.join(d, name), "wb") as dst:
                    dst.write(src.read())
            self.assertEqual(report.checks.peer_code("peer_torch", d), today)
            with open(os.path.join(d, "peer_torch.py"), "ab") as f:
                f.write(b"# changed\n")
            self.assertNotEqual(report.checks.peer_code("peer_torch", d), today)

    def test_off_contract_records_do_not_replace_contract_ones(self):
        # A newer --no-peer record and a newer --warmup 0 --iters 1 record of the qwen shape at
        # 2048 tokens: the main table, the plots, the sweep and the repeat table keep the
        # contract record; an "Off-contract records" table lists the two, saying why.
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            paths = fixture_records(results)
            qwen = (fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json"))
            alone = copy.deepcopy(qwen[0])
            set_median(alone["forward"], 0.123)
            records.write_record(records.make_record(alone, None, env(date="2020-01-01T00:00:00Z")), results)
            quick_mok, quick_peer = copy.deepcopy(qwen[0]), copy.deepcopy(qwen[1])
            quick_mok["timing"].update(warmup=0, iters=1)
            quick_peer["timing"].update(warmup=0, iters=1)
            set_median(quick_mok["forward"], 0.456)
            records.write_record(records.make_record(quick_mok, quick_peer, env(date="2020-01-02T00:00:00Z")), results)
            out, plots = os.path.join(d, "R.md"), os.path.join(d, "plots")
            recs = report.generate(sorted(glob.glob(os.path.join(results, "*.json"))), out, plots)
            q = [r for r in recs if r["shape"] == "qwen3.5-397b-a17b" and r["tokens_per_rank"] == 2048]
            self.assertEqual([r["mok"]["forward"]["median_ms"] for r in q], [1.0])
            text = helpers.read_text(out)
            self.assertIn("## Off-contract records", text)
            section = text[text.index("## Off-contract records"):].split("\n## ")[0]
            off = [line for line in section.splitlines() if line.startswith("| qwen")]
            self.assertEqual(len(off), 2, section)
            self.assertIn("| 0.123 | – | no peer (mok PASS) |", off[0] + off[1])
            self.assertTrue(any(row.endswith("| no peer |") for row in off), off)
            self.assertTrue(any("mok warm-up 0 (contract 500); mok timed iterations 1 (contract 100); "
                                "peer warm-up 0 (contract 500); peer timed iterations 1 (contract 100) |" in row
                                for row in off), off)
            # Nowhere else: the main table's rows are those of the contract records only.
            rest = text.replace(section, "")
            self.assertNotIn("0.123", rest)
            self.assertNotIn("0.456", rest)
            groups = report.repeat_groups(report.split_contract(report.load_records(paths))[0])
            self.assertEqual(len(groups), 1)

    def test_contract_breaks(self):
        rec = records.make_record(fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json"),
                                  env())
        self.assertEqual(records.contract_breaks(rec), [])
        self.assertEqual(records.contract_breaks(dict(rec, timing={"mok": rec["timing"]["mok"]})),
                         ["peer timing not recorded"])
        peer = copy.deepcopy(rec["timing"])
        peer["peer"]["iters"] = 50
        self.assertEqual(records.contract_breaks(dict(rec, timing=peer)), ["peer timed iterations 50 (contract 100)"])
        alone = records.make_record(fixture("fixture_mok_qwen35_slice.json"), None, env())
        self.assertEqual(records.contract_breaks(alone), ["no peer"])

    def test_unknown_dirty_is_never_shown_clean(self):
        mok, peer = fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json")
        unknown = records.make_record(mok, peer, {"date": "2001-02-03T04:05:06Z", "commit": {
            "sha": "0123456789abcdef", "dirty": None, "source": "MOK_BENCH_COMMIT"}})
        self.assertEqual(report.commit_text(unknown), "0123456+dirty?")
        self.assertEqual(report._commit_of(unknown), "0123456789ab+dirty?")
        clean = records.make_record(mok, peer, env())
        self.assertEqual((report.commit_text(clean), report._commit_of(clean)), ("0123456", "0123456789ab"))
        dirty = copy.deepcopy(clean)
        dirty["commit"]["dirty"] = True
        self.assertEqual((report.commit_text(dirty), report._commit_of(dirty)), ("0123456+dirty", "0123456789ab+dirty"))

    def test_peer_json_and_incomplete_records_are_skipped(self):
        with tempfile.TemporaryDirectory() as d:
            results = results_with_strays(d, "broken.json", lambda rec: rec.pop("precision"))
            r = subprocess.run([sys.executable, os.path.join(helpers.BENCH_DIR, "report.py"), "--results-dir", results,
                                "--out", os.path.join(d, "R.md"), "--plots-dir", os.path.join(d, "plots")],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("5 record(s)", r.stdout)
            self.assertIn("skipping " + os.path.join(results, "peer.json"), r.stderr)
            self.assertIn("broken.json: not a mok benchmark record: 'precision'", r.stderr)
            self.assertNotIn("Traceback", r.stderr)

    def test_without_matplotlib_nothing_is_touched(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            fixture_records(results)
            out, plots = os.path.join(d, "R.md"), os.path.join(d, "plots")
            report.main(["--results-dir", results, "--out", out, "--plots-dir", plots])
            before = {n: os.path.getmtime(os.path.join(plots, n)) for n in os.listdir(plots)}
            text = helpers.read_text(out)
            fake = os.path.join(d, "fake")
            os.makedirs(os.path.join(fake, "matplotlib"))
            with open(os.path.join(fake, "matplotlib", "__init__.py"), "w") as f:
                f.write("raise ImportError('simulated: no matplotlib here')\n")
            e = dict(os.environ, PYTHONPATH=fake + os.pathsep + os.environ.get("PYTHONPATH", ""))
            r = subprocess.run([sys.executable, os.path.join(helpers.BENCH_DIR, "report.py"), "--results-dir", results,
                                "--out", out, "--plots-dir", plots], capture_output=True, text=True, env=e)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("matplotlib is needed", r.stderr)
            self.assertNotIn("Traceback", r.stderr)
            self.assertEqual({n: os.path.getmtime(os.path.join(plots, n)) for n in os.listdir(plots)}, before)
            self.assertEqual(helpers.read_text(out), text)

    def test_report_is_replaced_whole_or_not_at_all(self):
        with tempfile.TemporaryDirectory() as d:
            paths = fixture_records(os.path.join(d, "results"))
            out, plots = os.path.join(d, "R.md"), os.path.join(d, "plots")
            report.generate(paths, out, plots)
            text = helpers.read_text(out)
            # Writing fails half-way (a lone surrogate cannot be encoded): the old report stays.
            with mock.patch.object(report, "markdown", return_value="half a report\udc80 and the rest"):
                with self.assertRaises(UnicodeEncodeError):
                    report.generate(paths, out, plots)
            self.assertEqual(helpers.read_text(out), text)
            self.assertEqual(sorted(os.listdir(d)), ["R.md", "plots", "results"])

    def snapshot(self, d):
        """Every file under d with its bytes and mtime (what "nothing touched" compares)."""
        out = {}
        for root, _, files in os.walk(d):
            for n in files:
                p = os.path.join(root, n)
                with open(p, "rb") as f:
                    out[os.path.relpath(p, d)] = (f.read(), os.path.getmtime(p))
        return out

    def made_report(self, d):
        results = os.path.join(d, "results")
        paths = fixture_records(results)
        out, plots = os.path.join(d, "R.md"), os.path.join(d, "plots")
        self.assertEqual(report.main(["--results-dir", results, "--out", out, "--plots-dir", plots]), 0)
        self.assertTrue(os.listdir(plots))
        return paths, out, plots

    def run_report(self, args):
        return subprocess.run([sys.executable, os.path.join(helpers.BENCH_DIR, "report.py")] + args,
                              capture_output=True, text=True)

    def assert_refused_touching_nothing(self, d, before, args, *messages):
        """report.py `args` exits 1 saying each of `messages`, with no traceback, and every file
        under d is as in `before` (snapshot)."""
        r = self.run_report(args)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        for message in messages:
            self.assertIn(message, r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        self.assertEqual(self.snapshot(d), before)

    def test_a_results_dir_that_does_not_exist_touches_nothing(self):
        with tempfile.TemporaryDirectory() as d:
            _, out, plots = self.made_report(d)
            before = self.snapshot(d)
            typo = os.path.join(d, "resluts")
            self.assert_refused_touching_nothing(d, before, ["--results-dir", typo, "--out", out, "--plots-dir", plots],
                                                 f"report.py: --results-dir {typo}: no such folder. Nothing was written.")

    def test_files_of_which_none_loads_touch_nothing(self):
        with tempfile.TemporaryDirectory() as d:
            paths, out, plots = self.made_report(d)
            junk = os.path.join(d, "junk")
            os.makedirs(junk)
            with open(os.path.join(junk, "a.json"), "w") as f:
                f.write("{not json")
            with open(os.path.join(junk, "peer.json"), "w") as f:
                json.dump(fixture("fixture_peer_qwen35_slice.json"), f)
            before = self.snapshot(d)
            for args in (["--results-dir", junk], [os.path.join(d, "missing.json"), os.path.join(junk, "a.json")]):
                self.assert_refused_touching_nothing(d, before, args + ["--out", out, "--plots-dir", plots],
                                                     "none of the 2 file(s) given is a readable record",
                                                     "Nothing was written.")
            # An empty results folder is a suite with no records yet (not a typo).
            empty = os.path.join(d, "empty")
            os.makedirs(empty)
            r = self.run_report(["--results-dir", empty, "--out", out, "--plots-dir", plots])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("No records yet", helpers.read_text(out))

    def test_a_plot_that_fails_leaves_the_old_report_and_plots(self):
        with tempfile.TemporaryDirectory() as d:
            paths, out, plots = self.made_report(d)
            before = self.snapshot(d)
            # The sweep is drawn after the bar plots: a crash there must not leave the bars new
            # and the sweep gone, nor a REPORT.md that links plots that are not there.
            with mock.patch.object(report, "_sweep_plot", side_effect=RuntimeError("simulated crash")):
                with self.assertRaisesRegex(RuntimeError, "simulated crash"):
                    report.generate(paths[:2] + paths[3:], out, plots)
            self.assertEqual(self.snapshot(d), before)
            self.assertEqual(sorted(os.listdir(d)), ["R.md", "plots", "results"])

    def test_an_unwritable_out_folder_touches_no_plot(self):
        with tempfile.TemporaryDirectory() as d:
            paths, out, plots = self.made_report(d)
            before = self.snapshot(d)
            elsewhere = os.path.join(d, "no", "such", "folder", "R.md")
            self.assert_refused_touching_nothing(
                d, before, ["--results-dir", os.path.join(d, "results"), "--out", elsewhere, "--plots-dir", plots],
                f"report.py: --out {elsewhere}: cannot be written")

    def test_skipped_files_are_listed_in_the_report(self):
        with tempfile.TemporaryDirectory() as d:
            results = results_with_strays(d, "edited.json", lambda rec: rec["check"].update(passes="false"))
            out = os.path.join(d, "R.md")
            self.assertEqual(report.main(["--results-dir", results, "--out", out, "--plots-dir",
                                          os.path.join(d, "plots")]), 0)
            text = helpers.read_text(out)
            self.assertIn("## Skipped files", text)
            self.assertIn("| results/edited.json | 'check.passes' must be true or false (got \"false\") |", text)
            self.assertIn("| results/peer.json | not a mok benchmark record: 'ep_mode' must be a string (missing) |", text)
            self.assertNotIn(d, text)  # (paths relative to the report, not this machine's)
        with tempfile.TemporaryDirectory() as d:  # none skipped: no section
            _, out, _ = self.made_report(d)
            self.assertNotIn("## Skipped files", helpers.read_text(out))

    def staging_left(self, folder):
        return sorted(n for n in os.listdir(folder) if n.startswith(".report-") or ".tmp" in n)

    def test_a_report_killed_mid_way_leaves_nothing_for_the_next_one(self):
        with tempfile.TemporaryDirectory() as d:
            paths, out, plots = self.made_report(d)
            # A report.py killed while it draws (SIGKILL: no finally runs) leaves its staging
            # folder in plots/ and its markdown's temporary file beside R.md.
            code = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); import report; "
                    "report._sweep_plot = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
                    "report.main(sys.argv[2:])")
            r = subprocess.run([sys.executable, "-c", code, helpers.BENCH_DIR, "--results-dir",
                                os.path.join(d, "results"), "--out", out, "--plots-dir", plots],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, -signal.SIGKILL, r.stderr)
            self.assertEqual(len(self.staging_left(plots)), 1, os.listdir(plots))
            self.assertEqual(len(self.staging_left(d)), 1, os.listdir(d))
            # Things that only look alike stay: a file of the name, folders of other names, the
            # pattern outside plots/, and the staging folder of a report still running (its pid
            # is a live process's).
            keep = [os.path.join(plots, n) for n in (".report-keep-me", ".reports", ".report-abc")]
            keep += [os.path.join(d, ".report-abcdefgh"), os.path.join(plots, f".report-{os.getppid()}-abcdefgh")]
            for k in keep:
                os.makedirs(k)
            with open(os.path.join(plots, ".report-12345678"), "w") as f:
                f.write("a file, not a staging folder")
            old_style = os.path.join(plots, ".report-k7_x2abc")  # (the name report.py gave them before)
            os.makedirs(os.path.join(old_style, "sub"))
            r = self.run_report(["--results-dir", os.path.join(d, "results"), "--out", out, "--plots-dir", plots])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("stale", r.stderr)
            self.assertEqual(self.staging_left(plots), sorted([".report-12345678", ".report-abc", ".report-keep-me",
                                                                f".report-{os.getppid()}-abcdefgh"]))
            self.assertEqual(self.staging_left(d), [".report-abcdefgh"])
            self.assertTrue(all(os.path.isdir(k) for k in keep))

    def test_a_report_removes_its_own_staging_on_success_and_on_failure(self):
        with tempfile.TemporaryDirectory() as d:
            paths, out, plots = self.made_report(d)
            self.assertEqual(self.staging_left(plots), [])
            seen = []
            def crash(path, *a, **k):
                seen.append(os.path.dirname(path))
                raise exc
            for exc in (RuntimeError("simulated crash"), KeyboardInterrupt()):
                with mock.patch.object(report, "_sweep_plot", side_effect=crash):
                    with self.assertRaises(type(exc)):
                        report.generate(paths, out, plots)
                self.assertTrue(os.path.basename(seen[-1]).startswith(f".report-{os.getpid()}-"), seen)
                self.assertFalse(os.path.exists(seen[-1]))
                self.assertEqual(self.staging_left(plots), [])
                self.assertEqual(self.staging_left(d), [])
            report.generate(paths, out, plots)
            self.assertEqual(self.staging_left(plots), [])
            self.assertEqual(self.staging_left(d), [])

    def test_records_with_bad_figures_are_skipped_with_the_reason_never_a_crash(self):
        # Each of these once reached the report (a TypeError in the backward table, a string
        # "inf" ceiling divided, a negative mok backward shown as a -8x PASS, a speedup of 50x
        # beside medians that give 3x): each is now skipped, named, with why.
        edits = {
            "peer_bwd_nan.json": (lambda r: r["peers"]["pytorch_pipeline"]["backward"].update(median_ms=float("nan")),
                                  "'peers.pytorch_pipeline.backward.median_ms' must be a finite number > 0"),
            "ceiling_inf.json": (lambda r: r["ceilings"].update(dense_bf16_tflops="inf"),
                                 "'ceilings.dense_bf16_tflops' must be a finite number > 0 or null (got \"inf\")"),
            "mok_bwd_neg.json": (lambda r: r["mok"].update(backward={"median_ms": -1.0, "tflops": -5.0}),
                                 "'mok.backward.median_ms' must be a finite number > 0"),
            "speedup_50.json": (lambda r: r["ratios"].update(speedup_forward_vs_pytorch=50.0),
                                "'ratios.speedup_forward_vs_pytorch' is 50.0, but the record's medians"),
        }
        with tempfile.TemporaryDirectory() as d:
            results = results_with_strays(d, "peer_bwd_nan.json", edits["peer_bwd_nan.json"][0])
            good = helpers.read_json(sorted(glob.glob(os.path.join(results, "2001-02-03_qwen*.json")))[0])
            for name, (edit, _) in edits.items():
                rec = copy.deepcopy(good)
                edit(rec)
                with open(os.path.join(results, name), "w") as f:
                    json.dump(rec, f)
            out = os.path.join(d, "R.md")
            r = self.run_report(["--results-dir", results, "--out", out, "--plots-dir", os.path.join(d, "plots")])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertNotIn("Traceback", r.stderr)
            self.assertIn("5 record(s)", r.stdout)
            text = helpers.read_text(out)
            for name, (_, why) in edits.items():
                self.assertIn("skipping " + os.path.join(results, name), r.stderr)
                row, = [line for line in text.splitlines() if line.startswith(f"| results/{name} |")]
                self.assertIn(why, row.replace("\\|", "|"))
            self.assertNotIn("50.00x", text)
            self.assertNotIn("-8", text.split("## Backward")[1].split("\n## ")[0] if "## Backward" in text else "")

    def test_an_out_that_is_a_folder_is_refused_before_any_plot(self):
        with tempfile.TemporaryDirectory() as d:
            _, out, plots = self.made_report(d)
            folder = os.path.join(d, "results")  # (an existing folder given as --out)
            before = self.snapshot(d)
            self.assert_refused_touching_nothing(
                d, before, ["--results-dir", folder, "--out", folder, "--plots-dir", plots],
                f"report.py: --out {folder}: is a folder")

    def test_a_failure_while_installing_leaves_the_old_report_and_plots(self):
        real_replace = os.replace
        with tempfile.TemporaryDirectory() as d:
            paths, out, plots = self.made_report(d)
            before = self.snapshot(d)
            for failing in ("report", "second plot"):
                placing = []  # (the new plots moved in from the staging folder, not the old ones set aside)
                def replace(src, dst, failing=failing):
                    new_plot = os.path.dirname(os.path.abspath(src)).startswith(os.path.join(plots, ".report-")) \
                        and os.path.basename(os.path.dirname(src)) != ".old" and dst.endswith(".png")
                    if new_plot:
                        placing.append(dst)
                    if (failing == "report" and dst == out) or (failing == "second plot" and new_plot
                                                                and len(placing) == 2):
                        raise OSError(5, "simulated I/O error")
                    return real_replace(src, dst)
                # Fewer plots than before (one sweep point left out): the old sweep must come back.
                with mock.patch.object(report.os, "replace", side_effect=replace):
                    with self.assertRaisesRegex(OSError, "simulated I/O error"):
                        report.generate(paths[:4], out, plots)
                self.assertEqual(self.snapshot(d), before, failing)
                self.assertEqual(sorted(os.listdir(d)), ["R.md", "plots", "results"])
                self.assertFalse([n for n in os.listdir(plots) if n.startswith(".report-")])

    def test_sweep_keys_that_make_one_file_name_get_a_plot_each(self):
        with tempfile.TemporaryDirectory() as d:
            results = os.path.join(d, "results")
            for shape in ("qwén", "qwèn"):
                for t in (512, 1024):
                    m, p = fixture("fixture_mok_qwen35_slice.json"), fixture("fixture_peer_qwen35_slice.json")
                    m["shape"], m["problem"]["tokens_per_rank"], m["rows"]["real"] = shape, t, t * 10
                    m["rows"]["remote"] = t * 10 * 63 // 64
                    set_median(m["forward"], t / 2048)
                    records.write_record(records.make_record(m, p, env()), results)
            out, plots = os.path.join(d, "R.md"), os.path.join(d, "plots")
            self.assertEqual(report.main(["--results-dir", results, "--out", out, "--plots-dir", plots]), 0)
            sweeps = sorted(n for n in os.listdir(plots) if n.startswith("sweep_"))
            self.assertEqual(len(sweeps), 2, sweeps)
            plain = "sweep_qw-n_slice64_gaussian_bf16_FIXTURE-GPU.png"
            self.assertIn(plain, sweeps)
            hashed, = set(sweeps) - {plain}
            self.assertRegex(hashed, r"^sweep_qw-n_slice64_gaussian_bf16_FIXTURE-GPU-[0-9a-f]{8}\.png$")
            text = helpers.read_text(out)
            for name in sweeps:
                self.assertIn(f"(plots/{name})", text)
                assert_png(self, os.path.join(plots, name))
            # Regenerated: the same names, nothing left over.
            self.assertEqual(report.main(["--results-dir", results, "--out", out, "--plots-dir", plots]), 0)
            self.assertEqual(sorted(n for n in os.listdir(plots) if n.startswith("sweep_")), sweeps)

    def test_ctrl_c_exits_130_with_one_line_and_leaves_the_old_report(self):
        with tempfile.TemporaryDirectory() as d:
            paths, out, plots = self.made_report(d)
            before = self.snapshot(d)
            err = io.StringIO()
            with mock.patch.object(report, "_sweep_plot", side_effect=KeyboardInterrupt()), \
                    contextlib.redirect_stderr(err):
                rc = report.main(["--results-dir", os.path.join(d, "results"), "--out", out, "--plots-dir", plots])
            self.assertEqual(rc, 130)
            self.assertEqual(err.getvalue().strip().splitlines(),
                             [f"report.py: interrupted (Ctrl-C); {out} and the plots in {plots} are as they were"])
            self.assertEqual(self.snapshot(d), before)

    def test_bad_file_is_skipped(self):
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.json")
            with open(bad, "w") as f:
                f.write("{not json")
            self.assertEqual(report.load_records([bad]), [])

    def test_command_line(self):
        with tempfile.TemporaryDirectory() as d:
            fixture_records(os.path.join(d, "results"))
            r = subprocess.run([sys.executable, os.path.join(helpers.BENCH_DIR, "report.py"), "--results-dir",
                                os.path.join(d, "results"), "--out", os.path.join(d, "R.md"), "--plots-dir",
                                os.path.join(d, "plots")], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("5 record(s)", r.stdout)


if __name__ == "__main__":
    unittest.main()
