#include "grad_handoff.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstring>
#include <stdexcept>
#include <typeinfo>
#include <utility>

namespace streamsched {

namespace autograd = torch::autograd;

GradHandOff::GradHandOff(std::vector<at::Tensor> members, std::vector<int64_t> sizes)
    : members_(std::move(members)), sizes_(std::move(sizes)) {
  if (members_.empty()) {
    throw std::invalid_argument("GradHandOff: no members");
  }
  if (!sizes_.empty() && sizes_.size() != members_.size()) {
    throw std::invalid_argument("GradHandOff: sizes must give one extent per member");
  }
  int64_t start = 0;
  for (size_t i = 0; i < members_.size(); ++i) {
    starts_.push_back(sizes_.empty() ? static_cast<int64_t>(i) : start);
    if (!sizes_.empty()) start += sizes_[i];
  }
}

namespace {

// Python hooks live in a dict that one C++ hook object wraps; removing the last Python
// hook empties the dict but leaves the wrapper in place. A wrapper around an empty dict
// hooks nothing. The types are matched by name: their typeinfo is not exported by
// libtorch_python, and anything unrecognised counts as a live hook.
template <typename Hook>
bool has_type(const Hook& hook, const char* mangled) {
  return std::strcmp(typeid(hook).name(), mangled) == 0;
}

bool is_live(const autograd::FunctionPreHook& hook) {
  if (has_type(hook, "N5torch8autograd23PyFunctionTensorPreHookE")) {
    return PyDict_Size(static_cast<const autograd::PyFunctionTensorPreHook&>(hook).dict) > 0;
  }
  if (has_type(hook, "N5torch8autograd17PyFunctionPreHookE")) {
    return PyDict_Size(static_cast<const autograd::PyFunctionPreHook&>(hook).dict) > 0;
  }
  return true;
}

bool is_live(const autograd::FunctionPostHook& hook) {
  if (has_type(hook, "N5torch8autograd18PyFunctionPostHookE")) {
    return PyDict_Size(static_cast<const autograd::PyFunctionPostHook&>(hook).dict) > 0;
  }
  return true;
}

bool is_live(const autograd::PostAccumulateGradHook& hook) {
  if (has_type(hook, "N5torch8autograd32PyFunctionTensorPostAccGradHooksE")) {
    return PyDict_Size(static_cast<const autograd::PyFunctionTensorPostAccGradHooks&>(hook).dict) > 0;
  }
  return true;
}

template <typename Hooks>
bool any_live(const Hooks& hooks) {
  for (const auto& h : hooks) {
    if (h && is_live(*h)) return true;
  }
  return false;
}

}  // namespace

bool GradHandOff::hooked() const {
  for (const auto& m : members_) {
    auto* meta = autograd::impl::get_autograd_meta(m);
    if (meta == nullptr) continue;
    if (any_live(meta->hooks_)) return true;
    if (meta->post_acc_grad_hooks_ && is_live(*meta->post_acc_grad_hooks_)) return true;
    // The accumulator exists once some graph used the member, or once a hook holder
    // (DDP's reducer) asked for it; its hooks are what a direct write would skip.
    auto acc = autograd::impl::try_get_grad_accumulator(m);
    if (acc && (any_live(acc->pre_hooks()) || any_live(acc->post_hooks()) || any_live(acc->tensor_pre_hooks()))) {
      return true;
    }
    if (acc && acc->tensor_post_acc_grad_hooks() && is_live(*acc->tensor_post_acc_grad_hooks())) return true;
  }
  return false;
}

at::Tensor GradHandOff::part(const at::Tensor& stacked, size_t i) const {
  return sizes_.empty() ? stacked.select(0, static_cast<int64_t>(i)) : stacked.narrow(0, starts_[i], sizes_[i]);
}

bool GradHandOff::fast_path_applies(const at::Tensor& grad) const {
  auto storage = buffer_.lock();
  if (!storage || grad.sizes() != c10::IntArrayRef(buffer_sizes_)) return false;
  const c10::IntArrayRef member_strides =
      sizes_.empty() ? c10::IntArrayRef(buffer_strides_).slice(1) : c10::IntArrayRef(buffer_strides_);
  const int64_t step = buffer_strides_[0];
  for (size_t i = 0; i < members_.size(); ++i) {
    const auto& m = members_[i];
    const at::Tensor& g = m.grad();
    if (!m.requires_grad() || !g.defined() || g.requires_grad() || g.scalar_type() != grad.scalar_type()) return false;
    const c10::TensorImpl* impl = g.unsafeGetTensorImpl();
    if (!impl->has_storage() || impl->storage().unsafeGetStorageImpl() != storage.get()) return false;
    if (impl->storage_offset() != buffer_offset_ + starts_[i] * step) return false;
    if (g.sizes() != m.sizes() || g.strides() != member_strides) return false;
  }
  return true;
}

bool GradHandOff::accumulate(const at::Tensor& grad) {
  // Run from a plain backward(), the engine executes every node (no exec_info). Under
  // autograd.grad() or backward(inputs=...) our node runs only because the caller named
  // the member it keeps an edge to: members' gradients were asked for, which this mode
  // cannot deliver through autograd. Say so rather than leave them out.
  const auto* exec_info = autograd::get_current_graph_task_exec_info();
  if (exec_info != nullptr && !exec_info->empty()) {
    throw std::runtime_error(
        "grad_handoff='direct' writes fused members' .grad directly, so their parameters cannot be named in "
        "torch.autograd.grad() or backward(inputs=...); use grad_handoff='autograd' (the default) for that");
  }
  const bool grad_mode = at::GradMode::is_enabled();  // create_graph=True
  if (!grad_mode && fast_path_applies(grad)) {
    // Every .grad is still its slice of the buffer we filled: one add for all.
    at::Tensor whole = members_[0].grad().as_strided(buffer_sizes_, buffer_strides_, buffer_offset_);
    whole.add_(grad);
    return true;
  }
  at::Tensor buffer;  // a contiguous copy, made only if some member has no .grad yet
  bool all_fresh = true;
  for (size_t i = 0; i < members_.size(); ++i) {
    const auto& m = members_[i];
    if (!m.requires_grad()) {
      all_fresh = false;
      continue;
    }
    at::Tensor& g = m.mutable_grad();
    if (!g.defined()) {
      if (!buffer.defined()) {
        buffer = (grad_mode ? grad : grad.detach()).clone(at::MemoryFormat::Contiguous);
      }
      g = part(buffer, i);
    } else if (grad_mode) {
      all_fresh = false;
      g = g + part(grad, i);
    } else {
      all_fresh = false;
      g.add_(part(grad, i));
    }
  }
  if (all_fresh && !grad_mode && buffer.defined()) {
    buffer_ = c10::weak_intrusive_ptr<c10::StorageImpl>(buffer.storage().getWeakStorageImpl());
    buffer_offset_ = buffer.storage_offset();
    buffer_sizes_ = buffer.sizes().vec();
    buffer_strides_ = buffer.strides().vec();
  } else {
    buffer_ = c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>());
  }
  return false;
}

}  // namespace streamsched
