// tests/nccl_shim_selftest.cpp - tests/nccl_shim.h itself, under mpirun -np 2 (tests/mpi.sh part 5):
// sums in place and not, in stream order, grouped, in a CUDA graph; and what it refuses as NCCL does. Exits 0 when
// every check holds, printing each one that fails.
#include "nccl_shim.h"

#include <cstdint>

static int g_failed = 0;
#define CHECK(c) \
    do { \
        if (!(c)) fprintf(stderr, "nccl-shim-selftest: %s:%d: failed: %s\n", __FILE__, __LINE__, #c), g_failed++; \
    } while (0)

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != 2) {
        fprintf(stderr, "nccl-shim-selftest: run it under mpirun -np 2\n");
        MPI_Finalize();
        return 2;
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));

    // a rank that is not MPI's: every rank fails (none waits in a collective)
    ncclComm_t comm = nullptr;
    if (rank == 0) CHECK(ncclGetUniqueId(&id) == ncclSuccess);
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    CHECK(ncclCommInitRank(&comm, 2, id, 1 - rank) == ncclInvalidArgument && !comm);
    // one device (QL_SHIM_DEVICES=2 gives two; each rank takes its own): NCCL's duplicate GPU
    CHECK(cudaSetDevice(0) == cudaSuccess);
    CHECK(ncclCommInitRank(&comm, 2, id, rank) == ncclInvalidUsage && !comm);
    CHECK(strstr(ncclGetLastError(nullptr), "Duplicate GPU detected") != nullptr);
    CHECK(cudaSetDevice(rank) == cudaSuccess);
    // an id that is not rank 0's
    ncclUniqueId own;
    CHECK(ncclGetUniqueId(&own) == ncclSuccess);
    CHECK(ncclCommInitRank(&comm, 2, rank == 0 ? id : own, rank) == ncclInvalidArgument && !comm);
    CHECK(ncclCommInitRank(&comm, 2, id, rank) == ncclSuccess && comm);
    int v = -1;
    CHECK(ncclCommCount(comm, &v) == ncclSuccess && v == 2);
    CHECK(ncclCommUserRank(comm, &v) == ncclSuccess && v == rank);
    CHECK(ncclCommCuDevice(comm, &v) == ncclSuccess && v == rank);

    const size_t n = 1000;
    float *d = nullptr;  // [3n]: x, y, z
    CHECK(cudaMalloc((void **)&d, 3 * n * sizeof(float)) == cudaSuccess);
    std::vector<float> h(3 * n), out(3 * n);
    for (size_t i = 0; i < 3 * n; i++) h[i] = (float)(i % 97) * 0.25f + (float)rank;
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s) == cudaSuccess);

    // in place and out of place in one group, behind a copy on the same stream: every element summed
    CHECK(cudaMemcpyAsync(d, h.data(), 3 * n * sizeof(float), cudaMemcpyHostToDevice, s) == cudaSuccess);
    CHECK(ncclGroupStart() == ncclSuccess);
    CHECK(ncclAllReduce(d, d, n, ncclFloat, ncclSum, comm, s) == ncclSuccess);          // x in place
    CHECK(ncclAllReduce(d + n, d + 2 * n, n, ncclFloat, ncclSum, comm, s) == ncclSuccess);  // y -> z
    CHECK(ncclGroupEnd() == ncclSuccess);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(cudaMemcpy(out.data(), d, 3 * n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    bool sums = true;
    for (size_t i = 0; i < n; i++) {
        const float x = (float)(i % 97) * 0.25f, y = (float)((n + i) % 97) * 0.25f;
        sums = sums && out[i] == 2 * x + 1 && out[n + i] == y + rank && out[2 * n + i] == 2 * y + 1;
    }
    CHECK(sums);

    // f64 max, on the legacy stream (at once)
    double *dd = nullptr;
    CHECK(cudaMalloc((void **)&dd, 4 * sizeof(double)) == cudaSuccess);
    const double hd[4] = {1.0 + rank, -3.0 * rank, 0.5, 7.0 - rank};
    CHECK(cudaMemcpy(dd, hd, sizeof(hd), cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(ncclAllReduce(dd, dd, 4, ncclDouble, ncclMax, comm, nullptr) == ncclSuccess);
    double od[4];
    CHECK(cudaMemcpy(od, dd, sizeof(od), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(od[0] == 2.0 && od[1] == 0.0 && od[2] == 0.5 && od[3] == 7.0);

    // what NCCL refuses: host memory, past an allocation's end, overlap, a type the shim lacks
    CHECK(ncclAllReduce(h.data(), h.data(), n, ncclFloat, ncclSum, comm, s) == ncclInvalidArgument);
    CHECK(ncclAllReduce(d + 2 * n, d + 2 * n, n + 1, ncclFloat, ncclSum, comm, s) == ncclInvalidArgument);
    CHECK(ncclAllReduce(d, d + 1, n, ncclFloat, ncclSum, comm, s) == ncclInvalidArgument);
    CHECK(ncclAllReduce(d, d, n, ncclBfloat16, ncclSum, comm, s) == ncclInvalidArgument);
    CHECK(ncclAllReduce(d, d, n, ncclFloat, ncclAvg, comm, s) == ncclInvalidArgument);
    CHECK(ncclAllReduce(d, d, n, ncclFloat, ncclSum, nullptr, s) == ncclInvalidArgument);
    CHECK(ncclGroupEnd() == ncclInvalidUsage);
    // a group with a bad call: ncclGroupEnd fails and none of it runs
    CHECK(cudaMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(ncclGroupStart() == ncclSuccess);
    CHECK(ncclAllReduce(d, d, n, ncclFloat, ncclSum, comm, s) == ncclSuccess);
    CHECK(ncclAllReduce(h.data(), h.data(), n, ncclFloat, ncclSum, comm, s) == ncclInvalidArgument);
    CHECK(ncclGroupEnd() == ncclInvalidArgument);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(cudaMemcpy(out.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(memcmp(out.data(), h.data(), n * sizeof(float)) == 0);

    // alone (no group), i64
    int64_t *di = nullptr;
    CHECK(cudaMalloc((void **)&di, sizeof(int64_t)) == cudaSuccess);
    const int64_t one = (int64_t)1 << 40;
    CHECK(cudaMemcpy(di, &one, sizeof(one), cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(ncclAllReduce(di, di, 1, ncclInt64, ncclSum, comm, s) == ncclSuccess);
    int64_t got = 0;
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(cudaMemcpy(&got, di, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess && got == 2 * one);
    // captured in a CUDA graph: each replay sums again (1 + 2 -> 3 -> 6)
    float *dg = nullptr;
    CHECK(cudaMalloc((void **)&dg, sizeof(float)) == cudaSuccess);
    const float fv = 1.0f + (float)rank;
    CHECK(cudaMemcpy(dg, &fv, sizeof(fv), cudaMemcpyHostToDevice) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    CHECK(ncclAllReduce(dg, dg, 1, ncclFloat, ncclSum, comm, s) == ncclSuccess);
    CHECK(cudaStreamEndCapture(s, &graph) == cudaSuccess && graph);
    CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    float fg = 0;
    CHECK(cudaMemcpy(&fg, dg, sizeof(fg), cudaMemcpyDeviceToHost) == cudaSuccess && fg == fv);  // (recorded, not run)
    CHECK(cudaGraphLaunch(exec, s) == cudaSuccess && cudaGraphLaunch(exec, s) == cudaSuccess);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(cudaMemcpy(&fg, dg, sizeof(fg), cudaMemcpyDeviceToHost) == cudaSuccess && fg == 6.0f);
    cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);

    ncclResult_t async = ncclInternalError;
    CHECK(ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess);

    CHECK(ncclCommDestroy(comm) == ncclSuccess);
    CHECK(cudaStreamDestroy(s) == cudaSuccess);
    cudaFree(d), cudaFree(dd), cudaFree(di), cudaFree(dg);
    int failed = g_failed;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("nccl-shim-selftest: %s\n", failed ? "FAILED" : "all checks hold on 2 ranks");
    MPI_Finalize();
    return failed ? 1 : 0;
}
