// The CUDA half of StreamRuntime. Side streams come from a process-wide pool per device
// and live as long as the process; events are c10::Events, created once per plan with
// PyTorch's default flags (timing disabled). Everything goes through c10::cuda, so that
// PyTorch sees the stream we make current (kernels launched from Python inside a task go
// to it), every event call runs on its stream's device, and the CUDA sanitizer
// (TORCH_CUDA_SANITIZER=1) sees our records and waits.
//
// Only c10 headers: ATen/cuda/CUDAContext.h would pull in cuBLAS and cuSPARSE headers,
// which a CUDA toolkit without those libraries lacks.
#include <cuda_runtime_api.h>

#include "../runtime.h"

#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <mutex>
#include <vector>

namespace streamsched {

namespace {

// Side stream k (1-based) of a device: created on first use, never destroyed. A plan's
// runtime can be dropped (plan-cache eviction, a new trace) while tensors are still
// recorded on its streams (record_stream); the caching allocator records events on those
// streams when such a tensor is freed, so the streams must outlive every plan. They are
// our own non-blocking streams, not PyTorch's pool, so other libraries cannot queue work
// on them; plans share them (calls into one module are serialised, and sharing between
// modules adds ordering, never removes it).
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device, int64_t k) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, std::vector<cudaStream_t>> pool;
  std::lock_guard<std::mutex> lock(mutex);
  auto& streams = pool[device];
  if (streams.size() < static_cast<size_t>(k)) {
    c10::cuda::CUDAGuard guard(device);
    while (streams.size() < static_cast<size_t>(k)) {
      cudaStream_t raw = nullptr;
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
      streams.push_back(raw);
    }
  }
  return c10::cuda::getStreamFromExternal(streams[static_cast<size_t>(k - 1)], device);
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int64_t device, int64_t num_streams, int64_t num_events)
      : device_(static_cast<c10::DeviceIndex>(device)), caller_(c10::cuda::getDefaultCUDAStream(device_)) {
    for (int64_t s = 1; s < num_streams; ++s) side_.push_back(side_stream(device_, s));
    events_.reserve(static_cast<size_t>(num_events));
    for (int64_t e = 0; e < num_events; ++e) events_.emplace_back(c10::DeviceType::CUDA);
    join_events_.reserve(side_.size());
    for (size_t s = 0; s < side_.size(); ++s) join_events_.emplace_back(c10::DeviceType::CUDA);
  }

  void fork(const std::vector<int64_t>& side) override {
    caller_ = c10::cuda::getCurrentCUDAStream(device_);
    fork_event_.record(caller_);
    for (int64_t s : side) fork_event_.block(stream(s));
  }

  void set_stream(int64_t s) override { c10::cuda::setCurrentCUDAStream(stream(s)); }

  void wait(int64_t s, int64_t event) override { events_.at(static_cast<size_t>(event)).block(stream(s)); }

  void record(int64_t s, int64_t event) override { events_.at(static_cast<size_t>(event)).record(stream(s)); }

  void record_stream(const at::Tensor& tensor, int64_t s) override {
    if (!tensor.is_cuda()) return;
    c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream(s));
  }

  void join(const std::vector<int64_t>& side) override {
    for (int64_t s : side) {
      c10::Event& ev = join_events_.at(static_cast<size_t>(s - 1));
      ev.record(stream(s));
      ev.block(caller_);
    }
  }

  void restore() override { c10::cuda::setCurrentCUDAStream(caller_); }

 private:
  c10::cuda::CUDAStream stream(int64_t s) const { return s == 0 ? caller_ : side_.at(static_cast<size_t>(s - 1)); }

  c10::DeviceIndex device_;
  c10::cuda::CUDAStream caller_;
  std::vector<c10::cuda::CUDAStream> side_;
  std::vector<c10::Event> events_;       // one per recording task
  std::vector<c10::Event> join_events_;  // one per side stream
  c10::Event fork_event_{c10::DeviceType::CUDA};
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int64_t device, int64_t num_streams, int64_t num_events) {
  return std::make_unique<CudaBackend>(device, num_streams, num_events);
}

bool cuda_compiled() { return true; }

}  // namespace streamsched
