#include "runtime.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <functional>
#include <set>
#include <stdexcept>
#include <utility>

namespace py = pybind11;

namespace streamsched {

StreamRuntime::StreamRuntime(std::vector<TaskSync> tasks, int64_t num_streams, std::vector<int64_t> side_outputs,
                             std::vector<int64_t> output_slots, bool use_cuda, int64_t device, py::object ops)
    : tasks_(std::move(tasks)),
      num_streams_(num_streams),
      side_outputs_(std::move(side_outputs)),
      output_slots_(std::move(output_slots)) {
  std::set<int64_t> side;
  int64_t max_id = -1;
  for (const auto& t : tasks_) {
    if (t.stream < 0 || t.stream >= num_streams_) {
      throw std::invalid_argument("task " + std::to_string(t.id) + " is on stream " + std::to_string(t.stream) +
                                  " but the plan has " + std::to_string(num_streams_) + " streams");
    }
    if (t.stream != 0) side.insert(t.stream);
    max_id = std::max(max_id, t.id);
  }
  side_streams_.assign(side.begin(), side.end());
  event_of_task_.assign(static_cast<size_t>(max_id + 1), -1);
  int64_t events = 0;
  for (const auto& t : tasks_) {
    if (t.records) event_of_task_[t.id] = events++;
  }
  for (const auto& t : tasks_) {
    for (int64_t w : t.waits) {
      if (w < 0 || w > max_id || event_of_task_[w] < 0) {
        throw std::invalid_argument("task " + std::to_string(t.id) + " waits on task " + std::to_string(w) +
                                    ", which records no event");
      }
    }
  }
  num_events_ = events;
  if (!ops.is_none()) {
    backend_ = make_python_backend(std::move(ops));
  } else if (use_cuda) {
    backend_ = make_cuda_backend(device, num_streams_, events);
  }
}

void StreamRuntime::add(std::string kind, int64_t stream, int64_t task, std::vector<int64_t> slots,
                        std::vector<int64_t> writes) {
  log_.push_back(SyncEntry{std::move(kind), stream, task, std::move(slots), std::move(writes)});
}

void StreamRuntime::begin(bool log) {
  logging_ = log;
  current_ = 0;
  if (backend_) backend_->fork(side_streams_);
  if (logging_) {
    for (int64_t s : side_streams_) add("fork", s, -1);
  }
}

void StreamRuntime::enter(int64_t index) {
  const TaskSync& t = tasks_.at(static_cast<size_t>(index));
  if (t.stream != current_) {
    if (backend_) backend_->set_stream(t.stream);
    current_ = t.stream;
  }
  for (int64_t producer : t.waits) {
    if (backend_) backend_->wait(t.stream, event_of_task_[producer]);
    if (logging_) add("wait", t.stream, producer);
  }
}

static void for_each_tensor(const py::handle& value, const std::function<void(const at::Tensor&)>& fn) {
  if (THPVariable_Check(value.ptr())) {
    fn(THPVariable_Unpack(value.ptr()));
  } else if (py::isinstance<py::tuple>(value) || py::isinstance<py::list>(value)) {
    for (const auto& item : value) for_each_tensor(item, fn);
  } else if (py::isinstance<py::dict>(value)) {
    for (const auto& item : py::reinterpret_borrow<py::dict>(value)) for_each_tensor(item.second, fn);
  }
}

void StreamRuntime::leave(int64_t index, py::list env) {
  const TaskSync& t = tasks_.at(static_cast<size_t>(index));
  if (logging_) add("launch", t.stream, t.id, t.reads, t.writes);
  for (int64_t slot : t.cross_reads) {
    if (backend_) {
      for_each_tensor(env[static_cast<size_t>(slot)], [&](const at::Tensor& tensor) {
        backend_->record_stream(tensor, t.stream);
      });
    }
    if (logging_) add("record_stream", t.stream, -1, {slot});
  }
  if (t.records) {
    if (backend_) backend_->record(t.stream, event_of_task_[t.id]);
    if (logging_) add("record", t.stream, t.id);
  }
  for (int64_t slot : t.frees) {
    env[static_cast<size_t>(slot)] = py::none();
    if (logging_) add("free", t.stream, -1, {slot});
  }
}

void StreamRuntime::end(py::list env, bool completed) {
  if (backend_) {
    if (current_ != 0) backend_->restore();
    backend_->join(side_streams_);
  }
  current_ = 0;
  if (logging_) {
    for (int64_t s : side_streams_) add("join", s, -1);
  }
  if (!completed) return;  // an exception propagates; no outputs to hand over
  for (int64_t slot : side_outputs_) {
    if (backend_) {
      for_each_tensor(env[static_cast<size_t>(slot)], [&](const at::Tensor& tensor) {
        backend_->record_stream(tensor, 0);
      });
    }
    if (logging_) add("record_stream", 0, -1, {slot});
  }
  if (logging_) add("output", 0, -1, output_slots_);
}

std::vector<SyncEntry> StreamRuntime::take_log() {
  std::vector<SyncEntry> out;
  out.swap(log_);
  return out;
}

StackGuard::StackGuard(std::vector<at::Tensor> tensors) { reset(std::move(tensors)); }

void StackGuard::reset(std::vector<at::Tensor> tensors) {
  tensors_ = std::move(tensors);
  impls_.clear();
  storages_.clear();
  offsets_.clear();
  for (const auto& t : tensors_) {
    impls_.push_back(t.unsafeGetTensorImpl());
    storages_.push_back(t.storage().unsafeGetStorageImpl());
    offsets_.push_back(t.storage_offset());
  }
}

bool StackGuard::valid() const {
  // We hold the same TensorImpl as the Python Parameter, so `p.data = other` and
  // `.to()` (which swap the storage under the same object) show up as another
  // StorageImpl or offset. Two pointer compares per tensor, no checks on the way.
  for (size_t i = 0; i < impls_.size(); ++i) {
    const c10::TensorImpl* impl = impls_[i];
    if (impl->storage().unsafeGetStorageImpl() != storages_[i] || impl->storage_offset() != offsets_[i]) {
      return false;
    }
  }
  return true;
}

namespace {
// The first byte of a tensor's data: its storage's data plus its offset. Read straight
// from the TensorImpl (no dispatch, no Python), as a graph replay reads it.
const void* address_of(const c10::TensorImpl* impl) {
  const auto* base = static_cast<const char*>(impl->storage().data());
  return base == nullptr ? nullptr : base + impl->storage_offset() * static_cast<int64_t>(impl->itemsize());
}
}  // namespace

AddressGuard::AddressGuard(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {
  for (const auto& t : tensors_) {
    TORCH_CHECK(t.defined() && t.unsafeGetTensorImpl()->has_storage(),
                "AddressGuard needs tensors with storage (not sparse, nested or undefined)");
    impls_.push_back(t.unsafeGetTensorImpl());
    addresses_.push_back(address_of(impls_.back()));
  }
}

bool AddressGuard::valid() const {
  for (size_t i = 0; i < impls_.size(); ++i) {
    if (address_of(impls_[i]) != addresses_[i]) {
      return false;
    }
  }
  return true;
}

bool AddressGuard::any_requires_grad() const {
  for (const c10::TensorImpl* impl : impls_) {
    if (impl->requires_grad()) {
      return true;
    }
  }
  return false;
}

#ifndef STREAMSCHED_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int64_t, int64_t, int64_t) {
  throw std::runtime_error(
      "streamsched._C was built without CUDA (USE_CUDA=0 or no CUDA toolkit at build time); "
      "rebuild it on a machine with CUDA to run plans on CUDA streams natively");
}
bool cuda_compiled() { return false; }
#endif

}  // namespace streamsched
