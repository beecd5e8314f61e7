// The plain interface between the CUDA kernels (csrc/cuda/kernels/*_kernel.cu) and the CUDA impls
// (csrc/cuda/*_impl.cpp): argument structs (`*Args`, as the CPU kernels' in cpu/kernels/kernels.h)
// of raw pointers, sizes, strides and a stream, and one launcher per kernel. No torch header is
// included here or in the .cu files, so every .cu
// compiles with a bare nvcc (tests/ops/test_cuda_compile.py does that on every CI run, for sm_80
// and sm_90, even where torch is a CPU build).
//
// Conventions shared by every launcher:
//  * The impl has already checked shapes, dtypes and devices (checks/<family>.h, as on CPU),
//    converted inputs as the CPU kernels do (`.to(acc).contiguous()` except for the logits),
//    made the tensor's device current (CUDAGuard) and passed its current stream.
//  * "acc" is float, or double for float64 inputs; every output but the logits gradient is
//    in acc. Pointers to acc data are `void*`, read as double when `is_double` is set.
//  * Launchers only enqueue work: they never synchronise; they return cudaGetLastError().
//  * Results are deterministic (fixed reduction trees, no atomics) and batch-invariant: the
//    work split inside a row depends only on that row's length, never on other rows or on the
//    grid size.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kl_estimators.h"  // KLEstimator, KLClamp, kl_value, kl_grad (plain C++, PYPPO_HD)
#include "row_layout.h"     // RowLayout, row_offset (plain C++, shared with the CPU kernels)

namespace pyppo {
namespace cuda {

enum class DType : int32_t { Float32 = 0, Float16 = 1, BFloat16 = 2, Float64 = 3 };

// A label outside [0, V) at an unmasked position never reaches an index: the kernels give that
// row NaN outputs (NaN gradient), and the impl raises the CPU's error from its own device-side
// check of the labels (one read-back per call, none while a CUDA graph is being captured).

// gather_logprobs forward. Outputs are [N] in acc (double for Float64 logits, else float).
// Rows that are masked or whose label is ignore_index get 0 in every output.
struct GatherFwdArgs {
  const void* logits = nullptr;
  DType dtype = DType::Float32;
  int64_t N = 0, V = 0;
  RowLayout rows;
  const int64_t* labels = nullptr;  // [N]
  const bool* mask = nullptr;       // [N] or nullptr
  int64_t ignore_index = -100;
  double temperature = 1.0;
  void* logprobs = nullptr;  // [N]
  void* entropy = nullptr;   // [N] or nullptr (return_entropy false)
  void* lse = nullptr;       // [N], logsumexp(z / temperature)
  cudaStream_t stream = nullptr;
};

// gather_logprobs backward: grad_logits [N, V] contiguous, in the logits' dtype.
struct GatherBwdArgs {
  const void* logits = nullptr;
  DType dtype = DType::Float32;
  int64_t N = 0, V = 0;
  RowLayout rows;
  const int64_t* labels = nullptr;
  const bool* mask = nullptr;
  int64_t ignore_index = -100;
  double temperature = 1.0;
  const void* grad_logprobs = nullptr;  // [N] acc
  const void* grad_entropy = nullptr;   // [N] acc or nullptr
  const void* lse = nullptr;            // [N] acc
  const void* entropy = nullptr;        // [N] acc; set whenever grad_entropy is
  void* grad_logits = nullptr;          // [N, V] contiguous
  cudaStream_t stream = nullptr;
};

// kl_penalty forward (out = kl) and backward (out = grad_kl * d kl / d logprobs, or 0 where
// grad_kl is 0). All arrays [n] contiguous acc.
struct KLArgs {
  bool is_double = false;
  int64_t n = 0;
  const void* logprobs = nullptr;
  const void* ref_logprobs = nullptr;
  const void* grad_kl = nullptr;  // backward only
  void* out = nullptr;
  KLEstimator estimator = KLEstimator::K1;
  KLClamp clamp;
  cudaStream_t stream = nullptr;
};

// shape_rewards: [B, T] contiguous acc arrays, scores [B] (already checked finite), mask [B, T]
// bool (every row already checked to have a valid position).
struct ShapeRewardsArgs {
  bool is_double = false;
  int64_t B = 0, T = 0;
  const void* scores = nullptr;
  const void* logprobs = nullptr;
  const void* ref_logprobs = nullptr;
  const bool* mask = nullptr;
  double kl_coef = 0;
  KLEstimator estimator = KLEstimator::K1;
  bool has_score_clip = false;
  double score_clip = 0;
  void* rewards = nullptr;
  void* kl = nullptr;
  cudaStream_t stream = nullptr;
};

// gae: [B, T] contiguous acc arrays, last_values [B] or nullptr. One warp per row, right to
// left in tiles of kGaeTile positions that start at multiples of kGaeTile from the row's
// start, each lane taking kGaeSegment consecutive positions of a tile: the split depends on
// neither B nor T, so extra right padding (whole masked tiles, skipped) leaves a row's bits
// unchanged. The advantages use row_lam[b] (else lam); the returns use lam_critic when
// has_lam_critic (a second composition beside the advantages' one), else the advantages' lam.
// A row_lam value outside [0, 1] (only possible while a graph is captured: the impl checks them
// otherwise) gives that row NaN advantages at its valid positions.
struct GaeArgs {
  bool is_double = false;
  int64_t B = 0, T = 0;
  const void* rewards = nullptr;
  const void* values = nullptr;
  const bool* mask = nullptr;
  const void* last_values = nullptr;
  double gamma = 1.0, lam = 0.95;
  const double* row_lam = nullptr;  // [B] or nullptr
  bool has_lam_critic = false;
  double lam_critic = 0;
  void* advantages = nullptr;
  void* returns = nullptr;
  cudaStream_t stream = nullptr;
};
constexpr int kGaeSegment = 16;
constexpr int kGaeTile = 32 * kGaeSegment;

// turn_gae: rewards, values [B, T] contiguous acc arrays, turn_ids [B, T] int64 (negative: not an
// agent position), last_values [B] or nullptr. One thread per row runs the CPU kernel's two
// loops (right to left over the turns, then left to right broadcasting each turn's advantage
// onto its positions) with the same operations in the same order: the CPU's bits, and a row's
// result depends on nothing but that row.
struct TurnGaeArgs {
  bool is_double = false;
  int64_t B = 0, T = 0;
  const void* rewards = nullptr;
  const void* values = nullptr;
  const int64_t* turn_ids = nullptr;
  const void* last_values = nullptr;
  double gamma = 1.0, lam = 0.95;
  void* advantages = nullptr;
  void* returns = nullptr;
  cudaStream_t stream = nullptr;
};

// group_advantages: scores [B] and advantages [B, T] contiguous acc arrays, mask [B, T] bool, and
// the groups: group_size > 0 (B / group_size groups of group_size consecutive rows; group_ids
// unused), or group_ids [B] int64 (checked to lie in [0, B) outside graph capture; the kernel only
// compares them, so any value is safe). One warp per row visits its group's members in row order
// (with ids: scanning the batch's ids in tiles of kGroupAdvTile shared by the block's warps),
// accumulating the group's statistics in double in the CPU kernel's order: the same bits as on
// CPU, and a group's result depends only on its members' scores and their order.
struct GroupAdvantagesArgs {
  bool is_double = false;
  int64_t B = 0, T = 0;
  const void* scores = nullptr;
  int64_t group_size = 0;
  const int64_t* group_ids = nullptr;
  const bool* mask = nullptr;
  bool rloo = false, std_normalize = true;
  double eps = 1e-6;
  void* advantages = nullptr;
  cudaStream_t stream = nullptr;
};
constexpr int kGroupAdvWarps = 8;  // rows per block
constexpr int kGroupAdvTile = 32 * kGroupAdvWarps;

// Whole-tensor masked moments, reduced in two deterministic stages: fixed chunks of
// kMaskedChunk elements give per-chunk partial sums (in double), then one block adds the
// partials in a fixed order. `stats` is a device buffer of 4 doubles:
//   stats[0] = sum of valid x, stats[1] = number of valid elements,
//   stats[2] = mean (sum / count; NaN when count is 0),
//   stats[3] = variance (sum of squared deviations / (count - unbiased); NaN when undefined).
// `partials` is a device workspace of 2 * masked_num_partials(n) doubles.
constexpr int64_t kMaskedChunk = 4096;
PYPPO_HD int64_t masked_num_partials(int64_t n) { return n <= 0 ? 1 : (n + kMaskedChunk - 1) / kMaskedChunk; }

struct MaskedStatsArgs {
  bool is_double = false;
  int64_t n = 0;
  const void* x = nullptr;  // [n] contiguous acc
  const bool* mask = nullptr;
  double* partials = nullptr;
  double* stats = nullptr;
  bool unbiased = true;  // used by launch_masked_variance
  cudaStream_t stream = nullptr;
};

// out[i] = mask[i] ? (x[i] - mean) / sqrt(var + eps) + (shift_mean ? 0 : mean) : 0, with mean
// and var read from stats[2], stats[3] on the device (no host round trip).
struct MaskedWhitenArgs {
  bool is_double = false;
  int64_t n = 0;
  const void* x = nullptr;
  const bool* mask = nullptr;
  const double* stats = nullptr;
  bool shift_mean = true;
  double eps = 1e-8;
  void* out = nullptr;
  cudaStream_t stream = nullptr;
};

// masked_mean along one dim, moved last: x, mask [R, L] contiguous -> out [R] (NaN for an
// all-masked slice), counts [R] int64 (the impl raises on a zero count).
struct MaskedMeanDimArgs {
  bool is_double = false;
  int64_t R = 0, L = 0;
  const void* x = nullptr;
  const bool* mask = nullptr;
  void* out = nullptr;
  int64_t* counts = nullptr;
  cudaStream_t stream = nullptr;
};

cudaError_t launch_gather_logprobs_fwd(const GatherFwdArgs& p);
cudaError_t launch_gather_logprobs_bwd(const GatherBwdArgs& p);
cudaError_t launch_kl_penalty_fwd(const KLArgs& p);
cudaError_t launch_kl_penalty_bwd(const KLArgs& p);
cudaError_t launch_shape_rewards(const ShapeRewardsArgs& p);
cudaError_t launch_gae(const GaeArgs& p);
cudaError_t launch_turn_gae(const TurnGaeArgs& p);
cudaError_t launch_group_advantages(const GroupAdvantagesArgs& p);
// stats[0..2] (sum, count, mean).
cudaError_t launch_masked_sum_count(const MaskedStatsArgs& p);
// stats[3] (variance about stats[2]); run after launch_masked_sum_count on the same stream.
cudaError_t launch_masked_variance(const MaskedStatsArgs& p);
cudaError_t launch_masked_whiten(const MaskedWhitenArgs& p);
cudaError_t launch_masked_mean_dim(const MaskedMeanDimArgs& p);

}  // namespace cuda
}  // namespace pyppo
