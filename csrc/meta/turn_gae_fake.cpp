// turn_gae on the Meta device (see meta/gather_logprobs_fake.cpp for why): the checks of
// checks/turn_gae.h and the outputs' shapes.
#include "checks/turn_gae.h"

#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor> turn_gae_meta(const at::Tensor& rewards, const at::Tensor& values,
                                                 const at::Tensor& turn_ids, double gamma, double lam,
                                                 const std::optional<at::Tensor>& last_values) {
  check_turn_gae(rewards, values, turn_ids, gamma, lam, last_values);
  return {at::empty_symint(rewards.sym_sizes(), out_options(rewards)),
          at::empty_symint(rewards.sym_sizes(), out_options(rewards))};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) { m.impl("turn_gae", &turn_gae_meta); }

}  // namespace pyppo
