// Dev-side only (never built by make or make test): writes tests/golden/kquants.bin, ggml's own
// quantisers on fixed inputs - the k-quant references (quantize_row_q4_K_ref, _q5_K_ref, _q6_K_ref,
// _q2_K_ref, _q3_K_ref: what llama-quantize calls without an importance matrix) and the iq4
// searches llama-quantize calls (quantize_iq4_nl, quantize_iq4_xs with no weights) - which
// tests/test_quants.cpp compares ./quantize's against byte for byte. Built against a
// llama.cpp checkout's ggml-quants.c, with ggml's flags for it (ggml-base: no -march, so no FMA):
//   L=/path/to/llama.cpp
//   gcc -O2 -c -I$L/ggml/include -I$L/ggml/src -I$L/ggml/src/ggml-cpu $L/ggml/src/ggml-quants.c -o /tmp/q.o
//   gcc -O2 -I$L/ggml/include -I$L/ggml/src tests/reference/kquants_golden.c /tmp/q.o -o /tmp/kq -lm
//   /tmp/kq > tests/golden/kquants.bin
// (the stubs below stand in for ggml.c's functions ggml-quants.c links against but these paths never call)
#include "ggml-quants.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ggml_abort(const char *file, int line, const char *fmt, ...) { (void)fmt; fprintf(stderr, "abort %s:%d\n", file, line); abort(); }
size_t ggml_row_size(enum ggml_type type, int64_t ne) { (void)type; (void)ne; abort(); }
const char *ggml_type_name(enum ggml_type type) { (void)type; return "?"; }
size_t ggml_type_size(enum ggml_type type) { (void)type; abort(); }

enum { NB = 32, N = 256 * NB };
static float x[N];
static uint64_t s = 20261124;
static double uni(void) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(s >> 11) / 9007199254740992.0;
}

int main(void) {
    for (int i = 0; i < N; i++) {  // per block: another distribution and scale
        const int b = i / 256;
        const double g = uni() + uni() + uni() - 1.5;  // roughly normal
        const double scale = 0.01 * (1 + b % 7);
        x[i] = (float)(b % 4 == 1 ? scale * (uni() - 0.5) : b % 4 == 2 ? scale * g + 0.3 * scale : scale * g);
    }
    memset(x + 256, 0, 256 * sizeof(float));        // an all-zero block
    x[2 * 256 + 7] = 2.0f;                            // an outlier
    for (int i = 3 * 256; i < 4 * 256; i++) x[i] = 0.125f;  // a constant block
    for (int i = 5 * 256; i < 5 * 256 + 32; i++) x[i] = 0;  // a zero sub-block
    fwrite(x, sizeof(float), N, stdout);
    static block_q4_K q4[NB];
    static block_q5_K q5[NB];
    static block_q6_K q6[NB];
    quantize_row_q4_K_ref(x, q4, N);
    quantize_row_q5_K_ref(x, q5, N);
    quantize_row_q6_K_ref(x, q6, N);
    fwrite(q4, sizeof(q4), 1, stdout);
    fwrite(q5, sizeof(q5), 1, stdout);
    fwrite(q6, sizeof(q6), 1, stdout);
    static block_q2_K q2[NB];
    static block_q3_K q3[NB];
    static block_iq4_nl nl[N / 32];
    static block_iq4_xs xs[NB];
    quantize_row_q2_K_ref(x, q2, N);
    quantize_row_q3_K_ref(x, q3, N);
    quantize_iq4_nl(x, nl, 1, N, NULL);
    quantize_iq4_xs(x, xs, 1, N, NULL);
    fwrite(q2, sizeof(q2), 1, stdout);
    fwrite(q3, sizeof(q3), 1, stdout);
    fwrite(nl, sizeof(nl), 1, stdout);
    fwrite(xs, sizeof(xs), 1, stdout);
    return 0;
}
