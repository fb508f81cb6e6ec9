// The Backend of runtime.h implemented by a Python object: every stream operation the
// runtime decides (fork, set_stream, wait, record, record_stream, join, restore) becomes
// one method call on it. streamsched.runtime.backends.NativeStreamOps maps them onto
// torch.cuda streams and events, so on the emulated CUDA device (CI, development
// machines) the runtime's own synchronisation logic runs and is checked; on a GPU the
// CUDA build uses cuda/cuda_backend.cpp instead, which does the same with c10::cuda.
#include "runtime.h"

#include <utility>

namespace py = pybind11;

namespace streamsched {

namespace {

class PythonBackend final : public Backend {
 public:
  explicit PythonBackend(py::object ops)
      : fork_(ops.attr("fork")),
        set_stream_(ops.attr("set_stream")),
        wait_(ops.attr("wait")),
        record_(ops.attr("record")),
        record_stream_(ops.attr("record_stream")),
        join_(ops.attr("join")),
        restore_(ops.attr("restore")),
        ops_(std::move(ops)) {}

  void fork(const std::vector<int64_t>& side) override { fork_(py::cast(side)); }
  void set_stream(int64_t stream) override { set_stream_(stream); }
  void wait(int64_t stream, int64_t event) override { wait_(stream, event); }
  void record(int64_t stream, int64_t event) override { record_(stream, event); }
  void record_stream(const at::Tensor& tensor, int64_t stream) override { record_stream_(tensor, stream); }
  void join(const std::vector<int64_t>& side) override { join_(py::cast(side)); }
  void restore() override { restore_(); }

 private:
  // Bound methods looked up once: a call per operation, no attribute lookup.
  py::object fork_, set_stream_, wait_, record_, record_stream_, join_, restore_;
  py::object ops_;
};

}  // namespace

std::unique_ptr<Backend> make_python_backend(py::object ops) { return std::make_unique<PythonBackend>(std::move(ops)); }

}  // namespace streamsched
