// The command-line tools, run as a user would (the binaries must be built: `make` does).
#include "../models/adapter.h"
#include "../models/json.h"
#include "../models/llama.h"
#include "../models/tokenizer.h"
#include "../models/trainer.h"
#include "../qlora.h"
#include "tiny.h"
#include "util.h"

#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// a tiny llama in GGUF: linear weights of `wtype`, norms and embeddings f32
void write_tiny_gguf(const std::string &path, ql_type wtype) {
    tiny_llama t(tiny_hparams(96, 128, 192), 5, 0.02f);
    llama_gguf_opts o;  // keys: the architecture, general.file_type and block_count
    o.file_type = true;
    o.shape_keys = false;
    o.norm_eps = false;
    o.linear_type = wtype;
    o.norms_first = true;
    write_llama_gguf(t.m, path, o);
}

std::string tool(const char *name) {  // make: repo root; cmake: the build directory (cwd)
    return exists(std::string("./") + name) ? std::string("./") + name : std::string();
}

}  // namespace

TEST_CASE("quantize: nf4 of the block weights, norms and embeddings kept, values as ql_quantize" * needs_tools("quantize")) {
    const std::string q = tool("quantize");
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
    uint64_t ft = 0;  // general.file_type: NF4's type id, outside llama.cpp's llama_ftype numbers
    CHECK(ql_gguf_get_u64(g, ql_gguf_find_kv(g, "general.file_type"), &ft));
    CHECK(ft == QL_TYPE_NF4);
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

    // from a quantised input (q8_0): dequantised, then NF4 (with --allow-requantize, as llama-quantize)
    const std::string q8 = d.path + "/tiny-q8.gguf", from_q8 = d.path + "/tiny-q8-nf4.gguf";
    REQUIRE_MESSAGE(run(q + " " + in + " " + q8 + " q8_0", &log) == 0, log);
    REQUIRE_MESSAGE(run(q + " " + q8 + " " + from_q8 + " nf4 --allow-requantize", &log) == 0, log);
    CHECK(log.find("q8_0 -> nf4") != std::string::npos);
}

TEST_CASE("quantize: bad input gives one clear line and no output file" * needs_tools("quantize")) {
    const std::string q = tool("quantize");
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
        {in + " " + d.path + "/no/such/dir/out.gguf nf4", "no/such/dir/out.gguf: the folder " + d.path + "/no/such/dir does not exist", 1},
        // the input under another name, or as the writer's temporary (emptied, then renamed over
        // the output: the input was lost); a folder; a file as a folder: refused before any work
        {in + " " + d.path + "/./tiny.gguf nf4", "tiny.gguf: the output would overwrite the input " + in, 2},
        {in + " " + d.path + "/tiny nf4", d.path + "/tiny: the output (through its temporary " + d.path + "/tiny.tmp) would overwrite the input " + in, 2},
        {in + " " + d.path + " nf4", d.path + ": is a folder (give the output file's name)", 2},
        {in + " " + in + "/x.gguf nf4", in + "/x.gguf: " + in + " is not a folder", 1},
        {in + " '' nf4", "the output path is empty", 2},
    };
    REQUIRE(run("ln " + in + " " + d.path + "/tiny.tmp", &log) == 0);  // (the temporary case: a hard link to the input)
    const std::string before = read_file(in);
    for (const bad_case &c : cases) {
        CAPTURE(c.args);
        CHECK(run(q + " " + c.args, &log) == c.code);
        CHECK_MESSAGE(log.find(c.says) != std::string::npos, log);
        CHECK(!exists(out));
        CHECK(read_file(in) == before);
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

// generate's text, without the timing line it appends on stderr
// the generated text: what precedes the statistics, without a warning line (-t above the cores)
std::string text_of(const std::string &log) {
    std::string t = log.substr(0, log.find("\n\ngenerate:"));
    const size_t w = t.find("generate: warning: ");
    if (w != std::string::npos) t.erase(w, t.find('\n', w) + 1 - w);
    return t;
}

}  // namespace

TEST_CASE("convert llama2c + generate: stories260K greedy from BOS tells its story" * needs_fixture("stories260K/stories260K.bin") *
          needs_tools("convert generate")) {
    const std::string fx = fixtures_dir();
    fixture("stories260K/stories260K.bin");
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
    REQUIRE(run("./generate -m " + gguf + " -p \"Once\" -n 0", &log) == 0);  // the prompt only
    CHECK(log.rfind("Once\n", 0) == 0);
}

TEST_CASE("convert --help: the usage on stdout, exit 0; no arguments: usage on stderr, exit 2" * needs_tools("convert")) {
    std::string log;
    CHECK(run("./convert --help 2>/dev/null", &log) == 0);
    CHECK(log.find("llama2c model.bin tokenizer.bin -o model.gguf") != std::string::npos);
    CHECK(log.find("tiktoken tokenizer.model --pre llama3") != std::string::npos);
    CHECK(run("./convert", &log) == 2);
    CHECK(log.find("usage: ") != std::string::npos);
}

TEST_CASE("generate / perplexity / finetune: -t above the physical cores warns, once, and still runs" * needs_tools("make-model generate")) {
    tmpdir d;
    const std::string m = d.path + "/m.gguf";
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 32 --layers 1 --heads 2 --ff 64", &log) == 0);
    const int over = ql_cpu_physical_cores() + 1;
    REQUIRE_MESSAGE(run("./generate -m " + m + " -p hi -n 2 --temp 0 -t " + std::to_string(over), &log) == 0, log);
    CHECK_MESSAGE(log.find("generate: warning: -t " + std::to_string(over) + " is more than the ") != std::string::npos, log);
    REQUIRE_MESSAGE(run("./generate -m " + m + " -p hi -n 2 --temp 0 -t 1", &log) == 0, log);
    CHECK(log.find("warning") == std::string::npos);
}

TEST_CASE("generate --profile: a decoded token's time by op, the multiplies by weight type" * needs_tools("make-model generate")) {
    tmpdir d;
    const std::string m = d.path + "/m.gguf";
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 256 --layers 2 --heads 4 --ff 512 --type q4_K --output-type q6_K", &log) == 0);
    REQUIRE_MESSAGE(run("./generate -m " + m + " -p hi -n 6 --temp 0 --profile", &log) == 0, log);
    CHECK_MESSAGE(log.find("generate: profile of a decoded token") != std::string::npos, log);
    CHECK_MESSAGE(log.find("mul_mat q4_K") != std::string::npos, log);
    CHECK_MESSAGE(log.find("mul_mat q6_K") != std::string::npos, log);
    REQUIRE_MESSAGE(run("./generate -m " + m + " -p hi -n 6 --temp 0", &log) == 0, log);
    CHECK(log.find("profile") == std::string::npos);  // only when asked
}

TEST_CASE("a vocabulary with more tokens than the embedding has rows is refused when it loads" * needs_tools("make-model generate")) {
    tmpdir d;
    const std::string m = d.path + "/m.gguf", bad = d.path + "/short.gguf";
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 32 --layers 1 --heads 2 --ff 64 --vocab 600", &log) == 0);
    // the embedding and the output cut to 500 rows; the 600-token vocabulary kept
    rewrite_gguf(m, bad, nullptr, [](const std::string &name, int64_t *ne, const void **, size_t *size) {
        if (name != "token_embd.weight" && name != "output.weight") return;
        ne[1] = 500;
        *size = (size_t)(ne[0] * 500 * 4);
    });
    CHECK(run("./generate -m " + bad + " -p hi -n 2 --temp 0", &log) == 1);
    CHECK_MESSAGE(log.find("tokenizer.ggml.tokens has 600 tokens but token_embd.weight only 500 rows") != std::string::npos, log);
    CHECK(std::count(log.begin(), log.end(), '\n') == 1);
}

TEST_CASE("generate / perplexity: NaN weights are an error (exit 1, one line), not a printed nan" * needs_tools("make-model generate perplexity")) {
    tmpdir d;
    const std::string m = d.path + "/m.gguf", bad = d.path + "/nan.gguf", text = d.path + "/t.txt";
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 32 --layers 1 --heads 2 --ff 64", &log) == 0);
    write_file(text, "the quick brown fox jumps over the lazy dog. the quick brown fox.\n");
    std::vector<float> nans(32, NAN);  // the same model with NaNs in output_norm.weight
    rewrite_gguf(m, bad, nullptr, [&](const std::string &name, int64_t *, const void **data, size_t *) {
        if (name == "output_norm.weight") *data = nans.data();
    });
    CHECK(run("./perplexity -m " + bad + " -f " + text + " -c 16 --json", &log) == 1);
    CHECK_MESSAGE(log.find("perplexity: the mean nll is nan: the model holds non-finite values") != std::string::npos, log);
    CHECK(log.find("\"ppl\"") == std::string::npos);
    CHECK(run("./generate -m " + bad + " -p the -n 4 --temp 0", &log) == 1);
    CHECK_MESSAGE(log.find("generate: the logits at position ") != std::string::npos, log);
    REQUIRE(run("./perplexity -m " + m + " -f " + text + " -c 16 --json", &log) == 0);  // the intact model still runs
}

// --zero: every weight 0 (so every logit 0: the perplexity is the vocabulary's size exactly), in
// NF4 with double quantisation (side data the reader accepts), written sparse.
TEST_CASE("make-model --zero: a sparse all-zero model that loads and plans" * needs_tools("make-model perplexity finetune")) {
    tmpdir d;
    const std::string gguf = d.path + "/z.gguf", text = d.path + "/t.txt";
    std::string log;
    REQUIRE_MESSAGE(run("./make-model -o " + gguf + " --dim 512 --layers 2 --heads 8 --kv-heads 2 --ff 1536 --type nf4 --embd-type f16 "
                        "--output-type bf16 --zero", &log) == 0, log);
    CHECK_MESSAGE(log.find("all zero") != std::string::npos, log);
    struct stat st;
    REQUIRE(stat(gguf.c_str(), &st) == 0);
    CHECK((uint64_t)st.st_blocks * 512 < (uint64_t)st.st_size / 4);  // the f16/bf16 and NF4 rows are holes
    FILE *f = fopen(text.c_str(), "wb");
    REQUIRE(f);
    fputs("Zero weights, uniform logits.", f);
    fclose(f);
    REQUIRE_MESSAGE(run("./perplexity -m " + gguf + " -f " + text + " --json", &log) == 0, log);
    double nll = 0, ppl = 0;
    long long n_tok = 0;
    REQUIRE(sscanf(log.c_str(), "{\"nll\": %lf, \"ppl\": %lf, \"tokens\": %lld}", &nll, &ppl, &n_tok) == 3);
    CHECK(ppl == doctest::Approx(512.0).epsilon(1e-5));
    const std::string data = d.path + "/d.jsonl";  // (tests run from the build folder under ctest: no repository paths)
    f = fopen(data.c_str(), "wb");
    REQUIRE(f);
    fputs("{\"text\": \"zero weights plan as real ones\"}\n", f);
    fclose(f);
    REQUIRE_MESSAGE(run("./finetune -m " + gguf + " -d " + data + " --dry-run --device cuda --vram 8G --cc 8.6", &log) == 0, log);
    CHECK_MESSAGE(log.find("fits") != std::string::npos, log);
}

TEST_CASE("perplexity: --json numbers equal an independent computation; every token counted once" * needs_tools("make-model perplexity")) {
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

// a trained model (random weights of a large std are chaotic: the two paths differed by 3% on one)
TEST_CASE("perplexity: 8-bit activations by default on a quantised model, --exact the exact path; close on a trained model" *
          needs_fixture("stories260K/stories260K.bin") * needs_tools("convert quantize perplexity")) {
    tmpdir d;
    fixture("stories260K/stories260K.bin");
    const std::string fx = fixtures_dir(), f32 = d.path + "/s.gguf", q = d.path + "/q.gguf", text = d.path + "/t.txt";
    std::string log;
    REQUIRE_MESSAGE(run("./convert llama2c " + fx + "/stories260K/stories260K.bin " + fx + "/stories260K/tok512.bin -o " + f32, &log) == 0, log);
    REQUIRE_MESSAGE(run("./quantize " + f32 + " " + q + " q8_0 2>&1", &log) == 0, log);
    FILE *f = fopen(text.c_str(), "wb");
    REQUIRE(f);
    const std::string body = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw "
                             "a big, red ball. She wanted to play with it, but it was too high. Lily's mom said, \"Lily, let's go to the "
                             "park.\" Lily was sad, but she was happy. She went to the park and played with her friends.";
    fwrite(body.data(), 1, body.size(), f);
    fclose(f);
    double nll[2] = {0, 0}, ppl = 0;
    long long n = 0;
    // -c 8: windows of 8 tokens, each multiply on the decode kernels every build has (the prompt's
    // int8 GEMM above 8 rows exists only with AVX-512 VNNI: tests/test_qmatmul.cpp checks it)
    for (int exact = 0; exact < 2; exact++) {
        REQUIRE_MESSAGE(run("./perplexity -m " + q + " -f " + text + " -c 8 --json" + (exact ? " --exact" : ""), &log) == 0, log);
        REQUIRE(sscanf(log.c_str(), "{\"nll\": %lf, \"ppl\": %lf, \"tokens\": %lld}", &nll[exact], &ppl, &n) == 3);
    }
    CHECK(nll[0] != nll[1]);  // the 8-bit path ran
    CHECK(std::fabs(nll[0] - nll[1]) < 0.005 * nll[1]);
}

TEST_CASE("make-model, convert, generate, perplexity: bad input, one clear line each" * needs_tools("make-model convert generate perplexity")) {
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
        {"./make-model -o " + d.path + "/x.gguf --threads 0", "--threads: '0' is not an integer in [1, 256]"},
        {"./convert llama2c " + junk + " " + junk + " -o " + d.path + "/x.gguf", "implausible llama2.c header"},
        {"./convert llama2c " + d.path + "/none.bin " + junk + " -o " + d.path + "/x.gguf", "none.bin: cannot open"},
        {"./convert llama2c a b", "missing -o"},
        {"./convert llama2c " + junk + " " + text + " -o " + junk, junk + ": the output would overwrite the input " + junk},
        {"./convert hf " + d.path + " -o " + d.path, d.path + ": is a folder"},
        {"./make-model -o " + d.path + "/no/x.gguf", d.path + "/no/x.gguf: the folder " + d.path + "/no does not exist"},
        {"./make-model -o " + d.path, d.path + ": is a folder"},
        // an empty value is no number (strtod reads it as 0); counts are whole; one model, one text
        {"./generate -m " + gguf + " -p hi --temp ''", "--temp: '' is not a number in [0, 100]"},
        {"./generate -m " + gguf + " -p hi -n 1.5", "-n: '1.5' is not a whole number"},
        {"./generate -m " + gguf + " -p hi --seed 2.5", "--seed: '2.5' is not a whole number"},
        {"./generate -m " + junk + " -m " + gguf + " -p hi", "-m given twice ('" + junk + "', '" + gguf + "')"},
        {"./generate -m " + gguf + " --frobnicate", "unknown or incomplete argument '--frobnicate' (--help lists the flags)"},
        {"./generate -m " + gguf + " -p hi --cache-type q8", "--cache-type: 'q8' is not f32 or f16"},
        {"./perplexity -m " + gguf + " -f " + text + " -t ''", "-t: '' is not a valid value"},
        {"./perplexity -m " + gguf + " -f " + junk + " -f " + text, "-f given twice ('" + junk + "', '" + text + "')"},
        {"./perplexity -m " + gguf + " -f " + text + " --frobnicate", "unknown or incomplete argument '--frobnicate' (--help"},
        {"./convert llama2c a -o x.gguf", "llama2c takes model.bin and tokenizer.bin: tokenizer.bin missing"},
        {"./convert hf dir -o", "-o needs a value"},
        {"./convert hf a b -o x.gguf", "hf takes one checkpoint folder: more than one given"},
        {"./convert onnx a -o b", "unknown source format 'onnx'"},
        {"./convert tiktoken a -o b", "needs --pre"},
        {"./generate", "-m model.gguf is required"},
        {"./generate -m " + junk, "junk.bin: bad magic"},
        {"./generate -m " + gguf + " --temp hot", "--temp: 'hot' is not a number"},
        {"./generate -m " + gguf + " --lora " + gguf, "not a LoRA adapter"},
        {"./generate -m " + gguf + " --lora a.gguf --lora b.gguf", "--lora given twice ('a.gguf', 'b.gguf')"},
        {"./generate -m " + gguf + " --lora-scale 2", "--lora-scale without --lora"},
        {"./perplexity -m " + gguf + " -f " + text + " --lora a --lora b", "--lora given twice ('a', 'b')"},
        {"./perplexity -m " + gguf + " -f " + text + " --lora-scale 2", "--lora-scale without --lora"},
        {"./generate -m " + gguf + " -p \"" + std::string(300, 'x') + "\" -c 64", "hint: a larger -c"},
        {"./perplexity -m " + gguf, "-f text.txt are required"},
        {"./perplexity -m " + gguf + " -f " + d.path + "/none.txt", "none.txt: cannot open"},
        {"./perplexity -m " + gguf + " -f " + text + " -c 1", "-c: '1' is not a valid value"},
        {"./perplexity -m " + gguf + " -f " + text + " --jsn", "unknown or incomplete argument '--jsn'"},
        {"./generate -m " + gguf + " --device tpu", "--device tpu: 'tpu' is not a device (cpu, cuda, cuda:N, auto)"},
        {"./perplexity -m " + gguf + " -f " + text + " --device cuda:x", "--device cuda:x: 'cuda:x' is not a device"},
    };
    for (const bad_case &c : cases) {
        CAPTURE(c.cmd);
        CHECK(run(c.cmd, &log) != 0);
        CHECK_MESSAGE(log.find(c.says) != std::string::npos, log);
    }
    CHECK(!exists(d.path + "/x.gguf"));
    // threads the system will not start (here: no address space for their stacks): one line and
    // exit 1 (it was an abort: std::thread's exception, uncaught)
    CHECK(run("sh -c 'ulimit -v 400000; exec ./generate -m " + gguf + " -p hi -n 1 -t 1000 --device cpu'", &log) == 1);
    CHECK_MESSAGE(log.find("cannot start 1000 CPU threads (the system's limit, or memory for their stacks)") !=
                      std::string::npos, log);
    // fewer tokens than -n asked, because the context ran out: said, with whose limit it was
    REQUIRE(run("./generate -m " + gguf + " -p hi -n 100 -c 8 --temp 0", &log) == 0);
    CHECK_MESSAGE(log.find("generate: stopped at the end of the context (8 tokens: -c) before -n 100 --> hint: a larger -c") !=
                      std::string::npos, log);
}

TEST_CASE("train-tiny and bench: flags as strict as the other tools'" * needs_tools("train-tiny")) {
    std::string log;
    struct bad_case {
        std::string cmd, says;
    };
    std::vector<bad_case> cases = {
        {"./train-tiny -t 100000", "-t: '100000' is not a whole number in [0, 1024]"},  // was: an abort starting threads
        {"./train-tiny --steps 1.9", "--steps: '1.9' is not a whole number in [1, 1000000]"},
        {"./train-tiny --steps 4294967297", "--steps: '4294967297' is not a whole number"},  // was: 1 step (wrapped)
        {"./train-tiny --steps ''", "--steps: '' is not a whole number"},
        {"./train-tiny --seed abc", "--seed: 'abc' is not a whole number"},
        {"./train-tiny --steps", "--steps needs a value"},
        {"./train-tiny --frobnicate", "unknown argument '--frobnicate'"},
    };
    if (exists("tools/bench")) {
        cases.push_back({"tools/bench matmul -t 100000", "-t: '100000' is not a whole number in [0, 1024]"});
        cases.push_back({"tools/bench matmul -r abc", "-r: 'abc' is not a whole number"});
        cases.push_back({"tools/bench matmul -r", "-r needs a value"});
        cases.push_back({"tools/bench matmul block", "'matmul' and 'block': one benchmark at a time"});
    }
    for (const bad_case &c : cases) {
        CAPTURE(c.cmd);
        CHECK(run(c.cmd, &log) == 2);
        CHECK_MESSAGE(log.find(c.says) != std::string::npos, log);
        CHECK_MESSAGE(std::count(log.begin(), log.end(), '\n') == 1, log);
    }
    REQUIRE(run("./train-tiny --help", &log) == 0);
    CHECK(log.find("usage: ") != std::string::npos);
    // a run too short to learn the text exits 1 and says why (it said nothing)
    CHECK(run("./train-tiny --steps 1 -t 1", &log) == 1);
    CHECK_MESSAGE(log.find("train-tiny: the loss fell from ") != std::string::npos, log);
}

// ---- finetune ----

namespace {

// a JSONL of prompt/completion pairs with a rule to learn (the answer spells the question backwards)
void write_qa_jsonl(const std::string &path, int n) {
    FILE *f = fopen(path.c_str(), "w");
    REQUIRE(f);
    for (int i = 0; i < n; i++) {
        std::string w;
        for (int k = 0; k < 3 + i % 4; k++) w += (char)('a' + (i * 7 + k * 3) % 26);
        fprintf(f, "{\"prompt\": \"Q: %s\\nA:\", \"completion\": \" %s.\"}\n", w.c_str(), std::string(w.rbegin(), w.rend()).c_str());
    }
    fclose(f);
}

// metrics.jsonl as (step, the rest of the line) pairs
std::vector<std::pair<long long, std::string>> metric_lines(const std::string &path) {
    std::vector<std::pair<long long, std::string>> out;
    const std::string s = read_file(path);
    for (size_t p = 0; p < s.size();) {
        const size_t e = s.find('\n', p);
        const std::string line = s.substr(p, e - p);
        long long step = -1;
        if (sscanf(line.c_str(), "{\"step\": %lld", &step) == 1) out.push_back({step, line});
        p = e == std::string::npos ? s.size() : e + 1;
    }
    return out;
}

// the value after "key": in a metrics line (NAN if absent)
double metric(const std::string &line, const char *key) {
    const std::string k = std::string("\"") + key + "\": ";
    const size_t p = line.find(k);
    return p == std::string::npos ? NAN : atof(line.c_str() + p + k.size());
}


}  // namespace

TEST_CASE("finetune: NF4 base end to end; outputs load in generate and perplexity as GGUF and as PEFT" * needs_tools("make-model finetune generate perplexity quantize")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl", out = d.path + "/run", text = d.path + "/t.txt";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 64 --layers 2 --heads 4 --kv-heads 2 --ff 128 --type nf4 --seed 3 --std 0.05",
                &log) == 0);
    write_qa_jsonl(data, 24);
    REQUIRE_MESSAGE(run("./finetune -m " + base + " -d " + data + " -o " + out +
                            " --max-steps 12 -b 4 --seq-len 32 --lr 3e-3 --val-split 0.25 --eval-every 4 --lora-r 8 -t 2 --merge",
                        &log) == 0, log);
    // the start summary and PEFT's line; r 8 on q,k,v,o of 2 layers: 2 * 8 * ((64+64) + (64+32) * 2 + (64+64))
    CHECK_MESSAGE(log.find("trainable params: 7,168 || all params: ") != std::string::npos, log);
    CHECK(log.find("effective batch 4 sequences; 12 steps") != std::string::npos);
    CHECK(log.find("nf4 weights") != std::string::npos);
    CHECK(log.find("memory plan (MiB)") != std::string::npos);
    CHECK(log.find("finetune: done: 12 steps") != std::string::npos);
    for (const char *f : {"/adapter.gguf", "/peft/adapter_config.json", "/peft/adapter_model.safetensors", "/loss.png",
                          "/checkpoint.gguf", "/merged.gguf"})
        CHECK_MESSAGE(exists(out + f), f);
    // metrics: steps 0 (eval before training) .. 12, every number present where promised
    const auto ml = metric_lines(out + "/metrics.jsonl");
    REQUIRE(ml.size() == 13);
    for (size_t i = 0; i < ml.size(); i++) {
        CHECK(ml[i].first == (long long)i);
        if (i == 0) continue;
        for (const char *k : {"loss", "lr", "grad_norm", "step_seconds", "tokens_per_s", "mem_mib", "peak_mib"})
            CHECK_MESSAGE(std::isfinite(metric(ml[i].second, k)), ml[i].second, " ", k);
        CHECK(std::isfinite(metric(ml[i].second, "eval_loss")) == (i % 4 == 0));
    }
    CHECK(std::isfinite(metric(ml[0].second, "eval_loss")));
    CHECK(metric(ml[12].second, "loss") < metric(ml[1].second, "loss"));
    // the adapter in both formats gives the same numbers, different from the base's
    REQUIRE(run("printf 'Q: abc\\nA: cba.\\nQ: hello\\nA: olleh.\\n' > " + text, &log) == 0);
    std::string p_base, p_gguf, p_peft, p_merged;
    REQUIRE(run("./perplexity -m " + base + " -f " + text + " -c 16 --json", &p_base) == 0);
    REQUIRE(run("./perplexity -m " + base + " -f " + text + " -c 16 --json --lora " + out + "/adapter.gguf", &p_gguf) == 0);
    REQUIRE(run("./perplexity -m " + base + " -f " + text + " -c 16 --json --lora " + out + "/peft", &p_peft) == 0);
    REQUIRE(run("./perplexity -m " + out + "/merged.gguf -f " + text + " -c 16 --json", &p_merged) == 0);
    const double nb = metric(p_base, "ppl"), ng = metric(p_gguf, "ppl"), np = metric(p_peft, "ppl"), nm = metric(p_merged, "ppl");
    CAPTURE(p_gguf);
    REQUIRE(std::isfinite(nb));
    CHECK(ng != nb);
    CHECK(std::fabs(np - ng) <= 1e-4 * ng);  // PEFT's rows go back through the q/k permutation
    CHECK(std::fabs(nm - ng) <= 2e-2 * ng);  // merged: f16 weights
    std::string g1, g2;
    REQUIRE(run("./generate -m " + base + " --lora " + out + "/adapter.gguf -p \"Q: abc\" -n 8 --temp 0", &g1) == 0);
    REQUIRE(run("./generate -m " + base + " --lora " + out + "/peft -p \"Q: abc\" -n 8 --temp 0", &g2) == 0);
    CHECK(text_of(g1) == text_of(g2));
    // its checkpoint is not a model: generate and quantize say so
    CHECK(run("./generate -m " + out + "/checkpoint.gguf -p hi -n 1", &log) == 1);
    CHECK_MESSAGE(log.find("checkpoint.gguf: a finetune checkpoint, not a model") != std::string::npos, log);
    CHECK(run("./quantize " + out + "/checkpoint.gguf " + d.path + "/q.gguf q4_0", &log) == 1);
    CHECK_MESSAGE(log.find("checkpoint.gguf: a finetune checkpoint, not a model") != std::string::npos, log);
    CHECK_FALSE(exists(d.path + "/q.gguf"));
    // a second run into the same directory does not clobber the first
    CHECK(run("./finetune -m " + base + " -d " + data + " -o " + out + " --max-steps 2", &log) == 1);
    CHECK_MESSAGE(log.find("already holds a run") != std::string::npos, log);
    // nor its outputs when the checkpoint is gone: each one alone is refused, and stays as it was
    const std::string kept = d.path + "/kept";
    for (const char *name : {"adapter.gguf", "peft/adapter_config.json", "metrics.jsonl"}) {
        CAPTURE(name);
        REQUIRE(run("rm -rf " + kept + " && mkdir -p " + kept + "/peft && echo mine > " + kept + "/" + name, &log) == 0);
        CHECK(run("./finetune -m " + base + " -d " + data + " -o " + kept + " --max-steps 2", &log) == 1);
        CHECK_MESSAGE(log.find(std::string("already holds ") + name) != std::string::npos, log);
        CHECK(read_file(kept + "/" + name) == "mine\n");
    }
    // --overwrite, when the new run cannot even start (here: metrics.jsonl is a folder): the
    // earlier run is left as it was, and nothing of the new one is left behind
    REQUIRE(run("rm " + out + "/metrics.jsonl && mkdir " + out + "/metrics.jsonl", &log) == 0);
    CHECK(run("./finetune -m " + base + " -d " + data + " -o " + out + " --max-steps 2 --overwrite", &log) == 1);
    CHECK_MESSAGE(log.find(out + "/metrics.jsonl: cannot write: Is a directory") != std::string::npos, log);
    CHECK(log.find("removed") == std::string::npos);
    for (const char *name : {"checkpoint.gguf", "adapter.gguf", "peft/adapter_config.json", "merged.gguf", "loss.png"})
        CHECK_MESSAGE(exists(out + "/" + name), name);
    CHECK(!exists(out + "/metrics.jsonl.tmp"));
    // once it starts, the earlier run's files go, so that the directory never mixes two runs (the
    // new one writes no merged.gguf: the old one's would have stayed beside its adapter)
    REQUIRE(run("rmdir " + out + "/metrics.jsonl", &log) == 0);
    REQUIRE_MESSAGE(run("./finetune -m " + base + " -d " + data + " -o " + out + " --max-steps 2 --overwrite", &log) == 0, log);
    CHECK_MESSAGE(log.find("removed the earlier run's checkpoint.gguf, adapter.gguf, peft/adapter_model.safetensors, "
                           "peft/adapter_config.json, merged.gguf, loss.png from " + out) != std::string::npos, log);
    CHECK(!exists(out + "/merged.gguf"));
    CHECK(exists(out + "/adapter.gguf"));
}

TEST_CASE("finetune: Ctrl-C saves a checkpoint; --resume continues to the uninterrupted run's losses" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 2 --heads 2 --ff 64 --seed 4", &log) == 0);
    write_qa_jsonl(data, 16);
    const std::string args = " -m " + base + " -d " + data + " --max-steps 400 -b 2 --seq-len 24 --lora-dropout 0.1 --lr 1e-3 "
                             "--lr-scheduler cosine --warmup-steps 5 -t 1 --val-split 0.2 --eval-every 50";
    REQUIRE_MESSAGE(run("./finetune" + args + " -o " + d.path + "/a", &log) == 0, log);
    const int rc = run_interrupted("./finetune" + args + " -o " + d.path + "/b", "step 1/", &log);
    CHECK_MESSAGE(rc == 130, log);  // 128 + SIGINT: `finetune && next` does not go on
    const size_t at = log.find("interrupted (SIGINT) after step ");
    REQUIRE_MESSAGE(at != std::string::npos, log);  // (400 steps outlast the signal's delivery)
    const long long k = atoll(log.c_str() + at + strlen("interrupted (SIGINT) after step "));
    CHECK(k >= 1);
    CHECK(k < 400);
    CHECK(exists(d.path + "/b/checkpoint.gguf"));
    CHECK(!exists(d.path + "/b/adapter.gguf"));  // the adapter is written when the run ends
    CHECK(metric_lines(d.path + "/b/metrics.jsonl").size() == (size_t)k + 1);
    const std::string ck = read_file(d.path + "/b/checkpoint.gguf");
    // a changed setting is refused, naming it: a flag the run was given, by the flag; one it was
    // not (a default), from the settings the checkpoint holds, by the flag too
    CHECK(run("./finetune --resume " + d.path + "/b --lr 2e-3", &log) == 2);
    CHECK_MESSAGE(log.find("finetune: --lr 2e-3: the run in " + d.path + "/b has --lr 1e-3; a resumed run keeps its settings") !=
                      std::string::npos, log);
    CHECK(run("./finetune --lora-r 4 --resume " + d.path + "/b", &log) == 1);
    CHECK_MESSAGE(log.find("checkpoint.gguf: another run: --lora-r was 16, now 4") != std::string::npos, log);
    // --export: the interrupted run's adapter, from its checkpoint alone, which stays as it was
    REQUIRE_MESSAGE(run("./finetune --export " + d.path + "/b -o " + d.path + "/e", &log) == 0, log);
    CHECK_MESSAGE(log.find("exported the adapter after step " + std::to_string(k) + " of 400") != std::string::npos, log);
    CHECK(exists(d.path + "/e/adapter.gguf"));
    CHECK(exists(d.path + "/e/peft/adapter_model.safetensors"));
    CHECK(!exists(d.path + "/b/adapter.gguf"));
    CHECK(read_file(d.path + "/b/checkpoint.gguf") == ck);
    // --resume DIR alone: the model, data and flags come from the checkpoint
    REQUIRE_MESSAGE(run("./finetune --resume " + d.path + "/b", &log) == 0, log);
    CHECK(log.find("resuming after step " + std::to_string(k)) != std::string::npos);
    const auto a = metric_lines(d.path + "/a/metrics.jsonl"), b = metric_lines(d.path + "/b/metrics.jsonl");
    REQUIRE(a.size() == 401);
    REQUIRE(b.size() == 401);
    for (size_t i = 0; i < a.size(); i++) {
        CAPTURE(i);
        CHECK(b[i].first == a[i].first);
        for (const char *key : {"loss", "eval_loss", "grad_norm", "lr"}) {
            const double x = metric(a[i].second, key), y = metric(b[i].second, key);
            CHECK_MESSAGE((x == y || (std::isnan(x) && std::isnan(y))), key, " ", a[i].second, " vs ", b[i].second);
        }
    }
    CHECK(read_file(d.path + "/a/adapter.gguf") == read_file(d.path + "/b/adapter.gguf"));
}

TEST_CASE("finetune: a finished run extended with --resume DIR --max-steps N equals one run of N steps" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 2 --heads 2 --ff 64 --seed 5", &log) == 0);
    write_qa_jsonl(data, 12);
    // a constant schedule: the learning rate of a step does not depend on the total
    const std::string args = " -m " + base + " -d " + data + " -b 2 --seq-len 24 --lr 1e-3 --lr-scheduler constant -t 1";
    REQUIRE_MESSAGE(run("./finetune" + args + " --max-steps 9 -o " + d.path + "/a", &log) == 0, log);
    REQUIRE_MESSAGE(run("./finetune" + args + " --max-steps 4 -o " + d.path + "/b", &log) == 0, log);
    REQUIRE_MESSAGE(run("./finetune --resume " + d.path + "/b", &log) == 0, log);  // finished: outputs again, no step
    CHECK_MESSAGE(log.find("had finished all 4 steps") != std::string::npos, log);
    CHECK(read_file(d.path + "/a/adapter.gguf") != read_file(d.path + "/b/adapter.gguf"));
    REQUIRE_MESSAGE(run("./finetune --resume " + d.path + "/b --max-steps 9", &log) == 0, log);
    CHECK_MESSAGE(log.find("the run had 4 steps, now 9") != std::string::npos, log);
    CHECK(read_file(d.path + "/a/adapter.gguf") == read_file(d.path + "/b/adapter.gguf"));
    // fewer steps than it has done: refused, the run kept
    CHECK(run("./finetune --resume " + d.path + "/b --max-steps 5", &log) == 1);
    CHECK_MESSAGE(log.find("it is at step 9, past this run's 5 steps") != std::string::npos, log);
    // a checkpoint that stores no command (an older finetune): --resume DIR alone says what to give
    const std::string old = d.path + "/c";
    REQUIRE(mkdir(old.c_str(), 0755) == 0);
    rewrite_gguf(d.path + "/b/checkpoint.gguf", old + "/checkpoint.gguf",
                 [](ql_gguf_writer *w) { ql_gguf_remove_kv(w, "qlora.run.command"); });
    CHECK(run("./finetune --resume " + old, &log) == 2);
    CHECK_MESSAGE(log.find("does not store its run's command (written by an older finetune): give the run's -m, -d and flags again") !=
                      std::string::npos, log);
}

TEST_CASE("finetune: padding to each micro-batch's longest - the plan's line, real and padded tokens/s; --seq-len past the context warns" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 1 --heads 2 --ff 64 --ctx 48 --seed 6", &log) == 0);
    write_qa_jsonl(data, 12);  // examples of ~10-20 tokens (byte-level vocabulary)
    const std::string args = " -m " + base + " -d " + data + " --max-steps 3 -b 2 --seq-len 64 -t 1 -o ";
    REQUIRE_MESSAGE(run("./finetune" + args + d.path + "/a", &log) == 0, log);
    CHECK_MESSAGE(log.find("finetune: warning: --seq-len 64 is longer than the model's context length 48") != std::string::npos, log);
    const size_t at = log.find("finetune: padding: ");
    REQUIRE_MESSAGE(at != std::string::npos, log);
    const std::string line = log.substr(at, log.find('\n', at) - at);
    CHECK_MESSAGE((line.find("each micro-batch to the shortest of") != std::string::npos ||
                   line.find("(the longest sequence's)") != std::string::npos), line);
    const double pct = atof(line.c_str() + line.rfind('(') + 1);  // "(P% padding)"
    const auto m = metric_lines(d.path + "/a/metrics.jsonl");
    REQUIRE(m.size() == 3);
    const double real = metric(m[2].second, "tokens_per_s"), padded = metric(m[2].second, "padded_tokens_per_s"),
                 sup = metric(m[2].second, "supervised_tokens_per_s");
    CHECK(sup > 0);
    CHECK(sup < real);
    CHECK(real <= padded);
    CHECK(log.find("tok/s (") != std::string::npos);
    // padded to --seq-len: 64 positions a sequence, of which the same real ones
    REQUIRE_MESSAGE(run("./finetune" + args + d.path + "/b --no-dynamic-padding", &log) == 0, log);
    const size_t at2 = log.find("finetune: padding: every micro-batch to --seq-len 64 (--no-dynamic-padding)");
    REQUIRE_MESSAGE(at2 != std::string::npos, log);
    const double pct2 = atof(log.c_str() + log.find('(', log.find("positions for", at2)) + 1);
    CHECK(pct2 > pct);
    CHECK(pct2 > 60);
}

// --threads N > 1: other values than one stream (N = 1, the default: ql_llama_randomize's), the same
// file for any N > 1; NF4's side data (one range) and q8_0's rows (split across threads) both
TEST_CASE("make-model --threads: the same file for any N > 1, the one-stream file for N = 1" * needs_tools("make-model finetune")) {
    tmpdir d;
    std::string log;
    for (const char *type : {"nf4", "q8_0"}) {
        INFO(type);
        auto make = [&](const std::string &name, const std::string &threads) {
            const std::string f = d.path + "/" + name + ".gguf";
            REQUIRE_MESSAGE(run("./make-model -o " + f + " --dim 64 --layers 2 --heads 2 --ff 128 --type " + type + " --embd-type bf16" +
                                    threads, &log) == 0, log);
            return read_file(f);
        };
        const std::string one = make("one", ""), one_t = make("one_t", " --threads 1"), two = make("two", " --threads 2"),
                          three = make("three", " --threads 3");
        CHECK(one == one_t);
        CHECK(two == three);
        CHECK(one.size() == two.size());
        CHECK(one != two);
        // and the model loads and trains
        write_qa_jsonl(d.path + "/qa.jsonl", 8);
        REQUIRE_MESSAGE(run("./finetune --overwrite -m " + d.path + "/three.gguf -d " + d.path + "/qa.jsonl -o " + d.path +
                                "/out --max-steps 1 -b 2 --seq-len 32 -t 1", &log) == 0, log);
    }
}

// --profile: the time per op kind, the multiplies by shape with their rate, the costliest nodes
TEST_CASE("finetune --profile: where the step's time goes, the multiplies by shape and their GFLOP/s" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 1 --heads 2 --ff 64 --ctx 64 --seed 6", &log) == 0);
    write_qa_jsonl(data, 8);
    REQUIRE_MESSAGE(run("./finetune -m " + base + " -d " + data + " --max-steps 2 -b 2 --seq-len 32 -t 1 --profile -o " + d.path + "/a",
                        &log) == 0, log);
    const size_t at = log.find("mul_mat by shape (M x N x K a.b: share of the graph, GFLOP/s):\n");
    REQUIRE_MESSAGE(at != std::string::npos, log);
    CHECK(log.find("finetune: profile of the training graph (") < at);
    CHECK(log.find("finetune: profile: steps 2-2 (step 1 left out: first calls)") != std::string::npos);  // warm-up excluded
    CHECK(log.find("  costliest nodes:") > at);
    // the first shape's line: "  P%  MxNxK a.b R" (M, K among the model's 32, 64, 512 and the LoRA rank)
    const std::string first = log.substr(log.find('\n', at) + 1, log.find('\n', log.find('\n', at) + 1) - log.find('\n', at) - 1);
    CAPTURE(first);
    double pct = 0;
    long long M = 0, N = 0, K = 0;
    REQUIRE(sscanf(first.c_str(), " %lf%% %lldx%lldx%lld", &pct, &M, &N, &K) == 4);
    CHECK((pct > 0 && pct <= 100));
    CHECK((M > 0 && N > 0 && K > 0));
    CHECK(atof(first.c_str() + first.rfind(' ') + 1) > 0);  // a rate
    CHECK(log.find("512x") != std::string::npos);  // the head
}

TEST_CASE("finetune: a full disk - the adapter first, then the checkpoint; the message names the file and the size" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl", out = d.path + "/run";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 64 --layers 2 --heads 2 --ff 128 --seed 4", &log) == 0);
    write_qa_jsonl(data, 8);
    const std::string ft = "./finetune -m " + base + " -d " + data + " -o " + out + " -b 2 --seq-len 24 -t 1";
    REQUIRE_MESSAGE(run(ft + " --max-steps 2", &log) == 0, log);
    const size_t adapter = read_file(out + "/adapter.gguf").size(), ckpt = read_file(out + "/checkpoint.gguf").size();
    REQUIRE(ckpt > adapter + 4096);
    const std::string good = read_file(out + "/checkpoint.gguf");
    // the run extended by a step, with files limited to between the two sizes (RLIMIT_FSIZE:
    // EFBIG, as a full disk's ENOSPC; the signal it raises ignored): the adapter is written, the
    // checkpoint is not, and the run's last one stays
    const long blocks = (long)((adapter + ckpt) / 2 / 512);
    const std::string limited = "sh -c \"trap '' XFSZ; ulimit -f " + std::to_string(blocks) + "; exec " + ft + " --resume " + out +
                                " --max-steps 3\"";
    CHECK(run(limited, &log) == 1);
    CHECK_MESSAGE(log.find(out + "/checkpoint.gguf: writing tensor data: ") != std::string::npos, log);
    CHECK_MESSAGE(log.find("(the file needs ") != std::string::npos, log);
    CHECK_MESSAGE(log.find("the previous file is kept as it was") != std::string::npos, log);
    CHECK_MESSAGE(log.find("the adapter is written") != std::string::npos, log);
    CHECK(read_file(out + "/checkpoint.gguf") == good);  // nothing good replaced by something partial
    CHECK(read_file(out + "/adapter.gguf").size() == adapter);
    CHECK(!exists(out + "/checkpoint.gguf.tmp"));
}

TEST_CASE("finetune: two runs on one -o at once - the second is refused, naming the first's pid" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl", out = d.path + "/run";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 1 --heads 2 --ff 64 --seed 4", &log) == 0);
    write_qa_jsonl(data, 8);
    const std::string ft = "./finetune -m " + base + " -d " + data + " -b 2 --seq-len 24 -t 1 -o " + out;
    // the first runs (stopped by SIGINT once the second has been tried); the second starts meanwhile
    const std::string script = ft + " --max-steps 4000 > " + d.path + "/first.log 2>&1 & p=$!; "
                               "while ! grep -q 'step 1/' " + d.path + "/first.log; do sleep 0.05; done; " +
                               ft + " --max-steps 2 --overwrite; echo second=$?; kill -INT $p; wait $p; echo first=$?";
    REQUIRE(run("( " + script + " )", &log) == 0);
    CHECK_MESSAGE(log.find("second=1") != std::string::npos, log);
    CHECK_MESSAGE(log.find(out + ": another finetune (pid ") != std::string::npos, log);
    CHECK_MESSAGE(log.find("first=130") != std::string::npos, log);  // the first was undisturbed, and saved
    CHECK(exists(out + "/checkpoint.gguf"));
    // the lock dies with its process: the directory is free again
    REQUIRE_MESSAGE(run(ft + " --max-steps 2 --overwrite", &log) == 0, log);
}

TEST_CASE("finetune: SIGTERM and SIGHUP save a checkpoint like Ctrl-C and exit 128 + the signal, also when sent twice" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl";
    std::string log;
    // steps of ~0.1 s, so that the repeated signal (5 ms later) comes while the run still saves
    REQUIRE(run("./make-model -o " + base + " --dim 384 --layers 2 --heads 4 --ff 1024 --seed 4", &log) == 0);
    write_qa_jsonl(data, 8);
    const std::string args = " -m " + base + " -d " + data + " --max-steps 400 -b 2 --seq-len 24 -t 1";
    for (const int sig : {SIGTERM, SIGHUP}) {
        const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGHUP", out = d.path + "/" + name;
        CAPTURE(name);
        // twice, as GNU timeout delivers it: the repeat must not kill the run the first asked to save
        const int rc = run_interrupted("./finetune" + args + " -o " + out, "step 1/", &log, sig, 2);
        CHECK_MESSAGE(rc == 128 + sig, log);  // 143 for SIGTERM, 129 for SIGHUP
        CHECK_MESSAGE(log.find("interrupted (" + name + ") after step ") != std::string::npos, log);
        CHECK(exists(out + "/checkpoint.gguf"));
        // it resumes (and stops again the same way)
        CHECK(run_interrupted("./finetune" + args + " --resume " + out, "step ", &log, sig) == 128 + sig);
        CHECK_MESSAGE(log.find("resuming after step ") != std::string::npos, log);
    }
}

TEST_CASE("finetune: stories260K fine-tuned on a few stories lowers its loss on held-out ones" * needs_fixture("stories260K/stories260K.bin") *
          needs_tools("convert finetune perplexity")) {
    const std::string fx = fixtures_dir();
    fixture("stories260K/stories260K.bin");
    const std::string dd = tests_dir() + "data";
    tmpdir d;
    std::string log;
    REQUIRE(run("./convert llama2c " + fx + "/stories260K/stories260K.bin " + fx + "/stories260K/tok512.bin -o " + d.path + "/s.gguf",
                &log) == 0);
    REQUIRE_MESSAGE(run("./finetune -m " + d.path + "/s.gguf -d " + dd + "/stories-train.jsonl --val-data " + dd +
                            "/stories-eval.jsonl -o " + d.path + "/o --max-steps 24 --lr 3e-3 -b 4 --seq-len 128 "
                            "--lora-targets all -t 2 --eval-every 12",
                        &log) == 0, log);
    const auto ml = metric_lines(d.path + "/o/metrics.jsonl");
    REQUIRE(ml.size() == 25);
    const double before = metric(ml[0].second, "eval_loss"), after = metric(ml[24].second, "eval_loss");
    MESSAGE("stories260K eval loss on held-out stories: ", before, " -> ", after);
    CHECK(before > 1.5);  // the model has not seen these stories: Mia and her dog Sam
    CHECK(after < 0.85 * before);

    // a run that diverges (--lr 10, no clipping, LoRA's scale 100000 / 16: a nan gradient by
    // step 3 in every build; --lr 10 alone diverged by chance - the portable build trained 40
    // steps to a finite loss) stops with the reason, and keeps the adapter and checkpoint of its
    // last good step, as the message says
    const std::string nan_run = "./finetune -m " + d.path + "/s.gguf -d " + dd + "/stories-train.jsonl -o " + d.path +
                                "/nan --max-steps 40 --lr 10 --max-grad-norm 0 --lora-alpha 100000 -t 1";
    CHECK(run("(" + nan_run + " 2> " + d.path + "/nan.err > /dev/null)", &log) == 1);  // (stderr alone)
    const std::string err = read_file(d.path + "/nan.err");
    const std::string left = "the adapter is left as it was after step ";  // (a nan loss, or a nan gradient)
    const size_t at = err.find(left);
    REQUIRE_MESSAGE(at != std::string::npos, err);
    const long long good = atoll(err.c_str() + at + left.size());
    CHECK(good >= 1);
    CHECK_MESSAGE(err.find("finetune: the adapter and the checkpoint of step " + std::to_string(good) + " are in " + d.path + "/nan\n") !=
                      std::string::npos, err);
    CHECK_MESSAGE(std::count(err.begin(), err.end(), '\n') == 2, err);  // the reason and what was kept: no blank line
    std::vector<std::string> unused;
    int64_t step = -1, total = -1;
    std::string e;
    REQUIRE_MESSAGE(ql_checkpoint_info((d.path + "/nan/checkpoint.gguf").c_str(), &unused, &step, &total, &e), e);
    CHECK(step == good);
    {  // its adapter is finite and loads
        REQUIRE(run("printf 'Once upon a time' > " + d.path + "/t.txt", &log) == 0);
        CHECK_MESSAGE(run("./perplexity -m " + d.path + "/s.gguf --lora " + d.path + "/nan/adapter.gguf -f " + d.path + "/t.txt", &log) == 0,
                      log);
    }
}

TEST_CASE("finetune: bad flags and bad input give one clear line, and nothing is written" * needs_tools("make-model finetune perplexity quantize")) {
    tmpdir d;
    const std::string base = d.path + "/m.gguf", data = d.path + "/qa.jsonl", bad = d.path + "/bad.jsonl", out = d.path + "/out";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 1 --heads 2 --ff 48", &log) == 0);
    write_qa_jsonl(data, 4);
    REQUIRE(run("printf '{\"text\": \"fine\"}\\n{\"text\": \"broken}\\n' > " + bad, &log) == 0);
    const std::string both = d.path + "/both.jsonl", nocompl = d.path + "/nocompl.jsonl", empty = d.path + "/empty.jsonl";
    write_file(both, "{\"prompt\": \"Q\", \"completion\": \" A\"}\n{\"text\": \"t\", \"prompt\": \"Q\", \"completion\": \" A\"}\n");
    write_file(nocompl, "{\"prompt\": \"Q\", \"completion\": \"\"}\n");
    write_file(empty, "");
    const std::string mixed = d.path + "/mixed.jsonl", one = d.path + "/one.jsonl";
    write_file(mixed, "{\"prompt\": \"Q\", \"completion\": \" A\", \"instruction\": \"I\", \"output\": \"O\"}\n");
    write_file(one, "{\"text\": \"a story\"}\n");
    struct bad_case {
        std::string args, says;
    };
    const std::string md = " -m " + base + " -d " + data + " -o " + out;
    std::vector<bad_case> cases = {
        {"", "-m model.gguf and -d data.jsonl are required"},
        {" -m " + base, "-m model.gguf and -d data.jsonl are required"},
        {md + " --frobnicate", "unknown flag '--frobnicate'"},
        {md + " --lr fast", "--lr: 'fast' is not a number"},
        {md + " --lora-r 0", "--lora-r: '0' is not a number in [1, 4096]"},
        {md + " --lora-r", "--lora-r needs a value"},
        {md + " -b 2.5", "-b: '2.5' is not a whole number"},
        {md + " --lr-scheduler constant --warmup-steps 1.5", "--warmup-steps: '1.5' is not a whole number"},
        {md + " --lora-targets q,x", "unknown target 'x'"},
        {md + " --lr-scheduler step", "--lr-scheduler: 'step'"},
        {md + " --val-split 0.1 --val-data " + data, "alternatives"},
        {md + " --chat-template vicuna", "unknown template 'vicuna'"},
        {" -m " + d.path + "/none.gguf -d " + data + " -o " + out, "none.gguf"},
        {" -m " + data + " -d " + data + " -o " + out, "qa.jsonl"},
        {" -m " + base + " -d " + d.path + "/none.jsonl -o " + out, "none.jsonl"},
        {" -m " + base + " -d " + bad + " -o " + out, "bad.jsonl:2: "},
        {md + " --resume " + d.path + "/nothing", "nothing: no such directory"},
        {md + " --mem-limit lots", "--mem-limit: 'lots' is not a size"},
        {md + " --mem-limit 0", "--mem-limit: '0' is not a size"},
        {md + " --mem-limit 6Q", "--mem-limit: '6Q' is not a size"},
        {md + " --vram lots", "--vram: 'lots' is not a size"},
        {md + " --cc 5.0", "--cc: '5.0' is not a compute capability qlora runs on"},
        {md + " --vram 8G --device cpu", "--vram/--cc describe a GPU: with --device cuda (this run: --device cpu)"},
        {md + " --cache-weights yes", "--cache-weights: 'yes' is not one of on, off, auto"},
        {md + " --cache-weights", "--cache-weights needs a value"},
        {md + " --device cpu --cache-weights on", "--cache-weights on: the CPU backend converts the weights while packing its panels"},
        {md + " --loss-chunk many", "--loss-chunk: 'many' is not a number in [-1, "},
        {md + " --ffn-chunk -2", "--ffn-chunk: '-2' is not a number in [-1, "},
        {md + " --attn-score-mib 0", "--attn-score-mib: '0' is not auto or a whole number of MiB in [1, 1048576]"},
        {md + " --attn-score-mib 1.5", "--attn-score-mib: '1.5' is not auto or a whole number of MiB"},
        {md + " --attn-score-mib", "--attn-score-mib needs a value"},
        {md + " --device cpu --attn-score-mib 64", "--attn-score-mib: the CPU backend's attention runs in tiles of its own"},
        {md + " --attn-backward sideways", "--attn-backward: 'sideways' is not one of auto, fused, products"},
        {md + " --attn-backward", "--attn-backward needs a value"},
        {md + " --device cpu --attn-backward fused", "--attn-backward: the CPU backend's attention runs in tiles of its own"},
        {md + " --host-mem 64", "--host-mem: '64' "},
        {md + " --host-mem 64G", "--host-mem plans for another machine's memory: with --dry-run"},
        {" -m " + base + " -d " + both + " -o " + out, both + ":2: both \"text\" and \"prompt\"/\"completion\": which to train on is ambiguous"},
        {" -m " + base + " -d " + nocompl + " -o " + out, nocompl + ":1: empty \"completion\": nothing to learn"},
        {md + " --val-data " + empty, "--val-data " + empty + ": no usable evaluation examples"},
        {" -m " + base + " -d " + mixed + " -o " + out, mixed + ":1: both \"prompt\"/\"completion\" and \"instruction\"/\"output\""},
        {" -m " + base + " -d " + one + " -o " + out + " --val-split 0.5",
         "--val-split 0.5: " + one + " has 1 usable example, too few to hold one out for evaluation"},
        {md + " --checkpointing half", "--checkpointing: 'half' (none, block, sqrt, auto)"},
        {md + " -b auto", "-b auto needs --mem-limit"},
        {md + " --checkpointing auto", "--checkpointing auto needs --mem-limit"},
        {md + " -b 2 --effective-batch 5", "--effective-batch 5 is not a multiple of -b 2"},
        {md + " --effective-batch 0", "--effective-batch: '0' is not a number in [1, "},
        {md + " --eps 0", "--eps: '0' must be above 0"},
        {md + " --lr ''", "--lr: '' is not a number in [0, 10]"},  // (was: lr 0, exit 0)
        {md + " --max-grad-norm ''", "--max-grad-norm: '' is not a number"},
        {md + " --optim sgd", "--optim: 'sgd' (adamw, adamw8bit, paged_adamw, paged_adamw8bit)"},
        {md + " --precision fp8", "--precision: 'fp8' (fp32, bf16, fp16, auto)"},
        {md + " --device tpu", "--device tpu: 'tpu' is not a device (cpu, cuda, cuda:N, auto)"},
        {md + " --device cuda:99", ql_cuda_device_count() == 0 ? "--device cuda:99: " : "no CUDA device 99"},
        {md + " --loss-scale-init 1024", "--loss-scale-init: loss scaling is for --precision fp16 (this run: "},
        {md + " --precision bf16 --loss-scale-interval 10", "--loss-scale-interval: loss scaling is for --precision fp16 (this run: bf16)"},
        {md + " --precision fp16 --loss-scale-backoff 1", "--loss-scale-backoff: '1' is not a number in [1e-06, 0.999999]"},
        {md + " --precision fp16 --loss-scale-interval 0", "--loss-scale-interval: '0' is not a number in [1, "},
        {md + " --precision fp16 --loss-scale-growth 0.5", "--loss-scale-growth: '0.5' is not a number in [1, 1000000]"},
        {md + " --precision fp16 --loss-scale-init 1e20", "--loss-scale-init: '1e20' is not a number in [1e-30, 1e+19]"},
    };
    if (ql_cuda_device_count() == 0)  // a card that is not here: only its plan
        cases.push_back({md + " --device cuda --vram 8G", "(--vram/--cc with --dry-run plan for a card that is not here)"});
    for (const bad_case &c : cases) {
        CAPTURE(c.args);
        CHECK(run("./finetune" + c.args, &log) != 0);
        CHECK_MESSAGE(log.find(c.says) != std::string::npos, log);
        CHECK_MESSAGE(std::count(log.begin(), log.end(), '\n') == 1, log);
        CHECK(!exists(out));
    }
    // settings that run but cannot do what they seem to ask: warned
    REQUIRE(run("./finetune -m " + base + " -d " + data + " -o " + d.path + "/warn --max-steps 2 --warmup-steps 5 --lora-r 64", &log) == 0);
    CHECK_MESSAGE(log.find("warning: a warmup of 5 steps in a run of 2: the learning rate never reaches --lr") != std::string::npos, log);
    CHECK_MESSAGE(log.find("warning: --lora-r 64 is above the model's dimension 32") != std::string::npos, log);
    // --skip-bad-lines trains on the rest and says what it skipped
    REQUIRE(run("./finetune -m " + base + " -d " + bad + " -o " + out + " --skip-bad-lines --max-steps 1", &log) == 0);
    CHECK_MESSAGE(log.find("skipped 1 bad line of " + bad + "; the first: " + bad + ":2: ") != std::string::npos, log);
    // the adapter it wrote, where a model belongs: one line each, nothing written
    {
        CHECK(run("./perplexity -m " + out + "/adapter.gguf -f " + data, &log) == 1);
        CHECK_MESSAGE(log.find("a LoRA adapter, not a model (give it with --lora") != std::string::npos, log);
        CHECK(run("./quantize " + out + "/adapter.gguf " + d.path + "/q.gguf nf4", &log) == 1);
        CHECK_MESSAGE(log.find("a LoRA adapter, not a model: nothing to quantize") != std::string::npos, log);
        CHECK(!exists(d.path + "/q.gguf"));
        // perplexity's text: a directory, a binary file
        CHECK(run("./perplexity -m " + base + " -f " + d.path, &log) == 1);
        CHECK_MESSAGE(log.find(d.path + ": cannot read: Is a directory") != std::string::npos, log);
        write_file(d.path + "/bin.dat", std::string("GGUF\0\0\0\3binary", 14));
        CHECK(run("./perplexity -m " + base + " -f " + d.path + "/bin.dat", &log) == 1);
        CHECK_MESSAGE(log.find("bin.dat: not a text file (a NUL byte at offset 4)") != std::string::npos, log);
    }
    // resuming another run into this one's directory would overwrite it: refused, nothing touched
    const std::string other = d.path + "/other", before = read_file(out + "/checkpoint.gguf");
    REQUIRE(run("./finetune" + md.substr(0, md.find(" -o ")) + " -o " + other + " --max-steps 2 --save-every 1", &log) == 0);
    CHECK(run("./finetune" + md.substr(0, md.find(" -o ")) + " --resume " + other + " -o " + out + " --max-steps 2", &log) == 1);
    CHECK_MESSAGE(log.find(out + " already holds a run") != std::string::npos, log);
    CHECK(read_file(out + "/checkpoint.gguf") == before);
}

TEST_CASE("finetune: BOS only where the vocabulary adds it (tokenizer.ggml.add_bos_token), as generate does" * needs_tools("make-model finetune tokenize")) {
    tmpdir d;
    const std::string base = d.path + "/m.gguf", nobos = d.path + "/nobos.gguf", data = d.path + "/t.jsonl";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 1 --heads 2 --ff 48", &log) == 0);
    write_file(data, "{\"text\": \"one two\"}\n{\"text\": \"three\"}\n{\"text\": \"four five six\"}\n");
    {  // the same model with add_bos_token = false
        char err[256];
        ql_gguf *g = ql_gguf_open(base.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(g, err);
        ql_gguf_writer *w = ql_gguf_writer_new();
        for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) ql_gguf_copy_kv(w, g, i);
        ql_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", false);
        for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
            int64_t ne[4];
            const int nd = ql_gguf_tensor_ne(g, i, ne);
            REQUIRE(ql_gguf_add_tensor(w, ql_gguf_tensor_name(g, i), ql_gguf_tensor_type(g, i), nd, ne, ql_gguf_tensor_data(g, i),
                                       ql_gguf_tensor_size(g, i)) == QL_OK);
        }
        REQUIRE_MESSAGE(ql_gguf_write(w, nobos.c_str(), err, sizeof(err)) == QL_OK, err);
        ql_gguf_writer_free(w);
        ql_gguf_close(g);
    }
    // without BOS the first token of each example is context, not a target: one target fewer each
    auto supervised = [&](const std::string &model) {
        std::string out;
        REQUIRE(run("./finetune -m " + model + " -d " + data + " -o " + d.path + "/run --overwrite --max-steps 1", &out) == 0);
        const size_t at = out.find(" supervised tokens");
        REQUIRE_MESSAGE(at != std::string::npos, out);
        size_t b = at;
        while (b > 0 && out[b - 1] >= '0' && out[b - 1] <= '9') b--;
        return atol(out.c_str() + b);
    };
    const long with_bos = supervised(base), without = supervised(nobos);
    CHECK(with_bos == without + 3);
    std::string t1, t2;  // and prompts (generate, tokenize) agree: BOS (id 1) only where the vocabulary adds it
    REQUIRE(run("./tokenize -m " + base + " -p \"one\"", &t1) == 0);
    REQUIRE(run("./tokenize -m " + nobos + " -p \"one\"", &t2) == 0);
    CHECK_MESSAGE(t1.rfind("1 ", 0) == 0, t1);
    CHECK_MESSAGE(t2 == t1.substr(2), t2);
}

namespace {

// "peak memory WHEN: X MiB measured (VmHWM), Y MiB planned" -> (X, Y); (-1, -1) if absent
std::pair<double, double> peak_line(const std::string &log, const char *when) {
    const std::string k = std::string("peak memory ") + when + ": ";
    const size_t p = log.find(k);
    double x = -1, y = -1;
    if (p == std::string::npos || sscanf(log.c_str() + p + k.size(), "%lf MiB measured (VmHWM), %lf MiB planned", &x, &y) != 2)
        return {-1, -1};
    return {x, y};
}

size_t count(const std::string &s, const std::string &what) {
    size_t n = 0;
    for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) n++;
    return n;
}

// the JSON object on a line of its own in a tool's output
ql_json json_line(const std::string &log) {
    ql_json j;
    for (size_t p = 0; p < log.size();) {
        const size_t e = std::min(log.find('\n', p), log.size());
        if (log[p] == '{') {
            std::string why;
            REQUIRE_MESSAGE(ql_json_parse(log.substr(p, e - p), QL_JSON_DOCUMENT, &j, &why), why);
            return j;
        }
        p = e + 1;
    }
    FAIL("no JSON line in: " << log);
    return j;
}

std::string jstr(const ql_json &j, const char *key) {
    const ql_json *v = j.get(key);
    REQUIRE_MESSAGE(v, key);
    return v->str;
}

double jnum(const ql_json &j, const char *key) {
    const ql_json *v = j.get(key);
    REQUIRE_MESSAGE(v, key);
    return v->num();
}

}  // namespace

TEST_CASE("finetune: the memory plan: --dry-run, measured peak within 3%, -b auto under --mem-limit, advice and snapshot" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl", out = d.path + "/run";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 192 --layers 4 --heads 4 --ff 512 --seed 1", &log) == 0);
    write_qa_jsonl(data, 16);
    // (every micro-batch at 256: the subject is the plan of a 256-token graph, not the data's lengths)
    const std::string ft = "./finetune -m " + base + " -d " + data + " -o " + out + " --seq-len 256 -t 2 --overwrite --no-dynamic-padding";

    // --dry-run: the table (or one JSON object), exit 0, nothing written
    REQUIRE_MESSAGE(run(ft + " -b 4 --dry-run", &log) == 0, log);
    for (const char *row : {"memory plan (MiB)", "base weights, pages read", "LoRA parameters", "gradients", "optimizer state",
                            "saved activations", "temporaries and recompute", "kernel workspace", "data buffers", "total"})
        CHECK_MESSAGE(has(log, row), row);
    CHECK(!exists(out));
    REQUIRE_MESSAGE(run(ft + " -b 4 --dry-run --json", &log) == 0, log);
    const ql_json j = json_line(log);
    double parts = jnum(j, "process") + jnum(*j.get("weights"), "read");
    for (const char *k : {"lora", "grads", "optimizer", "saved_activations", "temporaries", "workspace", "inputs", "graph", "graph_heap", "reserve"})
        parts += jnum(j, k);
    CHECK(parts == jnum(j, "total"));  // the parts add up to the total
    CHECK(jnum(j, "micro_batch") == 4);
    CHECK(j.get("fits")->b);
    CHECK(!exists(out));

    // the plan against the measured peak (VmHWM), after step 1 and at the end: within 3%
    double planned_none = 0, planned_block = 0;
    for (const std::string policy : {"none", "block", "sqrt"}) {
        CAPTURE(policy);
        REQUIRE_MESSAGE(run(ft + " -b 4 --max-steps 2 --checkpointing " + policy, &log) == 0, log);
        for (const char *when : {"after step 1", "of training"}) {
            const auto [measured, planned] = peak_line(log, when);
            MESSAGE(policy, " ", std::string(when), ": measured ", measured, " MiB, planned ", planned, " MiB");
            REQUIRE(planned > 0);
            CHECK(std::fabs(measured - planned) <= 0.03 * planned);
        }
        const auto ml = metric_lines(out + "/metrics.jsonl");
        REQUIRE(ml.size() == 2);
        CHECK(metric(ml[0].second, "planned_mib") == doctest::Approx(peak_line(log, "of training").second).epsilon(1e-3));
        if (policy == "none") planned_none = peak_line(log, "of training").second;
        if (policy == "block") planned_block = peak_line(log, "of training").second;
    }
    CHECK(planned_block < planned_none);
    {  // the demo's small NF4 model, whose loading reads part of the weights' pages before the plan
       // (counted twice, the plan was 6% above the peak here)
        const std::string small = d.path + "/small.gguf";
        REQUIRE(run("./make-model -o " + small + " --dim 256 --layers 4 --heads 4 --ff 768 --type nf4 --seed 7", &log) == 0);
        REQUIRE_MESSAGE(run("./finetune -m " + small + " -d " + data + " -o " + out + " --seq-len 64 -t 2 --overwrite -b 4 --max-steps 2"
                            " --lora-targets all", &log) == 0, log);
        const auto [measured, planned] = peak_line(log, "of training");
        MESSAGE("demo-sized: measured ", measured, " MiB, planned ", planned, " MiB");
        REQUIRE(planned > 0);
        CHECK(std::fabs(measured - planned) <= 0.03 * planned);
    }

    // -b auto: the largest micro-batch whose plan fits, never above the limit, measured too
    // none at b 4 fits (the printed plan is rounded to 0.1 MiB, and RSS before training varies a little)
    const long long limit = (long long)((planned_none + 1) * 1048576.0);
    REQUIRE_MESSAGE(run(ft + " -b auto --mem-limit " + std::to_string(limit) + "B --dry-run --json", &log) == 0, log);
    const ql_json ja = json_line(log);
    const int b = (int)jnum(ja, "micro_batch");
    CHECK(b >= 4);
    CHECK(jnum(ja, "total") <= (double)limit);
    if (b < 16) {  // one more sequence per micro-batch would not fit (without recompute, which auto would add)
        CHECK(run(ft + " -b " + std::to_string(b + 1) + " --checkpointing none --mem-limit " + std::to_string(limit) +
                  "B --dry-run --json", &log) == 1);
        CHECK(!json_line(log).get("fits")->b);
    }
    REQUIRE_MESSAGE(run(ft + " -b auto --effective-batch 8 --mem-limit " + std::to_string(limit) + "B --max-steps 1", &log) == 0, log);
    CHECK_MESSAGE(has(log, "micro-batch 4 (-b auto) x accumulation 2 = effective batch 8"), log);
    CHECK(peak_line(log, "of training").first * 1048576.0 <= (double)limit);
    CHECK(count(log, "above 90% of --mem-limit") == 1);  // within 1 MiB of the limit: the warning, once

    // --checkpointing auto halfway between block and none: fits, and recomputes less than block
    const long long half = (long long)((planned_none + planned_block) / 2 * 1048576.0);
    REQUIRE_MESSAGE(run(ft + " -b 4 --checkpointing auto --mem-limit " + std::to_string(half) + "B --max-steps 1", &log) == 0, log);
    CHECK_MESSAGE(has(log, "checkpointing: auto: of 8 segments"), log);
    {  // the plan fits the budget (printed to 0.1 MiB); VmHWM is the plan's within its 3%, not
       // under the budget to the byte (it went 0.1 MiB over once, in CI's UBSan tree under load)
        const auto [measured, planned] = peak_line(log, "of training");
        MESSAGE("auto at ", half / 1048576.0, " MiB: measured ", measured, " MiB, planned ", planned, " MiB");
        REQUIRE(planned > 0);
        CHECK((planned - 0.05) * 1048576.0 <= (double)half);
        CHECK(std::fabs(measured - planned) <= 0.03 * planned);
    }

    // the optimizers' state in the table: bytes per parameter, paged ones in host memory
    REQUIRE(run(ft + " -b 4 --dry-run --optim adamw", &log) == 0);
    CHECK_MESSAGE(has(log, "optimizer state (adamw)"), log);
    CHECK(has(log, " 8.00 bytes per parameter"));
    REQUIRE(run(ft + " -b 4 --dry-run --optim paged_adamw8bit", &log) == 0);  // A, B of 192 x 16: 3072 elements: f32
    CHECK_MESSAGE(has(log, "optimizer state (paged_adamw8bit)"), log);
    CHECK(has(log, " 8.00 bytes per parameter; paged: host memory"));
    REQUIRE(run(ft + " -b 4 --dry-run --optim adamw8bit --lora-r 32", &log) == 0);  // 192 x 32 = 6144: 8-bit
    CHECK_MESSAGE(has(log, " 2.03 bytes per parameter"), log);

    // --offload-activations: the checkpoints are shown as host memory
    REQUIRE(run(ft + " -b 4 --checkpointing block --offload-activations --dry-run", &log) == 0);
    CHECK_MESSAGE(has(log, "(host memory)"), log);
    CHECK(has(log, "with --offload-activations: "));

    // nothing fits: the biggest items, three changes with their totals, a snapshot; no run
    REQUIRE(run("rm -rf " + out, &log) == 0);
    CHECK(run(ft + " -b 4 --mem-limit 20M", &log) == 1);
    CHECK_MESSAGE(has(log, "does not fit: needs "), log);
    CHECK(has(log, "of the 20.0 MiB allowed (saved activations "));
    CHECK(has(log, "what would help most"));
    CHECK(has(log, "--checkpointing block "));
    CHECK(has(log, "-b 1 --grad-accum 4 (the same effective batch)"));
    CHECK(has(log, "--seq-len 128 "));
    CHECK(!exists(out + "/checkpoint.gguf"));
    REQUIRE(exists(out + "/memory-snapshot.json"));
    ql_json snap;
    std::string why;
    REQUIRE_MESSAGE(ql_json_parse(read_file(out + "/memory-snapshot.json"), QL_JSON_DOCUMENT, &snap, &why), why);
    const ql_json *tensors = snap.get("tensors");
    REQUIRE(tensors);
    REQUIRE(tensors->items.size() > 50);
    int saved = 0;
    for (const ql_json &x : tensors->items) {
        saved += x.get("category")->str == "saved";
        CHECK(jnum(x, "first") <= jnum(x, "last"));
        CHECK(jnum(x, "bytes") > 0);
    }
    CHECK(saved > 10);
    // a dry run may look at a directory that holds a run: it writes nothing there
    REQUIRE(run(ft + " -b 4 --max-steps 1", &log) == 0);
    const std::string ck = read_file(out + "/checkpoint.gguf");
    REQUIRE(run("./finetune -m " + base + " -d " + data + " -o " + out + " --seq-len 256 -t 2 -b 4 --dry-run", &log) == 0);
    CHECK(read_file(out + "/checkpoint.gguf") == ck);
    // --dry-run of a plan that does not fit: exit 1, the advice, nothing written
    REQUIRE(run("rm -rf " + out, &log) == 0);
    CHECK(run(ft + " -b 4 --mem-limit 20M --dry-run", &log) == 1);
    CHECK(has(log, "what would help most"));
    CHECK(!exists(out));
}

TEST_CASE("finetune: the device plan on a machine without the card (--vram, --cc), -b auto against it, advice" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl", out = d.path + "/run";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 128 --layers 2 --heads 4 --ff 256 --vocab 4000 --type nf4", &log) == 0);
    write_qa_jsonl(data, 16);
    const std::string ft = "./finetune -m " + base + " -d " + data + " -o " + out + " --seq-len 256 --device cuda --dry-run --no-dynamic-padding";
    REQUIRE_MESSAGE(run(ft + " -b 4 --vram 2G --cc 7.5 --precision auto", &log) == 0, log);
    for (const char *row : {"device memory plan (MiB)", "compute capability 7.5", "base weights, whole, as stored", "nf4",
                            "CUDA context + cuBLAS workspace", "allocator rounding", "total device memory", "fits"})
        CHECK_MESSAGE(has(log, row), row, "\n", log);
    CHECK(has(log, "fp16"));  // auto on a 7.5 card: no bf16 GEMM there
    CHECK(!exists(out));
    REQUIRE_MESSAGE(run(ft + " -b 4 --vram 2G --json", &log) == 0, log);
    const ql_json j = json_line(log);
    double parts = jnum(*j.get("weights"), "device") + jnum(j, "inputs_and_state") + jnum(j, "graph_buffer") + jnum(j, "context") +
                   jnum(j, "rounding") + jnum(*j.get("cache_weights"), "bytes");
    CHECK(parts == jnum(j, "total"));  // the parts add up to the total
    {  // the context: the card's (no --cc: 8.0 assumed), and the captured training graph's executable
        char e[256] = "";
        ql_backend *p = ql_backend_init_planned({QL_DEVICE_GPU, 0}, 80, e, sizeof(e));
        REQUIRE_MESSAGE(p, e);
        ql_backend_caps c;
        REQUIRE(ql_backend_get_caps(p, &c) == QL_OK);
        ql_backend_free(p);
        CHECK(jnum(*j.get("census"), "launches") > 0);
        CHECK(jnum(j, "context") == (double)c.context_bytes + (double)c.graph_launch_bytes * jnum(*j.get("census"), "launches"));
    }
    const double total = jnum(j, "total");
    // the loss in chunks: 1024 rows x 4000 logits is under one chunk; 64 rows per chunk forced
    REQUIRE_MESSAGE(run(ft + " -b 4 --vram 2G --loss-chunk 64", &log) == 0, log);
    CHECK(has(log, "in chunks of 64 tokens"));
    // the feed-forward in chunks: said in the plan (auto leaves this small shape whole)
    CHECK(!has(log, "feed-forward: in chunks"));
    REQUIRE_MESSAGE(run(ft + " -b 4 --vram 2G --ffn-chunk 100", &log) == 0, log);
    CHECK_MESSAGE(has(log, "feed-forward: in chunks of 100 tokens"), log);
    // a card too small (without recompute: auto, the default under a limit, would fit it): exit 1,
    // the biggest items, advice with predicted device totals; nothing written
    const std::string small = std::to_string((long long)(total * 0.98)) + "B";
    CHECK(run(ft + " -b 4 --checkpointing none --vram " + small, &log) == 1);
    CHECK_MESSAGE(has(log, "of device memory allowed"), log);
    CHECK_MESSAGE(has(log, "what would help most (predicted device totals"), log);
    CHECK(!exists(out));
    // -b auto against the card's memory (no --mem-limit needed): the largest batch whose plan fits
    REQUIRE_MESSAGE(run(ft + " -b auto --vram " + std::to_string((long long)total) + "B", &log) == 0, log);
    CHECK_MESSAGE(has(log, "-b auto: micro-batch"), log);
    CHECK(has(log, "of device memory"));
    // with offload, the checkpoints go to pinned host memory and the device total drops
    REQUIRE_MESSAGE(run(ft + " -b 4 --vram 2G --checkpointing block --offload-activations --json", &log) == 0, log);
    const ql_json o = json_line(log);
    REQUIRE_MESSAGE(run(ft + " -b 4 --vram 2G --checkpointing block --json", &log) == 0, log);
    const ql_json b = json_line(log);
    CHECK(jnum(*o.get("host"), "pinned") > 0);
    CHECK(jnum(o, "saved_activations") < jnum(b, "saved_activations"));
}

TEST_CASE("finetune --cache-weights: auto takes the copies on a large --vram and gives them up first on a small one; on "
          "refused where they do not fit" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl", out = d.path + "/run";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 128 --layers 2 --heads 4 --ff 512 --vocab 512 --type nf4", &log) == 0);
    write_qa_jsonl(data, 16);
    const std::string ft = "./finetune -m " + base + " -d " + data + " -o " + out + " --seq-len 64 -b 2 --device cuda --cc 9.0 --dry-run --json";
    auto plan = [&](const std::string &flags) {
        REQUIRE_MESSAGE(run(ft + flags, &log) == 0, log);
        return json_line(log);
    };
    // the copies: the seven NF4 linears of 2 blocks and the f32 head, in bf16; and the adapter's
    // factors (the default r 16 on q, k, v, o: [128, 16] and [16, 128] each)
    const size_t copies = (size_t)2 * (128 * 128 * 4 + 128 * 512 * 3) * 2 + (size_t)128 * 512 * 2 + (size_t)2 * 4 * 2 * (128 * 16) * 2;
    const ql_json big = plan(" --vram 8G"), off = plan(" --vram 8G --cache-weights off");
    const ql_json &cb = *big.get("cache_weights"), &co = *off.get("cache_weights");
    CHECK(jstr(cb, "choice") == "auto: on");
    CHECK(jnum(cb, "bytes") == (double)copies);
    CHECK(jstr(co, "choice") == "off");
    CHECK(jnum(co, "bytes") == 0);
    CHECK(jnum(co, "copies_would_take") == (double)copies);
    // their bytes and the allocator's rounding of their buffer: the whole difference, but for the
    // CUDA graph's executable (86 B a launch): the products read the copies, no dequantisation tiles
    const double fewer = jnum(*off.get("census"), "launches") - jnum(*big.get("census"), "launches");
    CHECK(fewer > 0);
    CHECK(jnum(big, "total") == jnum(off, "total") + (double)copies + (double)((2u << 20) - copies % (2u << 20)) - 86.0 * fewer);
    CHECK(jstr(big, "checkpointing") == jstr(off, "checkpointing"));
    // a card with room for the plan but not for the copies too: auto leaves them out and says so;
    // nothing else changes (no recompute for their sake)
    const std::string tight = std::to_string((long long)jnum(off, "total") + (long long)copies / 2) + "B";
    const ql_json small = plan(" --vram " + tight);
    CHECK(has(jstr(*small.get("cache_weights"), "choice"), "auto: off ("));
    CHECK(jnum(*small.get("cache_weights"), "bytes") == 0);
    CHECK(jnum(small, "total") == jnum(off, "total"));
    CHECK(jstr(small, "checkpointing") == jstr(off, "checkpointing"));
    // on where they do not fit: refused, naming the flag and the bytes needed against those available
    CHECK(run(ft + " --vram " + tight + " --cache-weights on --checkpointing none --embd-on-device --optim adamw", &log) == 1);
    CHECK_MESSAGE(has(log, "--cache-weights on: the plan needs " + std::to_string((long long)jnum(big, "total")) +
                               " bytes of device memory"), log);
    CHECK_MESSAGE(has(log, tight.substr(0, tight.size() - 1) + " available"), log);
    CHECK_MESSAGE(has(log, "--cache-weights auto (the weights' copies only when they fit)"), log);  // the advice's first line
    CHECK(!exists(out));
    // the table says it too
    REQUIRE_MESSAGE(run(ft.substr(0, ft.size() - 7) + " --vram 8G", &log) == 0, log);
    CHECK_MESSAGE(has(log, "weights' copies in the compute type"), log);
    CHECK_MESSAGE(has(log, "--cache-weights auto: on"), log);
}

TEST_CASE("finetune --attn-score-mib: auto takes the larger chunks of attention's products where they fit, and gives "
          "them up first; a number wins" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/long.jsonl";
    std::string log;
    // 16 heads at 4096 tokens: the default budget (32 MiB of scores) makes chunks of 128 queries, 64 MiB of 256;
    // head dim 64, so the forward is the fused kernel's and only the backward runs in chunks
    REQUIRE(run("./make-model -o " + base + " --dim 1024 --layers 2 --heads 16 --ff 256 --vocab 512 --type nf4", &log) == 0);
    {
        std::string a, lines;
        for (int i = 0; i < 1500; i++) a += "a b c ";
        for (int i = 0; i < 4; i++) lines += "{\"prompt\": \"q " + std::to_string(i) + "\", \"completion\": \"" + a + "\"}\n";
        write_file(data, lines);
    }
    const std::string ft = "./finetune -m " + base + " -d " + data + " --seq-len 4096 -b 1 --no-dynamic-padding --device cuda --cc 9.0 --dry-run --json";
    auto plan = [&](const std::string &flags) {
        REQUIRE_MESSAGE(run(ft + flags + " 2>/dev/null", &log) == 0, log);
        return json_line(log);
    };
    const ql_json big = plan(" --vram 8G"), small = plan(" --vram 8G --attn-score-mib 32");
    CHECK(jnum(big, "attn_chunk") == 256);
    CHECK(jstr(big, "attn_scores") == "auto: 64 MiB");
    CHECK(jnum(small, "attn_chunk") == 128);
    CHECK(jstr(small, "attn_scores") == "32 MiB");
    // twice the chunk, half the chunks: the backward's launches (3 + 7 a chunk) fall by 7 x 16 a block
    CHECK(jnum(*small.get("census"), "launches") - jnum(*big.get("census"), "launches") == 2 * 7 * 16);
    CHECK(jnum(big, "workspace") > jnum(small, "workspace"));
    CHECK(jnum(big, "total") > jnum(small, "total"));
    // a card that holds the plan with the default chunks but not with the larger ones: auto keeps
    // the default and says why; nothing else changes for their sake
    const std::string tight = std::to_string((long long)(jnum(small, "total") + jnum(big, "total")) / 2) + "B";
    const ql_json mid = plan(" --vram " + tight);
    CHECK(jnum(mid, "attn_chunk") == 128);
    CHECK(has(jstr(mid, "attn_scores"), "auto: 32 MiB ("));
    CHECK(has(jstr(mid, "attn_scores"), "over the limit with 64)"));
    CHECK(jnum(mid, "total") == jnum(small, "total"));
    CHECK(jstr(mid, "checkpointing") == jstr(small, "checkpointing"));
    // a short sequence: the default chunk holds every query already
    const ql_json shrt = plan(" --vram 8G --seq-len 256");
    CHECK(jnum(shrt, "attn_chunk") == 256);
    CHECK(has(jstr(shrt, "attn_scores"), "auto: 32 MiB (twice as much would not make larger chunks)"));
    // the table says it
    REQUIRE_MESSAGE(run(ft.substr(0, ft.size() - 7) + " --vram 8G", &log) == 0, log);
    CHECK_MESSAGE(has(log, "attention's backward products: chunks of 256 queries (--attn-score-mib auto: 64 MiB)"), log);
    CHECK_MESSAGE(has(log, "attention's backward: products (auto: on the card the faster of the two, timed at the start; planned here as products)"), log);
    // --attn-backward: a plan without the card plans auto as the products; the fused kernels given
    // take no score chunks and less workspace (3 launches a backward against 2 + 7 a chunk: k and v
    // read in place at micro-batch 1); products given are auto's plan
    CHECK(has(jstr(big, "attn_backward"), "products (auto: "));
    const ql_json fused = plan(" --vram 8G --attn-backward fused"), prod = plan(" --vram 8G --attn-backward products");
    CHECK(jstr(fused, "attn_backward") == "fused kernels (--attn-backward fused)");
    CHECK(jstr(prod, "attn_backward") == "products (--attn-backward products)");
    CHECK(jnum(prod, "total") == jnum(big, "total"));
    CHECK(jnum(*prod.get("census"), "launches") == jnum(*big.get("census"), "launches"));
    CHECK(jnum(fused, "workspace") < jnum(big, "workspace"));
    CHECK(jnum(*big.get("census"), "launches") - jnum(*fused.get("census"), "launches") == 2 * (2 + 7 * 16 - 3));
    REQUIRE_MESSAGE(run(ft.substr(0, ft.size() - 7) + " --vram 8G --attn-backward fused", &log) == 0, log);
    CHECK_MESSAGE(has(log, "attention's backward: fused kernels (--attn-backward fused)"), log);
    CHECK_MESSAGE(!has(log, "attention's backward products: chunks"), log);
    // QLORA_CUDA_FA sets the process's mode: auto keeps it and says so
    REQUIRE_MESSAGE(run("QLORA_CUDA_FA=fused " + ft + " --vram 8G 2>/dev/null", &log) == 0, log);
    const ql_json env = json_line(log);
    CHECK(jstr(env, "attn_backward") == "fused kernels (auto: the process's mode as set by QLORA_CUDA_FA, ql_cuda_fa_set_mode or an earlier run's flag)");
    CHECK(jnum(*env.get("census"), "launches") == jnum(*fused.get("census"), "launches"));
    // an f32 compute type: the fused kernels do not take it, whatever is given
    const ql_json f32 = plan(" --vram 8G --precision fp32 --attn-backward fused");
    CHECK(has(jstr(f32, "attn_backward"), "products (--attn-backward fused: the fused kernels take a bf16 compute type"));
}

TEST_CASE("finetune --precision: fp16's scale and skips in the progress line and metrics (valid JSON); auto by the CPU" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string base = d.path + "/m.gguf", data = d.path + "/qa.jsonl";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 64 --layers 2 --heads 2 --ff 96 --type nf4", &log) == 0);
    write_qa_jsonl(data, 8);
    const std::string ft = "./finetune -m " + base + " -d " + data + " -b 2 --seq-len 32 --max-steps 4 --overwrite";
    // a scale no f16 gradient survives: every step skipped, the scale halved each time
    REQUIRE(run(ft + " -o " + d.path + "/h --precision fp16 --loss-scale-init 1e18", &log) == 0);
    CHECK_MESSAGE(has(log, "precision fp16; loss scale 1e+18, x2 after 2000 clean steps, x0.5"), log);
    CHECK_MESSAGE(has(log, "scale 1e+18 SKIPPED (1 skipped)"), log);
    const auto ml = metric_lines(d.path + "/h/metrics.jsonl");
    REQUIRE(ml.size() >= 4);
    double want = 1e18;
    for (size_t i = ml.size() - 4; i < ml.size(); i++) {
        CAPTURE(ml[i].second);
        ql_json j;
        std::string why;
        REQUIRE_MESSAGE(ql_json_parse(ml[i].second, QL_JSON_LINE, &j, &why), why);  // no bare inf or nan
        CHECK(j.get("skipped")->kind == ql_json::BOOL);
        CHECK(j.get("skipped")->b);
        CHECK(j.get("grad_norm")->kind == ql_json::NUL);
        CHECK(jnum(j, "loss_scale") == doctest::Approx(want).epsilon(1e-6));
        want *= 0.5;
    }
    CHECK(metric(ml.back().second, "skipped_steps") == 4);
    // the default scale on this model: no skips, and bf16/fp32 lines carry no scaler fields
    REQUIRE(run(ft + " -o " + d.path + "/f --precision fp16", &log) == 0);
    CHECK_MESSAGE(has(log, "scale 65536 (0 skipped)"), log);
    CHECK(metric(metric_lines(d.path + "/f/metrics.jsonl").back().second, "skipped_steps") == 0);
    REQUIRE(run(ft + " -o " + d.path + "/b --precision bf16", &log) == 0);
    CHECK_MESSAGE(has(log, "finetune: precision bf16\n"), log);
    CHECK(!has(read_file(d.path + "/b/metrics.jsonl"), "loss_scale"));
    REQUIRE(run(ft + " -o " + d.path + "/a --precision auto", &log) == 0);
    // (which one depends on how ./finetune was built - make test-portable runs a portable test
    // binary against natively built tools - and on the CPU; the rule itself: test_trainer)
    const bool native = has(log, "finetune: precision bf16 (auto: this CPU multiplies bf16 natively, on AMX tiles)") ||
                        has(log, "finetune: precision bf16 (auto: this CPU multiplies bf16 natively, on AVX512-BF16 pair dot products)");
    CHECK_MESSAGE((native || has(log, "finetune: precision fp32 (auto: this CPU has no native bf16 multiply")), log);
}

// Every tool's error exits, as a user meets them: exit 1 or 2 with the tool's one-line message,
// and nothing else. make test-sanitize runs this case again with the tools built under ASan
// (QL_TOOLS=build/san/tools): a leak on an error path makes LeakSanitizer's report and exit 23.
TEST_CASE("tools: error exits - one line, the right code, nothing leaked" * needs_tools("make-model finetune")) {
    const char *dir = getenv("QL_TOOLS");
    const std::string T = std::string(dir ? dir : ".") + "/";
    tmpdir d;
    const std::string base = d.path + "/base.gguf", data = d.path + "/qa.jsonl", junk = d.path + "/junk.bin",
                      bad = d.path + "/bad.jsonl", run_dir = d.path + "/run";
    std::string log;
    REQUIRE(run("./make-model -o " + base + " --dim 32 --layers 1 --heads 2 --ff 64 --seed 3", &log) == 0);
    write_qa_jsonl(data, 6);
    write_file(junk, "hello, not a GGUF\n");
    write_file(bad, "{\"text\": 5}\n");
    REQUIRE_MESSAGE(run("./finetune -m " + base + " -d " + data + " -o " + run_dir + " --max-steps 2 -b 2 --seq-len 24 -t 1 --lr 1e-3",
                        &log) == 0, log);
    const std::string adapter = run_dir + "/adapter.gguf";
    struct bad_run {
        std::string cmd;
        int rc;
        const char *says;  // in the one line
        bool one_line = true;  // (a plan that does not fit is printed whole, with advice)
    };
    const std::vector<bad_run> runs = {
        {"finetune", 2, "are required"},
        {"finetune -m " + d.path + "/none.gguf -d " + data, 1, "cannot open"},
        {"finetune -m " + junk + " -d " + data, 1, "not a GGUF file"},
        {"finetune -m " + base + " -d " + d.path + "/none.jsonl -o " + d.path + "/o1", 1, "none.jsonl"},
        {"finetune -m " + base + " -d " + bad + " -o " + d.path + "/o2", 1, "bad.jsonl"},
        {"finetune -m " + base + " -d " + data + " --val-data " + bad + " -o " + d.path + "/o3", 1, "bad.jsonl"},
        {"finetune -m " + base + " -d " + data + " --mem-limit 1M -o " + d.path + "/o4", 1, "does not fit", false},
        {"finetune -m " + adapter + " -d " + data + " -o " + d.path + "/o5", 1, "a LoRA adapter, not a model"},
        {"finetune --resume " + d.path + "/none", 2, "none: no such directory"},
        {"finetune --resume " + run_dir + " --lr 5", 2, "a resumed run keeps its settings"},
        {"finetune --resume " + run_dir + " --lora-r 4", 1, "another run: --lora-r was 16, now 4"},
        {"generate -m " + d.path + "/none.gguf -p hi", 1, "cannot open"},
        {"generate -m " + base + " --lora " + d.path + "/none.gguf -p hi", 1, "none.gguf"},
        {"generate -m " + base + " --lora " + junk + " -p hi", 1, "junk.bin"},
        {"generate -m " + base + " -p hi -c 2", 1, "the prompt has"},
        {"perplexity -m " + base + " -f " + d.path, 1, "Is a directory"},
        {"perplexity -m " + base + " -f " + data + " --lora " + junk, 1, "junk.bin"},
        {"quantize " + adapter + " " + d.path + "/q.gguf nf4", 1, "a LoRA adapter, not a model"},
        {"quantize " + base + " " + d.path + "/q.gguf zzz", 2, "unknown target type"},
        {"make-model -o " + d.path + "/no/such/dir/m.gguf --dim 32 --layers 1 --heads 2 --ff 64", 1, "m.gguf"},
        {"convert tiktoken " + junk + " --pre llama3 -o " + d.path + "/v.gguf", 1, "junk.bin"},
        {"tokenize -m " + junk + " -p hi", 1, "not a GGUF file"},
        {"convert hf " + d.path + " -o " + d.path + "/h.gguf", 1, "config.json"},
    };
    for (const bad_run &b : runs) {
        const std::string name = b.cmd.substr(0, b.cmd.find(' '));
        if (!exists(T + name)) continue;
        CAPTURE(b.cmd);
        const int rc = run(T + b.cmd, &log);
        CHECK_MESSAGE(rc == b.rc, log);
        CHECK_MESSAGE(log.find(name + ": ") == 0, log);
        CHECK_MESSAGE(log.find(b.says) != std::string::npos, log);
        CHECK_MESSAGE(log.find("Sanitizer") == std::string::npos, log);
        if (b.one_line) CHECK_MESSAGE(std::count(log.begin(), log.end(), '\n') <= 2, log);  // one line (and a usage hint at most)
    }
}

// A logits file of tests/reference/hf_golden.py / hf5_golden.py: n_ids, vocab, the ids, then per
// model its name and the logits transformers computed for the ids [n_ids, vocab]
struct hf_logits {
    uint32_t T = 0, V = 0;
    std::vector<int32_t> ids;
    std::vector<std::pair<std::string, std::vector<float>>> models;
};
static hf_logits read_hf_logits(const std::string &path) {
    const std::vector<uint8_t> g = read_file_bytes(path);
    hf_logits h;
    REQUIRE(g.size() > 8);
    memcpy(&h.T, g.data(), 4);
    memcpy(&h.V, g.data() + 4, 4);
    h.ids.resize(h.T);
    memcpy(h.ids.data(), g.data() + 8, (size_t)h.T * 4);
    for (size_t at = 8 + (size_t)h.T * 4; at < g.size();) {
        uint32_t len = 0;
        memcpy(&len, g.data() + at, 4);
        const std::string name((const char *)g.data() + at + 4, len);
        at += 4 + len;
        std::vector<float> want((size_t)h.T * h.V);
        REQUIRE(at + want.size() * 4 <= g.size());
        memcpy(want.data(), g.data() + at, want.size() * 4);
        at += want.size() * 4;
        h.models.push_back({name, want});
    }
    return h;
}

// max |got - want|, and max |want| in *scale
static double max_diff(const std::vector<float> &got, const std::vector<float> &want, double *scale) {
    double worst = 0;
    *scale = 0;
    for (size_t i = 0; i < got.size(); i++) {
        worst = std::max(worst, (double)std::fabs(got[i] - want[i]));
        *scale = std::max(*scale, (double)std::fabs(want[i]));
    }
    return worst;
}

// ./convert hf against the real transformers: tests/golden/hf/ holds three checkpoints saved by
// save_pretrained (tests/reference/hf_golden.py: a Llama with GQA, an untied head and Llama 3.1
// rope scaling; a Qwen2 with biases and a tied head in two shards; a Mistral) and the logits
// transformers computes for them. Converted, loaded and run here, ours must equal them to 1e-4.
TEST_CASE("convert hf: Llama, Qwen2 (sharded), Mistral from save_pretrained give transformers' logits; the tokenizer loads" * needs_tools("convert")) {
    const std::string dir = tests_dir() + "golden/hf/";
    const hf_logits g = read_hf_logits(dir + "logits.bin");
    const uint32_t T = g.T, V = g.V;
    const std::vector<int32_t> &ids = g.ids;
    tmpdir d;
    int n = 0;
    for (const auto &model : g.models) {
        const std::string &name = model.first;  // (not a structured binding: CAPTURE's lambda takes it)
        const std::vector<float> &want = model.second;
        CAPTURE(name);
        const std::string out = d.path + "/" + name + ".gguf";
        std::string log;
        REQUIRE_MESSAGE(run("./convert hf " + dir + name + " -o " + out, &log) == 0, log);
        char err[256];
        ql_llama_file *f = ql_llama_load(out.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        CHECK(f->arch == (name == "qwen2" ? "qwen2" : "llama"));
        CHECK((f->model.output == f->model.tok_embd) == (name == "qwen2"));  // tied
        CHECK((f->model.rope_freqs != nullptr) == (name == "llama"));      // Llama 3.1's scaling
        CHECK((f->model.layers[0].bq != nullptr) == (name == "qwen2"));
        const std::vector<float> got = logits_of(f->model, ids);
        REQUIRE(got.size() == want.size());
        double scale = 0;
        const double worst = max_diff(got, want, &scale);
        MESSAGE(name, ": max |ours - transformers| = ", worst, " of max |logit| ", scale);
        CHECK(worst <= 1e-4 * scale);
        if (name == "llama") {  // a real PEFT adapter (get_peft_model + save_pretrained) on it: transformers + PEFT's logits
            std::string e;
            ql_lora_adapter *ad = ql_lora_attach_any(&f->model, f->arch.c_str(), (dir + "llama-peft").c_str(), 1.0f, &e);
            REQUIRE_MESSAGE(ad, e);
            const std::vector<uint8_t> pb = read_file_bytes(dir + "llama-peft-logits.bin");
            REQUIRE(pb.size() == want.size() * 4);
            std::vector<float> pw(want.size());
            memcpy(pw.data(), pb.data(), pb.size());
            const std::vector<float> pg = logits_of(f->model, ids);
            double pworst = 0, pscale = 0, moved = 0;
            for (size_t i = 0; i < pg.size(); i++) {
                pworst = std::max(pworst, (double)std::fabs(pg[i] - pw[i]));
                pscale = std::max(pscale, (double)std::fabs(pw[i]));
                moved = std::max(moved, (double)std::fabs(pw[i] - want[i]));
            }
            MESSAGE("llama + PEFT adapter: max |ours - transformers+PEFT| = ", pworst, " of max |logit| ", pscale, " (the adapter moves them by ",
                    moved, ")");
            CHECK(moved > 0.1 * pscale);  // the adapter matters
            CHECK(pworst <= 1e-4 * pscale);
            ql_lora_adapter_free(ad);
        }
        // the vocabulary: byte-level BPE with Llama 3's split, the special tokens from config.json
        ql_vocab *v = ql_vocab_load(f->gguf, err, sizeof(err));
        REQUIRE_MESSAGE(v, err);
        CHECK(ql_vocab_bos(v) == ids[0]);
        const std::vector<int32_t> t = ql_tokenize(v, " the", false, false);
        CHECK(t.size() == 1);  // "Ġ t" + "h e" + "Ġt he": one token
        ql_vocab_free(v);
        ql_llama_file_free(f);
        // --outtype: the block weights in another type, the same model to its rounding
        REQUIRE_MESSAGE(run("./convert hf " + dir + name + " -o " + d.path + "/q.gguf --outtype q8_0", &log) == 0, log);
        ql_llama_file *fq = ql_llama_load((d.path + "/q.gguf").c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(fq, err);
        CHECK(fq->model.layers[0].wq->type == QL_TYPE_Q8_0);
        ql_llama_file_free(fq);
        n++;
    }
    CHECK(n == 3);
    {  // a bitsandbytes 4-bit checkpoint: the NF4 codes carried over, bitsandbytes' dequantised model's logits
        std::string log;
        REQUIRE_MESSAGE(run("./convert hf " + dir + "llama-bnb4 -o " + d.path + "/bnb.gguf", &log) == 0, log);
        CHECK_MESSAGE(log.find("bitsandbytes NF4 (codes carried over)") != std::string::npos, log);
        char err[256];
        ql_llama_file *f = ql_llama_load((d.path + "/bnb.gguf").c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        const ql_llama_layer &L0 = f->model.layers[0];
        CHECK(L0.wv->type == QL_TYPE_NF4);       // double quantisation kept
        CHECK(L0.wq->type == QL_TYPE_NF4_NODQ);  // rows permuted: each block's absmax as bitsandbytes decodes it
        std::vector<ql_st_tensor> st;
        std::vector<uint8_t> storage;
        std::string why;
        REQUIRE_MESSAGE(ql_safetensors_read((dir + "llama-bnb4/model.safetensors").c_str(), &st, &storage, &why), why);
        for (const ql_st_tensor &t : st)
            if (t.name == "model.layers.0.self_attn.v_proj.weight") {
                REQUIRE(t.dtype == "U8");
                CHECK(memcmp(t.data, L0.wv->data, ql_nbytes(L0.wv)) == 0);  // bitsandbytes' packed bytes, bit for bit
            }
        const std::vector<uint8_t> lb = read_file_bytes(dir + "llama-bnb4-logits.bin");
        REQUIRE(lb.size() == (size_t)T * V * 4);
        std::vector<float> want((size_t)T * V);
        memcpy(want.data(), lb.data(), lb.size());
        const std::vector<float> got = logits_of(f->model, ids);
        double scale = 0;
        const double worst = max_diff(got, want, &scale);
        MESSAGE("bitsandbytes NF4 llama: max |ours - transformers on bitsandbytes' dequantised weights| = ", worst, " of ", scale);
        CHECK(worst <= 1e-4 * scale);
        ql_llama_file_free(f);
    }
    {  // a SentencePiece tokenizer.model (trained by the real sentencepiece): its ids, through the protobuf
        std::string log;
        REQUIRE_MESSAGE(run("./convert hf " + dir + "mistral-spm -o " + d.path + "/spm.gguf", &log) == 0, log);
        char err[256];
        ql_gguf *gg = ql_gguf_open((d.path + "/spm.gguf").c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(gg, err);
        ql_vocab *v = ql_vocab_load(gg, err, sizeof(err));
        REQUIRE_MESSAGE(v, err);
        const std::string lines = read_file(dir + "mistral-spm/ids.txt");
        int checked = 0;
        for (size_t p = 0; p < lines.size();) {
            const size_t e = lines.find('\n', p), tab = lines.find('\t', p);
            const std::string text = lines.substr(p, tab - p), want = lines.substr(tab + 1, e - tab - 1);
            const std::vector<int32_t> toks = ql_tokenize(v, text, false, false);
            std::string got;
            for (int32_t id : toks) got += (got.empty() ? "" : " ") + std::to_string(id);
            CHECK_MESSAGE(got == want, "'", text, "': ours ", got, ", sentencepiece ", want);
            checked++;
            p = e + 1;
        }
        CHECK(checked == 4);
        CHECK(ql_vocab_bos(v) == 1);
        ql_vocab_free(v);
        ql_gguf_close(gg);
    }
    // bad input: one line naming the file
    std::string log;
    CHECK(run("./convert hf " + d.path + " -o " + d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log.find("config.json: cannot open") != std::string::npos, log);
    write_file(d.path + "/config.json", "{\"architectures\": [\"GPT2LMHeadModel\"]}");
    CHECK(run("./convert hf " + d.path + " -o " + d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log.find("architecture 'GPT2LMHeadModel' is not supported") != std::string::npos, log);
    const std::string cfg = "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 32, \"intermediate_size\": 64, "
                            "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 300, ";
    write_file(d.path + "/config.json", cfg + "\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}");
    CHECK(run("./convert hf " + d.path + " -o " + d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log.find("config.json: rope scaling 'yarn' is not supported (llama3 and linear are)") != std::string::npos, log);
    write_file(d.path + "/config.json", cfg + "\"rope_scaling\": {\"type\": \"linear\"}}");
    CHECK(run("./convert hf " + d.path + " -o " + d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log.find("rope_scaling.factor must be a positive number") != std::string::npos, log);
    // each value by name: out of range or not a number is an error, not a GGUF that fails later
    const std::pair<std::string, std::string> values[] = {
        {"\"rms_norm_eps\": 0}", "rms_norm_eps is 0 (above 0, below 1)"},
        {"\"rms_norm_eps\": \"x\"}", "'rms_norm_eps' is not a number"},
        {"\"rope_theta\": 1e300}", "rope_theta is 1e+300 (above 1, at most 1e12)"},
        {"\"max_position_embeddings\": -5}", "max_position_embeddings is -5 (a size from 1 to 2^30)"},
        {"\"intermediate_size\": 0}", "intermediate_size is 0 (a size from 1 to 2^30)"},
        {"\"num_key_value_heads\": 3}", "inconsistent sizes: 4 heads of 8 (head_dim) for hidden_size 32, 3 key/value heads"},
        {"\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 0}}", "rope_scaling.factor must be a positive number for llama3"},
    };
    for (const auto &v : values) {
        CAPTURE(v.first);
        write_file(d.path + "/config.json", (v.first.find("intermediate") != std::string::npos
                                                 ? "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 32, \"num_hidden_layers\": 1, "
                                                   "\"num_attention_heads\": 4, \"vocab_size\": 300, "
                                                 : cfg) + v.first);
        CHECK(run("./convert hf " + d.path + " -o " + d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(log.find("config.json: " + v.second) != std::string::npos, log);
    }
    // a tensor whose shape is not config.json's (vocab_size 300, 270 embedding rows): refused by name
    write_file(d.path + "/config.json", cfg + "\"rms_norm_eps\": 1e-5}");
    std::vector<float> emb(270 * 32, 0.5f);
    std::string err;
    REQUIRE_MESSAGE(ql_safetensors_write((d.path + "/model.safetensors").c_str(), {{"model.embed_tokens.weight", "F32", {270, 32}, emb.data()}},
                                         {}, &err), err);
    CHECK(run("./convert hf " + d.path + " -o " + d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log.find("model.embed_tokens.weight is [270, 32], config.json makes it [300, 32]") != std::string::npos, log);
    CHECK_FALSE(exists(d.path + "/x.gguf"));
}

// The files users have today, from the newest libraries (tests/reference/hf5_golden.py, transformers
// 5.24 / bitsandbytes 0.50.2): config.json's rope_parameters (transformers 5: theta and a linear
// rope scaling together), and a real load_in_4bit + save_pretrained on bitsandbytes' CPU backend.
// Converted and run here, each gives the logits transformers computed for it.
TEST_CASE("convert hf: transformers 5 checkpoints (rope_parameters, linear rope scaling; a real load_in_4bit save) give its logits" * needs_tools("convert")) {
    const std::string dir = tests_dir() + "golden/hf/";
    const hf_logits g = read_hf_logits(dir + "hf5-logits.bin");
    tmpdir d;
    std::vector<std::string> names;
    for (const auto &model : g.models) {
        const std::string &name = model.first;  // (not a structured binding: CAPTURE's lambda takes it)
        const std::vector<float> &want = model.second;
        names.push_back(name);
        CAPTURE(name);
        const std::string out = d.path + "/" + name + ".gguf";
        std::string log;
        REQUIRE_MESSAGE(run("./convert hf " + dir + name + " -o " + out, &log) == 0, log);
        char err[256];
        ql_llama_file *f = ql_llama_load(out.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        if (name == "llama-linear") {
            CHECK_MESSAGE(log.find("linear rope scaling") != std::string::npos, log);
            CHECK(f->model.hp.rope_base == 20000.0f);  // rope_theta from rope_parameters
            REQUIRE(f->model.rope_freqs);              // the factor as every frequency's divisor
            CHECK(((const float *)f->model.rope_freqs->data)[0] == 4.0f);
        } else {
            CHECK_MESSAGE(log.find("bitsandbytes NF4 (codes carried over)") != std::string::npos, log);
            CHECK(f->model.layers[1].w_down->type == QL_TYPE_NF4);
            std::vector<ql_st_tensor> st;
            std::vector<uint8_t> storage;
            std::string why;
            REQUIRE_MESSAGE(ql_safetensors_read((dir + name + "/model.safetensors").c_str(), &st, &storage, &why), why);
            int same = 0;
            for (const ql_st_tensor &t : st)
                if (t.name == "model.layers.1.self_attn.v_proj.weight" || t.name == "model.layers.1.mlp.down_proj.weight") {
                    const ql_tensor *w = t.name.find("v_proj") != std::string::npos ? f->model.layers[1].wv : f->model.layers[1].w_down;
                    REQUIRE(t.dtype == "U8");
                    same += memcmp(t.data, w->data, ql_nbytes(w)) == 0;  // bitsandbytes' packed codes, bit for bit
                }
            CHECK(same == 2);
        }
        const std::vector<float> got = logits_of(f->model, g.ids);
        double scale = 0;
        const double worst = max_diff(got, want, &scale);
        MESSAGE(name, ": max |ours - transformers 5| = ", worst, " of max |logit| ", scale);
        CHECK(worst <= 1e-4 * scale);
        ql_llama_file_free(f);
    }
    CHECK(names == std::vector<std::string>{"llama-linear", "llama-bnb4-real"});
}

// ./quantize's llama.cpp mixes: llama-quantize's per-tensor types (8 layers: use_more_bits picks
// layers 0, 3, 6, 7), its tensor order (by layer, then name), its keys (the quantisation version
// and llama_ftype last), and the fallback for rows that are not whole 256-blocks
TEST_CASE("quantize Q4_K_M / Q4_K_S / Q8_0 / Q3_K_M / Q2_K / IQ4_XS: llama-quantize's per-tensor types, order, keys and fallbacks" * needs_tools("make-model quantize")) {
    tmpdir d;
    std::string log;
    REQUIRE(run("./make-model -o " + d.path + "/m.gguf --dim 256 --layers 8 --heads 4 --kv-heads 2 --ff 512 --seed 3", &log) == 0);
    auto types = [&](const std::string &path, std::vector<std::string> *names) {
        char err[256];
        ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(g, err);
        std::map<std::string, std::string> t;
        names->clear();
        for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
            t[ql_gguf_tensor_name(g, i)] = ql_type_name(ql_gguf_tensor_type(g, i));
            names->push_back(ql_gguf_tensor_name(g, i));
        }
        const int64_t n = ql_gguf_n_kv(g);
        CHECK(std::string(ql_gguf_kv_key(g, n - 2)) == "general.quantization_version");
        CHECK(std::string(ql_gguf_kv_key(g, n - 1)) == "general.file_type");
        CHECK(ql_gguf_find_kv(g, "qlora.quantize.type") < 0);
        ql_gguf_close(g);
        return t;
    };
    std::vector<std::string> names;
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/m.gguf " + d.path + "/km.gguf Q4_K_M", &log) == 0, log);
    auto t = types(d.path + "/km.gguf", &names);
    CHECK(t["output.weight"] == "q6_K");
    CHECK(t["token_embd.weight"] == "q4_K");
    CHECK(t["output_norm.weight"] == "f32");
    for (int l = 0; l < 8; l++) {
        const std::string b = "blk." + std::to_string(l) + ".", more = (l == 0 || l == 3 || l == 6 || l == 7) ? "q6_K" : "q4_K";
        CAPTURE(l);
        CHECK(t[b + "attn_v.weight"] == more);
        CHECK(t[b + "ffn_down.weight"] == more);
        CHECK(t[b + "attn_q.weight"] == "q4_K");
        CHECK(t[b + "ffn_up.weight"] == "q4_K");
        CHECK(t[b + "attn_norm.weight"] == "f32");
    }
    CHECK(names.front() == "output.weight");  // outside the blocks first, by name; then blk.0's by name
    CHECK(std::find(names.begin(), names.end(), "blk.0.attn_k.weight") < std::find(names.begin(), names.end(), "blk.1.attn_k.weight"));
    CHECK(std::find(names.begin(), names.end(), "blk.0.attn_k.weight") < std::find(names.begin(), names.end(), "blk.0.attn_norm.weight"));
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/m.gguf " + d.path + "/ks.gguf Q4_K_S", &log) == 0, log);
    t = types(d.path + "/ks.gguf", &names);
    for (int l = 0; l < 8; l++) {
        const std::string b = "blk." + std::to_string(l) + ".";
        CHECK(t[b + "attn_v.weight"] == (l < 4 ? "q5_K" : "q4_K"));
        CHECK(t[b + "ffn_down.weight"] == (l < 1 ? "q5_K" : "q4_K"));
    }
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/m.gguf " + d.path + "/q8.gguf Q8_0", &log) == 0, log);
    t = types(d.path + "/q8.gguf", &names);
    CHECK(t["output.weight"] == "q8_0");  // the head stays Q8_0 in a Q8_0 mix
    CHECK(t["blk.3.ffn_down.weight"] == "q8_0");
    // rows of 96 are not whole 256-blocks: q4_K falls back to q5_0, q6_K to q8_0
    REQUIRE(run("./make-model -o " + d.path + "/s.gguf --dim 96 --layers 2 --heads 2 --ff 192 --seed 3", &log) == 0);
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/s.gguf " + d.path + "/sm.gguf Q4_K_M", &log) == 0, log);
    t = types(d.path + "/sm.gguf", &names);
    CHECK(t["blk.1.attn_q.weight"] == "q5_0");
    CHECK(t["blk.0.attn_v.weight"] == "q5_0");  // 2 layers: use_more_bits picks layer 1 only
    CHECK(t["blk.1.attn_v.weight"] == "q8_0");
    CHECK(t["output.weight"] == "q8_0");
    // the low-bit mixes (n_gqa 2: Q2_K's attn_v is Q3_K, IQ4_XS's is not raised)
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/m.gguf " + d.path + "/k3.gguf Q3_K_M", &log) == 0, log);
    t = types(d.path + "/k3.gguf", &names);
    CHECK(t["output.weight"] == "q6_K");
    CHECK(t["token_embd.weight"] == "q3_K");
    for (int l = 0; l < 8; l++) {
        const std::string b = "blk." + std::to_string(l) + ".";
        CAPTURE(l);
        CHECK(t[b + "attn_v.weight"] == (l < 2 ? "q5_K" : "q4_K"));
        CHECK(t[b + "ffn_down.weight"] == "q4_K");  // (Q5_K in the first sixteenth: none of 8 layers)
        CHECK(t[b + "attn_output.weight"] == "q4_K");
        CHECK(t[b + "attn_q.weight"] == "q3_K");
        CHECK(t[b + "ffn_gate.weight"] == "q3_K");
    }
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/m.gguf " + d.path + "/k2.gguf Q2_K", &log) == 0, log);
    t = types(d.path + "/k2.gguf", &names);
    CHECK(t["token_embd.weight"] == "q2_K");
    CHECK(t["blk.5.attn_v.weight"] == "q3_K");
    CHECK(t["blk.5.ffn_down.weight"] == "q3_K");
    CHECK(t["blk.5.attn_output.weight"] == "q3_K");
    CHECK(t["blk.5.attn_k.weight"] == "q2_K");
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/m.gguf " + d.path + "/xs.gguf IQ4_XS", &log) == 0, log);
    t = types(d.path + "/xs.gguf", &names);
    CHECK(t["blk.0.ffn_down.weight"] == "q5_K");  // the first eighth
    CHECK(t["blk.1.ffn_down.weight"] == "iq4_xs");
    CHECK(t["blk.0.attn_v.weight"] == "iq4_xs");
    CHECK(t["output.weight"] == "q6_K");
    // and their fallbacks on rows of 96: q2_K / q3_K -> q4_0, iq4_xs -> iq4_nl; the head q8_0
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/s.gguf " + d.path + "/s2.gguf Q2_K", &log) == 0, log);
    t = types(d.path + "/s2.gguf", &names);
    CHECK(t["blk.1.attn_q.weight"] == "q4_0");
    CHECK(t["blk.1.attn_v.weight"] == "q4_0");
    CHECK(t["output.weight"] == "q8_0");
    REQUIRE_MESSAGE(run("./quantize " + d.path + "/s.gguf " + d.path + "/sx.gguf IQ4_XS", &log) == 0, log);
    t = types(d.path + "/sx.gguf", &names);
    CHECK(t["blk.1.attn_q.weight"] == "iq4_nl");
    CHECK(t["blk.1.ffn_down.weight"] == "iq4_nl");
    // every tensor of the written files is its f32 source within its type's resolution (relative
    // RMS error), and a file loads and runs
    auto rel_rms = [&](const std::string &path, std::map<std::string, double> *by_type) {
        char err[256];
        ql_gguf *q = ql_gguf_open(path.c_str(), err, sizeof(err)), *r = ql_gguf_open((d.path + "/m.gguf").c_str(), err, sizeof(err));
        REQUIRE((q && r));
        for (int64_t i = 0; i < ql_gguf_n_tensors(q); i++) {
            const int64_t k = ql_gguf_find_tensor(r, ql_gguf_tensor_name(q, i));
            REQUIRE(k >= 0);
            int64_t ne[4];
            ql_gguf_tensor_ne(q, i, ne);
            const int64_t rows = ne[1] * ne[2] * ne[3], n = rows * ne[0];
            std::vector<float> a((size_t)n), b((size_t)n);
            REQUIRE(ql_dequantize(ql_gguf_tensor_type(q, i), ql_gguf_tensor_data(q, i), rows, ne[0], a.data()) == QL_OK);
            REQUIRE(ql_dequantize(ql_gguf_tensor_type(r, k), ql_gguf_tensor_data(r, k), rows, ne[0], b.data()) == QL_OK);
            double e2 = 0, x2 = 0;
            for (int64_t j = 0; j < n; j++) e2 += (double)(a[j] - b[j]) * (a[j] - b[j]), x2 += (double)b[j] * b[j];
            double &worst = (*by_type)[ql_type_name(ql_gguf_tensor_type(q, i))];
            worst = std::max(worst, std::sqrt(e2 / x2));
        }
        ql_gguf_close(q);
        ql_gguf_close(r);
    };
    std::map<std::string, double> err_of;
    for (const char *f : {"/k3.gguf", "/k2.gguf", "/xs.gguf", "/km.gguf"}) rel_rms(d.path + f, &err_of);
    const std::map<std::string, double> bound = {{"f32", 0},       {"q2_K", 0.45},  {"q3_K", 0.25}, {"q4_K", 0.12},
                                                 {"q5_K", 0.06},   {"q6_K", 0.03},  {"iq4_xs", 0.12}};
    for (const auto &e : err_of) {
        CAPTURE(e.first);
        CAPTURE(e.second);
        REQUIRE(bound.count(e.first));
        CHECK(e.second <= bound.at(e.first));
        CHECK(e.second >= bound.at(e.first) / 4);  // (and it was quantised: f32 has error 0)
    }
    write_file(d.path + "/t.txt", "The lamp keeper climbs the stair at dusk; the ships come home. One light, one night.");
    CHECK_MESSAGE(run("./perplexity -m " + d.path + "/k2.gguf -f " + d.path + "/t.txt -c 64 --json -t 1", &log) == 0, log);
    CHECK(run("./quantize " + d.path + "/m.gguf " + d.path + "/x.gguf Q4_K_M --include-output", &log) == 2);
    CHECK_MESSAGE(log.find("decides every tensor itself") != std::string::npos, log);
}

TEST_CASE("generate --exact: f32 activations in the quantised weights' multiplies, and the same text for any -t either way" *
          needs_tools("make-model generate")) {
    tmpdir d;
    const std::string m = d.path + "/m.gguf";
    std::string log, one, three;
    REQUIRE(run("./make-model -o " + m + " --dim 64 --layers 2 --heads 2 --ff 128 --type q4_0", &log) == 0);
    for (const char *mode : {"", " --exact"}) {
        CAPTURE(std::string(mode));
        REQUIRE_MESSAGE(run("./generate -m " + m + " -p hi -n 12 --temp 0 -t 1" + mode, &one) == 0, one);
        REQUIRE_MESSAGE(run("./generate -m " + m + " -p hi -n 12 --temp 0 -t 3" + mode, &three) == 0, three);
        CHECK(text_of(one) == text_of(three));
    }
    CHECK(run("./generate --help", &log) == 0);
    CHECK(log.find("[--exact]") != std::string::npos);
}

TEST_CASE("finetune --device cuda:0,cuda:1: a plan line per card on a machine without them; bad lists refused, naming the flag" *
          needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string gguf = d.path + "/m.gguf", data = d.path + "/d.jsonl";
    std::string log;
    REQUIRE_MESSAGE(run("./make-model -o " + gguf + " --dim 128 --layers 4 --heads 4 --ff 256 --vocab 512 --type nf4", &log) == 0, log);
    FILE *f = fopen(data.c_str(), "wb");
    REQUIRE(f);
    for (int i = 0; i < 8; i++) fputs("{\"text\": \"a model split over two cards plans each card on its own\"}\n", f);
    fclose(f);
    const std::string ft = "./finetune -m " + gguf + " -d " + data + " --dry-run --cc 8.9 --seq-len 64";
    REQUIRE_MESSAGE(run(ft + " --device cuda:0,cuda:1 --vram 2G,1G", &log) == 0, log);
    CHECK_MESSAGE(log.find("card 0 cuda:0") != std::string::npos, log);
    CHECK_MESSAGE(log.find("card 1 cuda:1") != std::string::npos, log);
    CHECK_MESSAGE(log.find("balanced by memory") != std::string::npos, log);
    CHECK_MESSAGE(log.find("+ embedding") != std::string::npos, log);
    CHECK_MESSAGE(log.find("+ head") != std::string::npos, log);
    CHECK_MESSAGE(log.find("(fits)") != std::string::npos, log);
    REQUIRE_MESSAGE(run(ft + " --device cuda:0,cuda:1,cuda:2 --vram 2G --json 2>/dev/null", &log) == 0, log);
    CHECK_MESSAGE(log.find("\"card\": \"cuda:2\"") != std::string::npos, log);
    CHECK_MESSAGE(log.find("\"cards\": 3, \"fits\": true") != std::string::npos, log);
    // one line each, exit 2 for the flags, 1 for the model's limit
    const struct {
        const char *flags, *says;
        int rc;
    } bad[] = {{"--device cuda:0,cuda:0 --vram 2G", "--device cuda:0,cuda:0: cuda:0 given twice", 2},
               {"--device cuda,cuda:0 --vram 2G", "given twice", 2},  // ("cuda" is cuda:0)
               {"--device cuda:0,cuda:1 --vram 2G,2G,2G", "--vram: 3 sizes for 2 cards", 2},
               {"--device cuda:0 --vram 2G,2G", "--vram: 2 sizes for one card", 2},
               {"--device cuda:0,cpu", "--device cuda:0,cpu: a model split over cards takes CUDA cards", 2},
               {"--device cuda:0,cuda:1,cuda:2,cuda:3,cuda:4 --vram 2G", "5 cards for a model of 4 blocks", 1}};
    for (const auto &b : bad) {
        CAPTURE(std::string(b.flags));
        std::string out;
        CHECK(run("(" + ft + " " + b.flags + " >/dev/null 2>" + d.path + "/err)", &out) == b.rc);
        log = read_file(d.path + "/err");
        CHECK_MESSAGE(log.find(b.says) != std::string::npos, log);
        CHECK_MESSAGE(std::count(log.begin(), log.end(), '\n') == 1, log);
    }
}
