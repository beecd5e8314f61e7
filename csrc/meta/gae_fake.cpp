// gae on the Meta device (see meta/gather_logprobs_fake.cpp for why): the checks of checks/gae.h
// and the outputs' shapes (row_lam's values are data, checked on CPU and CUDA only).
#include "checks/gae.h"

#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_meta(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& response_mask, double gamma, double lam,
                                            const std::optional<at::Tensor>& last_values,
                                            std::optional<double> lam_critic,
                                            const std::optional<at::Tensor>& row_lam) {
  check_gae(rewards, values, response_mask, gamma, lam, last_values, lam_critic, row_lam);
  return {at::empty_symint(rewards.sym_sizes(), out_options(rewards)),
          at::empty_symint(rewards.sym_sizes(), out_options(rewards))};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) { m.impl("gae", &gae_meta); }

}  // namespace pyppo
