// tests/cuda_shim.h - CUDA on the CPU, for testing qlora-cuda.cu where there is no GPU.
//
//   #include "cuda_shim.h"        // defines QL_CUDA_SHIM; then
//   #include "../qlora-cuda.cu"   // the backend's own source, compiled by g++ / clang++
//
// The model. A launch runs synchronously (a stream is in order anyway). Its blocks are spread
// over a few worker threads (QL_SHIM_WORKERS, default 2), each running whole blocks one after
// another. Inside a block every CUDA thread is a fiber (its own stack; a few instructions switch
// them on x86-64, ucontext elsewhere), and fibers switch ONLY at
// __syncthreads, __syncwarp and warp collectives: between two barriers each thread runs alone,
// to the end, in a selectable order - forward (thread 0 first), reverse, or a seeded random
// permutation drawn anew at every barrier (QL_SHIM_ORDER=forward|reverse|random[:seed], or
// qlshim::set_order). So a missing barrier shows up as a wrong answer in some order.
// Devices: one by default; QL_SHIM_DEVICES=N gives N, each a number for cudaSetDevice (the current
// one, per host thread, is what cudaGetDevice says), all of them this process's memory.
//
// What it reports (the launch stops, cudaGetLastError() returns cudaErrorLaunchFailure and
// cudaGetErrorString() / qlshim::last_error_message() say what happened, file:line included):
//   - __syncthreads reached from two different call sites in one phase (divergent barrier);
//   - deadlock: threads waiting at a barrier while others exited or wait elsewhere;
//   - a warp collective whose mask names a lane that does not exist (the partial last warp of
//     a block whose size is not a multiple of 32) or has exited, that does not name the caller,
//     or whose lanes arrive from different call sites;
//   - an invalid launch (threads per block, grid limits, dynamic shared memory above 48 KiB
//     without cudaFuncSetAttribute, above the device's opt-in limit with it).
//   - an asynchronous copy (__pipeline_memcpy_async) not of 4, 8 or 16 bytes, not aligned to its
//     size, not into the block's dynamic shared memory, or never waited for. A copy lands when the
//     __syncthreads after the wait that covers it releases (QL_SHIM_ASYNC=early: as issued), so a
//     read before the wait or its barrier, or a copy into a buffer still being read, goes wrong.
//   - in a stream capture (CUDA graphs), what a capture forbids: synchronising, allocating, a
//     synchronous copy, a stream drawn in and never joined back (see "stream capture" below).
// Out-of-bounds accesses are ASan's: device allocations are plain malloc blocks. Fresh device
// memory and each block's dynamic shared memory are filled with 0xFF (NaN as floats).
//
// Rules for the kernels (qlora-cuda.cu keeps them): launch only through QL_LAUNCH; dynamic
// shared memory only through QL_DYN_SMEM; static __shared__ arrays become `static thread_local`
// (a worker runs one block at a time, so they are per block); no inline PTX, no cooperative
// groups; WMMA (nvcuda::wmma fragments, fill / load / store / mma_sync, called unqualified as
// `wmma::load_matrix_sync` through `using namespace nvcuda`) with the shim's own fragment layout; 16-bit values only converted (CUDA's own cuda_fp16.h / cuda_bf16.h do that
// bit-exactly on the host). Types and declarations come from CUDA's headers, so the backend
// compiles against the real signatures; the definitions below replace the runtime, cuBLAS and
// the cuBLASLt calls the backend makes.
//
// Limitations: memory-ordering races between blocks are not detected (blocks on one worker run
// in sequence); atomics are real atomics; cuBLAS is a plain reference GEMM (f32 sums in k order).
#pragma once

#define QL_CUDA_SHIM 1

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define QLSHIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QLSHIM_ASAN 1
#endif
#endif
#ifdef QLSHIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace qlshim {

enum order_t { ORDER_FORWARD, ORDER_REVERSE, ORDER_RANDOM };

// ---- global state: the device, the sticky error, settings -----------------------------------

struct state_t {
    std::mutex mu;
    int device_count = 1, cc_major = 9, cc_minor = 0;
    size_t total_mem = (size_t)16 << 30, in_use = 0, peak = 0;
    std::map<void *, size_t> allocs;
    cudaError_t sticky = cudaSuccess;  // launch failures: stays until cudaGetLastError
    std::string message;               // its detail
    order_t order = ORDER_FORWARD;
    uint64_t seed = 1;
    bool env_read = false;
    int workers = 2;
    std::map<const void *, int> max_dyn_smem;  // cudaFuncSetAttribute
    long long syncs = 0;                         // cudaStreamSynchronize calls (qlshim_host_syncs)
    long long stream_ops = 0;                    // kernels, cuBLAS calls, async copies and memsets run (qlshim_stream_ops)
    long long peer_copies = 0;                   // cudaMemcpyPeerAsync calls between two devices (qlshim_peer_copies)
    std::map<std::string, long long> launches;   // per kernel name (qlshim_launches)
    int wmma_sm80 = 0;                           // WMMA 16x16 fragments in sm_80's layout, not scrambled (QL_SHIM_WMMA=sm80)
    int async_early = 0;                         // asynchronous copies land when issued, not at the wait (QL_SHIM_ASYNC=early)
    std::atomic<long long> async_copies{0};      // __pipeline_memcpy_async calls (qlshim_async_copies)
    int fail_instantiate = 0;                    // the next this many cudaGraphInstantiate calls fail (qlshim_fail_instantiate)
    int refuse_lt = 0;                           // the next this many cublasLtMatmul calls are refused (qlshim_refuse_lt)
    int refuse_lt_skip = 0;                      // after this many are taken (qlshim_refuse_lt_after)
};
inline state_t &st() {
    static state_t s;
    return s;
}

inline void read_env() {
    state_t &s = st();
    if (s.env_read) return;
    s.env_read = true;
    if (const char *o = getenv("QL_SHIM_ORDER")) {
        const std::string v = o;
        if (v == "reverse") s.order = ORDER_REVERSE;
        else if (v.rfind("random", 0) == 0) {
            s.order = ORDER_RANDOM;
            if (v.size() > 7) s.seed = strtoull(v.c_str() + 7, nullptr, 10);
        }
    }
    if (const char *w = getenv("QL_SHIM_WORKERS")) s.workers = std::max(1, atoi(w));
    // devices: QL_SHIM_DEVICES=N (default 1), so that ranks on one machine each take their own
    // (tests/nccl_shim.h refuses two ranks on one device, as NCCL does)
    if (const char *d = getenv("QL_SHIM_DEVICES")) s.device_count = std::max(1, atoi(d));
    if (const char *w = getenv("QL_SHIM_WMMA")) s.wmma_sm80 = strcmp(w, "sm80") == 0;
    if (const char *a = getenv("QL_SHIM_ASYNC")) s.async_early = strcmp(a, "early") == 0;
}
// the current device (cudaSetDevice's; one per host thread, as in CUDA)
inline int &current_device() {
    static thread_local int d = 0;
    return d;
}

inline void set_order(order_t o, uint64_t seed = 1) {
    read_env();
    st().order = o;
    st().seed = seed;
}
inline void set_device(int major, int minor, size_t total_mem) {
    st().cc_major = major, st().cc_minor = minor, st().total_mem = total_mem;
}
inline void set_device_count(int n) { st().device_count = n; }
}  // namespace qlshim
// the device's compute capability, for suites compiled without this header (tests/test_backend_ops.cpp
// declares it weak: absent where the suite runs on a real GPU)
extern "C" __attribute__((weak)) void qlshim_set_cc(int major, int minor) { qlshim::st().cc_major = major, qlshim::st().cc_minor = minor; }
// the number of devices (QL_SHIM_DEVICES' setting, for suites compiled without this header; returns the previous one)
extern "C" __attribute__((weak)) int qlshim_set_devices(int n) {
    qlshim::read_env();
    const int was = qlshim::st().device_count;
    qlshim::st().device_count = n < 1 ? 1 : n;
    return was;
}
// WMMA's 16x16 fragments: 1 = sm_80's layout (what code that probes the layout at run time finds
// on a real GPU), 0 = the scramble (the default); returns the previous setting
extern "C" __attribute__((weak)) int qlshim_set_wmma_sm80(int on) {
    qlshim::read_env();
    const int was = qlshim::st().wmma_sm80;
    qlshim::st().wmma_sm80 = on;
    return was;
}
// asynchronous copies (__pipeline_memcpy_async): 1 = each lands as it is issued, 0 = at the
// __syncthreads after the __pipeline_wait_prior that covers it (the default); returns the previous
// setting. The two ends of the window in which the block may see it: the late end shows a read
// before the wait and its barrier, the early end a copy issued into a buffer still being read
extern "C" __attribute__((weak)) int qlshim_set_async_early(int on) {
    qlshim::read_env();
    const int was = qlshim::st().async_early;
    qlshim::st().async_early = on;
    return was;
}
// the next n graph instantiations fail with cudaErrorMemoryAllocation (a huge graph on a full card)
extern "C" __attribute__((weak)) void qlshim_fail_instantiate(int n) { qlshim::st().fail_instantiate = n; }
// the next n cublasLtMatmul calls return CUBLAS_STATUS_NOT_SUPPORTED (a layout a library refuses);
// returns how many were left unused
extern "C" __attribute__((weak)) int qlshim_refuse_lt(int n) {
    const int left = qlshim::st().refuse_lt;
    qlshim::st().refuse_lt = n;
    qlshim::st().refuse_lt_skip = 0;
    return left;
}
// the same, the first `skip` calls taken before the refusals start (a refusal inside a node)
extern "C" __attribute__((weak)) int qlshim_refuse_lt_after(int skip, int n) {
    const int left = qlshim::st().refuse_lt;
    qlshim::st().refuse_lt = n;
    qlshim::st().refuse_lt_skip = skip;
    return left;
}
namespace qlshim {
inline size_t device_bytes_in_use() { return st().in_use; }
inline size_t device_peak_bytes() { return st().peak; }
inline std::string last_error_message() { return st().message; }

inline int max_opt_in_smem() {
    const int cc = st().cc_major * 10 + st().cc_minor;
    return cc >= 90 ? 227 << 10 : cc == 80 ? 163 << 10 : cc >= 86 ? 99 << 10 : 64 << 10;
}

// ---- fibers ----------------------------------------------------------------------------------
// On x86-64 a switch saves the callee-saved registers, MXCSR and the x87 control word on the
// stack and swaps stack pointers (no system call: ucontext's swapcontext makes two, which cost
// more than the kernels under test); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void qlshim_switch(void **save_sp, void *new_sp);
asm(R"(
    .text
    .weak qlshim_switch
    .type qlshim_switch, @function
qlshim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size qlshim_switch, .-qlshim_switch
)");
#define QLSHIM_ASM_SWITCH 1
#endif

enum fstate { F_READY, F_BARRIER, F_WARP, F_DONE };
enum wop { W_SYNC, W_SHFL, W_XOR, W_DOWN, W_UP, W_BALLOT, W_ANY, W_ALL, W_GATHER };

struct fiber {
#ifdef QLSHIM_ASM_SWITCH
    void *sp = nullptr;  // its saved stack pointer while it is switched out
#else
    ucontext_t uc;
#endif
    char *stack = nullptr;
    fstate state = F_READY;
    int tid = 0;  // linear thread index in the block
    uint3 idx{0, 0, 0};
    const char *file = "";
    int line = 0;
    // a pending warp collective
    wop op = W_SYNC;
    unsigned mask = 0;
    uint64_t value = 0, result = 0;
    int param = 0, width = 32;
    // asynchronous copies (__pipeline_memcpy_async): issued since the last commit, and the
    // committed groups not yet waited for, oldest first; where the first one was issued
    struct async_copy {
        void *dst;
        const void *src;
        size_t n;
    };
    std::vector<async_copy> open;
    std::vector<std::vector<async_copy>> groups;
    std::vector<async_copy> waited;  // waited for: they land at this thread's next __syncthreads
    const char *copy_file = nullptr;
    int copy_line = 0;
};

struct block_ctx {
    std::vector<fiber> *fibers = nullptr;
    std::vector<uint64_t> gather;  // [warps * 32]: every lane's value at the last W_GATHER (WMMA)
    std::vector<char> mma_made;    // [warps]: whether mma_d holds the product of the warp's last W_GATHER
    std::vector<float> mma_d;      // [warps][256]: that product, each lane taking its slots
#ifdef QLSHIM_ASM_SWITCH
    void *sched_sp = nullptr;
#else
    ucontext_t sched;
#endif
    fiber *cur = nullptr;
    dim3 block_idx, block_dim, grid_dim;
    unsigned char *dyn = nullptr;
    size_t dyn_size = 0;
    const std::function<void()> *body = nullptr;
    bool failed = false;
    std::string err;
#ifdef QLSHIM_ASAN
    const void *sched_stack = nullptr;
    size_t sched_size = 0;
#endif
};
inline block_ctx *&cur_block() {
    static thread_local block_ctx *b = nullptr;
    return b;
}

inline size_t stack_bytes() {
#ifdef QLSHIM_ASAN
    return 512 << 10;
#else
    return 128 << 10;
#endif
}

inline void switch_to_scheduler(block_ctx *b, fiber *f) {
#ifdef QLSHIM_ASM_SWITCH
    qlshim_switch(&f->sp, b->sched_sp);
#else
    swapcontext(&f->uc, &b->sched);
#endif
}
inline void switch_to_fiber(block_ctx *b, fiber *f) {
#ifdef QLSHIM_ASM_SWITCH
    qlshim_switch(&b->sched_sp, f->sp);
#else
    swapcontext(&b->sched, &f->uc);
#endif
}

// switch from the current fiber back to the block's scheduler
inline void yield_to_scheduler(bool dying = false) {
    block_ctx *b = cur_block();
    fiber *f = b->cur;
#ifdef QLSHIM_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(dying ? nullptr : &fake, b->sched_stack, b->sched_size);
    switch_to_scheduler(b, f);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)dying;
    switch_to_scheduler(b, f);
#endif
}

inline void fail(const std::string &msg) {
    block_ctx *b = cur_block();
    if (!b->failed) b->err = msg;
    b->failed = true;
}

inline void fiber_entry() {
#ifdef QLSHIM_ASAN
    block_ctx *b0 = cur_block();
    __sanitizer_finish_switch_fiber(nullptr, &b0->sched_stack, &b0->sched_size);
#endif
    block_ctx *b = cur_block();
    (*b->body)();
    fiber *f = b->cur;
    size_t pending = f->open.size();
    for (const auto &g : f->groups) pending += g.size();
    if (pending)
        fail("thread " + std::to_string(f->tid) + " ended with " + std::to_string(pending) +
             " asynchronous copies never waited for (__pipeline_wait_prior), the first issued at " + f->copy_file + ":" +
             std::to_string(f->copy_line));
    f->state = F_DONE;
    yield_to_scheduler(true);
}

inline std::string site(const fiber &f) { return std::string(f.file) + ":" + std::to_string(f.line); }

inline void syncthreads(const char *file, int line) {
    block_ctx *b = cur_block();
    b->cur->state = F_BARRIER;
    b->cur->file = file;
    b->cur->line = line;
    yield_to_scheduler();
}

template <typename T> inline uint64_t bits_of(T v) {
    static_assert(sizeof(T) <= 8, "warp collectives move at most 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    return u;
}
template <typename T> inline T of_bits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof(T));
    return v;
}

inline uint64_t warp_op(wop op, unsigned mask, uint64_t value, int param, int width, const char *file, int line) {
    block_ctx *b = cur_block();
    fiber *f = b->cur;
    f->state = F_WARP, f->op = op, f->mask = mask, f->value = value, f->param = param, f->width = width;
    f->file = file, f->line = line;
    yield_to_scheduler();
    return f->result;
}

// ---- the block scheduler ---------------------------------------------------------------------

inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

inline void make_order(std::vector<int> &ord, int n, uint64_t &rs) {
    ord.resize((size_t)n);
    for (int i = 0; i < n; i++) ord[(size_t)i] = st().order == ORDER_REVERSE ? n - 1 - i : i;
    if (st().order == ORDER_RANDOM)
        for (int i = n - 1; i > 0; i--) std::swap(ord[(size_t)i], ord[(size_t)((rs = mix64(rs)) % (uint64_t)(i + 1))]);
}

// Resolve the warp collectives every lane of a warp is waiting at; false when none could be.
inline bool resolve_warps(block_ctx *b, int n) {
    std::vector<fiber> &fs = *b->fibers;
    bool progress = false;
    for (int w0 = 0; w0 < n && !b->failed; w0 += 32) {
        const int lanes = std::min(32, n - w0);
        int first = -1;
        for (int l = 0; l < lanes; l++)
            if (fs[(size_t)(w0 + l)].state == F_WARP) {
                first = l;
                break;
            }
        if (first < 0) continue;
        const fiber &f0 = fs[(size_t)(w0 + first)];
        const unsigned mask = f0.mask;
        auto where = [&] { return "warp " + std::to_string(w0 / 32) + " at " + site(f0); };  // (made only for a failure)
        if (!(mask >> first & 1u)) {
            fail("warp collective whose mask 0x" + std::to_string(mask) + " does not name the calling lane " +
                 std::to_string(first) + ", " + where());
            return false;
        }
        bool ready = true;
        for (int l = 0; l < 32; l++) {
            if (!(mask >> l & 1u)) continue;
            if (l >= lanes) {
                fail("full-mask warp collective in a partial warp: lane " + std::to_string(l) + " does not exist (" +
                     std::to_string(lanes) + " threads in the warp), " + where());
                return false;
            }
            const fiber &g = fs[(size_t)(w0 + l)];
            if (g.state == F_DONE) {
                fail("warp collective waits for lane " + std::to_string(l) + ", which has exited, " + where());
                return false;
            }
            if (g.state != F_WARP) ready = false;
            else if (g.line != f0.line || (g.file != f0.file && strcmp(g.file, f0.file)) || g.op != f0.op || g.mask != mask) {
                fail("lanes of one warp collective arrive from different call sites or masks: lane " + std::to_string(l) +
                     " at " + site(g) + ", " + where());
                return false;
            }
        }
        if (!ready) continue;
        uint64_t ballot = 0;
        for (int l = 0; l < 32; l++)
            if (mask >> l & 1u) ballot |= (uint64_t)(fs[(size_t)(w0 + l)].value != 0) << l;
        for (int l = 0; l < 32; l++) {
            if (!(mask >> l & 1u)) continue;
            fiber &g = fs[(size_t)(w0 + l)];
            const int wd = g.width, base = l / wd * wd;
            int src = l;
            switch (g.op) {
            case W_SHFL: src = base + (g.param % wd + wd) % wd; break;
            case W_XOR: src = (l ^ g.param) / wd == l / wd ? l ^ g.param : l; break;
            case W_DOWN: src = l % wd + g.param < wd ? l + g.param : l; break;
            case W_UP: src = l % wd >= g.param ? l - g.param : l; break;
            default: break;
            }
            if (g.op == W_SHFL || g.op == W_XOR || g.op == W_DOWN || g.op == W_UP) {
                if (!(mask >> src & 1u)) {
                    fail("shuffle reads lane " + std::to_string(src) + ", which is not in the mask, " + where());
                    return false;
                }
                g.result = fs[(size_t)(w0 + src)].value;
            } else if (g.op == W_BALLOT) {
                g.result = ballot;
            } else if (g.op == W_ANY) {
                g.result = ballot != 0;
            } else if (g.op == W_ALL) {
                g.result = ballot == (uint64_t)mask;
            } else if (g.op == W_GATHER) {  // the warp's values stay readable until its next collective
                b->gather[(size_t)(w0 + l)] = g.value;
                g.result = (uint64_t)(uintptr_t)&b->gather[(size_t)w0];
                b->mma_made[(size_t)(w0 / 32)] = 0;
            }
        }
        for (int l = 0; l < 32; l++)
            if (mask >> l & 1u) fs[(size_t)(w0 + l)].state = F_READY;
        progress = true;
    }
    return progress;
}

inline void run_block(block_ctx *b, int n, uint64_t seed) {
    std::vector<fiber> &fs = *b->fibers;
    std::vector<int> ord;
    uint64_t rs = seed;
    make_order(ord, n, rs);
    for (;;) {
        for (int i : ord) {
            fiber &f = fs[(size_t)i];
            if (f.state != F_READY) continue;
            b->cur = &f;
#ifdef QLSHIM_ASAN
            void *fake = nullptr;
            __sanitizer_start_switch_fiber(&fake, f.stack, stack_bytes());
            switch_to_fiber(b, &f);
            __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
            switch_to_fiber(b, &f);
#endif
            if (b->failed) return;
        }
        if (resolve_warps(b, n)) continue;
        if (b->failed) return;
        int done = 0, barrier = 0;
        const fiber *first_bar = nullptr;
        for (const fiber &f : fs) {
            done += f.state == F_DONE;
            if (f.state == F_BARRIER) {
                barrier++;
                if (!first_bar) first_bar = &f;
            }
        }
        if (done == n) return;
        if (barrier + done == n && done == 0) {
            for (const fiber &f : fs)
                if (f.line != first_bar->line || (f.file != first_bar->file && strcmp(f.file, first_bar->file))) {
                    fail("divergent __syncthreads: thread " + std::to_string(first_bar->tid) + " at " + site(*first_bar) +
                         ", thread " + std::to_string(f.tid) + " at " + site(f));
                    return;
                }
            for (fiber &f : fs) {  // the barrier releases: the copies its threads waited for land now
                for (const fiber::async_copy &c : f.waited)
                    if (c.n) memcpy(c.dst, c.src, c.n);
                f.waited.clear();
            }
            for (fiber &f : fs) f.state = F_READY;
            if (st().order == ORDER_RANDOM) make_order(ord, n, rs);
            continue;
        }
        // nothing can move: say who waits where
        std::string why = "deadlock: ";
        if (first_bar && done)
            why += std::to_string(done) + " thread(s) exited while thread " + std::to_string(first_bar->tid) +
                   " waits at __syncthreads " + site(*first_bar);
        else
            for (const fiber &f : fs)
                if (f.state == F_WARP || f.state == F_BARRIER) {
                    why += "thread " + std::to_string(f.tid) + " waits at " + (f.state == F_WARP ? "a warp collective " : "__syncthreads ") +
                           site(f) + "; ";
                    if (why.size() > 300) break;
                }
        fail(why);
        return;
    }
}

// ---- workers: whole blocks each ----------------------------------------------------------------

struct launch_job {
    const char *name;
    dim3 grid, block;
    size_t smem;
    const std::function<void()> *body;
    std::atomic<long long> next{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::string err;
};

// its own function: getcontext returns twice, which must not touch the caller's locals
__attribute__((noinline)) inline void init_fiber(fiber *f) {
#ifdef QLSHIM_ASM_SWITCH
    // the stack as qlshim_switch leaves it: MXCSR + x87 control word, six registers, and the
    // return address (fiber_entry), which sits 16-byte aligned so that fiber_entry starts as if called
    uintptr_t top = ((uintptr_t)f->stack + stack_bytes()) & ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)(top - 16);
    sp[0] = (uint64_t)(uintptr_t)&fiber_entry;
    for (int r = 1; r <= 6; r++) sp[-r] = 0;
    uint32_t *ctl = (uint32_t *)(sp - 7);
    ctl[0] = 0x1F80;  // MXCSR: round to nearest, exceptions masked
    ctl[1] = 0x037F;  // x87 control word: the default
    f->sp = sp - 7;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = stack_bytes();
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, fiber_entry, 0);
#endif
}

// one worker's share: blocks taken from a counter, fibers and stacks reused
inline void worker_run(launch_job *j) {
    const int n = (int)(j->block.x * j->block.y * j->block.z);
    struct stack_pool {  // this worker's fiber stacks, kept for its next blocks, freed when it ends
        std::vector<char *> s;
        ~stack_pool() {
            for (char *p : s) free(p);
        }
    };
    static thread_local std::vector<fiber> fibers;
    static thread_local stack_pool spool;
    std::vector<char *> &stacks = spool.s;
    while ((int)stacks.size() < n) {
        char *s = (char *)malloc(stack_bytes());
        if (!s) abort();
        stacks.push_back(s);
    }
    fibers.assign((size_t)n, fiber());
#ifdef QLSHIM_ASAN
    static thread_local std::vector<char> deep;  // per stack: its last fiber did not finish
    if (deep.size() < stacks.size()) deep.resize(stacks.size(), 1);
#endif
    std::vector<unsigned char> dyn(j->smem + 16);
    const long long nb = (long long)j->grid.x * j->grid.y * j->grid.z;
    block_ctx b;
    b.fibers = &fibers;
    b.block_dim = j->block;
    b.grid_dim = j->grid;
    b.body = j->body;
    b.dyn = dyn.data();
    b.dyn_size = j->smem;
    b.gather.assign((size_t)(n + 31) / 32 * 32, 0);
    b.mma_made.assign((size_t)(n + 31) / 32, 0);
    b.mma_d.resize((size_t)(n + 31) / 32 * 256);
    cur_block() = &b;
    for (long long bi; !j->failed.load() && (bi = j->next.fetch_add(1)) < nb;) {
        b.block_idx = dim3((unsigned)(bi % j->grid.x), (unsigned)(bi / j->grid.x % j->grid.y), (unsigned)(bi / j->grid.x / j->grid.y));
        memset(dyn.data(), 0xff, dyn.size());
        for (int t = 0; t < n; t++) {
            fiber &f = fibers[(size_t)t];
            f = fiber();
            f.tid = t;
            f.idx = uint3{(unsigned)(t % j->block.x), (unsigned)(t / j->block.x % j->block.y), (unsigned)(t / j->block.x / j->block.y)};
            f.stack = stacks[(size_t)t];
#ifdef QLSHIM_ASAN
            // a reused stack: the fiber before ended by switching away, never returning, so its
            // frames' redzones are still poisoned where the new fiber's frames will lie (seen: a
            // false stack-buffer-underflow copying a kernel's arguments, AVX2-only build). One that
            // finished left only its first frames, at the top; one that did not (a failed block), any
            const size_t top = deep[(size_t)t] ? stack_bytes() : (size_t)16 << 10;
            __asan_unpoison_memory_region(f.stack + stack_bytes() - top, top);
#endif
            init_fiber(&f);
        }
        run_block(&b, n, st().seed ^ mix64((uint64_t)bi));
#ifdef QLSHIM_ASAN
        for (int t = 0; t < n; t++) deep[(size_t)t] = fibers[(size_t)t].state != F_DONE;
#endif
        if (b.failed) {
            std::lock_guard<std::mutex> lk(j->mu);
            if (!j->failed.exchange(true))
                j->err = std::string(j->name) + ", block (" + std::to_string(b.block_idx.x) + "," + std::to_string(b.block_idx.y) +
                         "," + std::to_string(b.block_idx.z) + "): " + b.err;
        }
    }
    cur_block() = nullptr;
}

struct pool_t {
    std::vector<std::thread> threads;
    std::mutex mu;
    std::condition_variable cv, done_cv;
    launch_job *job = nullptr;
    long long generation = 0;
    int busy = 0;
    bool quit = false;
    void start(int n) {
        for (int i = 0; i < n; i++)
            threads.emplace_back([this] {
                long long seen = 0;
                for (;;) {
                    launch_job *j;
                    {
                        std::unique_lock<std::mutex> lk(mu);
                        cv.wait(lk, [&] { return quit || generation != seen; });
                        if (quit) return;
                        seen = generation;
                        j = job;
                    }
                    worker_run(j);
                    std::lock_guard<std::mutex> lk(mu);
                    if (--busy == 0) done_cv.notify_all();
                }
            });
    }
    ~pool_t() {
        {
            std::lock_guard<std::mutex> lk(mu);
            quit = true;
        }
        cv.notify_all();
        for (auto &t : threads) t.join();
    }
    void run(launch_job *j) {  // the caller works too
        {
            std::lock_guard<std::mutex> lk(mu);
            job = j;
            busy = (int)threads.size();
            generation++;
        }
        cv.notify_all();
        worker_run(j);
        std::unique_lock<std::mutex> lk(mu);
        done_cv.wait(lk, [&] { return busy == 0; });
    }
};
inline pool_t &pool() {
    static pool_t p;
    static std::once_flag once;
    std::call_once(once, [] { p.start(std::max(0, st().workers - 1)); });
    return p;
}

inline void set_sticky(cudaError_t e, const std::string &msg) {
    state_t &s = st();
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.sticky == cudaSuccess) {
        s.sticky = e;
        s.message = msg;
        fprintf(stderr, "qlshim: %s\n", msg.c_str());
    }
}

inline void flush_stream(cudaStream_t s, uint64_t upto = ~0ull);  // below: a stream's queued copies

inline bool capturing(cudaStream_t s);                                 // below: stream capture
inline void capture_record(cudaStream_t s, std::function<void()> op);

inline int stream_device(cudaStream_t s);  // (CUstream_st comes below)
template <typename K, typename... A>
inline void launch(const char *name, K kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A... args) {
    read_env();
    if (!capturing(stream)) flush_stream(stream);  // the copies queued before it on its stream land first
    const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    const int limit = [&] {
        std::lock_guard<std::mutex> lk(st().mu);
        auto it = st().max_dyn_smem.find((const void *)kernel);
        return it != st().max_dyn_smem.end() ? it->second : 48 << 10;
    }();
    std::string bad;
    if (threads == 0 || threads > 1024 || block.z > 64) bad = "block of " + std::to_string(threads) + " threads";
    else if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) bad = "grid dimensions";
    else if (smem > (size_t)limit) bad = std::to_string(smem) + " bytes of dynamic shared memory (limit " + std::to_string(limit) + ")";
    if (!bad.empty()) {
        set_sticky(cudaErrorInvalidConfiguration, std::string(name) + ": invalid launch: " + bad);
        return;
    }
    if (stream && stream_device(stream) != current_device()) {  // CUDA: a stream belongs to its device
        set_sticky(cudaErrorInvalidResourceHandle, std::string(name) + ": launched on a stream of device " + std::to_string(stream_device(stream)) +
                                                        " while device " + std::to_string(current_device()) + " is current");
        return;
    }
    if (capturing(stream)) {  // recorded with its arguments as they are now (by value, as a graph's kernel node)
        capture_record(stream, [=] { launch(name, kernel, grid, block, smem, stream, args...); });
        return;
    }
    {
        std::lock_guard<std::mutex> lk(st().mu);
        st().launches[name]++;
        st().stream_ops++;
    }
    const std::function<void()> body = [&] { kernel(args...); };
    launch_job j;
    j.name = name;
    j.grid = grid;
    j.block = block;
    j.smem = smem;
    j.body = &body;
    if ((long long)grid.x * grid.y * grid.z == 1) worker_run(&j);  // one block: no hand-off
    else pool().run(&j);
    if (j.failed.load()) set_sticky(cudaErrorLaunchFailure, j.err);
}

inline const dim3 &thread_idx() {
    static thread_local dim3 d;
    const uint3 &u = cur_block()->cur->idx;
    d = dim3(u.x, u.y, u.z);
    return d;
}

}  // namespace qlshim

// ---- the kernel language ---------------------------------------------------------------------

#undef __shared__
#define __shared__ static thread_local
#undef __launch_bounds__
#define __launch_bounds__(...)
#define QL_LAUNCH(k, grid, block, smem, stream, ...) ::qlshim::launch(#k, k, dim3(grid), dim3(block), (size_t)(smem), stream, __VA_ARGS__)
#define QL_DYN_SMEM(T, name) T *name = reinterpret_cast<T *>(::qlshim::cur_block()->dyn)
#define QL_UNROLL  // (a host compiler unrolls as it likes)

#define threadIdx (::qlshim::thread_idx())
#define blockIdx (::qlshim::cur_block()->block_idx)
#define blockDim (::qlshim::cur_block()->block_dim)
#define gridDim (::qlshim::cur_block()->grid_dim)

#define __syncthreads() ::qlshim::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ((void)::qlshim::warp_op(::qlshim::W_SYNC, QLSHIM_MASK(__VA_ARGS__), 0, 0, 32, __FILE__, __LINE__))
#define QLSHIM_MASK(...) QLSHIM_MASK_(__VA_ARGS__ + 0, 0xffffffffu)
#define QLSHIM_MASK_(m, d) ((m) ? (unsigned)(m) : (d))
#define __shfl_sync(mask, v, src, ...) ::qlshim::shfl(::qlshim::W_SHFL, mask, v, src, __FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_xor_sync(mask, v, lm, ...) ::qlshim::shfl(::qlshim::W_XOR, mask, v, lm, __FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_down_sync(mask, v, d, ...) ::qlshim::shfl(::qlshim::W_DOWN, mask, v, d, __FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_up_sync(mask, v, d, ...) ::qlshim::shfl(::qlshim::W_UP, mask, v, d, __FILE__, __LINE__, ##__VA_ARGS__)
#define __ballot_sync(mask, p) ((unsigned)::qlshim::warp_op(::qlshim::W_BALLOT, mask, (p) != 0, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, p) ((int)::qlshim::warp_op(::qlshim::W_ANY, mask, (p) != 0, 0, 32, __FILE__, __LINE__))
#define __all_sync(mask, p) ((int)::qlshim::warp_op(::qlshim::W_ALL, mask, (p) != 0, 0, 32, __FILE__, __LINE__))

namespace qlshim {
template <typename T> inline T shfl(wop op, unsigned mask, T v, int p, const char *file, int line, int width = 32) {
    return of_bits<T>(warp_op(op, mask, bits_of(v), p, width, file, line));
}
}  // namespace qlshim

// asynchronous copies, global -> shared (cp.async; cuda_pipeline_primitives.h's names): each lands
// when the __syncthreads after the wait that covers its group releases, or as it is issued
// (qlshim_set_async_early); checked: 4, 8 or
// 16 bytes, both ends aligned to it, the destination inside the block's dynamic shared memory, and
// every copy waited for before the thread ends
#define _CUDA_PIPELINE_PRIMITIVES_H_ 1  // CUDA's header (inline PTX) stays out
#define __pipeline_memcpy_async(dst, src, ...) ::qlshim::memcpy_async(__FILE__, __LINE__, dst, src, __VA_ARGS__)
#define __pipeline_commit() ::qlshim::pipeline_commit()
#define __pipeline_wait_prior(n) ::qlshim::pipeline_wait_prior(n)
namespace qlshim {
inline void land(const fiber::async_copy &c) {
    if (c.n) memcpy(c.dst, c.src, c.n);
}
inline void memcpy_async(const char *file, int line, void *dst, const void *src, size_t size, size_t zfill = 0) {
    block_ctx *b = cur_block();
    fiber *f = b->cur;
    const std::string at = std::string(file) + ":" + std::to_string(line);
    if ((size != 4 && size != 8 && size != 16) || zfill > size) return fail("__pipeline_memcpy_async of " + std::to_string(size) + " bytes at " + at);
    if (((uintptr_t)dst | (uintptr_t)src) % size) return fail("__pipeline_memcpy_async: an end not aligned to its " + std::to_string(size) + " bytes at " + at);
    if ((unsigned char *)dst < b->dyn || (unsigned char *)dst + size > b->dyn + b->dyn_size)
        return fail("__pipeline_memcpy_async: the destination is not in the block's dynamic shared memory at " + at);
    if (zfill) memset((char *)dst + (size - zfill), 0, zfill);
    st().async_copies++;
    const fiber::async_copy c{dst, src, size - zfill};
    if (f->open.empty() && f->groups.empty()) f->copy_file = file, f->copy_line = line;
    if (st().async_early) land(c);
    f->open.push_back(st().async_early ? fiber::async_copy{nullptr, nullptr, 0} : c);
}
inline void pipeline_commit() {
    fiber *f = cur_block()->cur;
    f->groups.push_back(std::move(f->open));
    f->open.clear();
}
// Copies waited for land when the block's next __syncthreads releases: what a barrier after the
// wait makes visible to the block. (Stricter than CUDA for the thread's own copies, which it may
// read right after the wait; the kernels here read tiles through WMMA, every thread's rows, after
// a barrier.)
inline void pipeline_wait_prior(size_t n) {
    fiber *f = cur_block()->cur;
    while (f->groups.size() > n) {
        for (const fiber::async_copy &c : f->groups.front()) f->waited.push_back(c);
        f->groups.erase(f->groups.begin());
    }
}
}  // namespace qlshim

// atomics: real ones (blocks run on several threads)
template <typename T> inline T qlshim_atomic_add(T *p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline float atomicAdd(float *p, float v) {
    float old = *p, want;
    do want = old + v;
    while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
inline double atomicAdd(double *p, double v) {
    double old = *p, want;
    do want = old + v;
    while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
inline int atomicAdd(int *p, int v) { return qlshim_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned *p, unsigned v) { return qlshim_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) { return qlshim_atomic_add(p, v); }
inline int atomicSub(int *p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicSub(unsigned *p, unsigned v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
template <typename T> inline T qlshim_atomic_minmax(T *p, T v, bool mx) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while ((mx ? v > old : v < old) && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
inline int atomicMax(int *p, int v) { return qlshim_atomic_minmax(p, v, true); }
inline unsigned atomicMax(unsigned *p, unsigned v) { return qlshim_atomic_minmax(p, v, true); }
inline unsigned long long atomicMax(unsigned long long *p, unsigned long long v) { return qlshim_atomic_minmax(p, v, true); }
inline int atomicMin(int *p, int v) { return qlshim_atomic_minmax(p, v, false); }
inline unsigned atomicMin(unsigned *p, unsigned v) { return qlshim_atomic_minmax(p, v, false); }
inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) { return qlshim_atomic_minmax(p, v, false); }
template <typename T> inline T qlshim_cas(T *p, T cmp, T v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return cmp;
}
inline int atomicCAS(int *p, int c, int v) { return qlshim_cas(p, c, v); }
inline unsigned atomicCAS(unsigned *p, unsigned c, unsigned v) { return qlshim_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long c, unsigned long long v) { return qlshim_cas(p, c, v); }
inline int atomicExch(int *p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicExch(unsigned *p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline float atomicExch(float *p, float v) {
    float old;
    __atomic_exchange(p, &v, &old, __ATOMIC_RELAXED);
    return old;
}
inline int atomicOr(int *p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicOr(unsigned *p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline int atomicAnd(int *p, int v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAnd(unsigned *p, unsigned v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// device math as the host computes it (the _rn forms: one rounding each, never fused)
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __saturatef(float x) { return x < 0 ? 0.0f : (x > 1 ? 1.0f : x); }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <typename T> inline T __ldg(const T *p) { return *p; }
// integer SIMD as the device: __dp4a sums the four byte products (signed x signed, or unsigned x
// unsigned) onto c; __byte_perm picks bytes of the 8-byte {y:x} by the low 3 bits of each selector
// nibble (callers keep bit 3 clear: PTX's prmt reads it as a sign-replication flag)
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> 8 * i) * (int)(int8_t)(b >> 8 * i);
    return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; i++) c += ((a >> 8 * i) & 255) * ((b >> 8 * i) & 255);
    return c;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((v >> 8 * ((s >> 4 * i) & 7)) & 255) << 8 * i;
    return r;
}
inline int __float2int_rn(float x) {  // as CUDA's: to nearest even, saturating; NaN gives 0 (a C++ cast would be undefined)
    if (std::isnan(x)) return 0;
    const float r = std::nearbyint(x);
    return r >= 2147483648.0f ? INT_MAX : r < -2147483648.0f ? INT_MIN : (int)r;
}
// device code's global min / max (CUDA has them for every arithmetic type)
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }
using std::isfinite;
using std::isnan;
using std::isinf;

// ---- WMMA, with the shim's own fragment layout ------------------------------------------------
// CUDA leaves the mapping of a fragment's elements to lanes unspecified, so correct code never
// depends on it; here element e (row-major in the tile) lives in lane perm(e) % 32, slot
// perm(e) / 32, with perm a fixed scramble - code that indexes frag.x[] by a guessed layout
// computes garbage. load/store/mma are warp collectives (all 32 lanes, one call site).
// QL_SHIM_WMMA=sm80 (or qlshim_set_wmma_sm80): 16x16 fragments instead in sm_80's mma.m16n8k16
// layout - element (r, c) in lane 4 (r % 8) + (c % 8) / 2, slot 4 (c / 8) + 2 (r / 8) + c % 2 -
// for code that checks the layout at run time before it relies on it (k_fa2_probe).
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static constexpr int rows = std::is_same<Use, matrix_b>::value ? K : M;
    static constexpr int cols = std::is_same<Use, matrix_a>::value ? K : N;
    static constexpr int num_elements = rows * cols / 32;
    T x[num_elements];
};
// the layouts as tables, made once: which element (row-major index) each lane holds in each slot
// (0: the scramble, 1: sm_80's). Only 16x16 fragments (m16n16k16), the shape the kernels use
struct qlshim_map256 {
    unsigned char e[2][32][8];  // [sm80][lane][slot] -> element
};
inline const qlshim_map256 &qlshim_map() {
    static const qlshim_map256 m = [] {
        qlshim_map256 t{};
        for (int sm80 = 0; sm80 < 2; sm80++)
            for (int e = 0; e < 256; e++) {
                const int r = e / 16, c = e % 16;
                const int q = sm80 ? (4 * (c / 8) + 2 * (r / 8) + c % 2) * 32 + 4 * (r % 8) + (c % 8) / 2
                                   : (e * 37 + 11) % 256;  // 37: odd, so a bijection
                t.e[sm80][q % 32][q / 32] = (unsigned char)e;
            }
        return t;
    }();
    return m;
}
// this lane's elements: slot i holds element lane_elems()[i]
inline const unsigned char *qlshim_lane_elems(int lane) { return qlshim_map().e[::qlshim::st().wmma_sm80 ? 1 : 0][lane]; }
template <typename F> constexpr void qlshim_16x16() {
    static_assert(F::rows == 16 && F::cols == 16, "the shim's WMMA has 16x16 fragments (m16n16k16) only");
}
inline float qlshim_to_f(float v) { return v; }
inline float qlshim_to_f(__half v) { return __half2float(v); }
inline float qlshim_to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> inline T qlshim_from_f(float v);
template <> inline float qlshim_from_f<float>(float v) { return v; }
template <> inline __half qlshim_from_f<__half>(float v) { return __float2half_rn(v); }
template <> inline __nv_bfloat16 qlshim_from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
inline int qlshim_lane() { return ::qlshim::cur_block()->cur->tid % 32; }
#define QLSHIM_WARP_SYNC(file, line) (void)::qlshim::warp_op(::qlshim::W_SYNC, 0xffffffffu, 0, 0, 32, file, line)

template <typename U, int M, int N, int K, typename T, typename L, typename V>
inline void qlshim_fill(fragment<U, M, N, K, T, L> &f, V v) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = qlshim_from_f<T>(qlshim_to_f(v));
}
// every slot of this lane from memory: element (r, c) at p[r * ldm + c] (row major) or p[c * ldm + r]
template <typename F, typename P> inline void qlshim_load(F &f, const P *p, unsigned ldm, bool row, const char *file, int line) {
    qlshim_16x16<F>();
    QLSHIM_WARP_SYNC(file, line);
    const unsigned char *me = qlshim_lane_elems(qlshim_lane());
    for (int i = 0; i < 8; i++) {
        const int r = me[i] / 16, c = me[i] % 16;
        f.x[i] = p[row ? (size_t)r * ldm + c : (size_t)c * ldm + r];
    }
}
template <typename F, typename P> inline void qlshim_store(P *p, const F &f, unsigned ldm, bool row, const char *file, int line) {
    qlshim_16x16<F>();
    QLSHIM_WARP_SYNC(file, line);
    const unsigned char *me = qlshim_lane_elems(qlshim_lane());
    for (int i = 0; i < 8; i++) {
        const int r = me[i] / 16, c = me[i] % 16;
        p[row ? (size_t)r * ldm + c : (size_t)c * ldm + r] = f.x[i];
    }
}
// D = A B + C: the warp's fragments gathered; the whole 16x16 D made once, by the lane that runs
// first after the gather (every lane's fragments are read before any lane writes its own), f32
// sums in k order; each lane then takes its slots
template <typename FD, typename FA, typename FB, typename FC>
inline void qlshim_mma(FD &d, const FA &a, const FB &b, const FC &c, const char *file, int line) {
    qlshim_16x16<FD>(), qlshim_16x16<FA>(), qlshim_16x16<FB>(), qlshim_16x16<FC>();
    struct parts { const FA *a; const FB *b; const FC *c; } mine{&a, &b, &c};
    const uint64_t *all = (const uint64_t *)(uintptr_t)::qlshim::warp_op(::qlshim::W_GATHER, 0xffffffffu, (uint64_t)(uintptr_t)&mine,
                                                                         0, 32, file, line);
    ::qlshim::block_ctx *bk = ::qlshim::cur_block();
    const size_t w = (size_t)(bk->cur->tid / 32);
    float *D = &bk->mma_d[w * 256];
    if (!bk->mma_made[w]) {
        bk->mma_made[w] = 1;
        float A[256], B[256];
        for (int l = 0; l < 32; l++) {
            const parts *pl = (const parts *)(uintptr_t)all[l];
            const unsigned char *el = qlshim_lane_elems(l);
            for (int i = 0; i < 8; i++)
                A[el[i]] = qlshim_to_f(pl->a->x[i]), B[el[i]] = qlshim_to_f(pl->b->x[i]), D[el[i]] = qlshim_to_f(pl->c->x[i]);
        }
        for (int r = 0; r < 16; r++)
            for (int col = 0; col < 16; col++) {
                float acc = 0;
                for (int k = 0; k < 16; k++) acc += A[r * 16 + k] * B[k * 16 + col];
                D[r * 16 + col] = acc + D[r * 16 + col];
            }
    }
    const unsigned char *me = qlshim_lane_elems(qlshim_lane());
    for (int i = 0; i < 8; i++) d.x[i] = qlshim_from_f<typename std::remove_reference<decltype(d.x[0])>::type>(D[me[i]]);
}
}  // namespace wmma
}  // namespace nvcuda
#define fill_fragment(f, v) qlshim_fill(f, v)
#define load_matrix_sync(f, p, ldm, ...) \
    qlshim_load(f, p, ldm, ::nvcuda::wmma::qlshim_row_of(f, ##__VA_ARGS__), __FILE__, __LINE__)
#define store_matrix_sync(p, f, ldm, layout) qlshim_store(p, f, ldm, (layout) == ::nvcuda::wmma::mem_row_major, __FILE__, __LINE__)
#define mma_sync(d, a, b, c) qlshim_mma(d, a, b, c, __FILE__, __LINE__)
namespace nvcuda {
namespace wmma {
// a matrix fragment's layout is in its type; an accumulator's is given at the call
template <typename U, int M, int N, int K, typename T> inline bool qlshim_row_of(const fragment<U, M, N, K, T, row_major> &) { return true; }
template <typename U, int M, int N, int K, typename T> inline bool qlshim_row_of(const fragment<U, M, N, K, T, col_major> &) { return false; }
template <typename F> inline bool qlshim_row_of(const F &, layout_t l) { return l == mem_row_major; }
}  // namespace wmma
}  // namespace nvcuda

// ---- the runtime API (CUDA's declarations, these definitions) --------------------------------

// A stream runs its kernels at once, but its async copies wait in its queue until something
// orders them: a later launch or GEMM on the same stream, an event another stream waits for, or
// a synchronisation. So a copy on a second stream really happens "later" - a kernel that reads
// its destination without waiting for its event reads the old bytes, and one that overwrites
// its source first changes what it copies: the offload's missing waits show as wrong results.
struct CUstream_st {
    std::vector<std::function<void()>> q;  // queued copies; q[i] is number done + i
    uint64_t done = 0;
    uint64_t cap = 0;                      // the stream capture it is part of (0: none)
    uint64_t cap_ops = 0, cap_joined = 0;  // work recorded on it in that capture; how much of it the origin waited for
    int device = 0;                        // the device current when it was made: a launch on it needs that one current
};
namespace qlshim {
inline int stream_device(cudaStream_t s) { return s->device; }
}  // namespace qlshim
struct CUevent_st {
    double t;
    cudaStream_t s = nullptr;  // the stream recorded on, and its queue position then
    uint64_t pos = 0;
    uint64_t cap = 0, cap_pos = 0;  // recorded during capture `cap`, after cap_pos of s's recorded work
};
// A captured graph is the list of what the capture recorded, in issue order: each entry issues
// its call again (a kernel with the arguments it had then), so a replay is the eager run again
struct CUgraph_st {
    std::vector<std::function<void()>> ops;
    cudaStream_t origin = nullptr;
    std::vector<cudaStream_t> streams;  // every stream the capture drew in
};
struct CUgraphExec_st : CUgraph_st {};
namespace qlshim {
inline void flush_stream(cudaStream_t s, uint64_t upto) {
    if (!s) return;
    while (s->done < upto && !s->q.empty()) {
        std::function<void()> f = std::move(s->q.front());
        s->q.erase(s->q.begin());
        s->done++;
        f();
    }
}

// ---- stream capture (CUDA graphs) ----
// cudaStreamBeginCapture puts a stream in capture mode: its launches, async copies and memsets,
// event records and waits and cuBLAS calls are recorded, not run. Another stream joins the
// capture by waiting for an event recorded in it, and must be joined back (the origin waits
// for an event recorded after its last work) before cudaStreamEndCapture, or that fails with
// cudaErrorStreamCaptureUnjoined. As on a GPU, what a capture forbids fails and invalidates it
// (cudaErrorStreamCaptureUnsupported; cudaStreamEndCapture then returns
// cudaErrorStreamCaptureInvalidated): synchronising a capturing stream, cudaMalloc / cudaFree /
// cudaMallocHost / cudaFreeHost, synchronous copies and memsets, cudaDeviceSynchronize (from
// the capturing thread in thread-local mode, from any in global mode; relaxed mode allows them),
// waiting for an event recorded outside the capture (cudaErrorStreamCaptureIsolation). And the
// shim's own rule: a cuBLAS call is captured only on a handle given its workspace
// (cublasSetWorkspace), else cuBLAS allocates one of its own per capture.
// limitation: a join is seen only where the origin itself waits for the joined stream's event
// (not through a third stream).
struct capture_t {
    cudaStream_t origin = nullptr;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
    std::thread::id thread;
    std::vector<std::function<void()>> ops;
    std::vector<cudaStream_t> streams;  // origin first, then those that joined
    std::string invalid;                // why it was invalidated ("": it was not)
};
struct graphs_t {
    uint64_t next_id = 1;
    std::map<uint64_t, capture_t> active;
    uint64_t captures = 0, launches = 0;  // graphs captured and launched so far (for tests)
};
inline graphs_t &gs() {
    static graphs_t g;
    return g;
}
inline capture_t *capture_of(cudaStream_t s) {
    if (!s || !s->cap) return nullptr;
    auto it = gs().active.find(s->cap);
    return it == gs().active.end() ? nullptr : &it->second;
}
inline bool capturing(cudaStream_t s) { return capture_of(s) != nullptr; }
inline void capture_record(cudaStream_t s, std::function<void()> op) {  // work on a capturing stream
    capture_of(s)->ops.push_back(std::move(op));
    s->cap_ops++;
}
inline void capture_invalidate(capture_t &c, const std::string &why) {
    if (!c.invalid.empty()) return;
    c.invalid = why;
    fprintf(stderr, "qlshim: stream capture invalidated: %s\n", why.c_str());
}
// a call no capture allows: true (and the captures it breaks invalidated) when one is under way
inline bool forbidden_in_capture(const char *call) {
    bool hit = false;
    for (auto &kv : gs().active) {
        capture_t &c = kv.second;
        if (c.mode == cudaStreamCaptureModeRelaxed || (c.mode == cudaStreamCaptureModeThreadLocal && c.thread != std::this_thread::get_id()))
            continue;
        capture_invalidate(c, std::string(call) + " during stream capture");
        hit = true;
    }
    return hit;
}
inline uint64_t graphs_captured() { return gs().captures; }
inline uint64_t graphs_launched() { return gs().launches; }
}  // namespace qlshim
struct cublasContext {
    cudaStream_t stream;
    bool workspace = false;  // cublasSetWorkspace was called
};

extern "C" {
inline cudaError_t cudaGetDeviceCount(int *n) {
    qlshim::read_env();
    *n = qlshim::st().device_count;
    return *n ? cudaSuccess : cudaErrorNoDevice;
}
inline cudaError_t cudaSetDevice(int d) {
    qlshim::read_env();
    if (d < 0 || d >= qlshim::st().device_count) return cudaErrorInvalidDevice;
    qlshim::current_device() = d;
    return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int *d) {
    *d = qlshim::current_device();
    return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
    qlshim::read_env();
    if (d < 0 || d >= qlshim::st().device_count) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "qlshim (CPU)");
    p->major = qlshim::st().cc_major;
    p->minor = qlshim::st().cc_minor;
    p->totalGlobalMem = qlshim::st().total_mem;
    p->sharedMemPerBlock = 48 << 10;
    p->sharedMemPerBlockOptin = (size_t)qlshim::max_opt_in_smem();
    p->multiProcessorCount = 4;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    return cudaSuccess;
}
inline cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
    *total = qlshim::st().total_mem;
    *free_b = *total - qlshim::st().in_use;
    return cudaSuccess;
}
inline cudaError_t cudaMalloc(void **p, size_t size) {
    *p = nullptr;
    if (qlshim::forbidden_in_capture("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
    qlshim::state_t &s = qlshim::st();
    std::lock_guard<std::mutex> lk(s.mu);
    *p = nullptr;
    if (s.in_use + size > s.total_mem) return cudaErrorMemoryAllocation;
    void *m = malloc(std::max<size_t>(size, 1));
    if (!m) return cudaErrorMemoryAllocation;
    memset(m, 0xff, size);  // device memory starts as garbage
    s.allocs[m] = size;
    s.in_use += size;
    s.peak = std::max(s.peak, s.in_use);
    *p = m;
    return cudaSuccess;
}
inline cudaError_t cudaFree(void *p) {
    if (qlshim::forbidden_in_capture("cudaFree")) return cudaErrorStreamCaptureUnsupported;
    if (!p) return cudaSuccess;
    qlshim::state_t &s = qlshim::st();
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.allocs.find(p);
    if (it == s.allocs.end()) return cudaErrorInvalidValue;
    s.in_use -= it->second;
    s.allocs.erase(it);
    free(p);
    return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void **p, size_t size) {
    *p = nullptr;
    if (qlshim::forbidden_in_capture("cudaMallocHost")) return cudaErrorStreamCaptureUnsupported;
    *p = malloc(std::max<size_t>(size, 1));
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeHost(void *p) {
    if (qlshim::forbidden_in_capture("cudaFreeHost")) return cudaErrorStreamCaptureUnsupported;
    free(p);
    return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind) {
    if (qlshim::forbidden_in_capture("cudaMemcpy")) return cudaErrorStreamCaptureUnsupported;
    if (n) memmove(dst, src, n);
    return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind k, cudaStream_t s) {
    if (!s) return cudaMemcpy(dst, src, n, k);
    if (qlshim::capturing(s)) {
        qlshim::capture_record(s, [=] { cudaMemcpyAsync(dst, src, n, k, s); });
        return cudaSuccess;
    }
    s->q.push_back([=] {
        if (n) memmove(dst, src, n);
    });
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    qlshim::st().stream_ops++;
    return cudaSuccess;
}
// rows of width bytes, height of them, pitches apart: the real call refuses a width over either pitch
inline cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                                     cudaMemcpyKind k, cudaStream_t s) {
    if (width > dpitch || width > spitch) return cudaErrorInvalidPitchValue;
    if (qlshim::capturing(s)) {
        qlshim::capture_record(s, [=] { cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, k, s); });
        return cudaSuccess;
    }
    for (size_t r = 0; r < height; r++) {
        const cudaError_t e = cudaMemcpyAsync((char *)dst + r * dpitch, (const char *)src + r * spitch, width, k, s);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}
// Peer copies: every shim device's memory is the host's, so the copy is a memmove on the stream;
// the devices named must exist, and any pair can access each other
inline cudaError_t cudaDeviceCanAccessPeer(int *can, int d, int peer) {
    qlshim::read_env();
    if (d < 0 || d >= qlshim::st().device_count || peer < 0 || peer >= qlshim::st().device_count) return cudaErrorInvalidDevice;
    *can = d != peer;
    return cudaSuccess;
}
inline cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
    if (peer < 0 || peer >= qlshim::st().device_count || peer == qlshim::current_device()) return cudaErrorInvalidDevice;
    return cudaSuccess;
}
inline cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_dev, const void *src, int src_dev, size_t n, cudaStream_t s) {
    qlshim::read_env();
    if (dst_dev < 0 || dst_dev >= qlshim::st().device_count || src_dev < 0 || src_dev >= qlshim::st().device_count) return cudaErrorInvalidDevice;
    if (dst_dev != src_dev) {
        std::lock_guard<std::mutex> lk(qlshim::st().mu);
        qlshim::st().peer_copies++;
    }
    return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s);
}
extern "C" __attribute__((used)) inline long long qlshim_peer_copies(void) {
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    return qlshim::st().peer_copies;
}
inline cudaError_t cudaMemset(void *p, int v, size_t n) {
    if (qlshim::forbidden_in_capture("cudaMemset")) return cudaErrorStreamCaptureUnsupported;
    if (n) memset(p, v, n);
    return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    if (!s) return cudaMemset(p, v, n);
    if (qlshim::capturing(s)) {
        qlshim::capture_record(s, [=] { cudaMemsetAsync(p, v, n, s); });
        return cudaSuccess;
    }
    qlshim::flush_stream(s);  // in order behind its stream's copies
    if (n) memset(p, v, n);
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    qlshim::st().stream_ops++;
    return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t *s) {
    *s = new CUstream_st();
    (*s)->device = qlshim::current_device();
    return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { return cudaStreamCreate(s); }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
    delete s;
    return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (qlshim::capture_t *c = qlshim::capture_of(s)) {
        qlshim::capture_invalidate(*c, "cudaStreamSynchronize of a capturing stream");
        return cudaErrorStreamCaptureUnsupported;
    }
    if (!s && qlshim::forbidden_in_capture("cudaDeviceSynchronize")) return cudaErrorStreamCaptureUnsupported;
    qlshim::flush_stream(s, ~0ull);
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    qlshim::st().syncs++;
    return qlshim::st().sticky;  // a failed launch shows at the next synchronisation too
}
// The counts, for tests built without the shim's headers (they declare these weak: NULL outside
// the shim's suite): host synchronisations so far, launches of a kernel (by its name) so far.
extern "C" __attribute__((used)) inline long long qlshim_stream_ops(void) {  // (ql_census' launches, as run)
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    return qlshim::st().stream_ops;
}
extern "C" __attribute__((used)) inline long long qlshim_host_syncs(void) {
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    return qlshim::st().syncs;
}
extern "C" __attribute__((used)) inline long long qlshim_async_copies(void) { return qlshim::st().async_copies.load(); }
extern "C" __attribute__((used)) inline long long qlshim_launches(const char *kernel) {
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    auto it = qlshim::st().launches.find(kernel);
    return it == qlshim::st().launches.end() ? 0 : it->second;
}
inline cudaError_t cudaDeviceSynchronize(void) { return cudaStreamSynchronize(nullptr); }
inline cudaError_t cudaGetLastError(void) {
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    const cudaError_t e = qlshim::st().sticky;
    qlshim::st().sticky = cudaSuccess;
    return e;
}
inline cudaError_t cudaPeekAtLastError(void) {
    std::lock_guard<std::mutex> lk(qlshim::st().mu);
    return qlshim::st().sticky;
}
inline const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    default: return "cudaError";
    }
}
inline const char *cudaGetErrorString(cudaError_t e) {
    // the detail of the last launch failure while it is the one asked about
    static thread_local std::string s;
    s = cudaGetErrorName(e);
    if ((e == cudaErrorLaunchFailure || e == cudaErrorInvalidConfiguration) && !qlshim::st().message.empty())
        s += ": " + qlshim::st().message;
    else if (e == cudaErrorMemoryAllocation)
        s = "out of memory";
    return s.c_str();
}
inline cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new CUevent_st();
    return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (qlshim::capturing(s)) {  // a point in the capture another stream may wait for (not work of its own)
        e->cap = s->cap;
        e->cap_pos = s->cap_ops;
        e->s = s;
        qlshim::capture_of(s)->ops.push_back([=] { cudaEventRecord(e, s); });
        return cudaSuccess;
    }
    e->cap = 0;
    e->t = (double)std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
    e->s = s;
    e->pos = s ? s->done + s->q.size() : 0;
    return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (e->cap && qlshim::gs().active.count(e->cap) && qlshim::forbidden_in_capture("cudaEventSynchronize of a captured event"))
        return cudaErrorStreamCaptureUnsupported;
    qlshim::flush_stream(e->s, e->pos);
    return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    qlshim::graphs_t &g = qlshim::gs();
    auto it = e->cap ? g.active.find(e->cap) : g.active.end();
    if (it != g.active.end()) {  // recorded in a capture under way: s joins it (or is in it already)
        qlshim::capture_t &c = it->second;
        if (!s) {
            qlshim::capture_invalidate(c, "the legacy stream waits for a captured event");
            return cudaErrorStreamCaptureImplicit;
        }
        if (s->cap && s->cap != e->cap) {
            qlshim::capture_invalidate(c, "a stream of another capture waits for a captured event");
            return cudaErrorStreamCaptureMerge;
        }
        if (!s->cap) {
            s->cap = e->cap;
            s->cap_ops = s->cap_joined = 0;
            c.streams.push_back(s);
        }
        if (s == c.origin && e->s != s) e->s->cap_joined = std::max(e->s->cap_joined, e->cap_pos);
        c.ops.push_back([=] { cudaStreamWaitEvent(s, e, 0); });
        return cudaSuccess;
    }
    if (qlshim::capture_t *c = qlshim::capture_of(s)) {
        qlshim::capture_invalidate(*c, "a capturing stream waits for an event recorded outside the capture");
        return cudaErrorStreamCaptureIsolation;
    }
    qlshim::flush_stream(e->s, e->pos);  // what the event covers is done before the waiting stream goes on
    return cudaSuccess;
}
inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    if (!s) return cudaErrorStreamCaptureUnsupported;  // the legacy stream cannot be captured
    if (s->cap) return cudaErrorIllegalState;
    qlshim::graphs_t &g = qlshim::gs();
    const uint64_t id = g.next_id++;
    qlshim::capture_t &c = g.active[id];
    c.origin = s;
    c.mode = mode;
    c.thread = std::this_thread::get_id();
    c.streams.push_back(s);
    s->cap = id;
    s->cap_ops = s->cap_joined = 0;
    return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
    const qlshim::capture_t *c = qlshim::capture_of(s);
    *status = !c ? cudaStreamCaptureStatusNone : c->invalid.empty() ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusInvalidated;
    return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    *graph = nullptr;
    qlshim::capture_t *c = qlshim::capture_of(s);
    if (!c) return cudaErrorIllegalState;
    if (c->origin != s) {
        qlshim::capture_invalidate(*c, "cudaStreamEndCapture on a stream that did not begin the capture");
        return cudaErrorStreamCaptureUnmatched;
    }
    const uint64_t id = s->cap;
    std::string unjoined;
    for (cudaStream_t x : c->streams) {
        if (x != s && x->cap_ops > x->cap_joined) unjoined = "a stream drawn into the capture has work the origin stream never waited for";
        x->cap = 0;
    }
    qlshim::capture_t done = std::move(*c);
    qlshim::gs().active.erase(id);
    if (!done.invalid.empty()) return cudaErrorStreamCaptureInvalidated;
    if (!unjoined.empty()) {
        fprintf(stderr, "qlshim: cudaStreamEndCapture: %s\n", unjoined.c_str());
        return cudaErrorStreamCaptureUnjoined;
    }
    CUgraph_st *gr = new CUgraph_st();
    gr->ops = std::move(done.ops);
    gr->origin = s;
    gr->streams = std::move(done.streams);
    *graph = gr;
    qlshim::gs().captures++;
    return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long) {
    if (!graph) return cudaErrorInvalidValue;
    if (qlshim::st().fail_instantiate > 0) {  // as a card out of memory for a graph's executable would
        qlshim::st().fail_instantiate--;
        *exec = nullptr;
        return cudaErrorMemoryAllocation;
    }
    CUgraphExec_st *x = new CUgraphExec_st();
    static_cast<CUgraph_st &>(*x) = *graph;
    *exec = x;
    return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (!exec) return cudaErrorInvalidValue;
    if (qlshim::capturing(s)) {  // a graph inside a capture: its work, recorded
        qlshim::capture_record(s, [=] { cudaGraphLaunch(exec, s); });
        return cudaSuccess;
    }
    if (s != exec->origin) qlshim::flush_stream(s);  // after what s did before
    for (const std::function<void()> &op : exec->ops) op();
    if (s != exec->origin)
        for (cudaStream_t x : exec->streams) qlshim::flush_stream(x);  // the graph is done before s goes on
    qlshim::gs().launches++;
    return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;
    return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = (float)((b->t - a->t) / 1000.0);
    return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
inline cudaError_t cudaMemcpyToSymbol(const void *symbol, const void *src, size_t n, size_t offset, cudaMemcpyKind) {
    memcpy((char *)symbol + offset, src, n);  // __constant__ data is an ordinary global here
    return cudaSuccess;
}
inline cudaError_t cudaDriverGetVersion(int *v) {
    *v = 13000;
    return cudaSuccess;
}
inline cudaError_t cudaRuntimeGetVersion(int *v) {
    *v = 13000;
    return cudaSuccess;
}
}  // extern "C"

namespace qlshim {
inline cudaError_t set_max_dyn_smem(const void *k, int bytes) {
    if (bytes < 0 || bytes > max_opt_in_smem()) return cudaErrorInvalidValue;
    std::lock_guard<std::mutex> lk(st().mu);
    st().max_dyn_smem[k] = bytes;
    return cudaSuccess;
}
}  // namespace qlshim
#define cudaFuncSetAttribute(k, attr, v) \
    ((attr) == cudaFuncAttributeMaxDynamicSharedMemorySize ? ::qlshim::set_max_dyn_smem((const void *)(k), (int)(v)) : cudaSuccess)

// ---- cuBLAS: a reference GEMM with cuBLAS' column-major semantics and argument checks -----------

namespace qlshim {
// D = alpha op(A) op(B) + beta C per batch (column-major, f32 sums in k order, rounded once to the
// output type); C and D of one type, D may be C (cuBLAS) or apart (cuBLASLt); beta 0: C not read
inline void gemm_ref(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al, const void *A, cudaDataType at, long long lda,
                     long long sA, const void *B, cudaDataType bt, long long ldb, long long sB, float be, const void *C, cudaDataType ct,
                     long long ldc, long long sC, void *D, long long ldd, long long sD, int batch) {
    {
        std::lock_guard<std::mutex> lk(st().mu);
        st().stream_ops++;
    }
    auto ld = [](const void *p, cudaDataType t, long long i) -> float {
        if (t == CUDA_R_32F) return ((const float *)p)[i];
        if (t == CUDA_R_16F) return __half2float(((const __half *)p)[i]);
        return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    };
    const int cs = ct == CUDA_R_32F ? 4 : 2;
    for (int bi = 0; bi < batch; bi++) {
        const char *Ab = (const char *)A + bi * sA * (at == CUDA_R_32F ? 4 : 2);
        const char *Bb = (const char *)B + bi * sB * (bt == CUDA_R_32F ? 4 : 2);
        const char *Cb = (const char *)C + bi * sC * cs;
        char *Db = (char *)D + bi * sD * cs;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                float acc = 0;
                for (int p = 0; p < k; p++) {
                    const float a = ld(Ab, at, ta == CUBLAS_OP_N ? i + (long long)p * lda : p + (long long)i * lda);
                    const float b = ld(Bb, bt, tb == CUBLAS_OP_N ? p + (long long)j * ldb : j + (long long)p * ldb);
                    acc += a * b;
                }
                float r = al * acc;
                if (be != 0.0f) r += be * ld(Cb, ct, i + (long long)j * ldc);  // beta 0: C is not read (garbage never leaks)
                const long long di = i + (long long)j * ldd;
                if (ct == CUDA_R_32F) ((float *)Db)[di] = r;
                else if (ct == CUDA_R_16F) ((__half *)Db)[di] = __float2half_rn(r);
                else ((__nv_bfloat16 *)Db)[di] = __float2bfloat16_rn(r);
            }
    }
}
}  // namespace qlshim

extern "C" {
inline cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
    *h = new cublasContext{nullptr};
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    h->workspace = false;  // as cuBLAS: setting the stream resets the workspace to its own pool
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t) { return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED; }
inline cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *p, size_t size) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->workspace = p && size > 0;
    return CUBLAS_STATUS_SUCCESS;
}
inline const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_EXECUTION_FAILED";
    }
}

inline cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                                 const void *alpha, const void *A, cudaDataType at, int lda, long long sA,
                                                 const void *B, cudaDataType bt, int ldb, long long sB, const void *beta, void *C,
                                                 cudaDataType ct, int ldc, long long sC, int batch, cublasComputeType_t comp,
                                                 cublasGemmAlgo_t) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    const bool capture = qlshim::capturing(h->stream);
    if (!capture) qlshim::flush_stream(h->stream);  // in order behind its stream's copies
    if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max(1, ta == CUBLAS_OP_N ? m : k) ||
        ldb < std::max(1, tb == CUBLAS_OP_N ? k : n) || ldc < std::max(1, m) || (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) ||
        (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool f32 = at == CUDA_R_32F && bt == CUDA_R_32F && ct == CUDA_R_32F;
    const bool h16 = at == bt && (at == CUDA_R_16F || at == CUDA_R_16BF) && (ct == CUDA_R_32F || ct == at);
    if (!(f32 || h16) || (comp != CUBLAS_COMPUTE_32F && comp != CUBLAS_COMPUTE_32F_PEDANTIC && comp != CUBLAS_COMPUTE_32F_FAST_TF32 &&
                          comp != CUBLAS_COMPUTE_32F_FAST_16F && comp != CUBLAS_COMPUTE_32F_FAST_16BF))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (at == CUDA_R_16BF && qlshim::st().cc_major < 8) return CUBLAS_STATUS_ARCH_MISMATCH;
    if (capture) {  // recorded: alpha and beta by value (host pointer mode), the rest as given
        if (!h->workspace) {
            qlshim::capture_invalidate(*qlshim::capture_of(h->stream), "a cuBLAS call captured on a handle without "
                                       "cublasSetWorkspace (cuBLAS would allocate a workspace of its own per capture)");
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        const float al = *(const float *)alpha, be = *(const float *)beta;
        qlshim::capture_record(h->stream, [=] {
            const float a2 = al, b2 = be;
            cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, &a2, A, at, lda, sA, B, bt, ldb, sB, &b2, C, ct, ldc, sC, batch, comp,
                                       CUBLAS_GEMM_DEFAULT);
        });
        return CUBLAS_STATUS_SUCCESS;
    }
    qlshim::gemm_ref(ta, tb, m, n, k, *(const float *)alpha, A, at, lda, sA, B, bt, ldb, sB, *(const float *)beta, C, ct, ldc, sC, C, ldc,
                     sC, batch);
    return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *alpha,
                                   const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                                   void *C, cudaDataType ct, int ldc, cublasComputeType_t comp, cublasGemmAlgo_t algo) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc, 0, 1, comp, algo);
}

// ---- cuBLASLt: what the backend asks of it (D = alpha op(A) op(B) + beta C with D apart from C:
// a residual added by the product that writes the sum), on the reference GEMM. The descriptors
// are the header's opaque structs, initialised in place (no allocation); what is set is kept in
// their words: a layout's type, rows, cols, ld, batch count and stride; a multiply's compute and
// scale types and the two transposes
}  // extern "C"
struct cublasLtContext {
    int magic = 0x4c74;
};
namespace qlshim {
enum { LT_TYPE, LT_ROWS, LT_COLS, LT_LD, LT_BATCH, LT_STRIDE, LT_SET };  // a layout's words
enum { LT_COMPUTE, LT_SCALE, LT_TA, LT_TB, LT_DSET };                      // a multiply's words
}  // namespace qlshim
extern "C" {
inline cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    *h = new cublasLtContext();
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    if (!h || h->magic != 0x4c74) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutInit_internal(cublasLtMatrixLayout_t l, size_t size, cudaDataType type, uint64_t rows,
                                                         uint64_t cols, int64_t ld) {
    if (!l || size < sizeof(cublasLtMatrixLayoutOpaque_t)) return CUBLAS_STATUS_INVALID_VALUE;
    int64_t *w = (int64_t *)l->data;
    w[qlshim::LT_TYPE] = (int64_t)type, w[qlshim::LT_ROWS] = (int64_t)rows, w[qlshim::LT_COLS] = (int64_t)cols, w[qlshim::LT_LD] = ld;
    w[qlshim::LT_BATCH] = 1, w[qlshim::LT_STRIDE] = 0, w[qlshim::LT_SET] = 0x4c61;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, const void *buf,
                                                        size_t size) {
    if (!l || !buf || ((int64_t *)l->data)[qlshim::LT_SET] != 0x4c61) return CUBLAS_STATUS_INVALID_VALUE;
    int64_t *w = (int64_t *)l->data;
    if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT && size == sizeof(int32_t)) w[qlshim::LT_BATCH] = *(const int32_t *)buf;
    else if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET && size == sizeof(int64_t)) w[qlshim::LT_STRIDE] = *(const int64_t *)buf;
    else return CUBLAS_STATUS_INVALID_VALUE;  // (the backend sets no other)
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescInit_internal(cublasLtMatmulDesc_t d, size_t size, cublasComputeType_t compute,
                                                       cudaDataType_t scale) {
    if (!d || size < sizeof(cublasLtMatmulDescOpaque_t)) return CUBLAS_STATUS_INVALID_VALUE;
    int64_t *w = (int64_t *)d->data;
    w[qlshim::LT_COMPUTE] = (int64_t)compute, w[qlshim::LT_SCALE] = (int64_t)scale;
    w[qlshim::LT_TA] = w[qlshim::LT_TB] = (int64_t)CUBLAS_OP_N, w[qlshim::LT_DSET] = 0x4c64;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void *buf,
                                                      size_t size) {
    if (!d || !buf || ((int64_t *)d->data)[qlshim::LT_DSET] != 0x4c64) return CUBLAS_STATUS_INVALID_VALUE;
    int64_t *w = (int64_t *)d->data;
    if ((attr == CUBLASLT_MATMUL_DESC_TRANSA || attr == CUBLASLT_MATMUL_DESC_TRANSB) && size == sizeof(int32_t))
        w[attr == CUBLASLT_MATMUL_DESC_TRANSA ? qlshim::LT_TA : qlshim::LT_TB] = *(const int32_t *)buf;
    else return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                                     cublasLtMatrixLayout_t Ad, const void *B, cublasLtMatrixLayout_t Bd, const void *beta, const void *C,
                                     cublasLtMatrixLayout_t Cd, void *D, cublasLtMatrixLayout_t Dd, const cublasLtMatmulAlgo_t *algo,
                                     void *workspace, size_t workspace_size, cudaStream_t stream) {
    (void)algo, (void)workspace, (void)workspace_size;  // (algo NULL: the library's heuristic; the reference has one way)
    if (!h || h->magic != 0x4c74) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!desc || !Ad || !Bd || !Cd || !Dd || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
    const int64_t *dw = (const int64_t *)desc->data, *a = (const int64_t *)Ad->data, *b = (const int64_t *)Bd->data,
                  *c = (const int64_t *)Cd->data, *d = (const int64_t *)Dd->data;
    using namespace qlshim;
    if (dw[LT_DSET] != 0x4c64 || a[LT_SET] != 0x4c61 || b[LT_SET] != 0x4c61 || c[LT_SET] != 0x4c61 || d[LT_SET] != 0x4c61)
        return CUBLAS_STATUS_INVALID_VALUE;
    const cublasOperation_t ta = (cublasOperation_t)dw[LT_TA], tb = (cublasOperation_t)dw[LT_TB];
    // D m x n; op(A) m x k, op(B) k x n, as the layouts say (rows and cols before the transpose)
    const int64_t m = d[LT_ROWS], n = d[LT_COLS], k = ta == CUBLAS_OP_N ? a[LT_COLS] : a[LT_ROWS];
    const int batch = (int)d[LT_BATCH];
    const bool shapes = (ta == CUBLAS_OP_N ? a[LT_ROWS] : a[LT_COLS]) == m && (tb == CUBLAS_OP_N ? b[LT_ROWS] : b[LT_COLS]) == k &&
                        (tb == CUBLAS_OP_N ? b[LT_COLS] : b[LT_ROWS]) == n && c[LT_ROWS] == m && c[LT_COLS] == n &&
                        a[LT_LD] >= std::max<int64_t>(1, a[LT_ROWS]) && b[LT_LD] >= std::max<int64_t>(1, b[LT_ROWS]) &&
                        c[LT_LD] >= std::max<int64_t>(1, m) && d[LT_LD] >= std::max<int64_t>(1, m) && a[LT_BATCH] == batch &&
                        b[LT_BATCH] == batch && c[LT_BATCH] == batch && batch >= 1 && (ta == CUBLAS_OP_N || ta == CUBLAS_OP_T) &&
                        (tb == CUBLAS_OP_N || tb == CUBLAS_OP_T);
    if (!shapes) return CUBLAS_STATUS_INVALID_VALUE;
    {
        std::lock_guard<std::mutex> lk(st().mu);
        if (st().refuse_lt > 0 && st().refuse_lt_skip > 0) {
            st().refuse_lt_skip--;
        } else if (st().refuse_lt > 0) {
            st().refuse_lt--;
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
    }
    const cudaDataType at = (cudaDataType)a[LT_TYPE], bt = (cudaDataType)b[LT_TYPE], ct = (cudaDataType)c[LT_TYPE];
    const bool f32 = at == CUDA_R_32F && bt == CUDA_R_32F && ct == CUDA_R_32F;
    const bool h16 = at == bt && (at == CUDA_R_16F || at == CUDA_R_16BF) && (ct == CUDA_R_32F || ct == at);
    if (!(f32 || h16) || (cudaDataType)d[LT_TYPE] != ct || dw[LT_COMPUTE] != CUBLAS_COMPUTE_32F || dw[LT_SCALE] != CUDA_R_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (at == CUDA_R_16BF && st().cc_major < 8) return CUBLAS_STATUS_ARCH_MISMATCH;
    // C and D apart, or D in place over C: a D that only partly overlaps C is an error
    const size_t es = ct == CUDA_R_32F ? 4 : 2;
    const char *c0 = (const char *)C, *d0 = (const char *)D;
    const size_t cspan = (size_t)((batch - 1) * c[LT_STRIDE] + (n - 1) * c[LT_LD] + m) * es,
                 dspan = (size_t)((batch - 1) * d[LT_STRIDE] + (n - 1) * d[LT_LD] + m) * es;
    if (c0 != d0 && c0 < d0 + dspan && d0 < c0 + cspan) return CUBLAS_STATUS_INVALID_VALUE;
    const float al = *(const float *)alpha, be = *(const float *)beta;
    const int64_t lda = a[LT_LD], ldb = b[LT_LD], ldc = c[LT_LD], ldd = d[LT_LD], sA = a[LT_STRIDE], sB = b[LT_STRIDE],
                  sC = c[LT_STRIDE], sD = d[LT_STRIDE];
    auto run = [=] { gemm_ref(ta, tb, (int)m, (int)n, (int)k, al, A, at, lda, sA, B, bt, ldb, sB, be, C, ct, ldc, sC, D, ldd, sD, batch); };
    if (capturing(stream)) {
        capture_record(stream, run);
        return CUBLAS_STATUS_SUCCESS;
    }
    flush_stream(stream);  // in order behind its stream's copies
    run();
    return CUBLAS_STATUS_SUCCESS;
}
}  // extern "C"

// last: the runtime's structs above have a field of this name
#define warpSize 32
