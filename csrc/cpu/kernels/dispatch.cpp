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

const KernelTable kDefault{"DEFAULT", &DEFAULT::gather_fwd, &DEFAULT::gather_bwd, &DEFAULT::kl_fwd, &DEFAULT::kl_bwd};
#ifdef PYPPO_HAVE_AVX2
const KernelTable kAvx2{"AVX2", &AVX2::gather_fwd, &AVX2::gather_bwd, &AVX2::kl_fwd, &AVX2::kl_bwd};
#endif
#ifdef PYPPO_HAVE_AVX512
const KernelTable kAvx512{"AVX512", &AVX512::gather_fwd, &AVX512::gather_bwd, &AVX512::kl_fwd, &AVX512::kl_bwd};
#endif

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
