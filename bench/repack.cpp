// bench/repack.cpp - dev-side measurement (issue 32), not product code: decode's products on the
// rows of a Q4_K (or Q4_0) weight against the same weights repacked by ql_backend_cache_weights.
//   g++ -O2 -march=native -std=c++17 -I. bench/repack.cpp build/libqlora.a -o /tmp/repack -pthread -ldl
//   /tmp/repack M K THREADS NW [4k|0|6k]   (NW distinct M x K weights of Q4_K, Q4_0 or Q6_K, one
//   graph; best of 30 each; M a multiple of 8, K of 256)
// Prints GB/s of weights read each way and the largest difference relative to the largest output.
#include "qlora.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <random>
#include <vector>
#include <algorithm>
int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage: %s M K THREADS NW [4k|0|6k]\n", argv[0]); return 2; }
    const int64_t M = atoll(argv[1]), K = atoll(argv[2]);
    const int th = atoi(argv[3]), NW = atoi(argv[4]);
    const ql_type T = argc > 5 && argv[5][0] == '0' ? QL_TYPE_Q4_0 : argc > 5 && argv[5][0] == '6' ? QL_TYPE_Q6_K : QL_TYPE_Q4_K;
    if (M <= 0 || M % 8 || K <= 0 || K % 256 || th < 1 || NW < 1) { fprintf(stderr, "M %% 8, K %% 256, THREADS >= 1, NW >= 1\n"); return 2; }
    const size_t wbytes = ql_type_data_size(T, M, K);
    std::mt19937 rng(1);
    std::normal_distribution<float> G(0.0f, 0.05f);
    ql_init_params ip = {(wbytes + 4096) * NW + (size_t)(K + M * NW) * 4 + (16u << 20), nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, K, 1);
    for (int64_t k = 0; k < K; k++) ((float *)x->data)[k] = G(rng) * 20;
    ql_graph *gr = ql_graph_new(ctx);
    std::vector<ql_tensor *> ys, ws;
    std::vector<float> wf((size_t)(M * K));
    for (int w = 0; w < NW; w++) {
        for (float &v : wf) v = G(rng);
        ql_tensor *t = ql_new_tensor_2d(ctx, T, K, M);
        if (ql_quantize(T, wf.data(), M, K, t->data, nullptr, 0) != QL_OK) return 1;
        ws.push_back(t);
        ql_tensor *y = ql_set_output(ql_mul_mat(ctx, t, x));
        if (ql_mul_mat_set_prec(y, QL_TYPE_Q8_0) != QL_OK) return 1;
        ql_graph_build_forward(gr, y);
        ys.push_back(y);
    }
    ql_backend *be = ql_backend_cpu_init(th);
    if (ql_graph_alloc(gr, be) != QL_OK) return 1;
    auto best = [&]() {
        double t = 1e9;
        for (int rep = 0; rep < 30; rep++) {
            auto t0 = std::chrono::steady_clock::now();
            if (ql_backend_graph_compute(be, gr) != QL_OK) exit(1);
            t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        return t;
    };
    const double tr = best();
    std::vector<float> yr;
    for (auto y : ys) yr.insert(yr.end(), (float *)y->data, (float *)y->data + M);
    char err[256];
    ql_backend_buffer *b = ql_backend_cache_weights(be, ws.data(), NW, T, err, sizeof(err));
    if (!b) { fprintf(stderr, "%s\n", err); return 1; }
    const double tk = best();
    double diff = 0, mag = 0; size_t i = 0;
    for (auto y : ys) for (int64_t j = 0; j < M; j++, i++) { diff = std::max(diff, (double)std::fabs(((float*)y->data)[j] - yr[i])); mag = std::max(mag, (double)std::fabs(yr[i])); }
    const double bytes = (double)wbytes * NW;
    printf("%d x %s %lld x %lld, %d th: rows %.1f GB/s, repacked %.1f GB/s (%.2fx) diff %.1e\n", NW, ql_type_name(T), (long long)M, (long long)K, th,
           bytes / tr / 1e9, bytes / tk / 1e9, tr / tk, diff / mag);
    return 0;
}
