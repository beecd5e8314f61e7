// The CPU kernels that are compiled once per instruction set (DEFAULT, AVX2, AVX512) and
// chosen at run time: a wheel built here runs on any x86-64, yet uses the widest vector unit
// the machine has. The CPU impls (cpu/<family>_impl.cpp: checks, allocation) call them through
// cpu_kernels(); their argument structs are `*Args`, as the CUDA kernels' (cuda/kernels/kernels.h).
#pragma once

#include <c10/core/ScalarType.h>

#include "row_layout.h"

#include <cstdint>

namespace pyppo {
namespace cpu {

struct GatherFwdArgs {
  c10::ScalarType dtype;      // of logits; outputs are float (double for double logits)
  const void* logits;         // [*, V], unit stride along V, rows where `rows` says
  RowLayout rows;
  int64_t N, V;
  const int64_t* labels;      // [N]
  const bool* mask;           // [N] or nullptr
  int64_t ignore_index;
  double temperature;
  void* logprobs;             // [N]
  void* lse;                  // [N]
  void* entropy;              // [N] or nullptr
};

struct GatherBwdArgs {
  c10::ScalarType dtype;
  const void* logits;         // [*, V], unit stride along V, rows where `rows` says
  RowLayout rows;
  int64_t N, V;
  const int64_t* labels;
  const bool* mask;
  int64_t ignore_index;
  double temperature;
  const void* grad_logprobs;  // [N], accumulation dtype
  const void* grad_entropy;   // [N] or nullptr
  const void* lse;            // [N]
  const void* entropy;        // [N] or nullptr
  void* grad_logits;          // [N, V] contiguous, logits' dtype
};

// kl_penalty over n contiguous elements of the accumulation dtype (float or double).
struct KLArgs {
  c10::ScalarType dtype;
  int32_t estimator;          // a KLEstimator
  bool has_lo = false, has_hi = false;
  double lo = 0, hi = 0;
  const void* logprobs;
  const void* ref_logprobs;
  const void* grad = nullptr; // backward only: d loss / d kl
  void* out;                  // kl (forward) or d loss / d logprobs (backward)
  int64_t n;
};

// gae over [B, T] contiguous arrays of the accumulation dtype (float or double). The advantages
// use lam (row_lam[b] where given); the returns use lam_critic where has_lam_critic, else the
// advantages' lam, from the same scan.
struct GaeArgs {
  c10::ScalarType dtype;
  int64_t B, T;
  const void* rewards;
  const void* values;
  const bool* mask;
  const void* last_values;    // [B] or nullptr
  double gamma, lam;
  const double* row_lam = nullptr;  // [B] or nullptr: each row's lam, replacing lam
  bool has_lam_critic = false;
  double lam_critic = 0;
  void* advantages;
  void* returns;
};

// turn_gae over [B, T] contiguous arrays of the accumulation dtype (float or double), turn_ids
// [B, T] int64 (negative: not an agent position).
struct TurnGaeArgs {
  c10::ScalarType dtype;
  int64_t B, T;
  const void* rewards;
  const void* values;
  const int64_t* turn_ids;
  const void* last_values;    // [B] or nullptr
  double gamma, lam;
  void* advantages;
  void* returns;
};

// group_advantages: scores [B] and advantages [B, T] contiguous in the accumulation dtype (float
// or double), mask [B, T] bool, and the groups: group_size > 0 (B / group_size groups of
// group_size consecutive rows; group_ids unused) or group_ids [B] already checked to lie in
// [0, B) (group_size 0).
struct GroupAdvantagesArgs {
  c10::ScalarType dtype;
  int64_t B, T;
  const void* scores;
  int64_t group_size;
  const int64_t* group_ids;
  const bool* mask;
  bool rloo, std_normalize;
  double eps;
  void* advantages;
};

// The masked statistics over n contiguous elements of the accumulation dtype.
struct MaskedArgs {
  c10::ScalarType dtype;
  const void* x;
  const bool* mask;
  int64_t n;
};

struct MaskedMoments {
  double sum = 0;
  int64_t count = 0;
};

struct KernelTable {
  const char* name;
  void (*gather_fwd)(const GatherFwdArgs&);
  void (*gather_bwd)(const GatherBwdArgs&);
  void (*kl_fwd)(const KLArgs&);
  void (*kl_bwd)(const KLArgs&);
  void (*gae)(const GaeArgs&);
  void (*turn_gae)(const TurnGaeArgs&);
  // Returns the first row whose score is not finite (then nothing is written) or -1.
  int64_t (*group_advantages)(const GroupAdvantagesArgs&);
  MaskedMoments (*masked_sum)(const MaskedArgs&);
  double (*masked_sq_dev)(const MaskedArgs&, double mean);  // sum of (x - mean)^2 over valid x
  // out = valid ? (x - mean) * inv_std + add_back : 0
  void (*masked_whiten)(const MaskedArgs&, double mean, double inv_std, double add_back, void* out);
  // Means of the rows of x [n / L, L] into out; returns the first all-masked row (then nothing
  // is written) or -1.
  int64_t (*masked_mean_rows)(const MaskedArgs&, int64_t L, void* out);
};

// The table for this machine: the widest of AVX512 / AVX2 / DEFAULT that both the build and
// the CPU support, or the one named by the environment variable PYPPO_CPU_CAPABILITY.
const KernelTable& cpu_kernels();

#define PYPPO_DECLARE_ISA(ISA)                                                                  \
  namespace ISA {                                                                               \
  void gather_fwd(const GatherFwdArgs& a);                                                      \
  void gather_bwd(const GatherBwdArgs& a);                                                      \
  void kl_fwd(const KLArgs& a);                                                                 \
  void kl_bwd(const KLArgs& a);                                                                 \
  void gae(const GaeArgs& a);                                                                   \
  void turn_gae(const TurnGaeArgs& a);                                                          \
  int64_t group_advantages(const GroupAdvantagesArgs& a);                                       \
  MaskedMoments masked_sum(const MaskedArgs& a);                                                \
  double masked_sq_dev(const MaskedArgs& a, double mean);                                       \
  void masked_whiten(const MaskedArgs& a, double mean, double inv_std, double add_back, void* out); \
  int64_t masked_mean_rows(const MaskedArgs& a, int64_t L, void* out);                          \
  }
PYPPO_DECLARE_ISA(DEFAULT)
PYPPO_DECLARE_ISA(AVX2)
PYPPO_DECLARE_ISA(AVX512)
#undef PYPPO_DECLARE_ISA

}  // namespace cpu
}  // namespace pyppo
