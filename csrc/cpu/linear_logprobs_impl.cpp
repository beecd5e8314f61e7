// linear_logprobs on CPU: the device-generic chunked implementation of linear/linear_logprobs.cpp
// (ATen GEMMs and this device's gather_logprobs kernels).
#include "linear/linear_logprobs.h"

#include <torch/library.h>

namespace pyppo {

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("linear_logprobs", &linear_logprobs_impl);
  m.impl("linear_logprobs_backward", &linear_logprobs_backward_impl);
}

}  // namespace pyppo
