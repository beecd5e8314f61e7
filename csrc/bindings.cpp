// The Python module object `pyppo._C`. Loading it also runs the TORCH_LIBRARY registrations
// compiled into the same library; pybind only carries build information.
#include <ATen/Parallel.h>

#include "cpu/kernels/kernels.h"
#include <pybind11/pybind11.h>

#include <string>

#ifndef PYPPO_VERSION
#define PYPPO_VERSION "unknown"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyppo compiled operators (registered as torch.ops.pyppo.*)";
  m.attr("__version__") = PYPPO_VERSION;
  m.attr("torch_version") = PYPPO_TORCH_VERSION;
#ifdef PYPPO_WITH_CUDA
  m.attr("with_cuda") = true;
  m.attr("cuda_archs") = PYPPO_CUDA_ARCHS;
#else
  m.attr("with_cuda") = false;
  m.attr("cuda_archs") = "";
#endif
#ifdef PYPPO_OPENMP
  m.attr("with_openmp") = true;
#else
  m.attr("with_openmp") = false;
#endif
  m.attr("build_type") = PYPPO_BUILD_TYPE;
  m.attr("compiler") =
#if defined(__clang__)
      "clang " __clang_version__;
#elif defined(__GNUC__)
      "gcc " __VERSION__;
#else
      "unknown";
#endif
  m.attr("cpu_isas") = PYPPO_CPU_ISAS;
  m.def("cpu_capability", []() { return std::string(pyppo::cpu::cpu_kernels().name); },
        "Instruction set of the CPU kernels in use (DEFAULT, AVX2 or AVX512); PYPPO_CPU_CAPABILITY caps it.");
  m.def("num_threads", []() { return at::get_num_threads(); },
        "Threads that at::parallel_for (and so every pyppo CPU kernel) uses.");
}
