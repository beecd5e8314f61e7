# CUDA kernels of pyppo (csrc/cuda): kernel bodies in kernels/<family>_kernel.cu (CUDA headers and
# csrc/cuda/kernels/kernels.h only), their ATen implementation and CUDA registration in
# <family>_impl.cpp, named as the CPU side's csrc/cpu/<family>_impl.cpp. Included from CMakeLists.txt once target _C exists (its warning flags
# are C++-only there, since nvcc rejects -Wall): include(cmake/cuda.cmake)
#
#   PYPPO_CUDA=auto (default)  build them when the installed torch has CUDA and nvcc is found
#   PYPPO_CUDA=on              the same, but a missing torch CUDA or nvcc is an error
#   PYPPO_CUDA=off             CPU only; nothing is added
#   TORCH_CUDA_ARCH_LIST       architectures, e.g. "8.0;9.0" (the default) or "8.0 9.0+PTX";
#                              a -D value wins over the environment variable of that name
#   PYPPO_TORCH_CUDA_VERSION   torch's CUDA version; asked from the Python interpreter when
#                              unset (set it only to cross-configure)
#
# With CUDA on, _C gets PYPPO_WITH_CUDA and PYPPO_CUDA_ARCHS="8.0,9.0" (read by bindings.cpp,
# shown by `pyppo info`).

set(PYPPO_CUDA "auto" CACHE STRING "Build the CUDA kernels: auto (if torch has CUDA and nvcc is found), on, off")
set_property(CACHE PYPPO_CUDA PROPERTY STRINGS auto on off)
string(TOLOWER "${PYPPO_CUDA}" _pyppo_cuda_mode)
if(NOT _pyppo_cuda_mode MATCHES "^(auto|on|off)$")
  message(FATAL_ERROR "pyppo: PYPPO_CUDA must be auto, on or off, got '${PYPPO_CUDA}'")
endif()

set(_pyppo_cuda_enable OFF)
set(_pyppo_cuda_why "")
if(NOT _pyppo_cuda_mode STREQUAL "off")
  # 1. Does the torch we build against have CUDA? Ask the interpreter that will import us.
  if(NOT DEFINED PYPPO_TORCH_CUDA_VERSION)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "import torch; print(torch.version.cuda or '', end='')"
      OUTPUT_VARIABLE _pyppo_torch_cuda
      RESULT_VARIABLE _pyppo_torch_cuda_rc
      ERROR_QUIET)
    if(NOT _pyppo_torch_cuda_rc EQUAL 0)
      set(_pyppo_torch_cuda "")
    endif()
    set(PYPPO_TORCH_CUDA_VERSION "${_pyppo_torch_cuda}")
  endif()

  # 2. Is there an nvcc? CMAKE_CUDA_COMPILER (or CUDACXX) first, then PATH, CUDA_HOME, CUDA_PATH
  #    and /usr/local/cuda. find_package(Torch) may already have enabled CUDA for us.
  get_property(_pyppo_langs GLOBAL PROPERTY ENABLED_LANGUAGES)
  set(_pyppo_nvcc "")
  if("CUDA" IN_LIST _pyppo_langs)
    set(_pyppo_nvcc "${CMAKE_CUDA_COMPILER}")
  elseif(CMAKE_CUDA_COMPILER)
    set(_pyppo_nvcc "${CMAKE_CUDA_COMPILER}")
  elseif(DEFINED ENV{CUDACXX} AND EXISTS "$ENV{CUDACXX}")
    set(_pyppo_nvcc "$ENV{CUDACXX}")
  else()
    find_program(PYPPO_NVCC nvcc
      HINTS ENV CUDA_HOME ENV CUDA_PATH
      PATH_SUFFIXES bin
      PATHS /usr/local/cuda/bin)
    if(PYPPO_NVCC)
      set(_pyppo_nvcc "${PYPPO_NVCC}")
    endif()
  endif()

  if(PYPPO_TORCH_CUDA_VERSION STREQUAL "")
    set(_pyppo_cuda_why "the installed torch has no CUDA (torch.version.cuda is None)")
  elseif(_pyppo_nvcc STREQUAL "")
    set(_pyppo_cuda_why "nvcc was not found (set CUDACXX or CMAKE_CUDA_COMPILER, or put nvcc on PATH)")
  else()
    set(_pyppo_cuda_enable ON)
  endif()
  if(NOT _pyppo_cuda_enable AND _pyppo_cuda_mode STREQUAL "on")
    message(FATAL_ERROR "pyppo: PYPPO_CUDA=on but ${_pyppo_cuda_why}")
  endif()
endif()

if(NOT _pyppo_cuda_enable)
  if(_pyppo_cuda_mode STREQUAL "off")
    message(STATUS "pyppo: CUDA kernels off (PYPPO_CUDA=off)")
  else()
    message(STATUS "pyppo: CUDA kernels off: ${_pyppo_cuda_why}")
  endif()
  return()
endif()

# ---- CUDA on ----
if(NOT "CUDA" IN_LIST _pyppo_langs)
  set(CMAKE_CUDA_COMPILER "${_pyppo_nvcc}" CACHE FILEPATH "CUDA compiler" FORCE)
  enable_language(CUDA)
endif()
find_package(CUDAToolkit REQUIRED)

# Architectures: TORCH_CUDA_ARCH_LIST (a CMake variable, else the environment), default 8.0;9.0.
if(DEFINED TORCH_CUDA_ARCH_LIST AND NOT "${TORCH_CUDA_ARCH_LIST}" STREQUAL "")
  set(_pyppo_archs "${TORCH_CUDA_ARCH_LIST}")
elseif(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
  set(_pyppo_archs "$ENV{TORCH_CUDA_ARCH_LIST}")
else()
  set(_pyppo_archs "8.0;9.0")
endif()
string(REPLACE " " ";" _pyppo_archs "${_pyppo_archs}")
set(_pyppo_gencode "")
set(_pyppo_arch_names "")
foreach(_a IN LISTS _pyppo_archs)
  if(_a STREQUAL "")
    continue()
  endif()
  if(NOT _a MATCHES "^([0-9]+)\\.([0-9]+)([a-z]?)(\\+PTX)?$")
    message(FATAL_ERROR "pyppo: TORCH_CUDA_ARCH_LIST entry '${_a}' is not of the form 8.0, 9.0a or 9.0+PTX")
  endif()
  set(_sm "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
  if(CMAKE_MATCH_4)
    list(APPEND _pyppo_gencode "--generate-code=arch=compute_${_sm},code=[sm_${_sm},compute_${_sm}]")
  else()
    list(APPEND _pyppo_gencode "--generate-code=arch=compute_${_sm},code=[sm_${_sm}]")
  endif()
  list(APPEND _pyppo_arch_names "${_a}")
endforeach()
if(NOT _pyppo_gencode)
  message(FATAL_ERROR "pyppo: TORCH_CUDA_ARCH_LIST names no architecture")
endif()
list(JOIN _pyppo_arch_names "," PYPPO_CUDA_ARCHS)

# find_package(Torch) appends -gencode flags of its own choosing (the GPU it detected, or its
# TORCH_CUDA_ARCH_LIST) to CMAKE_CUDA_FLAGS; drop them so the architectures are exactly ours.
string(REGEX REPLACE "-gencode[ =]+arch=[^ ]+" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")

file(GLOB PYPPO_CUDA_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/kernels/*_kernel.cu")
file(GLOB PYPPO_CUDA_IMPL_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*_impl.cpp")
target_sources(_C PRIVATE ${PYPPO_CUDA_SOURCES} ${PYPPO_CUDA_IMPL_SOURCES})
set_target_properties(_C PROPERTIES
  CUDA_ARCHITECTURES OFF          # the --generate-code flags below say it
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CUDA_RUNTIME_LIBRARY Shared)    # the libcudart torch loads, not a second static copy
foreach(_g IN LISTS _pyppo_gencode)
  target_compile_options(_C PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:${_g}>")
endforeach()
# kl_estimators.h calls std::numeric_limits<T>::infinity() (constexpr) from __host__ __device__ code.
target_compile_options(_C PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>")
target_link_libraries(_C PRIVATE CUDA::cudart)
target_compile_definitions(_C PRIVATE PYPPO_WITH_CUDA=1 "PYPPO_CUDA_ARCHS=\"${PYPPO_CUDA_ARCHS}\"")
message(STATUS "pyppo: CUDA kernels on: torch CUDA ${PYPPO_TORCH_CUDA_VERSION}, nvcc ${CMAKE_CUDA_COMPILER}, "
               "architectures ${PYPPO_CUDA_ARCHS}")
