// linear_ppo_loss, device-generic (linear/linear_ppo_loss.cpp): what cpu/linear_ppo_loss_impl.cpp
// and cuda/linear_ppo_loss_impl.cpp register. Schema in ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

namespace pyppo {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ppo_loss_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& response_mask, const at::Tensor& token_weights,
    const std::optional<at::Tensor>& ref_logprobs, const std::optional<at::Tensor>& bias, double temperature,
    int64_t ignore_index, double cliprange_low, double cliprange_high, std::optional<double> dual_clip,
    double kl_loss_coef, c10::string_view kl_loss_estimator, double entropy_coef, bool return_entropy,
    int64_t chunk_size, std::array<bool, 3> output_mask, c10::string_view policy_loss);

}  // namespace pyppo
