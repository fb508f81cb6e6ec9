// The CUDA half of StreamRuntime: streams created once, events created once per plan
// with cudaEventDisableTiming, everything on c10::cuda streams so that PyTorch sees the
// stream we make current (kernels launched from Python inside a task go to it).
#include "../runtime.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace streamsched {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("streamsched: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int64_t device, int64_t num_streams, int64_t num_events) : device_(static_cast<c10::DeviceIndex>(device)) {
    c10::cuda::CUDAGuard guard(device_);
    // Own non-blocking streams (not the shared pool): other libraries cannot queue
    // work on them behind our backs.
    for (int64_t s = 1; s < num_streams; ++s) {
      cudaStream_t raw;
      check(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      raw_streams_.push_back(raw);
      side_.push_back(c10::cuda::getStreamFromExternal(raw, device_));
    }
    for (int64_t e = 0; e < num_events; ++e) {
      cudaEvent_t ev;
      check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      events_.push_back(ev);
    }
    check(cudaEventCreateWithFlags(&fork_event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    join_events_.resize(side_.size());
    for (auto& ev : join_events_) {
      check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
  }

  ~CudaBackend() override {
    // Destroying an event or stream with pending work is safe in CUDA: resources are
    // released once the work completes.
    for (auto ev : events_) cudaEventDestroy(ev);
    for (auto ev : join_events_) cudaEventDestroy(ev);
    cudaEventDestroy(fork_event_);
    for (auto s : raw_streams_) cudaStreamDestroy(s);
  }

  void fork(const std::vector<int64_t>& side) override {
    caller_ = c10::cuda::getCurrentCUDAStream(device_);
    check(cudaEventRecord(fork_event_, caller_.stream()), "cudaEventRecord (fork)");
    for (int64_t s : side) check(cudaStreamWaitEvent(stream(s).stream(), fork_event_, 0), "cudaStreamWaitEvent (fork)");
  }

  void set_stream(int64_t s) override { c10::cuda::setCurrentCUDAStream(stream(s)); }

  void wait(int64_t s, int64_t event) override {
    check(cudaStreamWaitEvent(stream(s).stream(), events_.at(event), 0), "cudaStreamWaitEvent");
  }

  void record(int64_t s, int64_t event) override {
    check(cudaEventRecord(events_.at(event), stream(s).stream()), "cudaEventRecord");
  }

  void record_stream(const at::Tensor& tensor, int64_t s) override {
    if (!tensor.is_cuda()) return;
    c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream(s));
  }

  void join(const std::vector<int64_t>& side) override {
    for (size_t i = 0; i < side.size(); ++i) {
      cudaEvent_t ev = join_events_.at(static_cast<size_t>(side[i] - 1));
      check(cudaEventRecord(ev, stream(side[i]).stream()), "cudaEventRecord (join)");
      check(cudaStreamWaitEvent(caller_.stream(), ev, 0), "cudaStreamWaitEvent (join)");
    }
  }

  void restore() override { c10::cuda::setCurrentCUDAStream(caller_); }

 private:
  c10::cuda::CUDAStream stream(int64_t s) const { return s == 0 ? caller_ : side_.at(static_cast<size_t>(s - 1)); }

  c10::DeviceIndex device_;
  std::vector<cudaStream_t> raw_streams_;
  std::vector<c10::cuda::CUDAStream> side_;
  std::vector<cudaEvent_t> events_;
  std::vector<cudaEvent_t> join_events_;
  cudaEvent_t fork_event_{};
  c10::cuda::CUDAStream caller_ = c10::cuda::getDefaultCUDAStream();
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int64_t device, int64_t num_streams, int64_t num_events) {
  return std::make_unique<CudaBackend>(device, num_streams, num_events);
}

bool cuda_compiled() { return true; }

}  // namespace streamsched
