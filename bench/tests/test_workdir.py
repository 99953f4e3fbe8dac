"""The work-directory contract, on a synthetic work directory (synth_workdir.py).

Also runs the peer's pipeline steps in numpy (argsort permute, bincount offsets, one GEMM per
expert segment, SwiGLU, unpermute, weighted combine) to show that the steps peer_torch.py
takes in torch reproduce rows_ref and y_ref from the contract's inputs.
"""
import json
import os
import re
import tempfile
import unittest
from unittest import mock

import numpy as np

import helpers  # noqa: F401  (sets sys.path)

import checks
import workdir
from synth_workdir import make_workdir, rank_dir_from_single


def f32(bits):
    return workdir.bf16_bits_to_f32(bits)


def swiglu(h, width, limit):
    g, u = h[:, :width], h[:, width:]
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return workdir.round_bf16(workdir.round_bf16(g / (1 + np.exp(-g))) * u)


def numpy_pipeline(doc, a):
    """peer_torch.routed_rows and local_y, step by step, in numpy (bf16 rounding at the same places)."""
    R, T, H, I, k, El, widths = workdir.problem_dims(doc["problem"])
    limit = doc["problem"].get("swiglu_limit")
    x_recv = f32(a["x_all"])[a["row_source"]]
    order = np.argsort(a["row_expert"], kind="stable")
    x_perm = x_recv[order]
    offs = np.cumsum(np.bincount(a["row_expert"], minlength=El)).astype(np.int32)
    w13 = np.concatenate([f32(a["w_gate"]), f32(a["w_up"])], axis=1)  # [El, 2I, H]
    w2 = f32(a["w_down"])
    o = np.zeros((len(order), H), dtype=np.float32)
    start = 0
    for e, end in enumerate(offs):
        h = workdir.round_bf16(x_perm[start:end] @ w13[e].T)
        o[start:end] = workdir.round_bf16(swiglu(h, I, limit) @ w2[e].T)
        start = end
    out = np.empty_like(o)
    out[order] = o
    # The rank's own tokens' rows go into their slots (NaN in the file: row_slot.npy).
    slots = f32(a["combine_local"]).copy()
    own = a["row_slot"] >= 0
    slots[a["row_slot"][own]] = out[own]
    # The weighting: bf16 weights, the sum rounded to bf16 (one bmm), then fp32 with the shared.
    w = workdir.round_bf16(a["router_weights"].astype(np.float32))
    acc = workdir.round_bf16((w[..., None] * slots.reshape(T, k, H)).sum(1))
    x_local = f32(a["x_local"])
    for s, width in zip(a["shared"], widths):
        w13s = np.concatenate([f32(s["w_gate"]), f32(s["w_up"])], axis=0)
        h = workdir.round_bf16(x_local @ w13s.T)
        acc = acc + workdir.round_bf16(swiglu(h, width, limit) @ f32(s["w_down"]).T)
    return out, workdir.round_bf16(acc)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpp_bench_file_names():
    """The names `mok bench` writes, from tools/mok/work_dir.h's bench_file_name() switch (the
    C++ side's one list), and its shared-weight prefix from work_dir.cpp."""
    with open(os.path.join(REPO, "tools", "mok", "work_dir.h")) as f:
        names = set(re.findall(r'case BenchFile::k\w+: return "([^"]+)";', f.read()))
    with open(os.path.join(REPO, "tools", "mok", "work_dir.cpp")) as f:
        prefix = re.search(r'kShared\[\] = "([^"]+)"', f.read())
    return names, prefix.group(1) if prefix else None


class NamesAgreeWithTheCppWriter(unittest.TestCase):
    """bench/README.md's contract is spelled twice: by the C++ writer (tools/mok/work_dir.h)
    and by this reader. A file renamed on one side only fails here, not on the device."""

    def test_every_file_the_reader_opens_is_one_mok_bench_writes(self):
        names, shared_prefix = cpp_bench_file_names()
        self.assertIn("x_all.npy", names)  # the parse found the list
        self.assertIsNotNone(shared_prefix, "work_dir.cpp's kShared prefix not found")
        opened = []
        real_load = workdir._load

        def recording_load(work_dir, name, kind, shape):
            opened.append(name)
            return real_load(work_dir, name, kind, shape)

        with tempfile.TemporaryDirectory() as d, mock.patch.object(workdir, "_load", recording_load):
            make_workdir(os.path.join(d, "one"), shared=(128, 64))
            workdir.load_work(os.path.join(d, "one"))
            # A group rank's directory, as peer_dist.py reads it (its own routing and reference slots).
            make_workdir(os.path.join(d, "single"), ep_size=1, ep_mode="all", num_experts=4, top_k=2, shared=(64,))
            rank_dir_from_single(os.path.join(d, "single"), os.path.join(d, "rank0"))
            workdir.load_rank_work(os.path.join(d, "rank0"))
        self.assertIn("top_experts.npy", opened)  # (the rank's reader ran)
        self.assertIn(workdir.MOK_JSON, names)
        self.assertIn(workdir.PEER_JSON, names)
        for name in opened:
            m = re.fullmatch(re.escape(shared_prefix) + r"\d+_(.+)", name)
            self.assertIn(m.group(1) if m else name, names, f"{name}: read by bench/workdir.py, not written by mok bench")
        # ... and every peer input mok bench writes is read, by peer_torch.py or peer_dist.py
        # (both through workdir.py; the two json files are records, not inputs).
        unread = names - set(opened) - {workdir.MOK_JSON, workdir.PEER_JSON}
        self.assertEqual(unread, set(), "written by mok bench, read by no peer")


class Contract(unittest.TestCase):
    def _check(self, **kw):
        with tempfile.TemporaryDirectory() as d:
            doc = make_workdir(d, **kw)
            doc2, a = workdir.load_work(d)
            self.assertEqual(doc, doc2)
            R, T, H, I, k, El, widths = workdir.problem_dims(doc["problem"])
            N = doc["rows"]["real"]
            self.assertEqual(a["rows_ref"].shape, (N, H))
            self.assertEqual(a["x_all"].dtype, np.uint16)
            self.assertEqual(a["row_source"].dtype, np.int64)
            self.assertEqual(a["row_expert"].dtype, np.int32)
            self.assertEqual(len(a["shared"]), len(widths))
            # Every routed row of the active rank is there once: sum over ranks of rows = R*T*k.
            tol = checks.tolerance(doc["problem"]["precision"])
            out, y = numpy_pipeline(doc, a)
            st_rows = checks.compare(out, f32(a["rows_ref"]), np)
            st_y = checks.compare(y, f32(a["y_ref"]), np)
            self.assertTrue(checks.passes(st_rows, tol), st_rows)
            self.assertTrue(checks.passes(st_y, tol), st_y)
            # The slots the peer fills are NaN in the file: a pipeline that left them fails y.
            self.assertTrue(np.isnan(f32(a["combine_local"])[a["row_slot"][a["row_slot"] >= 0]]).all())
            # ... and a wrong permutation fails the check (so the check is not vacuous).
            if N > 1:
                st_bad = checks.compare(np.roll(out, 1, axis=0), f32(a["rows_ref"]), np)
                self.assertFalse(checks.passes(st_bad, tol))
            return doc

    def test_slice_with_shared(self):
        doc = self._check()
        self.assertGreater(doc["rows"]["remote"], 0)

    def test_single_rank_no_shared(self):
        doc = self._check(ep_size=1, ep_mode="all", shared=(), num_experts=4, top_k=2)
        self.assertEqual(doc["rows"]["remote"], 0)
        self.assertEqual(doc["rows"]["real"], 64 * 2)

    def test_two_shared_clamped(self):
        self._check(shared=(128, 64), swiglu_limit=0.5, active_rank=1)

    def test_contract_errors(self):
        with tempfile.TemporaryDirectory() as d:
            make_workdir(d)
            # wrong dtype
            np.save(os.path.join(d, "row_weight.npy"), np.zeros(3, np.int16))
            with self.assertRaisesRegex(workdir.ContractError, "row_weight.npy: dtype"):
                workdir.load_work(d)
        with tempfile.TemporaryDirectory() as d:
            make_workdir(d)
            w = np.load(os.path.join(d, "w_down.npy"))
            np.save(os.path.join(d, "w_down.npy"), w[:, :, :-1])
            with self.assertRaisesRegex(workdir.ContractError, "w_down.npy: shape"):
                workdir.load_work(d)
        with tempfile.TemporaryDirectory() as d:
            make_workdir(d)
            os.remove(os.path.join(d, "shared0_w_up.npy"))
            with self.assertRaisesRegex(workdir.ContractError, "shared0_w_up.npy: missing"):
                workdir.load_work(d)
        with tempfile.TemporaryDirectory() as d:
            make_workdir(d)
            re_ = np.load(os.path.join(d, "row_expert.npy"))
            re_[0] = 99
            np.save(os.path.join(d, "row_expert.npy"), re_)
            with self.assertRaisesRegex(workdir.ContractError, "row_expert.npy: values"):
                workdir.load_work(d)
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaisesRegex(workdir.ContractError, "mok.json: missing"):
                workdir.load_work(d)

    def test_a_record_without_peer_inputs_is_refused(self):
        # mok bench --no-peer-inputs writes "peer_inputs": false; a peer must refuse the DIR
        # by that (even were stale inputs there), while a record without the key (older ones)
        # or with true loads as before.
        for value, refused in ((False, True), (True, False), (None, False)):
            with tempfile.TemporaryDirectory() as d:
                make_workdir(d)
                path = os.path.join(d, "mok.json")
                doc = workdir.read_json(path)
                if value is None:
                    doc.pop("peer_inputs", None)
                else:
                    doc["peer_inputs"] = value
                with open(path, "w") as f:
                    json.dump(doc, f)
                if refused:
                    with self.assertRaisesRegex(workdir.ContractError, "written by mok bench --no-peer-inputs"):
                        workdir.load_work(d)
                else:
                    workdir.load_work(d)

    def test_backward_input_optional(self):
        with tempfile.TemporaryDirectory() as d:
            make_workdir(d)
            os.remove(os.path.join(d, "dy_local.npy"))
            _, a = workdir.load_work(d, need_backward=False)
            self.assertNotIn("dy_local", a)
            with self.assertRaises(workdir.ContractError):
                workdir.load_work(d, need_backward=True)


class PeerJson(unittest.TestCase):
    def test_peer_json_is_written_whole_or_not_at_all(self):
        with tempfile.TemporaryDirectory() as d:
            path = workdir.write_peer_json(d, {"check": {"passes": True}, "forward": {"median_ms": 1.0}})
            self.assertEqual(path, os.path.join(d, workdir.PEER_JSON))
            with open(path) as f:
                before = f.read()
            self.assertEqual(json.loads(before)["forward"], {"median_ms": 1.0})
            # A value JSON cannot hold (the dump fails half-way) and a failing rename: the earlier
            # peer.json stays whole, and no temporary file is left beside it.
            with self.assertRaises(TypeError):
                workdir.write_peer_json(d, {"check": {"passes": False}, "forward": {"median_ms": object()}})
            with mock.patch.object(workdir.os, "replace", side_effect=OSError(28, "No space left on device")):
                with self.assertRaises(OSError):
                    workdir.write_peer_json(d, {"check": {"passes": False}})
            with open(path) as f:
                self.assertEqual(f.read(), before)
            self.assertEqual(os.listdir(d), [workdir.PEER_JSON])
            # Written through a temporary file renamed over peer.json (never opened in place).
            real_replace, renamed = os.replace, []
            def replace(src, dst):
                renamed.append((os.path.dirname(src), dst))
                return real_replace(src, dst)
            with mock.patch.object(workdir.os, "replace", side_effect=replace):
                workdir.write_peer_json(d, {"check": {"passes": True}})
            self.assertEqual(renamed, [(d, path)])
            self.assertEqual(os.listdir(d), [workdir.PEER_JSON])


if __name__ == "__main__":
    unittest.main()
