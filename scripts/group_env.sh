# Sourced by the device scripts that start NCCL groups (device_check.sh, device_multi.sh).
# Multicast off in every process (KINDS.md: it can take the host's GPUs out of service);
# PyTorch's NCCL directory first in the loader's search, since mok needs the release its
# headers came from (comm/ep_group.h: nccl_library()) and the image's system NCCL is older;
# group_gpus: the GPUs this process may use (CUDA_VISIBLE_DEVICES included).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
torch_nccl_dir=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$torch_nccl_dir" ] && [ -d "$torch_nccl_dir" ] && export LD_LIBRARY_PATH="$torch_nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Counted by the driver (nvidia-smi), not by torch: a CPU-only torch, or one whose CUDA failed
# to start, says 0 and exits 0, and the multi-GPU checks then passed having run nothing.
# CUDA_VISIBLE_DEVICES, when set, limits them to its entries (as it does for every process).
if command -v nvidia-smi > /dev/null; then
  group_gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
else  # (no driver tool: torch's count, or 0)
  group_gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
fi
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  visible=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c '[^[:space:]]' || true)
  [ "$visible" -lt "$group_gpus" ] && group_gpus=$visible
fi
