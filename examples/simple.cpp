// examples/simple.cpp - the drop-in check: this file and qlora.cpp, one compiler command:
//
//     c++ -std=c++17 -O2 -pthread examples/simple.cpp qlora.cpp -o simple && ./simple
//
// Fits a two-layer network y = W2 silu(W1 x) to a fixed random target function with AdamW and
// exits non-zero unless the loss falls by 100x. Uses nothing but the C API in qlora.h, and only
// touches tensors through the backend (set/get), so the same code runs on a GPU: built with
// qlora-cuda.cu it picks CUDA when a device is there (--device auto's rule).
#include "../qlora.h"

#include <stdio.h>
#include <stdlib.h>

static float frand(unsigned *s) {  // xorshift, [-1, 1)
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return (float)(*s % 20000) / 10000.0f - 1.0f;
}

int main(void) {
    enum { IN = 13, HID = 37, OUT = 5, N = 64 };
    ql_init_params ip = {16u << 20, NULL, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w1 = ql_set_param(ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, IN, HID), "w1"));   // [in, hid]
    ql_tensor *w2 = ql_set_param(ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, HID, OUT), "w2"));  // [hid, out]
    ql_tensor *x  = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_F32, IN, N));                        // [in, N]
    ql_tensor *y  = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_F32, OUT, N));                       // [out, N]
    static float hw1[IN * HID], hw2[HID * OUT], hx[IN * N], hy[OUT * N];  // host data, set on the backend below
    unsigned seed = 42;
    for (int64_t i = 0; i < IN * HID; i++) hw1[i] = 0.3f * frand(&seed);
    for (int64_t i = 0; i < HID * OUT; i++) hw2[i] = 0.3f * frand(&seed);
    for (int64_t i = 0; i < IN * N; i++) hx[i] = frand(&seed);
    for (int n = 0; n < N; n++)  // target: a smooth function of x
        for (int o = 0; o < OUT; o++) {
            const float *xn = hx + n * IN;
            hy[n * OUT + o] = 0.5f * xn[o] * xn[o + 1] - 0.3f * xn[2 * o + 2];
        }

    ql_tensor *pred = ql_mul_mat(ctx, w2, ql_silu(ctx, ql_mul_mat(ctx, w1, x)));  // [out, N]
    ql_tensor *err  = ql_add(ctx, pred, ql_scale(ctx, y, -1.0f));
    ql_tensor *loss = ql_scale(ctx, ql_sum(ctx, ql_mul(ctx, err, err)), 1.0f / N);
    ql_graph *gf = ql_graph_new(ctx);
    ql_graph_build_forward(gf, loss);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
    ql_tensor *m1 = ql_new_tensor_2d(ctx, QL_TYPE_F32, IN, HID), *v1 = ql_new_tensor_2d(ctx, QL_TYPE_F32, IN, HID);
    ql_tensor *m2 = ql_new_tensor_2d(ctx, QL_TYPE_F32, HID, OUT), *v2 = ql_new_tensor_2d(ctx, QL_TYPE_F32, HID, OUT);
    char why[256];
    ql_backend *be = ql_backend_init_by_name("auto", 0, why, sizeof(why));
    if (!be) {
        fprintf(stderr, "simple: %s\n", why);
        return 1;
    }
    // every leaf (weights, inputs, gradients, moments) into the backend's memory; nothing moves on the CPU
    ql_backend_buffer *buf = ql_backend_place_ctx_tensors(be, ctx);
    ql_plan_stats st;
    if (!gb || !buf || ql_backend_tensor_set(be, w1, hw1, 0, sizeof(hw1)) || ql_backend_tensor_set(be, w2, hw2, 0, sizeof(hw2)) ||
        ql_backend_tensor_set(be, x, hx, 0, sizeof(hx)) || ql_backend_tensor_set(be, y, hy, 0, sizeof(hy)) ||
        ql_graph_plan(gb, be, &st) != QL_OK || ql_graph_alloc(gb, be) != QL_OK) {
        fprintf(stderr, "simple: %s\n", ql_ctx_error(ctx));
        return 1;
    }
    printf("planned: %zu bytes for %d tensors (%zu without reuse) + %zu bytes kernel workspace\n",
           st.buffer_size - st.bytes[QL_MEM_WORK], st.n_planned, st.sum_of_sizes, st.bytes[QL_MEM_WORK]);

    ql_tensor *moments[4] = {m1, v1, m2, v2};
    for (int i = 0; i < 4; i++) ql_backend_tensor_memset(be, moments[i], 0, 0, ql_nbytes(moments[i]));
    const ql_adamw_params opt = {1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f};
    float first = 0, last = 0;
    for (int step = 1; step <= 300; step++) {
        if (ql_backend_graph_zero_grads(be, gb) != QL_OK || ql_backend_graph_compute(be, gb) != QL_OK ||
            ql_backend_tensor_get(be, loss, &last, 0, sizeof(last)) != QL_OK) {
            fprintf(stderr, "simple: %s\n", ql_ctx_error(ctx));
            return 1;
        }
        if (step == 1) first = last;
        if (step % 50 == 0 || step == 1) printf("step %3d  loss %.6f\n", step, last);
        ql_backend_adamw_update(be, w1, m1, v1, NULL, NULL, step, &opt, 1.0f);
        ql_backend_adamw_update(be, w2, m2, v2, NULL, NULL, step, &opt, 1.0f);
    }
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_buffer_free(buf);
    ql_backend_free(be);
    ql_free(ctx);
    if (!(last < first / 100)) {
        fprintf(stderr, "simple: loss fell only from %g to %g\n", first, last);
        return 1;
    }
    printf("ok: loss %.6f -> %.6f\n", first, last);
    return 0;
}
