// mok: built without CUDA (no nvcc found): the cuda backend reports that clearly.
#include "core/backend.h"

namespace mok {

std::unique_ptr<BackendImpl> make_cuda_backend(const Problem&, const Config&, const LayerOptions&) {
  throw Error("backend = cuda: this build of mok has no CUDA backend (nvcc was not found at configure time)");
}
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
std::vector<std::pair<const void*, std::string>> cuda_forward_kernels() { return {}; }
std::string cuda_device_name() { return "none"; }

}  // namespace mok

#include "core/device_mirror.h"

namespace mok {
struct DeviceMirror::Impl {};
DeviceMirror::DeviceMirror(const LayerData&, int, int) {
  throw Error("DeviceMirror: this build of mok has no CUDA backend");
}
DeviceMirror::~DeviceMirror() = default;
std::vector<RankForward> DeviceMirror::forward_args() const { return {}; }
std::vector<RankBackward> DeviceMirror::backward_args() const { return {}; }
void DeviceMirror::poison_outputs() {}
void DeviceMirror::copy_outputs_to(LayerData&) const {}
std::size_t DeviceMirror::bytes() const { return 0; }
}  // namespace mok

#include "core/device_timer.h"

namespace mok {
std::vector<double> device_times_ms(void*, int, int, const DeviceTimerCalls&) {
  throw Error("device_times_ms: this build of mok has no CUDA backend");
}
}  // namespace mok
