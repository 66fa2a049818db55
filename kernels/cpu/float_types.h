// The element types kvmesh's CPU kernels take, shared by every kernel in this folder.
#pragma once

#include <ATen/ATen.h>

namespace kvmesh_cpu {

// Calls f with a value of t's element type: float, at::BFloat16 or at::Half. ``what`` names t
// in the error for any other type.
template <typename F>
void with_float_type(const at::Tensor& t, const char* what, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, not ", t.scalar_type());
  }
}

}  // namespace kvmesh_cpu
