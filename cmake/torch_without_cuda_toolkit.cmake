# Lets find_package(Torch) take every torch wheel: the CPU build, and the CUDA builds (PyPI's
# torch on x86_64 Linux) with or without a CUDA toolkit on the machine. Included before
# find_package(Torch) by CMakeLists.txt and, installed beside it, by tensordictConfig.cmake.
#
# A CUDA build of torch makes its own config (share/cmake/Caffe2/Caffe2Config.cmake) include
# public/cuda.cmake, which wants a CUDA toolkit that CMake can use as a language:
# find_package(CUDA), enable_language(CUDA), find_package(CUDAToolkit) of nvcc's version. Without
# a toolkit it stops with "Your installed Caffe2 version uses CUDA but I cannot find the CUDA
# libraries", and with one it can stop too (CMake 3.25 and CUDA 13.0: "requires the language
# dialect CUDA20 ... the current compiler NVIDIA does not support this"). Nothing of ours compiles
# CUDA or calls the CUDA runtime: linking torch's libraries is all we need, and
# libtorch_cuda.so finds the CUDA libraries of the nvidia-* wheels through its own RUNPATH, at
# link and at run time.
#
# cuda.cmake begins with an include guard, `if(TARGET torch::cudart) return()`, and otherwise
# defines torch::cudart as CUDA::cudart, the one target of its own that torch's exported targets
# (c10_cuda, torch_cuda) link. Defined here first, as an empty interface, it makes cuda.cmake
# return at once: find_package(Torch) then defines torch's targets, torch_cuda among them, the
# same way with a toolkit or without, and looks for none. A CPU build of torch never includes
# cuda.cmake, so the target is unused there.
#
# A project that compiles CUDA against torch itself, with a toolkit torch's config accepts, calls
# find_package(Torch) before find_package(tensordict): torch::cudart is then torch's own.
if(NOT TARGET torch::cudart)
  add_library(torch::cudart INTERFACE IMPORTED)
endif()
