// mok bench's work directory: what it and the peers (bench/peer_torch.py, peer_dist.py)
// write there, and how an earlier run's files are kept from being read as this run's.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

namespace mok::cli {

// The files of a work directory (bench/README.md's contract with the peers), named in one
// place: mok bench writes each through bench_file_name() and the numbered helpers below, and
// is_bench_output() recognises exactly these, so a file added to the bench is cleared too.
enum class BenchFile : int {
  kMokJson,         // mok bench's record
  kPeerJson,        // a peer's record (bench/peer_torch.py, peer_dist.py)
  kXAll,            // the peer inputs (bench/README.md) ...
  kRowSource,
  kRowExpert,
  kRowWeight,
  kRowSlot,
  kCombineLocal,
  kRowsRef,
  kDyLocal,
  kTopExperts,      // ... a group rank's own routing
  kWGate,
  kWUp,
  kWDown,
  kXLocal,
  kRouterWeights,
  kYRef,
  kSlotsRef,        // a group rank's reference rows in its combine slots ([T*k, H]), for peer_dist's check
  kCount
};
// A switch: a file added without a name is a -Wswitch warning.
constexpr const char* bench_file_name(BenchFile f) {
  switch (f) {
    case BenchFile::kMokJson: return "mok.json";
    case BenchFile::kPeerJson: return "peer.json";
    case BenchFile::kXAll: return "x_all.npy";
    case BenchFile::kRowSource: return "row_source.npy";
    case BenchFile::kRowExpert: return "row_expert.npy";
    case BenchFile::kRowWeight: return "row_weight.npy";
    case BenchFile::kRowSlot: return "row_slot.npy";
    case BenchFile::kCombineLocal: return "combine_local.npy";
    case BenchFile::kRowsRef: return "rows_ref.npy";
    case BenchFile::kDyLocal: return "dy_local.npy";
    case BenchFile::kTopExperts: return "top_experts.npy";
    case BenchFile::kWGate: return "w_gate.npy";
    case BenchFile::kWUp: return "w_up.npy";
    case BenchFile::kWDown: return "w_down.npy";
    case BenchFile::kXLocal: return "x_local.npy";
    case BenchFile::kRouterWeights: return "router_weights.npy";
    case BenchFile::kYRef: return "y_ref.npy";
    case BenchFile::kSlotsRef: return "slots_ref.npy";
    case BenchFile::kCount: break;
  }
  return "";
}
// Shared expert s's weight `which` (kWGate, kWUp or kWDown): shared<s>_w_gate.npy, ...
std::string shared_weight_file(int s, BenchFile which);
// A group's reference-row exchange: the rows (and their slots) rank r needs from this rank.
std::string rows_for_file(int r);
std::string slots_for_file(int r);

// True for a file name above, or its ".tmp" form (written, then renamed).
bool is_bench_output(const std::string& file_name);

// Removes every bench output (above) directly inside `dir`; other files and directories are
// left alone. Returns the names removed. Throws mok::Error naming a file it cannot remove.
// Why: a reused --work-dir must not hand an earlier run's mok.json, peer inputs or exchange
// files to this run's readers. In a group each rank clears its own rank<r>/ before the group
// forms and reads the others' only after, so every file it reads was written by this run.
std::vector<std::string> clear_bench_outputs(const std::filesystem::path& dir);

// The directory an option names (mok run's --save, mok bench's --work-dir), made if missing.
// A file of that name, or a directory that cannot be made, is a mok::Error naming the option.
void make_option_directory(const std::filesystem::path& dir, const std::string& option);

}  // namespace mok::cli
