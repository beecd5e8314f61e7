// masked_mean, masked_var and masked_whiten on CPU, after the checks of args/masked.h.
//
// Whole-tensor reductions are summed in fixed blocks of kBlock elements whose partial sums
// are then added in block order: the result is the same bits whatever the thread count.
#include "args/masked.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace pyppo {
namespace {

constexpr int64_t kBlock = 4096;
// Blocks per task: tensors under ~64K elements are summed on one thread.
constexpr int64_t kBlocksPerTask = 16;

struct Moments {
  double sum = 0;
  int64_t count = 0;
};

template <typename T>
Moments masked_sum(const T* x, const bool* m, int64_t n) {
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(nblocks, 0.0);
  std::vector<int64_t> counts(nblocks, 0);
  at::parallel_for(0, nblocks, kBlocksPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      double s = 0;
      int64_t c = 0;
      for (int64_t i = k * kBlock, e = std::min(n, (k + 1) * kBlock); i < e; ++i)
        if (m[i]) {
          s += static_cast<double>(x[i]);
          ++c;
        }
      sums[k] = s;
      counts[k] = c;
    }
  });
  Moments out;
  for (int64_t k = 0; k < nblocks; ++k) {
    out.sum += sums[k];
    out.count += counts[k];
  }
  return out;
}

template <typename T>
double masked_sq_dev(const T* x, const bool* m, int64_t n, double mean) {
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(nblocks, 0.0);
  at::parallel_for(0, nblocks, kBlocksPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      double s = 0;
      for (int64_t i = k * kBlock, e = std::min(n, (k + 1) * kBlock); i < e; ++i)
        if (m[i]) {
          const double d = static_cast<double>(x[i]) - mean;
          s += d * d;
        }
      sums[k] = s;
    }
  });
  double out = 0;
  for (double s : sums) out += s;
  return out;
}

// Mean and variance of the masked-in elements; errors (not NaN) when there are too few.
std::pair<double, double> mean_var(const char* op, const MaskedInputs& p, bool unbiased) {
  double mean = 0, var = 0;
  AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "pyppo_masked_var", [&] {
    const scalar_t* x = p.x.data_ptr<scalar_t>();
    const bool* m = p.mask.data_ptr<bool>();
    Moments mo = masked_sum(x, m, p.x.numel());
    check_masked_count(op, mo.count, true, unbiased);
    mean = mo.sum / static_cast<double>(mo.count);
    var = masked_sq_dev(x, m, p.x.numel(), mean) / static_cast<double>(unbiased ? mo.count - 1 : mo.count);
  });
  return {mean, var};
}

at::Tensor masked_mean_cpu(const at::Tensor& x, const at::Tensor& mask, std::optional<int64_t> dim) {
  const char* op = "masked_mean";
  const std::optional<int64_t> dd = check_masked_mean(x, mask, dim);
  MaskedInputs p = prepare_masked(op, x, mask);
  if (!dd.has_value()) {
    at::Tensor out = at::empty({}, p.x.options());
    AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "pyppo_masked_mean", [&] {
      Moments mo = masked_sum(p.x.data_ptr<scalar_t>(), p.mask.data_ptr<bool>(), p.x.numel());
      check_masked_count(op, mo.count, false, false);
      out.fill_(mo.sum / static_cast<double>(mo.count));
    });
    return out;
  }
  const int64_t d = *dd;
  MeanDimInputs md = prepare_mean_dim(p, x, d);
  const int64_t R = md.R, L = md.L;
  at::Tensor out = md.out;
  AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "pyppo_masked_mean_dim", [&] {
    const scalar_t* xp = md.x.data_ptr<scalar_t>();
    const bool* mp = md.mask.data_ptr<bool>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < R; ++r) {
      int64_t c = 0;
      for (int64_t j = 0; j < L; ++j) c += mp[r * L + j];
      if (c == 0) fail_all_masked_slice(r, d);
    }
    at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(L, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        double s = 0;
        int64_t c = 0;
        for (int64_t j = 0; j < L; ++j)
          if (mp[r * L + j]) {
            s += static_cast<double>(xp[r * L + j]);
            ++c;
          }
        o[r] = static_cast<scalar_t>(s / static_cast<double>(c));
      }
    });
  });
  return out;
}

at::Tensor masked_var_cpu(const at::Tensor& x, const at::Tensor& mask, bool unbiased) {
  MaskedInputs p = prepare_masked("masked_var", x, mask);
  auto mv = mean_var("masked_var", p, unbiased);
  return at::full({}, mv.second, p.x.options());
}

at::Tensor masked_whiten_cpu(const at::Tensor& x, const at::Tensor& mask, bool shift_mean, bool unbiased, double eps) {
  const char* op = "masked_whiten";
  check_whiten_eps(eps);
  MaskedInputs p = prepare_masked(op, x, mask);
  auto [mean, var] = mean_var(op, p, unbiased);
  const double inv_std = whiten_inv_std(var, eps);
  at::Tensor out = at::empty(x.sizes(), p.x.options());
  AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "pyppo_masked_whiten", [&] {
    const scalar_t* xp = p.x.data_ptr<scalar_t>();
    const bool* mp = p.mask.data_ptr<bool>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const double add_back = shift_mean ? 0.0 : mean;
    at::parallel_for(0, p.x.numel(), 65536, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        o[i] = mp[i] ? static_cast<scalar_t>((static_cast<double>(xp[i]) - mean) * inv_std + add_back) : scalar_t(0);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("masked_mean", &masked_mean_cpu);
  m.impl("masked_var", &masked_var_cpu);
  m.impl("masked_whiten", &masked_whiten_cpu);
}

}  // namespace pyppo
