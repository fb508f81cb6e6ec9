// Handing one stacked gradient to N fused member parameters in one call.
//
// Through autograd, a gradient for N member parameters costs N graph edges and N
// AccumulateGrad nodes: about 3 us per member on a CPU, which for 4,000 members is
// more than the batched matmuls themselves. GradHandOff does what those N nodes would
// do (fill or accumulate each member's .grad) in one loop, and, when every member's
// .grad is still the slice of one buffer that it wrote last time, in one add_.
//
// It mirrors AccumulateGrad::accumulateGrad for dense tensors:
//   .grad undefined        -> a slice of a fresh contiguous copy of the gradient
//                             (so .grad has the parameter's strides)
//   defined, no grad mode  -> in-place add
//   defined, grad mode     -> out-of-place add (create_graph keeps the graph)
// Members that do not require grad are skipped, as autograd would.
//
// It runs from a plain backward() only: the autograd function calling it keeps one edge
// to a member (a canary), so autograd.grad() or backward(inputs=...) naming that member
// reaches accumulate(), which then refuses with an error instead of leaving gradients
// out. (The canary's edge also carries zeros in a plain backward, so that its
// AccumulateGrad, a leaf, makes the engine order this stream before the caller's.) It does not fire hooks: members with tensor hooks, post-accumulate hooks or hooks on
// their AccumulateGrad node (DDP's reducer registers those) must take the autograd
// path; hooked() tells the caller.

#pragma once

#include <torch/extension.h>

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace streamsched {

class GradHandOff {
 public:
  // members[i] is fused member i's parameter; sizes (concatenated members) gives each
  // member's extent along dim 0, empty for stacked members (one index each).
  GradHandOff(std::vector<at::Tensor> members, std::vector<int64_t> sizes);

  // Whether any member has a gradient hook that a direct write would skip.
  bool hooked() const;

  // Fill or accumulate every member's .grad from the stacked gradient `grad`.
  // Returns true when the whole-buffer fast path (one add_) was taken.
  bool accumulate(const at::Tensor& grad);

 private:
  at::Tensor part(const at::Tensor& stacked, size_t i) const;
  bool fast_path_applies(const at::Tensor& grad) const;

  std::vector<at::Tensor> members_;
  std::vector<int64_t> sizes_;   // empty: stacked
  std::vector<int64_t> starts_;  // offsets along dim 0 (concatenated)
  // The buffer the current .grad slices live in, held weakly: zero_grad(set_to_none)
  // must free it as it would free N separate gradients.
  c10::weak_intrusive_ptr<c10::StorageImpl> buffer_{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t buffer_offset_ = 0;
  std::vector<int64_t> buffer_sizes_;
  std::vector<int64_t> buffer_strides_;
  int64_t member_step_ = 0;  // elements between consecutive stacked members
};

}  // namespace streamsched
