// streamsched._C: the per-task bookkeeping of the streams executor, in one call each.
//
// A StreamRuntime holds the synchronisation facts of one compiled plan (which stream
// each task runs on, which producers' events it waits for, whether it records, which
// of its inputs another stream allocated, which slots it releases). Per call:
//
//   begin()        fork: every side stream waits on the caller's current stream
//   enter(i)       make task i's stream current, wait on its producers' events
//   (Python runs the task's generated function)
//   leave(i, env)  record_stream its cross-stream inputs, record its event, drop slots
//   end(env)       join side streams into the caller's, restore the caller's stream,
//                  record_stream(caller) on outputs allocated on a side stream
//
// Without CUDA (the CPU build, or a CPU plan) every decision is still made and logged,
// and nothing is issued: the SyncLog it writes is compared with the Python executor's.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace streamsched {

// One SyncLog entry; kinds match streamsched/runtime/synclog.py.
struct SyncEntry {
  std::string kind;
  int64_t stream;
  int64_t task;
  std::vector<int64_t> slots;
  std::vector<int64_t> writes;
};

struct TaskSync {
  int64_t id;
  int64_t stream;
  std::vector<int64_t> waits;  // task ids
  bool records;
  std::vector<int64_t> reads;
  std::vector<int64_t> writes;
  std::vector<int64_t> cross_reads;
  std::vector<int64_t> frees;
};

// The stream operations: the narrow interface through which the runtime's fork, wait,
// record, record_stream and join reach streams and events. Implemented for CUDA in
// cuda/cuda_backend.cpp (c10::cuda), and in python_backend.cpp by a Python object
// (streamsched.runtime.backends.NativeStreamOps) that drives torch.cuda: that is how the
// runtime's every synchronisation action is exercised on the emulated device.
// Streams are numbered as in plans (0: the caller's stream, captured by fork()); events
// by the runtime (one per recording task).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual void fork(const std::vector<int64_t>& side) = 0;
  virtual void set_stream(int64_t stream) = 0;
  virtual void wait(int64_t stream, int64_t event) = 0;
  virtual void record(int64_t stream, int64_t event) = 0;
  virtual void record_stream(const at::Tensor& tensor, int64_t stream) = 0;
  virtual void join(const std::vector<int64_t>& side) = 0;
  virtual void restore() = 0;
};

std::unique_ptr<Backend> make_cuda_backend(int64_t device, int64_t num_streams, int64_t num_events);
// ops: an object with the methods of Backend (fork, set_stream, wait, record,
// record_stream, join, restore), called with the GIL held.
std::unique_ptr<Backend> make_python_backend(pybind11::object ops);
bool cuda_compiled();

class StreamRuntime {
 public:
  // ops: a Python Backend (make_python_backend) used instead of CUDA's when not None.
  StreamRuntime(std::vector<TaskSync> tasks, int64_t num_streams, std::vector<int64_t> side_outputs,
                std::vector<int64_t> output_slots, bool use_cuda, int64_t device,
                pybind11::object ops = pybind11::none());
  int64_t num_events() const { return num_events_; }

  void begin(bool log);
  void enter(int64_t index);
  void leave(int64_t index, pybind11::list env);
  void end(pybind11::list env, bool completed);

  std::vector<SyncEntry> take_log();
  bool uses_cuda() const { return backend_ != nullptr; }
  int64_t num_tasks() const { return static_cast<int64_t>(tasks_.size()); }

 private:
  void add(std::string kind, int64_t stream, int64_t task, std::vector<int64_t> slots = {},
           std::vector<int64_t> writes = {});

  std::vector<TaskSync> tasks_;
  int64_t num_streams_;
  std::vector<int64_t> side_streams_;
  std::vector<int64_t> side_outputs_;
  std::vector<int64_t> output_slots_;
  std::vector<int64_t> event_of_task_;  // task id -> event index, -1 if it never records
  std::unique_ptr<Backend> backend_;
  int64_t num_events_ = 0;
  int64_t current_ = 0;
  bool logging_ = false;
  std::vector<SyncEntry> log_;
};

// Checks, in one loop, that N tensors still alias the storage slots they were given
// (a fused group's parameters inside their stacked tensor).
class StackGuard {
 public:
  explicit StackGuard(std::vector<at::Tensor> tensors);
  bool valid() const;
  void reset(std::vector<at::Tensor> tensors);

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<c10::TensorImpl*> impls_;
  std::vector<const c10::StorageImpl*> storages_;
  std::vector<int64_t> offsets_;
};

// Checks, in one loop, that N tensors still start at the addresses they had when it was
// made: what a captured CUDA graph reads them at. Unlike StackGuard it also sees a
// storage re-allocated under the same StorageImpl (`untyped_storage().resize_()`).
// Also answers, in one loop, whether any of them requires grad now (a frozen model's
// thousands of parameters, asked before every replay).
class AddressGuard {
 public:
  explicit AddressGuard(std::vector<at::Tensor> tensors);
  bool valid() const;
  bool any_requires_grad() const;

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<const c10::TensorImpl*> impls_;
  std::vector<const void*> addresses_;
};

}  // namespace streamsched
