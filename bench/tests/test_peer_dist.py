"""The distributed peer's exchange plan (bench/peer_dist.py), on the CPU with numpy: R ranks
simulated in one process, all-to-all by concatenation, experts as per-(rank, expert) scales,
so every slot's expected row is known exactly."""
import os
import sys
import unittest

import numpy as np

import helpers  # noqa: F401  (sets sys.path)

import peer_dist
import synth_workdir


def random_top(rng, T, k, E):
    return np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int64)


class ExchangePlan(unittest.TestCase):
    def run_group(self, R, T, k, E_loc, H, seed):
        rng = np.random.default_rng(seed)
        E = R * E_loc
        xs = [rng.standard_normal((T, H)) for _ in range(R)]
        tops = [random_top(rng, T, k, E) for _ in range(R)]
        scale = rng.uniform(1, 2, size=(R, E_loc))
        plans = [peer_dist.send_plan(t.reshape(-1), k, E_loc, R, np) for t in tops]
        counts = [p[3] for p in plans]
        x_recv = peer_dist.simulate_exchange([xs[r][plans[r][1]] for r in range(R)], counts)
        e_recv = peer_dist.simulate_exchange([plans[r][2] for r in range(R)], counts)
        outs = [x_recv[d] * scale[d][e_recv[d]][:, None] for d in range(R)]
        # Back: rank d returns to s exactly the rows s sent it (counts transposed).
        back_counts = [np.array([counts[s][d] for s in range(R)]) for d in range(R)]
        backs = peer_dist.simulate_exchange(outs, back_counts)
        for r in range(R):
            slots = peer_dist.unpermute_slots(backs[r], plans[r][0], np)
            self.assertEqual(slots.shape, (T * k, H))
            for t in range(T):
                for j in range(k):
                    e = tops[r][t, j]
                    np.testing.assert_array_equal(slots[t * k + j], xs[r][t] * scale[e // E_loc][e % E_loc])

    def test_groups(self):
        for R, T, k, E_loc, seed in ((2, 7, 2, 3, 1), (3, 16, 4, 2, 2), (4, 9, 1, 5, 3), (4, 12, 8, 2, 4)):
            with self.subTest(R=R, T=T, k=k):
                self.run_group(R, T, k, E_loc, 5, seed)

    def test_send_order_keeps_token_order_within_a_destination(self):
        top = np.array([[3, 0], [1, 2], [0, 3]])  # E_loc = 2, R = 2
        order, src, experts, counts = peer_dist.send_plan(top.reshape(-1), 2, 2, 2, np)
        self.assertEqual(counts.tolist(), [3, 3])
        self.assertEqual(order.tolist(), [1, 2, 4, 0, 3, 5])
        self.assertEqual(src.tolist(), [0, 1, 2, 0, 1, 2])
        self.assertEqual(experts.tolist(), [0, 1, 0, 1, 0, 1])


class Group(unittest.TestCase):
    def test_environment(self):
        self.assertEqual(peer_dist.group_env({"MOK_RANK": "1", "MOK_WORLD_SIZE": "4", "MOK_LOCAL_RANK": "1",
                                              "MOK_LAUNCH_DIR": "/tmp/x"}), (1, 4, 1, "/tmp/x"))
        self.assertEqual(peer_dist.group_env({"RANK": "2", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}), (2, 8, 0, None))
        with self.assertRaises(RuntimeError):
            peer_dist.group_env({})


class MulticastOff(unittest.TestCase):
    def test_inherited_settings_are_overwritten(self):
        env = {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "OTHER": "x"}
        peer_dist.multicast_off(env)
        self.assertEqual(env, {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "OTHER": "x"})


try:
    import torch
except ImportError:
    torch = None


class RankWorkInputs(unittest.TestCase):
    """A group rank's inputs are held to the problem's dtypes and shapes before the peer uses them."""

    def setUp(self):
        import tempfile
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from synth_workdir import make_workdir
        self.tmp = tempfile.TemporaryDirectory()
        single, self.rank0 = os.path.join(self.tmp.name, "single"), os.path.join(self.tmp.name, "rank0")
        make_workdir(single, ep_size=1, ep_mode="all", num_experts=4, top_k=2, shared=(64,))
        synth_workdir.rank_dir_from_single(single, self.rank0)

    def tearDown(self):
        self.tmp.cleanup()

    def test_good_inputs_load(self):
        import workdir
        doc, a = workdir.load_rank_work(self.rank0)
        self.assertEqual(a["top_experts"].shape, (64, 2))
        self.assertEqual(a["slots_ref"].shape, (128, 256))
        self.assertEqual(len(a["shared"]), 1)

    def test_each_wrong_input_is_named(self):
        import workdir
        x = np.load(os.path.join(self.rank0, "x_local.npy"))
        top = np.load(os.path.join(self.rank0, "top_experts.npy"))
        for name, arr, words in (("x_local.npy", x[:-1], "shape (63, 256), expected (64, 256)"),
                                 ("slots_ref.npy", np.zeros((3, 3), np.float64), "dtype '<f8'"),
                                 ("top_experts.npy", np.full_like(top, 4), "values must lie in [0, 4)")):
            keep = os.path.join(self.rank0, name)
            saved = np.load(keep)
            np.save(keep, arr)
            try:
                with self.assertRaises(workdir.ContractError) as ctx:
                    workdir.load_rank_work(self.rank0)
                self.assertIn(name, str(ctx.exception))
                self.assertIn(words, str(ctx.exception))
            finally:
                np.save(keep, saved)
        os.remove(os.path.join(self.rank0, "y_ref.npy"))
        with self.assertRaisesRegex(workdir.ContractError, "y_ref.npy: missing"):
            workdir.load_rank_work(self.rank0)


@unittest.skipIf(torch is None or not hasattr(torch, "_grouped_mm"),
                 "PyTorch (with torch._grouped_mm) is not installed: peer_dist CPU test skipped")
class RankWorkOnCpu(unittest.TestCase):
    """RankWork's whole forward as one process of a gloo group on the CPU: its y and its combine
    slots pass against the references, and slots that lost a row fail."""

    def test_a_group_of_one_passes_and_its_slots_are_checked(self):
        import tempfile
        import torch.distributed as dist
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import checks
        from synth_workdir import make_workdir
        with tempfile.TemporaryDirectory() as d:
            single, rank0 = os.path.join(d, "single"), os.path.join(d, "rank0")
            make_workdir(single, ep_size=1, ep_mode="all", num_experts=4, top_k=2, shared=(64,))
            synth_workdir.rank_dir_from_single(single, rank0)
            dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "rdv"), rank=0, world_size=1)
            try:
                work = peer_dist.RankWork(rank0, torch.device("cpu"))
                tol = checks.tolerance("bf16")
                y = work.forward()
                self.assertTrue(checks.passes(checks.compare(y.float(), work.y_ref.float(), torch), tol))
                self.assertTrue(checks.passes(checks.compare(work.slots.float(), work.slots_ref.float(), torch), tol))
                work.slots[3] = 0  # one slot's row lost
                self.assertFalse(checks.passes(checks.compare(work.slots.float(), work.slots_ref.float(), torch), tol))
            finally:
                dist.destroy_process_group()


if __name__ == "__main__":
    unittest.main()
