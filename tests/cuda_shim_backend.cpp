// tests/cuda_shim_backend.cpp - the CUDA backend (qlora-cuda.cu) compiled as host C++: its kernels
// run on the CPU through tests/cuda_shim.h, so build/test-cuda-shim tests them without a GPU.
#include "cuda_shim.h"

#include "../qlora-cuda.cu"
