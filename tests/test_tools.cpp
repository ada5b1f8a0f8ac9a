// The command-line tools, run as a user would (the binaries must be built: `make` does).
#include "../models/llama.h"
#include "../models/tokenizer.h"
#include "../qlora.h"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
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

// ---- convert, make-model, generate, perplexity ----

namespace {

std::string fixtures_dir() {
    if (const char *e = getenv("QLORA_FIXTURES")) return e;
    std::string f = __FILE__;
    return f.substr(0, f.find_last_of('/') + 1) + "../../shared/fixtures";
}

// generate's text, without the timing line it appends on stderr
std::string text_of(const std::string &log) { return log.substr(0, log.find("\n\ngenerate:")); }

bool all_built(std::initializer_list<const char *> names) {
    for (const char *n : names)
        if (tool(n).empty()) {
            MESSAGE("skipped: ./", n, " is not built (run make)");
            return false;
        }
    return true;
}

}  // namespace

TEST_CASE("convert llama2c + generate: stories260K greedy from BOS tells its story") {
    const std::string fx = fixtures_dir();
    if (!exists(fx + "/stories260K/stories260K.bin")) {
        MESSAGE("skipped: no fixtures at ", fx);
        return;
    }
    if (!all_built({"convert", "generate"})) return;
    tmpdir d;
    const std::string gguf = d.path + "/s.gguf";
    std::string log;
    REQUIRE_MESSAGE(run("./convert llama2c " + fx + "/stories260K/stories260K.bin " + fx + "/stories260K/tok512.bin -o " + gguf,
                        &log) == 0, log);
    CHECK(log.find("dim 64, 5 layers, 8/4 heads") != std::string::npos);
    REQUIRE_MESSAGE(run("./generate -m " + gguf + " -n 40 --temp 0", &log) == 0, log);
    CHECK_MESSAGE(log.rfind(" Once upon a time, there was a little girl named Lily. She loved to play outside in the park.", 0) == 0,
                  log);
    // the same with 1 thread and with 3: greedy decoding does not depend on the split
    std::string one, three;
    REQUIRE(run("./generate -m " + gguf + " -n 30 --temp 0 -t 1", &one) == 0);
    REQUIRE(run("./generate -m " + gguf + " -n 30 --temp 0 -t 3", &three) == 0);
    CHECK(text_of(one) == text_of(three));
    // sampling: the same seed, the same text; tokens/s reported
    std::string a, b;
    REQUIRE(run("./generate -m " + gguf + " -p \"Once\" -n 20 --temp 0.9 --seed 7", &a) == 0);
    REQUIRE(run("./generate -m " + gguf + " -p \"Once\" -n 20 --temp 0.9 --seed 7", &b) == 0);
    CHECK(text_of(a) == text_of(b));
    REQUIRE(run("./generate -m " + gguf + " -p \"Once\" -n 20 --temp 0.9 --seed 8", &b) == 0);
    CHECK(text_of(a) != text_of(b));
    CHECK(a.rfind("Once", 0) == 0);
    REQUIRE(run("./generate -m " + gguf + " -n 5 --temp 0", &log) == 0);
    CHECK(log.find("tokens/s") != std::string::npos);
}

TEST_CASE("perplexity: --json numbers equal an independent computation; every token counted once") {
    if (!all_built({"make-model", "perplexity"})) return;
    tmpdir d;
    const std::string gguf = d.path + "/m.gguf", text = d.path + "/t.txt";
    std::string log;
    REQUIRE_MESSAGE(run("./make-model -o " + gguf + " --dim 64 --layers 2 --heads 4 --kv-heads 2 --ff 96 --seed 9 --std 0.5", &log) == 0,
                    log);
    const std::string body = "The lamp keeper climbs the stair at dusk; the ships come home.\nOne light, one night.";
    FILE *f = fopen(text.c_str(), "wb");
    REQUIRE(f);
    fwrite(body.data(), 1, body.size(), f);
    fclose(f);
    for (int c : {17, 512}) {  // several windows with a short tail, and one window
        CAPTURE(c);
        REQUIRE_MESSAGE(run("./perplexity -m " + gguf + " -f " + text + " -c " + std::to_string(c) + " --json", &log) == 0, log);
        double nll = 0, ppl = 0;
        long long n_tok = 0;
        REQUIRE(sscanf(log.c_str(), "{\"nll\": %lf, \"ppl\": %lf, \"tokens\": %lld}", &nll, &ppl, &n_tok) == 3);
        // the reference: windows of BOS + c-1 tokens, -log softmax in double from the library's logits
        char err[256];
        ql_llama_file *lf = ql_llama_load(gguf.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(lf, err);
        ql_vocab *v = ql_vocab_load(lf->gguf, err, sizeof(err));
        REQUIRE_MESSAGE(v, err);
        const std::vector<int32_t> toks = ql_tokenize(v, body, false, false);
        CHECK(n_tok == (long long)toks.size());
        double sum = 0;
        for (size_t s = 0; s < toks.size(); s += (size_t)(c - 1)) {
            const size_t len = std::min(toks.size() - s, (size_t)(c - 1));
            std::vector<int32_t> w = {ql_vocab_bos(v)};
            w.insert(w.end(), toks.begin() + (long)s, toks.begin() + (long)(s + len));
            const int V = lf->model.hp.n_vocab, T = (int)w.size();
            ql_init_params ip = {8u << 20, nullptr, false, false};
            ql_context *ctx = ql_init(ip);
            ql_tensor *tk = ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1), *ps = ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1);
            for (int t = 0; t < T; t++) {
                ((int32_t *)tk->data)[t] = w[(size_t)t];
                ((int32_t *)ps->data)[t] = t;
            }
            ql_tensor *lg = ql_llama_forward(ctx, &lf->model, tk, ps, nullptr);
            ql_graph *g = ql_graph_new(ctx);
            ql_graph_build_forward(g, lg);
            ql_backend *be = ql_backend_cpu_init(1);
            REQUIRE(ql_graph_alloc(g, be) == QL_OK);
            REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
            for (int t = 0; t + 1 < T; t++) {
                const float *row = (const float *)lg->data + (size_t)t * V;
                double mx = row[0], z = 0;
                for (int i = 1; i < V; i++) mx = std::max(mx, (double)row[i]);
                for (int i = 0; i < V; i++) z += std::exp((double)row[i] - mx);
                sum += mx + std::log(z) - row[w[(size_t)t + 1]];
            }
            ql_graph_free(g);
            ql_backend_free(be);
            ql_free(ctx);
        }
        const double want = sum / (double)toks.size();
        CHECK(nll == doctest::Approx(want).epsilon(1e-5));
        CHECK(ppl == doctest::Approx(std::exp(want)).epsilon(1e-5));
        ql_vocab_free(v);
        ql_llama_file_free(lf);
    }
}

TEST_CASE("make-model, convert, generate, perplexity: bad input, one clear line each") {
    if (!all_built({"make-model", "convert", "generate", "perplexity"})) return;
    tmpdir d;
    const std::string gguf = d.path + "/m.gguf", junk = d.path + "/junk.bin", text = d.path + "/t.txt";
    std::string log;
    REQUIRE(run("./make-model -o " + gguf + " --dim 32 --layers 1 --heads 2 --ff 48", &log) == 0);
    REQUIRE(run("printf 'not a model at all, really not a model' > " + junk + " && printf 'hello' > " + text, &log) == 0);
    struct bad_case {
        std::string cmd, says;
    };
    const std::vector<bad_case> cases = {
        {"./make-model --dim 64", "-o model.gguf is required"},
        {"./make-model -o " + d.path + "/x.gguf --type q9_9", "unknown --type 'q9_9'"},
        {"./make-model -o " + d.path + "/x.gguf --layers -3", "--layers: '-3' is not an integer"},
        {"./convert llama2c " + junk + " " + junk + " -o " + d.path + "/x.gguf", "implausible llama2.c header"},
        {"./convert llama2c " + d.path + "/none.bin " + junk + " -o " + d.path + "/x.gguf", "none.bin: cannot open"},
        {"./convert llama2c a b", "missing -o"},
        {"./convert onnx a -o b", "unknown source format 'onnx'"},
        {"./convert tiktoken a -o b", "needs --pre"},
        {"./generate", "-m model.gguf is required"},
        {"./generate -m " + junk, "junk.bin: bad magic"},
        {"./generate -m " + gguf + " --temp hot", "--temp: 'hot' is not a number"},
        {"./generate -m " + gguf + " --lora " + gguf, "not a LoRA adapter"},
        {"./generate -m " + gguf + " -p \"" + std::string(300, 'x') + "\" -c 64", "hint: a larger -c"},
        {"./perplexity -m " + gguf, "-f text.txt are required"},
        {"./perplexity -m " + gguf + " -f " + d.path + "/none.txt", "none.txt: cannot open"},
        {"./perplexity -m " + gguf + " -f " + text + " -c 1", "-c: '1' is not a valid value"},
        {"./perplexity -m " + gguf + " -f " + text + " --jsn", "unknown or incomplete argument '--jsn'"},
    };
    for (const bad_case &c : cases) {
        CAPTURE(c.cmd);
        CHECK(run(c.cmd, &log) != 0);
        CHECK_MESSAGE(log.find(c.says) != std::string::npos, log);
    }
    CHECK(!exists(d.path + "/x.gguf"));
}
