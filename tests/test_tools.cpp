// The command-line tools, run as a user would (the binaries must be built: `make` does).
#include "../models/llama.h"
#include "../qlora.h"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

bool exists(const std::string &p) {
    struct stat st;
    return stat(p.c_str(), &st) == 0;
}

// run a command, return its exit code; its combined output goes to *out
int run(const std::string &cmd, std::string *out) {
    FILE *p = popen((cmd + " 2>&1").c_str(), "r");
    if (!p) return -1;
    char buf[4096];
    out->clear();
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

struct tmpdir {
    std::string path;
    tmpdir() {
        char t[] = "/tmp/qlora-test-XXXXXX";
        path = mkdtemp(t) ? t : "/tmp";
    }
    ~tmpdir() { (void)!system(("rm -rf '" + path + "'").c_str()); }
};

// a tiny llama in GGUF: linear weights of `wtype`, norms and embeddings f32
void write_tiny_gguf(const std::string &path, ql_type wtype) {
    ql_llama_hparams hp;
    hp.n_vocab = 96; hp.n_embd = 128; hp.n_layer = 2; hp.n_head = 4; hp.n_head_kv = 2; hp.n_ff = 192;
    ql_init_params ip = {16u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_llama m;
    REQUIRE(ql_llama_create(ctx, &m, hp, QL_TYPE_F32, false) == QL_OK);
    ql_llama_randomize(&m, 5, 0.02f);
    ql_gguf_writer *w = ql_gguf_writer_new();
    ql_gguf_set_str(w, "general.architecture", "llama");
    ql_gguf_set_u32(w, "general.file_type", 0);
    ql_gguf_set_u32(w, "llama.block_count", (uint32_t)hp.n_layer);
    std::vector<std::vector<uint8_t>> keep;
    auto add = [&](ql_tensor *t, ql_type type) {
        const int64_t ne[4] = {t->ne[0], t->ne[1], 1, 1};
        keep.emplace_back(ql_type_data_size(type, t->ne[1], t->ne[0]));
        REQUIRE(ql_quantize(type, (const float *)t->data, t->ne[1], t->ne[0], keep.back().data(), nullptr, 0) == QL_OK);
        REQUIRE(ql_gguf_add_tensor(w, t->name, type, ql_n_dims(t), ne, keep.back().data(), keep.back().size()) == QL_OK);
    };
    add(m.tok_embd, QL_TYPE_F32);
    add(m.out_norm, QL_TYPE_F32);
    add(m.output, QL_TYPE_F32);
    for (ql_llama_layer &L : m.layers) {
        add(L.attn_norm, QL_TYPE_F32);
        add(L.ffn_norm, QL_TYPE_F32);
        for (ql_tensor *t : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down}) add(t, wtype);
    }
    char err[256];
    REQUIRE_MESSAGE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK, err);
    ql_gguf_writer_free(w);
    ql_free(ctx);
}

std::string tool(const char *name) {  // make: repo root; cmake: the build directory (cwd)
    return exists(std::string("./") + name) ? std::string("./") + name : std::string();
}

}  // namespace

TEST_CASE("quantize: nf4 of the block weights, norms and embeddings kept, values as ql_quantize") {
    const std::string q = tool("quantize");
    if (q.empty()) {
        MESSAGE("skipped: ./quantize is not built (run make)");
        return;
    }
    tmpdir d;
    const std::string in = d.path + "/tiny.gguf", out = d.path + "/tiny-nf4.gguf";
    write_tiny_gguf(in, QL_TYPE_F16);  // f16 linear weights: dequantised, then NF4
    std::string log;
    REQUIRE_MESSAGE(run(q + " " + in + " " + out + " nf4", &log) == 0, log);
    CHECK(log.find("14 tensors to nf4") != std::string::npos);
    CHECK(log.find("bits per parameter") != std::string::npos);
    char err[256];
    ql_gguf *src = ql_gguf_open(in.c_str(), err, sizeof(err));
    ql_gguf *g = ql_gguf_open(out.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    CHECK(ql_gguf_tensor_type(g, ql_gguf_find_tensor(g, "blk.1.ffn_down.weight")) == QL_TYPE_NF4);
    CHECK(ql_gguf_tensor_type(g, ql_gguf_find_tensor(g, "blk.0.attn_norm.weight")) == QL_TYPE_F32);
    CHECK(ql_gguf_tensor_type(g, ql_gguf_find_tensor(g, "token_embd.weight")) == QL_TYPE_F32);
    CHECK(ql_gguf_tensor_type(g, ql_gguf_find_tensor(g, "output.weight")) == QL_TYPE_F32);
    CHECK(ql_gguf_find_kv(g, "general.file_type") < 0);
    CHECK(ql_gguf_find_kv(g, "qlora.note") >= 0);
    uint64_t qv = 0;
    CHECK(ql_gguf_get_u64(g, ql_gguf_find_kv(g, "general.quantization_version"), &qv));
    CHECK(qv == 2);
    size_t len;
    CHECK(std::string(ql_gguf_get_str(g, ql_gguf_find_kv(g, "general.architecture"), &len)) == "llama");
    // the bytes are exactly NF4 of the dequantised f16 input
    const int64_t i = ql_gguf_find_tensor(src, "blk.0.attn_q.weight"), j = ql_gguf_find_tensor(g, "blk.0.attn_q.weight");
    int64_t ne[4];
    ql_gguf_tensor_ne(src, i, ne);
    std::vector<float> f((size_t)(ne[0] * ne[1]));
    REQUIRE(ql_dequantize(QL_TYPE_F16, ql_gguf_tensor_data(src, i), ne[1], ne[0], f.data()) == QL_OK);
    std::vector<uint8_t> want(ql_type_data_size(QL_TYPE_NF4, ne[1], ne[0]));
    REQUIRE(ql_quantize(QL_TYPE_NF4, f.data(), ne[1], ne[0], want.data(), nullptr, 0) == QL_OK);
    REQUIRE(ql_gguf_tensor_size(g, j) == want.size());
    CHECK(memcmp(ql_gguf_tensor_data(g, j), want.data(), want.size()) == 0);
    ql_gguf_close(g);
    ql_gguf_close(src);

    // flags: fp32 absmax; the output and the embedding too
    const std::string out2 = d.path + "/tiny-nf4-all.gguf";
    REQUIRE_MESSAGE(run(q + " " + in + " " + out2 + " nf4 --no-double-quant --include-output --include-embd", &log) == 0, log);
    g = ql_gguf_open(out2.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    CHECK(ql_gguf_tensor_type(g, ql_gguf_find_tensor(g, "blk.0.attn_q.weight")) == QL_TYPE_NF4_NODQ);
    CHECK(ql_gguf_tensor_type(g, ql_gguf_find_tensor(g, "output.weight")) == QL_TYPE_NF4_NODQ);
    CHECK(ql_gguf_tensor_type(g, ql_gguf_find_tensor(g, "token_embd.weight")) == QL_TYPE_NF4_NODQ);
    ql_gguf_close(g);

    // from a quantised input (q8_0): dequantised, then NF4
    const std::string q8 = d.path + "/tiny-q8.gguf", from_q8 = d.path + "/tiny-q8-nf4.gguf";
    REQUIRE_MESSAGE(run(q + " " + in + " " + q8 + " q8_0", &log) == 0, log);
    REQUIRE_MESSAGE(run(q + " " + q8 + " " + from_q8 + " nf4", &log) == 0, log);
    CHECK(log.find("q8_0 -> nf4") != std::string::npos);
}

TEST_CASE("quantize: bad input gives one clear line and no output file") {
    const std::string q = tool("quantize");
    if (q.empty()) {
        MESSAGE("skipped: ./quantize is not built (run make)");
        return;
    }
    tmpdir d;
    const std::string in = d.path + "/tiny.gguf", out = d.path + "/out.gguf";
    write_tiny_gguf(in, QL_TYPE_F32);
    std::string log;
    struct bad_case {
        std::string args, says;
        int code;
    };
    const std::vector<bad_case> cases = {
        {in + " " + out + " nf5", "unknown target type 'nf5'", 2},
        {in + " " + out + " nf4 --fast", "unknown flag '--fast'", 2},
        {in + " " + out, "usage", 2},
        {in + " " + out + " q8_0 --no-double-quant", "--no-double-quant applies to nf4 only", 2},
        {d.path + "/missing.gguf " + out + " nf4", "missing.gguf: cannot open", 1},
        {in + " " + in + " nf4", "would overwrite the input", 2},
        {in + " " + d.path + "/no/such/dir/out.gguf nf4", "no/such/dir/out.gguf", 1},
    };
    for (const bad_case &c : cases) {
        CAPTURE(c.args);
        CHECK(run(q + " " + c.args, &log) == c.code);
        CHECK_MESSAGE(log.find(c.says) != std::string::npos, log);
        CHECK(!exists(out));
    }
    // a truncated file: the reader's message, with the path
    const std::string cut = d.path + "/cut.gguf";
    REQUIRE(run("head -c 300 " + in + " > " + cut, &log) == 0);
    CHECK(run(q + " " + cut + " " + out + " nf4", &log) == 1);
    CHECK(log.find("cut.gguf") != std::string::npos);
    CHECK(!exists(out));
}
