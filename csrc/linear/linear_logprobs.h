// linear_logprobs and its backward, device-generic (linear/linear_logprobs.cpp): what
// cpu/linear_logprobs_impl.cpp and cuda/linear_logprobs_impl.cpp register. Schemas in ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

namespace pyppo {

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprobs_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool return_entropy,
    int64_t chunk_size);

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprobs_backward_impl(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    double temperature, int64_t ignore_index, int64_t chunk_size, std::array<bool, 3> output_mask);

}  // namespace pyppo
