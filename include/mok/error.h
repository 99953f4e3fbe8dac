// mok: errors. Every validation failure throws mok::Error whose message names the
// argument and the rule it broke, e.g. "top_experts[rank 1][token 5, slot 2] = 9: expert id must be in [0, 8)".
#pragma once
#include <stdexcept>
#include <string>

namespace mok {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A process of a distributed EP group stopped waiting for its peers: one died or hangs, or
// NCCL reported an error. The `mok` tool exits with status 4 for it, so that `mok launch`
// can tell a rank that gave up on its peers from the rank that failed (kPeerWaitExitStatus).
class PeerWaitError : public Error {
 public:
  using Error::Error;
};
inline constexpr int kPeerWaitExitStatus = 4;

// Throws mok::Error(message) unless cond holds. Used for argument validation, never for
// internal invariants (those are asserts).
inline void require(bool cond, const std::string& message) {
  if (!cond) throw Error(message);
}

}  // namespace mok
