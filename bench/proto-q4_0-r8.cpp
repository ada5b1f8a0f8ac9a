// bench/proto-q4_0-r8.cpp - a measurement prototype for issue 32, NOT product code: is decode's
// Q4_0 product faster on weights repacked into groups of 8 rows (the layout llama.cpp's REPACK
// gives Q4_0) than on qlora's rows?
//   g++ -O2 -march=native -std=c++17 -I. bench/proto-q4_0-r8.cpp build/libqlora.a -o /tmp/proto-r8 -pthread -ldl
//   /tmp/proto-r8 M K THREADS NW   (NW distinct M x K weights, used one after the other, as a model's)
// qlora: ql_mul_mat with 8-bit activations (ql_mul_mat_set_prec), one graph of NW products on the
// CPU backend. Repacked: per group of 8 rows and block of 32, the 8 rows' d (16 bytes), then for
// q = 0..3 the 8 rows' code bytes 4q..4q+3 (32 bytes): one vpdpbusd adds 4 products to each row's
// lane, so no horizontal sums, one scale conversion for 8 rows. Its own threads (no graph), the
// same bytes and activations; it prints the largest relative difference between the two results.
// Needs AVX-512 VNNI + VL. Best of 20 runs each.
#include "qlora.h"
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

struct blk { uint16_t d; uint8_t qs[16]; };
static_assert(sizeof(blk) == 18, "Q4_0 blocks are 18 bytes");

// groups [g0, g1) of 8 rows: y[8 g + r]; x as qlora quantises it (int8 per block of 32, scale xd), x8 = 8 sum x
static void gemv_r8(int64_t K, int64_t g0, int64_t g1, const uint8_t *W, const int8_t *xq, const float *xd, const int32_t *x8, float *y) {
    const int64_t nb = K / 32;
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *p = W + g * nb * 144;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, p += 144) {
            const int8_t *x = xq + 32 * b;
            __m256i s = _mm256_setzero_si256();
            for (int q = 0; q < 4; q++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * q));
                int32_t lo, hi;
                memcpy(&lo, x + 4 * q, 4);
                memcpy(&hi, x + 16 + 4 * q, 4);
                s = _mm256_dpbusd_epi32(s, _mm256_and_si256(c, m4), _mm256_set1_epi32(lo));
                s = _mm256_dpbusd_epi32(s, _mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_set1_epi32(hi));
            }
            s = _mm256_sub_epi32(s, _mm256_set1_epi32(x8[b]));  // codes are q - 8
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xd[b])), acc);
        }
        _mm256_storeu_ps(y + 8 * g, acc);
    }
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: %s M K THREADS NW\n", argv[0]); return 2; }
    const int64_t M = atoll(argv[1]), K = atoll(argv[2]);
    const int th = atoi(argv[3]), NW = atoi(argv[4]);
    if (M % 8 || K % 32 || th < 1 || NW < 1) { fprintf(stderr, "M %% 8, K %% 32, THREADS >= 1, NW >= 1\n"); return 2; }
    const int64_t nb = K / 32;
    const size_t wbytes = ql_type_data_size(QL_TYPE_Q4_0, M, K);
    std::mt19937 rng(1);
    std::normal_distribution<float> G(0.0f, 0.05f);
    // the weights: NW distinct Q4_0 matrices in one qlora context, and the same bytes repacked
    ql_init_params ip = {(wbytes + 4096) * NW + (size_t)(K + M * NW) * 4 + (16u << 20), nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, K, 1);
    for (int64_t k = 0; k < K; k++) ((float *)x->data)[k] = G(rng) * 20;
    ql_graph *gr = ql_graph_new(ctx);
    std::vector<ql_tensor *> ys;
    std::vector<uint8_t> r8(wbytes * NW);
    std::vector<float> wf((size_t)(M * K));
    for (int w = 0; w < NW; w++) {
        for (float &v : wf) v = G(rng);
        ql_tensor *t = ql_new_tensor_2d(ctx, QL_TYPE_Q4_0, K, M);
        if (ql_quantize(QL_TYPE_Q4_0, wf.data(), M, K, t->data, nullptr, 0) != QL_OK) return 1;
        const blk *nat = (const blk *)t->data;
        for (int64_t g = 0; g < M / 8; g++)
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *p = r8.data() + (size_t)w * wbytes + (size_t)(g * nb + b) * 144;
                for (int r = 0; r < 8; r++) {
                    const blk &s = nat[(g * 8 + r) * nb + b];
                    memcpy(p + 2 * r, &s.d, 2);
                    for (int q = 0; q < 4; q++) memcpy(p + 16 + 32 * q + 4 * r, s.qs + 4 * q, 4);
                }
            }
        ql_tensor *y = ql_set_output(ql_mul_mat(ctx, t, x));
        if (ql_mul_mat_set_prec(y, QL_TYPE_Q8_0) != QL_OK) return 1;
        ql_graph_build_forward(gr, y);
        ys.push_back(y);
    }
    ql_backend *be = ql_backend_cpu_init(th);
    if (ql_graph_alloc(gr, be) != QL_OK) return 1;
    // the activations as the 8-bit path quantises them: amax / 127 per block, to nearest
    std::vector<int8_t> xq((size_t)K);
    std::vector<float> xd((size_t)nb);
    std::vector<int32_t> x8((size_t)nb);
    for (int64_t b = 0; b < nb; b++) {
        float am = 0;
        for (int k = 0; k < 32; k++) am = std::max(am, std::fabs(((float *)x->data)[32 * b + k]));
        const float id = am > 0 ? 127.0f / am : 0.0f;
        int s = 0;
        for (int k = 0; k < 32; k++) s += xq[(size_t)(32 * b + k)] = (int8_t)std::nearbyint(((float *)x->data)[32 * b + k] * id);
        xd[(size_t)b] = am / 127.0f;
        x8[(size_t)b] = 8 * s;
    }
    std::vector<float> yr((size_t)(M * NW));
    double tq = 1e9, tr = 1e9;
    for (int rep = 0; rep < 20; rep++) {
        auto t0 = std::chrono::steady_clock::now();
        if (ql_backend_graph_compute(be, gr) != QL_OK) return 1;
        auto t1 = std::chrono::steady_clock::now();
        auto work = [&](int t) {
            for (int w = 0; w < NW; w++)
                gemv_r8(K, (M / 8) * t / th, (M / 8) * (t + 1) / th, r8.data() + (size_t)w * wbytes, xq.data(), xd.data(), x8.data(),
                        yr.data() + (size_t)w * M);
        };
        if (th == 1) work(0);
        else {
            std::vector<std::thread> ts;
            for (int t = 0; t < th; t++) ts.emplace_back(work, t);
            for (auto &j : ts) j.join();
        }
        auto t2 = std::chrono::steady_clock::now();
        tq = std::min(tq, std::chrono::duration<double>(t1 - t0).count());
        tr = std::min(tr, std::chrono::duration<double>(t2 - t1).count());
    }
    double diff = 0, mag = 0;
    for (int w = 0; w < NW; w++)
        for (int64_t j = 0; j < M; j++) {
            diff = std::max(diff, (double)std::fabs(((float *)ys[(size_t)w]->data)[j] - yr[(size_t)(w * M + j)]));
            mag = std::max(mag, (double)std::fabs(yr[(size_t)(w * M + j)]));
        }
    const double bytes = (double)wbytes * NW;
    printf("%d x Q4_0 %lld x %lld, %d threads: qlora %.1f GB/s, repacked 8 rows %.1f GB/s (%.2fx); max |diff| / max |y| %.1e\n", NW, (long long)M,
           (long long)K, th, bytes / tq / 1e9, bytes / tr / 1e9, tq / tr, diff / mag);
    ql_graph_free(gr);
    ql_backend_free(be);
    ql_free(ctx);
    return 0;
}
