#include "cuda/device_error.h"

#include <sstream>

namespace mok::cuda {

std::string describe_device_error(const DeviceError& e, int T, int k) {
  std::ostringstream s;
  const long long slot = e.index % (static_cast<long long>(T) * k);
  const long long t = slot / k, j = slot % k;
  const int rank = static_cast<int>(e.index / (static_cast<long long>(T) * k));
  switch (e.code) {
    case kExpertOutOfRange:
      s << "top_experts[rank " << rank << "][token " << t << ", slot " << j << "] = " << e.value
        << ": expert id must be in [0, num_experts)";
      break;
    case kDuplicateExpert:
      s << "top_experts[rank " << rank << "][token " << t << "]: expert " << e.value << " appears twice (slot " << j
        << "); a token's experts must be distinct";
      break;
    case kNonFiniteWeight:
      s << "router_weights[rank " << rank << "][token " << t << ", slot " << j << "]: must be finite";
      break;
    case kCapacityExceeded:
      s << "schedule: rank " << e.rank << " receives " << e.value << " padded rows, more than its capacity of "
        << e.index << "; raise Config::schedule_capacity_factor (1.0 covers every valid routing). No token was dropped: "
        << "the forward's output was poisoned with NaN";
      break;
    case kWaitTimeout: {
      s << "device wait timed out on rank " << e.rank << ": ";
      switch (e.where) {
        case kWaitRowsReady:
          s << "a GEMM waiting for its pulled rows, row tile " << e.index;
          break;
        case kWaitActReady:
          s << "a down GEMM waiting for its SwiGLU rows, row tile " << e.index;
          break;
        case kWaitSharedActReady:
          s << "a shared expert's down GEMM waiting for its SwiGLU rows, token tile " << e.index;
          break;
        case kWaitRingFree:
          // (The counter is that of the tile whose ring slot this one reuses, a ring earlier.)
          s << "the pull of row tile " << e.index << " waiting for its ring slot, which the down GEMMs of the "
            << "row tile a ring earlier free";
          break;
        default:
          s << "wait site " << e.where << ", item " << e.index;
      }
      s << " (counter stuck at " << e.value << ")";
      break;
    }
    case kScheduleMismatch:
      s << "internal error in the GPU schedule: rank " << e.rank << "'s local expert " << e.index << " has "
        << e.value << " rows by its chunk counts but a different total (were the schedule counters zeroed before "
        << "the count kernel?); the forward's output was poisoned with NaN";
      break;
    case kGroupAbandoned:
      s << "rank " << e.rank << "'s EP group was being aborted when this forward's schedule ran (an earlier error "
        << "or abandon_group): the forward touched no peer memory, did no routed work, and its output was poisoned "
        << "with NaN";
      break;
    case kNoGroupStatus:
      s << "the group's barrier was aborted before its status arrived (its rows for this rank's tokens may be "
        << "missing), and the output was poisoned with NaN";
      break;
    default:
      s << "device error code " << e.code;
  }
  return s.str();
}

bool is_routing_error(int code) {
  return code == kExpertOutOfRange || code == kDuplicateExpert || code == kNonFiniteWeight;
}

namespace {

// The peers' errors of one forward, described (describe_peer_errors's text), and whether the
// one named is bad routing.
struct PeerErrors {
  std::string text;
  bool bad_routing;
};

std::optional<PeerErrors> peer_errors(std::span<const DeviceError> gathered, int self_rank, int T, int k) {
  int first = -1, first_routing = -1, failed = 0;
  for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
    if (r == self_rank || gathered[r].code == kOk) continue;
    ++failed;
    if (first < 0) first = r;
    if (first_routing < 0 && is_routing_error(gathered[r].code)) first_routing = r;
  }
  if (first < 0) return std::nullopt;
  if (first_routing >= 0) first = first_routing;
  const int others = failed - 1;
  std::string s = "rank " + std::to_string(first) + " of the EP group " +
                  (gathered[first].code == kNoGroupStatus ? "sent no status: " : "recorded a device error: ") +
                  describe_device_error(gathered[first], T, k);
  if (others > 0) s += " (and " + std::to_string(others) + " other rank" + (others > 1 ? "s" : "") + " recorded one too)";
  return PeerErrors{std::move(s), first_routing >= 0};
}

}  // namespace

std::optional<std::string> describe_peer_errors(std::span<const DeviceError> gathered, int self_rank, int T, int k) {
  if (auto peers = peer_errors(gathered, self_rank, T, k)) return std::move(peers->text);
  return std::nullopt;
}

std::string describe_forward_errors(const DeviceError& own, std::span<const DeviceError> gathered, int self_rank,
                                    int T, int k) {
  const std::string mine = describe_device_error(own, T, k);
  const std::optional<PeerErrors> peers = peer_errors(gathered, self_rank, T, k);
  if (!peers) return mine;
  if (own.code == kCapacityExceeded && peers->bad_routing)
    return peers->text + "; in the same forward, and possibly because of it (this rank's capacity check counts the "
                         "rows its peers' ids send it): " + mine;
  return mine + "; in the same forward, " + peers->text;
}

}  // namespace mok::cuda
