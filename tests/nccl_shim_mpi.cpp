// tests/nccl_shim_mpi.cpp - qlora-mpi.cpp with its NCCL part (QL_DIST_NCCL) on tests/nccl_shim.h:
// NCCL on MPI over the CUDA shim's device memory. Linked with tests/cuda_shim_backend.cpp into
// build/mpi/finetune-shim, whose mpirun -np 2 runs the data-parallel GPU path on the CPU.
#include "nccl_shim.h"

#define QL_DIST_NCCL 1
#include "../qlora-mpi.cpp"
