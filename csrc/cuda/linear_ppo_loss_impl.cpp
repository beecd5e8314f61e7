// linear_ppo_loss on CUDA: the device-generic chunked implementation of linear/linear_ppo_loss.cpp
// (ATen GEMMs and this device's gather_logprobs and kl_penalty kernels).
#include "linear/linear_ppo_loss.h"

#include <torch/library.h>

namespace pyppo {

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) { m.impl("linear_ppo_loss", &linear_ppo_loss_impl); }

}  // namespace pyppo
