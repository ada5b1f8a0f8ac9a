// tests/fuzz_gguf.cpp - libFuzzer target for the GGUF reader (and the writer, on what it accepts).
//
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz_gguf.cpp qlora.cpp \
//       models/llama.cpp -o /tmp/fuzz_gguf -pthread
//   /tmp/fuzz_gguf_seeds SEEDS && /tmp/fuzz_gguf -runs=1000000 -max_len=4096 CORPUS SEEDS
//
// Properties, beyond "no crash, no sanitizer report":
// - a refused input gets a non-empty one-line message naming the source;
// - an accepted one has every string NUL-terminated at its length, every tensor's bytes inside the
//   input, and no two tensors sharing bytes;
// - what the reader accepts, the writer accepts too (copy_kv, add_tensor), and the file it writes
//   reads back with the same keys, values, tensors and bytes.
#include "../qlora.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#define FUZZ_CHECK(x)                                                                                   \
    do {                                                                                                \
        if (!(x)) {                                                                                     \
            fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #x);                   \
            __builtin_trap();                                                                           \
        }                                                                                               \
    } while (0)

static size_t elem_size(ql_gguf_type t) {
    switch (t) {
    case QL_GGUF_U8: case QL_GGUF_I8: case QL_GGUF_BOOL: return 1;
    case QL_GGUF_U16: case QL_GGUF_I16: return 2;
    case QL_GGUF_U32: case QL_GGUF_I32: case QL_GGUF_F32: return 4;
    case QL_GGUF_U64: case QL_GGUF_I64: case QL_GGUF_F64: return 8;
    default: return 0;
    }
}

static volatile uint64_t g_sink;

// Reads every value the reader exposes; checks the reader's own promises.
static void touch(const ql_gguf *g, const uint8_t *buf, size_t size) {
    uint64_t acc = ql_gguf_version(g) + ql_gguf_alignment(g) + ql_gguf_data_offset(g);
    FUZZ_CHECK(ql_gguf_alignment(g) && (ql_gguf_alignment(g) & (ql_gguf_alignment(g) - 1)) == 0);
    for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) {
        const char *key = ql_gguf_kv_key(g, i);
        FUZZ_CHECK(key && ql_gguf_find_kv(g, key) == i);
        const ql_gguf_type t = ql_gguf_kv_type(g, i);
        FUZZ_CHECK(t < QL_GGUF_TYPE_COUNT);
        int64_t iv = 0;
        uint64_t uv = 0;
        double dv = 0;
        bool bv = false;
        size_t len = 0;
        acc += ql_gguf_get_i64(g, i, &iv) + ql_gguf_get_u64(g, i, &uv) + ql_gguf_get_f64(g, i, &dv) +
               ql_gguf_get_bool(g, i, &bv);
        acc += (uint64_t)iv + uv + (uint64_t)bv + (dv == dv);
        const char *s = ql_gguf_get_str(g, i, &len);
        FUZZ_CHECK((s != nullptr) == (t == QL_GGUF_STRING));
        if (s) {
            FUZZ_CHECK(s[len] == '\0');
            for (size_t k = 0; k < len; k++) acc += (uint8_t)s[k];
        }
        const uint64_t n = ql_gguf_arr_n(g, i);
        const ql_gguf_type et = ql_gguf_arr_type(g, i);
        FUZZ_CHECK((et != QL_GGUF_TYPE_COUNT) == (t == QL_GGUF_ARRAY));
        if (et == QL_GGUF_STRING) {
            FUZZ_CHECK(ql_gguf_arr_data(g, i) == nullptr);
            for (uint64_t j = 0; j < n; j++) {
                const char *e = ql_gguf_arr_str(g, i, j, &len);
                FUZZ_CHECK(e && e[len] == '\0');
                if (len) acc += (uint8_t)e[0] + (uint8_t)e[len - 1];
            }
            FUZZ_CHECK(ql_gguf_arr_str(g, i, n, &len) == nullptr);
        } else if (t == QL_GGUF_ARRAY) {
            const uint8_t *d = (const uint8_t *)ql_gguf_arr_data(g, i);
            FUZZ_CHECK(d);
            const uint64_t bytes = n * elem_size(et);
            FUZZ_CHECK(bytes <= size);
            for (uint64_t k = 0; k < bytes; k++) acc += d[k];
        } else {
            FUZZ_CHECK(n == 0 && ql_gguf_arr_data(g, i) == nullptr && ql_gguf_arr_str(g, i, 0, &len) == nullptr);
        }
    }
    FUZZ_CHECK(ql_gguf_kv_key(g, ql_gguf_n_kv(g)) == nullptr);

    std::vector<std::pair<size_t, size_t>> ranges;
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        const char *name = ql_gguf_tensor_name(g, i);
        FUZZ_CHECK(name && strlen(name) < QL_MAX_NAME && ql_gguf_find_tensor(g, name) == i);
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(g, i, ne);
        FUZZ_CHECK(nd >= 1 && nd <= 4);
        for (int d = 0; d < 4; d++) FUZZ_CHECK(ne[d] >= 0 && (d < nd || ne[d] == 1));
        const ql_type type = ql_gguf_tensor_type(g, i);
        const ql_type_traits *tt = ql_type_traits_get(type);
        FUZZ_CHECK(tt && ne[0] % tt->blck_size == 0);
        const uint8_t *d = (const uint8_t *)ql_gguf_tensor_data(g, i);
        const size_t sz = ql_gguf_tensor_size(g, i);
        FUZZ_CHECK(d && d >= buf && sz <= size && (size_t)(d - buf) <= size - sz);
        FUZZ_CHECK((size_t)(d - buf) >= ql_gguf_data_offset(g));
        FUZZ_CHECK(((size_t)(d - buf) - ql_gguf_data_offset(g)) % ql_gguf_alignment(g) == 0);
        FUZZ_CHECK(sz == ql_type_data_size(type, ne[1] * ne[2] * ne[3], ne[0]));
        if (sz) {
            acc += d[0] + d[sz - 1];
            ranges.push_back({(size_t)(d - buf), sz});
        }
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t k = 1; k < ranges.size(); k++) FUZZ_CHECK(ranges[k - 1].first + ranges[k - 1].second <= ranges[k].first);
    g_sink = acc;
}

// Two readers hold the same KVs (same order) and tensors (same order, shapes and bytes).
static void same(const ql_gguf *a, const ql_gguf *b) {
    FUZZ_CHECK(ql_gguf_n_kv(a) == ql_gguf_n_kv(b) && ql_gguf_n_tensors(a) == ql_gguf_n_tensors(b));
    FUZZ_CHECK(ql_gguf_alignment(a) == ql_gguf_alignment(b));
    for (int64_t i = 0; i < ql_gguf_n_kv(a); i++) {
        FUZZ_CHECK(strcmp(ql_gguf_kv_key(a, i), ql_gguf_kv_key(b, i)) == 0);
        const ql_gguf_type t = ql_gguf_kv_type(a, i);
        FUZZ_CHECK(t == ql_gguf_kv_type(b, i));
        size_t la = 0, lb = 0;
        if (t == QL_GGUF_STRING) {
            const char *sa = ql_gguf_get_str(a, i, &la), *sb = ql_gguf_get_str(b, i, &lb);
            FUZZ_CHECK(la == lb && memcmp(sa, sb, la) == 0);
        } else if (t == QL_GGUF_ARRAY) {
            const ql_gguf_type et = ql_gguf_arr_type(a, i);
            const uint64_t n = ql_gguf_arr_n(a, i);
            FUZZ_CHECK(et == ql_gguf_arr_type(b, i) && n == ql_gguf_arr_n(b, i));
            if (et == QL_GGUF_STRING) {
                for (uint64_t j = 0; j < n; j++) {
                    const char *sa = ql_gguf_arr_str(a, i, j, &la), *sb = ql_gguf_arr_str(b, i, j, &lb);
                    FUZZ_CHECK(la == lb && memcmp(sa, sb, la) == 0);
                }
            } else {
                FUZZ_CHECK(memcmp(ql_gguf_arr_data(a, i), ql_gguf_arr_data(b, i), n * elem_size(et)) == 0);
            }
        } else {
            uint64_t ua = 0, ub = 0;
            int64_t ia = 0, ib = 0;
            double da = 0, db = 0;
            FUZZ_CHECK(ql_gguf_get_u64(a, i, &ua) == ql_gguf_get_u64(b, i, &ub) && ua == ub);
            FUZZ_CHECK(ql_gguf_get_i64(a, i, &ia) == ql_gguf_get_i64(b, i, &ib) && ia == ib);
            FUZZ_CHECK(ql_gguf_get_f64(a, i, &da) == ql_gguf_get_f64(b, i, &db));
            FUZZ_CHECK(memcmp(&da, &db, sizeof(da)) == 0);
        }
    }
    for (int64_t i = 0; i < ql_gguf_n_tensors(a); i++) {
        FUZZ_CHECK(strcmp(ql_gguf_tensor_name(a, i), ql_gguf_tensor_name(b, i)) == 0);
        FUZZ_CHECK(ql_gguf_tensor_type(a, i) == ql_gguf_tensor_type(b, i));
        int64_t na[4], nb[4];
        FUZZ_CHECK(ql_gguf_tensor_ne(a, i, na) == ql_gguf_tensor_ne(b, i, nb) && memcmp(na, nb, sizeof(na)) == 0);
        const size_t sz = ql_gguf_tensor_size(a, i);
        FUZZ_CHECK(sz == ql_gguf_tensor_size(b, i));
        if (sz) FUZZ_CHECK(memcmp(ql_gguf_tensor_data(a, i), ql_gguf_tensor_data(b, i), sz) == 0);
    }
}

// The writer takes everything the reader accepted; what it writes reads back the same.
static void round_trip(const ql_gguf *g) {
    static std::string path;
    if (path.empty()) {
        const char *dir = getenv("TMPDIR");
        path = std::string(dir && *dir ? dir : "/tmp") + "/fuzz_gguf_" + std::to_string((long)getpid()) + ".gguf";
    }
    ql_gguf_writer *w = ql_gguf_writer_new();
    FUZZ_CHECK(w);
    for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) ql_gguf_copy_kv(w, g, i);
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(g, i, ne);
        FUZZ_CHECK(ql_gguf_add_tensor(w, ql_gguf_tensor_name(g, i), ql_gguf_tensor_type(g, i), nd, ne,
                                      ql_gguf_tensor_data(g, i), ql_gguf_tensor_size(g, i)) == QL_OK);
    }
    char err[512];
    const ql_status st = ql_gguf_write(w, path.c_str(), err, sizeof(err));
    if (st != QL_OK) fprintf(stderr, "write refused what the reader accepted: %s\n", err);
    FUZZ_CHECK(st == QL_OK);
    ql_gguf_writer_free(w);
    ql_gguf *g2 = ql_gguf_open(path.c_str(), err, sizeof(err));
    if (!g2) fprintf(stderr, "the written file does not read back: %s\n", err);
    FUZZ_CHECK(g2);
    same(g, g2);
    ql_gguf_close(g2);
    unlink(path.c_str());
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[512];
    memset(err, 'x', sizeof(err));
    err[sizeof(err) - 1] = '\0';
    ql_gguf *g = ql_gguf_open_memory(data, size, err, sizeof(err));
    if (!g) {
        FUZZ_CHECK(strncmp(err, "<memory>: ", 10) == 0 && err[10] != '\0' && !strchr(err, '\n'));
        return 0;
    }
    FUZZ_CHECK(err[0] == '\0');
    touch(g, data, size);
    round_trip(g);
    ql_gguf_close(g);
    return 0;
}
