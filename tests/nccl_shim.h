// tests/nccl_shim.h - NCCL on MPI, for code compiled through tests/cuda_shim.h: each process of an
// mpirun job is one "GPU", so that qlora-mpi.cpp's device all-reduce (QL_DIST_NCCL) runs without one.
//
//   #include "nccl_shim.h"        // cuda_shim.h, mpi.h and NCCL's own nccl.h (its types, signatures)
//   #include "../qlora-mpi.cpp"   // as tests/nccl_shim_mpi.cpp does (build/mpi/finetune-shim)
//
// The model. Shim device memory is host memory, so a collective is the MPI collective over the
// buffers themselves, on a duplicate of MPI_COMM_WORLD, in stream order: ncclAllReduce queues it
// on its stream as the shim queues an async copy, and it runs when the stream is flushed
// (cudaStreamSynchronize, an event waited for, the next launch on that stream); on the legacy
// stream (NULL) at once; in a stream capture it is recorded and runs at each replay. Between
// ncclGroupStart and ncclGroupEnd calls are only checked and collected ("nothing will be started
// on the CUDA stream until ncclGroupEnd"); ncclGroupEnd queues them in call order, each its own
// MPI_Allreduce (f32 sums in f32, as NCCL's), or none if one of them failed its checks.
//
// What it refuses, with NCCL's result codes (the reason on stderr and in ncclGetLastError):
//   - ncclCommInitRank: MPI not initialised (ncclInvalidUsage); nranks or rank not MPI_COMM_WORLD's
//     size and rank, an id not made by ncclGetUniqueId or not the same on every rank (rank 0's
//     broadcast missing), (ncclInvalidArgument); two ranks of one machine on one device (cudaSetDevice's,
//     out of QL_SHIM_DEVICES) - NCCL's "Duplicate GPU detected" (ncclInvalidUsage). Every rank takes
//     part in the check and all fail together (no rank left waiting in a collective);
//   - a collective: no communicator; a type or operation the shim lacks; a buffer not inside one
//     cudaMalloc block (host memory; past the end); send and receive buffers that overlap
//     without being the same (in place) (ncclInvalidArgument);
//   - ncclGroupEnd without ncclGroupStart (ncclInvalidUsage).
// A collective that fails as it runs (MPI's error) leaves the communicator's async error
// (ncclCommGetAsyncError) and the shim's sticky CUDA error: the stream's synchronisation fails.
//
// limitation: 16-bit and 8-bit floats and ncclAvg are refused (MPI has no half-precision sum);
// ncclCommInitRank inside a group is refused; collectives other than all-reduce are not here.
#pragma once

#include "cuda_shim.h"

#define OMPI_SKIP_MPICXX 1  // (as qlora-mpi.cpp: MPI's C API only)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>

#include <unistd.h>

#include <climits>
#include <set>

struct ncclComm {
    MPI_Comm mpi = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD: its collectives apart from the caller's
    int rank = 0, size = 1, device = 0;
    ncclResult_t async = ncclSuccess;  // a collective that failed as it ran
    std::set<cudaStream_t> streams;    // the streams it queued work on (flushed by ncclCommDestroy)
    long long launches = 0, runs = 0, bytes = 0;  // groups (or lone calls) issued; all-reduces run, their bytes
};

namespace qlshim {
namespace nccl {

// one collective, as called
struct op_t {
    const void *send;
    void *recv;
    size_t count;
    MPI_Datatype type;
    MPI_Op op;
    ncclComm_t comm;
    cudaStream_t stream;
};
struct group_t {  // NCCL's group state is per host thread
    int depth = 0;
    ncclResult_t failed = ncclSuccess;  // a call of the group failed its checks: ncclGroupEnd says so, runs none
    std::vector<op_t> ops;
};
inline group_t &group() {
    static thread_local group_t g;
    return g;
}
inline std::string &last_error() {
    static std::string s;
    return s;
}
inline ncclResult_t fail(ncclResult_t r, const std::string &why) {
    last_error() = why;
    fprintf(stderr, "qlshim nccl: %s\n", why.c_str());
    return r;
}

inline size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}
inline MPI_Datatype mpi_type(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: return MPI_INT8_T;
    case ncclUint8: return MPI_UINT8_T;
    case ncclInt32: return MPI_INT32_T;
    case ncclUint32: return MPI_UINT32_T;
    case ncclInt64: return MPI_INT64_T;
    case ncclUint64: return MPI_UINT64_T;
    case ncclFloat32: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
    default: return MPI_DATATYPE_NULL;  // limitation: no 16-bit or 8-bit floats
    }
}
inline MPI_Op mpi_op(ncclRedOp_t o) {
    switch (o) {
    case ncclSum: return MPI_SUM;
    case ncclProd: return MPI_PROD;
    case ncclMax: return MPI_MAX;
    case ncclMin: return MPI_MIN;
    default: return MPI_OP_NULL;  // limitation: ncclAvg, ncclRedOpCreatePreMulSum's
    }
}

// [p, p + bytes) inside one device allocation (cudaMalloc's)
inline bool in_device_memory(const void *p, size_t bytes) {
    state_t &s = st();
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.allocs.upper_bound(const_cast<void *>(p));
    if (it == s.allocs.begin()) return false;
    --it;
    const char *base = (const char *)it->first, *q = (const char *)p;
    return q >= base && (size_t)(q - base) <= it->second && bytes <= it->second - (size_t)(q - base);
}

// the collective itself (MPI counts are int: a long buffer in pieces)
inline void run(const op_t &o) {
    int esz = 0;
    MPI_Type_size(o.type, &esz);
    for (size_t at = 0; at < o.count;) {
        const int k = (int)std::min(o.count - at, (size_t)INT_MAX);
        const void *src = o.send == o.recv ? MPI_IN_PLACE : (const void *)((const char *)o.send + at * (size_t)esz);
        if (MPI_Allreduce(src, (char *)o.recv + at * (size_t)esz, k, o.type, o.op, o.comm->mpi) != MPI_SUCCESS) {
            o.comm->async = ncclSystemError;
            const std::string why = "ncclAllReduce: MPI_Allreduce failed (rank " + std::to_string(o.comm->rank) + ")";
            fail(ncclSystemError, why);
            set_sticky(cudaErrorLaunchFailure, why);
            return;
        }
        at += (size_t)k;
    }
    o.comm->runs++;
    o.comm->bytes += (long long)(o.count * (size_t)esz);
    std::lock_guard<std::mutex> lk(st().mu);
    st().stream_ops++;
}
// onto its stream: queued behind the stream's work, recorded in a capture, at once on the legacy stream
inline void issue(const op_t &o) {
    if (!o.stream) return run(o);
    if (capturing(o.stream)) return capture_record(o.stream, [=] { issue(o); });
    o.comm->streams.insert(o.stream);
    o.stream->q.push_back([=] { run(o); });
}

}  // namespace nccl
}  // namespace qlshim

extern "C" {
inline const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}
inline const char *ncclGetLastError(ncclComm_t) { return qlshim::nccl::last_error().c_str(); }

inline ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return qlshim::nccl::fail(ncclInvalidArgument, "ncclGetUniqueId: NULL id");
    memset(id, 0, sizeof(*id));
    static int made = 0;  // this process's, its pid and the time: unique enough for a test
    const long long t = (long long)std::chrono::steady_clock::now().time_since_epoch().count();
    snprintf(id->internal, sizeof(id->internal), "qlshim-nccl %d %lld %d", (int)getpid(), t, made++);
    return ncclSuccess;
}

inline ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    using qlshim::nccl::fail;
    if (!comm) return fail(ncclInvalidArgument, "ncclCommInitRank: NULL comm");
    *comm = nullptr;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) return fail(ncclInvalidUsage, "ncclCommInitRank: the shim's NCCL runs on MPI: MPI_Init first");
    if (qlshim::nccl::group().depth > 0) return fail(ncclInvalidUsage, "ncclCommInitRank inside a group (limitation of the shim)");
    int world_rank = 0, world_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    // what every rank checks of every other: its arguments, its id, its machine and device
    struct who_t {
        int rank, nranks, device;
        char host[MPI_MAX_PROCESSOR_NAME];
        ncclUniqueId id;
    } me;
    memset(&me, 0, sizeof(me));
    me.rank = rank, me.nranks = nranks, me.id = id;
    cudaGetDevice(&me.device);
    int len = 0;
    MPI_Get_processor_name(me.host, &len);
    std::vector<who_t> all((size_t)world_size);
    if (MPI_Allgather(&me, (int)sizeof(me), MPI_BYTE, all.data(), (int)sizeof(me), MPI_BYTE, MPI_COMM_WORLD) != MPI_SUCCESS)
        return fail(ncclSystemError, "ncclCommInitRank: MPI_Allgather failed");
    for (int r = 0; r < world_size; r++) {
        const who_t &w = all[(size_t)r];
        const std::string at = "ncclCommInitRank (MPI rank " + std::to_string(r) + "): ";
        if (w.nranks != world_size || w.rank != r)
            return fail(ncclInvalidArgument, at + "rank " + std::to_string(w.rank) + " of " + std::to_string(w.nranks) +
                                                 ", but MPI_COMM_WORLD's is rank " + std::to_string(r) + " of " + std::to_string(world_size));
        if (strncmp(w.id.internal, "qlshim-nccl ", 12) != 0) return fail(ncclInvalidArgument, at + "an id ncclGetUniqueId did not make");
        if (memcmp(&w.id, &all[0].id, sizeof(ncclUniqueId)) != 0) return fail(ncclInvalidArgument, at + "another id than rank 0's");
        for (int q = 0; q < r; q++)
            if (all[(size_t)q].device == w.device && strcmp(all[(size_t)q].host, w.host) == 0)
                return fail(ncclInvalidUsage, "Duplicate GPU detected : rank " + std::to_string(r) + " and rank " + std::to_string(q) +
                                                  " both on CUDA device " + std::to_string(w.device) + " of " + w.host +
                                                  " (QL_SHIM_DEVICES: how many the shim has)");
    }
    ncclComm *c = new ncclComm();
    c->rank = rank, c->size = nranks, c->device = me.device;
    if (MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi) != MPI_SUCCESS) {
        delete c;
        return fail(ncclSystemError, "ncclCommInitRank: MPI_Comm_dup failed");
    }
    *comm = c;
    return ncclSuccess;
}

inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    for (cudaStream_t s : comm->streams) qlshim::flush_stream(s);  // (its queued collectives hold it)
    // what it did, for a test to see that the collectives ran (tests/mpi-shim.sh)
    fprintf(stderr, "qlshim nccl: rank %d of %d on device %d: %lld launches, %lld all-reduces run, %lld bytes\n", comm->rank,
            comm->size, comm->device, comm->launches, comm->runs, comm->bytes);
    MPI_Comm_free(&comm->mpi);
    delete comm;
    return ncclSuccess;
}
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *e) {
    if (!comm || !e) return qlshim::nccl::fail(ncclInvalidArgument, "ncclCommGetAsyncError: NULL argument");
    *e = comm->async;
    return ncclSuccess;
}
inline ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm || !count) return qlshim::nccl::fail(ncclInvalidArgument, "ncclCommCount: NULL argument");
    *count = comm->size;
    return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!comm || !rank) return qlshim::nccl::fail(ncclInvalidArgument, "ncclCommUserRank: NULL argument");
    *rank = comm->rank;
    return ncclSuccess;
}
inline ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    if (!comm || !device) return qlshim::nccl::fail(ncclInvalidArgument, "ncclCommCuDevice: NULL argument");
    *device = comm->device;
    return ncclSuccess;
}

inline ncclResult_t ncclGroupStart() {
    qlshim::nccl::group().depth++;
    return ncclSuccess;
}
inline ncclResult_t ncclGroupEnd() {
    qlshim::nccl::group_t &g = qlshim::nccl::group();
    if (g.depth == 0) return qlshim::nccl::fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--g.depth > 0) return ncclSuccess;  // (nested: the outermost end issues)
    const ncclResult_t r = g.failed;
    std::vector<qlshim::nccl::op_t> ops;
    ops.swap(g.ops);
    g.failed = ncclSuccess;
    if (r != ncclSuccess) return r;
    std::set<ncclComm_t> comms;  // (a group is one launch per communicator)
    for (const qlshim::nccl::op_t &o : ops) qlshim::nccl::issue(o), comms.insert(o.comm);
    for (ncclComm_t c : comms) c->launches++;
    return ncclSuccess;
}

inline ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) {
    using namespace qlshim::nccl;
    const qlshim::nccl::op_t o = {send, recv, count, mpi_type(type), mpi_op(op), comm, stream};
    const size_t bytes = count * type_size(type);
    ncclResult_t r = ncclSuccess;
    if (!comm) r = fail(ncclInvalidArgument, "ncclAllReduce: NULL comm");
    else if (o.type == MPI_DATATYPE_NULL) r = fail(ncclInvalidArgument, "ncclAllReduce: data type " + std::to_string((int)type) + " (not in the shim)");
    else if (o.op == MPI_OP_NULL) r = fail(ncclInvalidArgument, "ncclAllReduce: reduction " + std::to_string((int)op) + " (not in the shim)");
    else if (count && (!in_device_memory(send, bytes) || !in_device_memory(recv, bytes)))
        r = fail(ncclInvalidArgument, "ncclAllReduce: a buffer of " + std::to_string(bytes) + " bytes not in one device allocation");
    else if (send != recv && (const char *)send < (const char *)recv + bytes && (const char *)recv < (const char *)send + bytes)
        r = fail(ncclInvalidArgument, "ncclAllReduce: send and receive buffers overlap (not in place)");
    group_t &g = group();
    if (g.depth > 0) {  // collected, issued by ncclGroupEnd (or none of the group, if this one failed)
        if (r != ncclSuccess) g.failed = r;
        else if (count) g.ops.push_back(o);
        return r;
    }
    if (r == ncclSuccess && count) issue(o), comm->launches++;
    return r;
}
}  // extern "C"
