// Picks the per-ISA kernel table once per process.
#include "cpu/kernels/kernels.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace pyppo {
namespace cpu {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#define PYPPO_KERNEL_TABLE(ISA)                                                                            \
  KernelTable {                                                                                            \
    #ISA, &ISA::gather_fwd, &ISA::gather_bwd, &ISA::kl_fwd, &ISA::kl_bwd, &ISA::gae, &ISA::turn_gae,       \
        &ISA::group_advantages, &ISA::masked_sum, &ISA::masked_sq_dev, &ISA::masked_whiten,                \
        &ISA::masked_mean_rows                                                                             \
  }
const KernelTable kDefault = PYPPO_KERNEL_TABLE(DEFAULT);
#ifdef PYPPO_HAVE_AVX2
const KernelTable kAvx2 = PYPPO_KERNEL_TABLE(AVX2);
#endif
#ifdef PYPPO_HAVE_AVX512
const KernelTable kAvx512 = PYPPO_KERNEL_TABLE(AVX512);
#endif
#undef PYPPO_KERNEL_TABLE

const KernelTable& choose() {
  const char* env = std::getenv("PYPPO_CPU_CAPABILITY");
  std::string want = env ? env : "";
  for (auto& c : want) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  TORCH_CHECK_VALUE(want.empty() || want == "DEFAULT" || want == "AVX2" || want == "AVX512",
                    "PYPPO_CPU_CAPABILITY must be one of default, avx2, avx512; got '", env, "'");
#ifdef PYPPO_HAVE_AVX512
  if ((want.empty() || want == "AVX512") && cpu_has_avx512()) return kAvx512;
#endif
#ifdef PYPPO_HAVE_AVX2
  if ((want.empty() || want == "AVX512" || want == "AVX2") && cpu_has_avx2()) return kAvx2;
#endif
  return kDefault;
}

}  // namespace

const KernelTable& cpu_kernels() {
  static const KernelTable& table = choose();
  return table;
}

}  // namespace cpu
}  // namespace pyppo
