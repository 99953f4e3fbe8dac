// GPU test helpers: run the CUDA backend and the CPU reference on the same data.
#pragma once
#include <gtest/gtest.h>

#include <vector>

#include "core/compare.h"
#include "core/device_mirror.h"
#include "core/schedule.h"
#include "mok/mok.h"
#include "test_util.h"  // make_problem and the other CPU-test building blocks

namespace mok::test {

// Skips the calling test (with a line saying why) when no GPU the build runs on (Hopper) is
// present.
#define MOK_REQUIRE_GPU()                                                                      \
  do {                                                                                         \
    if (!::mok::cuda_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU: GPU test skipped"; \
  } while (0)

// The seed of this process's random inputs (data and routing): MOK_TEST_SEED when set, to
// rerun a failure's inputs, else drawn fresh for every run, so that the checks meet new
// inputs each time. Printed when the tests start and after every failed test.
std::uint64_t test_seed();

// The tests' LayerOptions for the cuda backend: EP mode `mode` (rank_slice: with `active_rank`
// the rank that does its work), GPU 0, its legacy default stream. A test that needs more (its
// own stream, another GPU) sets those fields on the result.
LayerOptions cuda_layer_options(EpMode mode = EpMode::all_ranks, int active_rank = 0);

struct GpuRun {
  LayerData data;                                // y filled from the GPU
  std::vector<std::vector<ScheduleRow>> schedules;
  std::vector<ScheduleStats> stats;  // of the last forward, per rank
};


// Runs the CUDA forward `repeats` times (all ranks here; every call but the last back to back,
// then y poisoned again) and returns the last call's result.
GpuRun run_gpu_all_ranks(const LayerData& host, const Config& config = {}, int repeats = 1);

// CPU reference forward of all ranks.
LayerData run_reference(const LayerData& host, const Config& config = {});

// Concatenates every rank's y in rank order (the global batch's output).
std::vector<std::uint16_t> global_y(const LayerData& data);

// Every rank's y within MoK's bar of the reference's (both with the same ranks, none empty).
void expect_close(const LayerData& gpu, const LayerData& ref, Precision precision, const std::string& what);

// Two global outputs (global_y) are the same size and bit for bit equal; `what` names the pair.
// `want` must hold no poison (0xffff, an output's bits before any forward wrote it): two
// unwritten outputs would otherwise compare equal.
void expect_same_bits(const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& want,
                      const std::string& what);

// Zeroes every rank's y on the device (DeviceMirror poisons outputs with NaN when it is made):
// then a y that is all NaN after a failed forward shows that the forward poisoned it.
void zero_y(const DeviceMirror& mirror);

// How many elements of the bf16 tensor `t` are not NaN.
std::int64_t elements_not_nan(const HostTensor& t);

// Every element of every rank's y in `data` is NaN.
void expect_all_y_nan(const LayerData& data, const std::string& what);

// One CUDA forward of `host` on `layer` (its y zeroed on the device first) that synchronize()
// must refuse with a mok::Error holding every string of `want`; the y it leaves, copied back
// into `host`, must be all NaN (the device error poisoned it, nothing was half written).
void expect_refused_and_y_poisoned(Layer& layer, LayerData& host, const std::vector<std::string>& want,
                                   const std::string& what);

}  // namespace mok::test
