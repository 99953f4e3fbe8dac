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

// Skips the calling test (with a line saying why) when no CUDA GPU is present.
#define MOK_REQUIRE_GPU()                                                        \
  do {                                                                           \
    if (!::mok::cuda_available()) GTEST_SKIP() << "no CUDA GPU: GPU test skipped"; \
  } while (0)

struct GpuRun {
  LayerData data;                                // y filled from the GPU
  std::vector<std::vector<ScheduleRow>> schedules;
  std::vector<ScheduleStats> stats;  // of the last forward, per rank
};


// Runs the CUDA forward `repeats` times (all ranks here) and returns the last result.
GpuRun run_gpu_all_ranks(const LayerData& host, const Config& config = {}, int repeats = 1);

// CPU reference forward of all ranks.
LayerData run_reference(const LayerData& host, const Config& config = {});

// Concatenates every rank's y in rank order (the global batch's output).
std::vector<std::uint16_t> global_y(const LayerData& data);

void expect_close(const LayerData& gpu, const LayerData& ref, Precision precision, const std::string& what);

// Two global outputs (global_y) are the same size and bit for bit equal; `what` names the pair.
void expect_same_bits(const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& want,
                      const std::string& what);

}  // namespace mok::test
