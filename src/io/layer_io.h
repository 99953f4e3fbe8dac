// mok: saving and loading a whole layer's tensors as .npy files, so any outside tool can
// feed mok and check it.
//
// DIR/problem.json      the problem (written by save, read by load)
// DIR/rank<r>/<name>.npy  one file per tensor of rank r: x, top_experts, router_weights,
//   w_gate, w_up, w_down, shared<s>_w_gate, shared<s>_w_up, shared<s>_w_down, y, dy, dx,
//   d_router_weights, d_w_gate, d_w_up, d_w_down, shared<s>_d_w_gate, ...
// bf16 tensors are '<u2' bit patterns (see io/npy.h). Missing tensors are not written.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "mok/data.h"

namespace mok::io {

std::string problem_to_json(const Problem& problem);
// Throws mok::Error naming the file and the key when malformed.
Problem problem_from_json(const std::string& text, const std::string& source);
// A mok::Error starting with `context` unless `dir` is a directory (none there, or a file).
void require_directory(const std::string& dir, const std::string& context);
// DIR/problem.json's problem, or nothing when there is none; an unreadable or malformed one is
// a mok::Error starting with `context`.
std::optional<Problem> read_problem_json(const std::string& dir, const std::string& context);

// Writes problem.json and every rank's non-empty tensors under `dir` (created if missing). A
// save that fails part way removes the files it had written and the directories it had made
// (nothing else) before its error propagates.
void save_layer_data(const std::string& dir, const LayerData& data);

// Loads DIR/problem.json and every input tensor (x, top_experts, router_weights, weights,
// dy when present); outputs are allocated and poisoned. Each file's shape and dtype are
// checked against the problem; routing is validated. Before any tensor is read, the host
// memory the data takes plus `extra_host_bytes(problem)` (what the caller will hold beside it:
// the CPU reference's slots and work, say) is checked against what the host has. Every
// mok::Error it throws starts with "--load DIR".
LayerData load_layer_data(const std::string& dir, bool with_backward,
                          const std::function<std::uint64_t(const Problem&)>& extra_host_bytes = {});

}  // namespace mok::io
