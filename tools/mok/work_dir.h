// mok bench's work directory: what it and the peers (bench/peer_torch.py, peer_dist.py)
// write there, and how an earlier run's files are kept from being read as this run's.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

namespace mok::cli {

// True for a file name mok bench or a peer writes into a work directory (or rank<r>/
// subdirectory), its ".tmp" form included: mok.json, peer.json, the peer inputs (*.npy of
// bench/README.md's contract) and a group's reference-row exchange (rows_for<r>.npy,
// slots_for<r>.npy).
bool is_bench_output(const std::string& file_name);

// Removes every bench output (above) directly inside `dir`; other files and directories are
// left alone. Returns the names removed. Throws mok::Error naming a file it cannot remove.
// Why: a reused --work-dir must not hand an earlier run's mok.json, peer inputs or exchange
// files to this run's readers. In a group each rank clears its own rank<r>/ before the group
// forms and reads the others' only after, so every file it reads was written by this run.
std::vector<std::string> clear_bench_outputs(const std::filesystem::path& dir);

}  // namespace mok::cli
