// mok: what went wrong on the device, as the kernels record it and the host describes it.
// Host-only types (no CUDA): the descriptions are tested on the CPU.
#pragma once
#include <optional>
#include <span>
#include <string>

namespace mok::cuda {

// What went wrong on the device. The first failure wins (atomicCAS on `code`); every role
// watches `abort` and leaves its loop, so the kernel ends and the host can read this.
enum DeviceErrorCode : int {
  kOk = 0,
  kExpertOutOfRange = 1,     // index = rank*T*k + slot, value = the id
  kDuplicateExpert = 2,      // index = rank*T*k + slot, value = the id
  kNonFiniteWeight = 3,      // index = rank*T*k + slot
  kCapacityExceeded = 4,     // rank, value = padded rows needed, index = capacity
  kWaitTimeout = 5,          // rank, where = which wait, index = the item waited for, value = seen
  kScheduleMismatch = 6,     // rank, index = local expert, value = its rows by the chunk counts (a bug, not bad input)
  kGroupAbandoned = 7,       // rank: its EP group was being aborted when the schedule ran (no routed work was done)
  // In the gathered table only: no status came from that rank. Each group barrier's
  // all-gather is preceded by filling the table with 0xFF bytes and overwrites every entry,
  // so an entry still so after it means the barrier was aborted before that rank's status
  // arrived (a dead or stuck peer), and the epilogue poisons y rather than sum the slots
  // that rank never filled.
  kNoGroupStatus = -1,
};

enum WaitSite : int {
  kWaitRowsReady = 1,   // a GEMM waited for its rows to be pulled
  kWaitActReady = 2,    // a down GEMM waited for its SwiGLU rows
  kWaitRingFree = 3,    // a pull waited for a ring slot to be released (index: the tile to pull)
  kWaitSharedActReady = 4,  // a shared expert's down GEMM waited for its SwiGLU rows (index: token tile)
};

struct DeviceError {
  int code;
  int rank;
  int where;
  int pad;
  long long index;
  long long value;
  int abort;  // set once any failure is recorded
  int pad2;
  // The first bad routing entry, as the CPU's validation would name it: the count kernel's
  // checks run in any order, so each keeps the least key (stream position g << 2 | code - 1:
  // at one position out of range, then repeated, then the weight) stored inverted by
  // atomicMax (0: none), and the offsets kernel records that one as the error (code, rank,
  // index, value), ahead of a capacity overflow, as the CPU checks the ids before the
  // schedule.
  unsigned long long first_bad_routing_inverted;
};

// The error as one sentence naming the argument, rank, token and slot (or the wait) involved.
std::string describe_device_error(const DeviceError& e, int tokens_per_rank, int top_k);

// Bad routing (an id out of range, a repeated id, a non-finite weight): a cause, named first
// when several ranks recorded errors in one forward (a rank's repeated ids can push another
// rank past its capacity, which only checks the rank's own ids).
bool is_routing_error(int code);

// A real group's barrier gathers every rank's DeviceError (entry r: rank r's). The first rank
// other than `self_rank` that recorded bad routing, else the first that recorded any error,
// described, with how many others did; nothing when no other rank did (this rank's own error
// is reported as its own).
std::optional<std::string> describe_peer_errors(std::span<const DeviceError> gathered, int self_rank,
                                                int tokens_per_rank, int top_k);

// What synchronize() says for this rank's own error `own` (code != kOk) with the peers'
// errors of the same forward (`gathered` empty outside a group): the own error, then the
// peers'; but a capacity overflow here after a peer's bad routing names the peer's first,
// since it may be the cause.
std::string describe_forward_errors(const DeviceError& own, std::span<const DeviceError> gathered, int self_rank,
                                    int tokens_per_rank, int top_k);

}  // namespace mok::cuda
