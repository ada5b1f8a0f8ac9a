// qlora-mpi.cpp - several processes over MPI: the definitions of qlora.h's ql_dist_* that replace
// the library's one-process weak ones when this object is linked in (make MPI=1, -DQLORA_MPI=ON).
//
// mpirun starts the processes; MPI_COMM_WORLD is the job. Only the calling (main) thread uses MPI
// (MPI_THREAD_FUNNELED: the CPU backend's workers never do). Errors come back as statuses
// (MPI_ERRORS_RETURN) for the caller to name; a rank that dies is mpirun's to notice, which ends
// the job and names the rank and its signal or exit code.
//
// On GPUs (make MPI=1 CUDA=1 compiles the NCCL part, QL_DIST_NCCL): ql_dist_allreduce_device_f32 sums
// buffers in device memory with NCCL, its id made by rank 0 and broadcast over MPI (llm.c's
// pattern). Without it, that call says QL_ERR_UNSUPPORTED and the trainer stages through the host.
#include "qlora.h"

#define OMPI_SKIP_MPICXX 1   // the C API only: Open MPI's and MPICH's C++ bindings (deprecated) left out
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

bool g_init = false;       // ql_dist_init succeeded: MPI is ours to use and to finalise
int g_rank = 0, g_size = 1, g_local = 0;
char g_name[128] = "one process";

// MPI counts are int: a long buffer goes in pieces
template <class T> ql_status allreduce(T *buf, size_t n, MPI_Datatype type) {
    if (!g_init || g_size == 1 || n == 0) return QL_OK;
    if (!buf) return QL_ERR_INVALID;
    for (size_t at = 0; at < n;) {
        const int k = (int)(n - at < (size_t)INT_MAX ? n - at : (size_t)INT_MAX);
        if (MPI_Allreduce(MPI_IN_PLACE, buf + at, k, type, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS) return QL_ERR_IO;
        at += (size_t)k;
    }
    return QL_OK;
}

}  // namespace

ql_status ql_dist_init(int *argc, char ***argv, char *err, size_t err_size) {
    if (err && err_size) err[0] = 0;
    if (g_init) return QL_OK;
    int provided = 0, rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) {
        if (err && err_size) snprintf(err, err_size, "MPI_Init_thread failed (error %d)", rc);
        return QL_ERR_IO;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    MPI_Comm local;  // the processes that share this machine's memory: the local rank picks the GPU
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &local) == MPI_SUCCESS) {
        MPI_Comm_rank(local, &g_local);
        MPI_Comm_free(&local);
    }
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(lib, &len);
    lib[strcspn(lib, ",\n")] = 0;  // "Open MPI v4.1.4, package: ..." -> "Open MPI v4.1.4"
    snprintf(g_name, sizeof(g_name), "%.*s", (int)sizeof(g_name) - 1, lib);
    g_init = true;
    return QL_OK;
}

// ---- NCCL: sums in a GPU's memory (built only with CUDA: the one part of this file that needs it) ----
#if defined(QL_DIST_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

namespace {

ncclComm_t g_nccl = nullptr;
cudaStream_t g_nccl_stream = nullptr;

// The job's communicator on this process's current device (the backend's: ql_backend_cuda_init
// set it), made at the first device all-reduce: rank 0's id broadcast over MPI.
// limitation: NCCL's own device memory (its buffers, tens of MiB per peer) is not in the memory plan.
ql_status nccl_setup() {
    if (g_nccl) return QL_OK;
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    if (g_rank == 0 && ncclGetUniqueId(&id) != ncclSuccess) return QL_ERR_IO;  // (the caller's failure stops the job)
    if (MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS) return QL_ERR_IO;
    if (cudaStreamCreateWithFlags(&g_nccl_stream, cudaStreamNonBlocking) != cudaSuccess) return QL_ERR_IO;
    if (ncclCommInitRank(&g_nccl, g_size, id, g_rank) != ncclSuccess) {
        g_nccl = nullptr;
        return QL_ERR_IO;
    }
    return QL_OK;
}

void nccl_free() {
    if (g_nccl) ncclCommDestroy(g_nccl);
    if (g_nccl_stream) cudaStreamDestroy(g_nccl_stream);
    g_nccl = nullptr, g_nccl_stream = nullptr;
}

}  // namespace

ql_status ql_dist_allreduce_device_f32(ql_backend *be, float *const *bufs, const size_t *n, int count) {
    if (!be || !ql_backend_is_cuda(be)) return QL_ERR_UNSUPPORTED;
    if (!g_init || count == 0) return QL_OK;  // (one rank too: a check of NCCL on a machine with one GPU)
    if (!bufs || !n || count < 0) return QL_ERR_INVALID;
    if (ql_backend_synchronize(be) != QL_OK) return QL_ERR_IO;  // the buffers are complete on the backend's stream
    const ql_status st = nccl_setup();
    if (st != QL_OK) return st;
    bool ok = ncclGroupStart() == ncclSuccess;  // one collective for all of them
    for (int i = 0; ok && i < count; i++)
        ok = ncclAllReduce(bufs[i], bufs[i], n[i], ncclFloat, ncclSum, g_nccl, g_nccl_stream) == ncclSuccess;
    ok = ncclGroupEnd() == ncclSuccess && ok;
    return ok && cudaStreamSynchronize(g_nccl_stream) == cudaSuccess ? QL_OK : QL_ERR_IO;
}
#else
static void nccl_free() {}
#endif

void ql_dist_free(void) {
    if (!g_init) return;
    nccl_free();
    MPI_Finalize();
    g_init = false;
}

int ql_dist_rank(void) { return g_rank; }
int ql_dist_size(void) { return g_size; }
int ql_dist_local_rank(void) { return g_local; }
const char *ql_dist_name(void) { return g_name; }

ql_status ql_dist_allreduce_f32(float *buf, size_t n) { return allreduce(buf, n, MPI_FLOAT); }
ql_status ql_dist_allreduce_f64(double *buf, size_t n) { return allreduce(buf, n, MPI_DOUBLE); }
ql_status ql_dist_allreduce_i64(int64_t *buf, size_t n) { return allreduce(buf, n, MPI_INT64_T); }

ql_status ql_dist_broadcast(void *buf, size_t bytes, int root) {
    if (root < 0 || root >= g_size) return QL_ERR_INVALID;
    if (!g_init || g_size == 1 || bytes == 0) return QL_OK;
    if (!buf) return QL_ERR_INVALID;
    for (size_t at = 0; at < bytes;) {
        const int k = (int)(bytes - at < (size_t)INT_MAX ? bytes - at : (size_t)INT_MAX);
        if (MPI_Bcast((char *)buf + at, k, MPI_BYTE, root, MPI_COMM_WORLD) != MPI_SUCCESS) return QL_ERR_IO;
        at += (size_t)k;
    }
    return QL_OK;
}

ql_status ql_dist_barrier(void) {
    if (!g_init || g_size == 1) return QL_OK;
    return MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS ? QL_OK : QL_ERR_IO;
}

void ql_dist_abort(int code, const char *msg) {
    fprintf(stderr, "rank %d of %d: %s\n", g_rank, g_size, msg ? msg : "");
    fflush(stderr);
    fflush(stdout);
    if (g_init) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);  // (MPI_Abort does not return; without MPI started: this process alone)
}
