// generate says why it stopped (an end-of-generation token, by name; -n; the context's end) and
// stops on every token the vocabulary marks as one, as llama.cpp does; its output ends with a
// newline. perplexity --json prints 9 significant digits. tokenize --data shows finetune's
// rendering of a JSONL line: ids, pieces and the loss mask.
#include <doctest/doctest.h>

#include "../models/data.h"
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "util.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

// A model whose greedy next token is known: every layer adds nothing (attn_output and ffn_down
// are 0), so the last hidden state is the current token's embedding. Every token's embedding is
// e0 = (1, ..., 1) but `a_id`'s, e1 = (1, ..., 1, -1, ..., -1); output row a_id is e0 and row
// `after_a` is e1 (the others 0). So after any token but a_id comes a_id, and after a_id comes
// after_a: "x" -> "a" -> after_a.
// `texts` renames tokens (id -> text, token type), `keys` sets u32 keys (eot/eom ids).
struct stop_model {
    std::string path;
    int32_t a_id = -1;
};
stop_model make_stop_model(const tmpdir &d, const char *name, int32_t after_a,
                           const std::map<int32_t, std::pair<std::string, int>> &texts,
                           const std::map<std::string, uint32_t> &keys = {}) {
    stop_model sm;
    const std::string base = d.file(std::string(name) + ".base.gguf");
    std::string log;
    REQUIRE_MESSAGE(run("./make-model -o " + base + " --dim 32 --layers 1 --heads 2 --ff 32 --vocab 400 --ctx 64", &log) == 0, log);
    char err[512];
    ql_gguf *g = ql_gguf_open(base.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    ql_gguf_writer *w = ql_gguf_writer_new();
    for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) ql_gguf_copy_kv(w, g, i);
    // the vocabulary, renamed where asked
    const int64_t kt = ql_gguf_find_kv(g, "tokenizer.ggml.tokens"), ky = ql_gguf_find_kv(g, "tokenizer.ggml.token_type");
    REQUIRE((kt >= 0 && ky >= 0));
    const uint64_t n_vocab = ql_gguf_arr_n(g, kt);
    std::vector<std::string> tok;
    std::vector<int32_t> type((const int32_t *)ql_gguf_arr_data(g, ky), (const int32_t *)ql_gguf_arr_data(g, ky) + n_vocab);
    for (uint64_t j = 0; j < n_vocab; j++) {
        size_t len;
        const char *s = ql_gguf_arr_str(g, kt, j, &len);
        tok.emplace_back(s, len);
    }
    for (const auto &t : texts) {
        tok[(size_t)t.first] = t.second.first;
        type[(size_t)t.first] = t.second.second;
    }
    std::vector<const char *> ptr;
    for (const std::string &t : tok) ptr.push_back(t.c_str());
    ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", ptr.data(), ptr.size());
    ql_gguf_set_arr(w, "tokenizer.ggml.token_type", QL_GGUF_I32, type.data(), type.size());
    for (const auto &k : keys) ql_gguf_set_u32(w, k.first.c_str(), k.second);
    for (int32_t j = 0; j < (int32_t)n_vocab; j++)
        if (tok[(size_t)j] == "a") sm.a_id = j;
    REQUIRE(sm.a_id >= 0);
    // the weights
    std::vector<std::vector<float>> keep;
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        const std::string nm = ql_gguf_tensor_name(g, i);
        REQUIRE(ql_gguf_tensor_type(g, i) == QL_TYPE_F32);
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(g, i, ne);
        const size_t n = ql_gguf_tensor_size(g, i) / 4;
        const float *src = (const float *)ql_gguf_tensor_data(g, i);
        keep.emplace_back(src, src + n);
        std::vector<float> &x = keep.back();
        const int64_t dim = ne[0];
        auto row = [&](int64_t r, bool e1) {
            for (int64_t c = 0; c < dim; c++) x[(size_t)(r * dim + c)] = e1 && c >= dim / 2 ? -1.0f : 1.0f;
        };
        if (nm == "token_embd.weight") {
            for (int64_t r = 0; r < ne[1]; r++) row(r, r == sm.a_id);
        } else if (nm == "output.weight") {
            std::fill(x.begin(), x.end(), 0.0f);
            row(sm.a_id, false);
            row(after_a, true);
        } else if (nm.find("attn_output") != std::string::npos || nm.find("ffn_down") != std::string::npos) {
            std::fill(x.begin(), x.end(), 0.0f);
        }
        REQUIRE(ql_gguf_add_tensor(w, nm.c_str(), QL_TYPE_F32, nd, ne, x.data(), x.size() * 4) == QL_OK);
    }
    sm.path = d.file(std::string(name) + ".gguf");
    REQUIRE_MESSAGE(ql_gguf_write(w, sm.path.c_str(), err, sizeof(err)) == QL_OK, err);
    ql_gguf_writer_free(w);
    ql_gguf_close(g);
    return sm;
}

// generate's stdout and stderr apart
struct gen_out {
    int rc;
    std::string out, err;
};
gen_out generate(const tmpdir &d, const std::string &args) {
    gen_out g;
    const std::string ef = d.file("gen.err");
    g.rc = run("(./generate " + args + " 2>" + ef + ")", &g.out);
    g.err = read_file(ef);
    return g;
}

}  // namespace

TEST_CASE("generate: stops at every end-of-generation token the vocabulary marks, and names it" * needs_tools("make-model generate")) {
    tmpdir d;
    const int control = QL_TOKEN_CONTROL;
    struct stop_case {
        const char *name;
        std::map<int32_t, std::pair<std::string, int>> texts;
        std::map<std::string, uint32_t> keys;
        int32_t stop_id;
        std::string stop_text;
    };
    // the make-model vocabulary: <unk> <s> </s>, 256 bytes, characters; ids 390.. are fillers
    const std::vector<stop_case> cases = {
        {"eos", {}, {}, 2, "</s>"},
        {"eot_text", {{390, {"<|eot_id|>", control}}}, {}, 390, "<|eot_id|>"},
        {"end_of_text", {{391, {"<|end_of_text|>", control}}}, {}, 391, "<|end_of_text|>"},
        {"im_end", {{392, {"<|im_end|>", control}}}, {}, 392, "<|im_end|>"},
        {"endoftext", {{393, {"<|endoftext|>", control}}}, {}, 393, "<|endoftext|>"},
        {"end_of_turn", {{394, {"<end_of_turn>", control}}}, {}, 394, "<end_of_turn>"},
        {"eom_text", {{395, {"<|eom_id|>", control}}}, {}, 395, "<|eom_id|>"},
        // ids from the file's keys, whatever their text
        {"eot_key", {{396, {"<my_turn_end>", control}}}, {{"tokenizer.ggml.eot_token_id", 396}}, 396, "<my_turn_end>"},
        {"eom_key", {{397, {"<my_msg_end>", control}}}, {{"tokenizer.ggml.eom_token_id", 397}}, 397, "<my_msg_end>"},
        // Llama 3 marks both: <|end_of_text|> as eos and <|eot_id|> as eot; either stops
        {"llama3_eot", {{398, {"<|eot_id|>", control}}, {399, {"<|end_of_text|>", control}}},
         {{"tokenizer.ggml.eos_token_id", 399}, {"tokenizer.ggml.eot_token_id", 398}}, 398, "<|eot_id|>"},
    };
    for (const stop_case &c : cases) {
        CAPTURE(c.name);
        const stop_model m = make_stop_model(d, c.name, c.stop_id, c.texts, c.keys);
        const gen_out g = generate(d, "-m " + m.path + " -p x -n 10 --temp 0");
        REQUIRE_MESSAGE(g.rc == 0, g.err);
        CHECK(g.out == "xa\n");  // one token, then the end: the output ends with a newline
        CHECK_MESSAGE(has(g.err, "generate: stopped at the end-of-generation token " + c.stop_text + " (id " +
                                     std::to_string(c.stop_id) + ") after 1 token\n"),
                      g.err);
    }
}

TEST_CASE("generate: a control token that is no end of generation does not stop it; -n is named" * needs_tools("make-model generate")) {
    tmpdir d;
    const stop_model m = make_stop_model(d, "other", 390, {{390, {"<|im_start|>", QL_TOKEN_CONTROL}}});
    const gen_out g = generate(d, "-m " + m.path + " -p x -n 4 --temp 0");
    REQUIRE_MESSAGE(g.rc == 0, g.err);
    CHECK(g.out == "xaa\n");  // a, <|im_start|> (a control token prints nothing), a, <|im_start|>
    CHECK_MESSAGE(has(g.err, "generate: stopped after -n 4 tokens\n"), g.err);
    CHECK(!has(g.err, "end-of-generation"));
    // one line says why; the statistics line stays
    CHECK(has(g.err, "tokens/s"));
    // the context's end (the model's 64 tokens) cuts -n short: said as before
    const gen_out c = generate(d, "-m " + m.path + " -p x -n 100 --temp 0");
    REQUIRE(c.rc == 0);
    CHECK_MESSAGE(has(c.err, "generate: stopped at the end of the context (64 tokens: the model's training context) before -n 100"),
                  c.err);
    CHECK(c.out.back() == '\n');
    // -n 0: the prompt alone, on its own line
    const gen_out z = generate(d, "-m " + m.path + " -p x -n 0 --temp 0");
    CHECK(z.out == "x\n");
    CHECK_MESSAGE(has(z.err, "generate: stopped after -n 0 tokens\n"), z.err);
}

TEST_CASE("generate: output that ends in a newline gets no second one" * needs_tools("make-model generate")) {
    tmpdir d;
    // a prompt ending in a newline, and nothing after it: printed as it is
    const stop_model m = make_stop_model(d, "nl", 2, {});
    const gen_out g = generate(d, "-m " + m.path + " -p 'x\n' -n 0 --temp 0");
    CHECK(g.out == "x\n");
}

TEST_CASE("perplexity --json: nll and ppl with 9 significant digits" * needs_tools("make-model perplexity")) {
    tmpdir d;
    const std::string m = d.file("m.gguf"), txt = d.file("t.txt");
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 32 --layers 1 --heads 2 --ff 32 --vocab 400 --ctx 64", &log) == 0);
    write_file(txt, "the quick brown fox jumps over the lazy dog, and then some more words to read.");
    REQUIRE_MESSAGE(run("./perplexity -m " + m + " -f " + txt + " -c 32 --json 2>/dev/null", &log) == 0, log);
    // {"nll": 5.70378971, "ppl": 299.766541, "tokens": 80}
    auto digits = [](const std::string &s, const char *key) {
        const size_t k = s.find(std::string("\"") + key + "\": ");
        REQUIRE(k != std::string::npos);
        const size_t b = k + strlen(key) + 4, e = s.find_first_of(",}", b);
        const std::string num = s.substr(b, e - b);
        int n = 0;
        bool lead = true;
        for (char ch : num) {
            if (ch == 'e') break;
            if (ch < '0' || ch > '9') continue;
            if (lead && ch == '0') continue;
            lead = false;
            n++;
        }
        return std::make_pair(n, std::strtod(num.c_str(), nullptr));
    };
    const auto nll = digits(log, "nll"), ppl = digits(log, "ppl");
    // 9 significant digits, of which %g drops trailing zeros: 8 or 9 seen (6 decimals gave 7 for this nll)
    CHECK_MESSAGE(nll.first >= 8, log);
    CHECK_MESSAGE(ppl.first >= 8, log);
    CHECK(nll.first <= 9);
    CHECK(ppl.first <= 9);
    CHECK(std::abs(std::exp(nll.second) - ppl.second) < 1e-6 * ppl.second);
}

TEST_CASE("tokenize --data: a JSONL line's ids, pieces and loss mask, as finetune's loader renders them" * needs_tools("make-model tokenize")) {
    tmpdir d;
    const stop_model m = make_stop_model(d, "chat", 2,
                                         {{390, {"<|im_start|>", QL_TOKEN_CONTROL}}, {391, {"<|im_end|>", QL_TOKEN_CONTROL}}});
    const std::string data = d.file("d.jsonl");
    write_file(data, "{\"prompt\": \"Q: hi\", \"completion\": \" ok\"}\n"
                     "\n"
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n");
    std::string out;
    REQUIRE_MESSAGE(run("./tokenize -m " + m.path + " --data " + data + " --chat-template chatml --line 3 2>&1", &out) == 0, out);
    // what finetune's loader makes of the same file
    char err[512];
    ql_gguf *g = ql_gguf_open(m.path.c_str(), err, sizeof(err));
    REQUIRE(g);
    ql_vocab *v = ql_vocab_load(g, err, sizeof(err));
    REQUIRE(v);
    ql_data_options o;
    std::string e;
    REQUIRE_MESSAGE(ql_data_options_for(g, v, "chatml", &o, &e), e);  // finetune's own options for the model
    CHECK(o.chat == QL_CHAT_CHATML);
    ql_dataset ds;
    REQUIRE_MESSAGE(ql_dataset_load(data.c_str(), v, o, &ds, &e), e);
    REQUIRE(ds.examples.size() == 2);
    const ql_example &ex = ds.examples[1];
    REQUIRE(ex.line == 3);
    int64_t n_sup = 0;
    std::string want = "line 3: " + std::to_string(ex.tokens.size()) + " tokens, ";
    for (uint8_t s : ex.supervised) n_sup += s;
    want += std::to_string(n_sup) + " trained (+); chat template chatml\n";
    for (size_t i = 0; i < ex.tokens.size(); i++) {
        char b[64];
        snprintf(b, sizeof(b), "%8d %c ", (int)ex.tokens[i], ex.supervised[i] ? '+' : '.');
        std::string piece = ql_token_to_piece(v, ex.tokens[i], true), q = "\"";
        for (char c : piece) q += c == '\n' ? std::string("\\n") : std::string(1, c);
        want += b + q + "\"\n";
    }
    CHECK(out == want);
    // the rendered conversation, readable in the pieces; its assistant turn trained, the user's not
    CHECK(has(out, ". \"<|im_start|>\"\n"));
    CHECK(has(out, ". \"\\n\"\n"));
    CHECK(has(out, "+ \"<|im_end|>\"\n"));  // the assistant's end of turn is a target
    CHECK(n_sup > 0);
    CHECK(n_sup < (int64_t)ex.tokens.size());
    // every example without --line; the prompt/completion line's completion is what is trained
    REQUIRE(run("./tokenize -m " + m.path + " --data " + data + " --chat-template chatml 2>&1", &out) == 0);
    CHECK(has(out, "line 1: "));
    CHECK(has(out, "\n\nline 3: "));
    // a blank line, or past the end: said, exit 1; bad flags: exit 2
    CHECK(run("./tokenize -m " + m.path + " --data " + data + " --chat-template chatml --line 2", &out) == 1);
    CHECK_MESSAGE(has(out, "no example at line 2"), out);
    CHECK(run("./tokenize -m " + m.path + " --data " + data + " --line 0", &out) == 2);
    CHECK(run("./tokenize -m " + m.path + " --data " + data + " -p hi", &out) == 2);
    CHECK(run("./tokenize -m " + m.path + " -p hi --line 3", &out) == 2);
    CHECK_MESSAGE(has(out, "--line goes with --data FILE.jsonl"), out);
    CHECK(run("./tokenize -m " + m.path + " --data " + data + " --chat-template nope", &out) == 2);
    // without a template, a messages line is finetune's error, word for word
    CHECK(run("./tokenize -m " + m.path + " --data " + data, &out) == 1);
    ql_data_options none;
    REQUIRE(ql_data_options_for(g, v, nullptr, &none, &e));  // the model has no template: none
    CHECK(none.chat == QL_CHAT_NONE);
    ql_dataset ds2;
    CHECK_FALSE(ql_dataset_load(data.c_str(), v, none, &ds2, &e));
    CHECK_MESSAGE(out == "tokenize: " + e + "\n", out);
    ql_vocab_free(v);
    ql_gguf_close(g);
}

TEST_CASE("tokenize --data: --skip-bad-lines as finetune; 'cut to --seq-len' only for an example that was cut" * needs_tools("make-model tokenize")) {
    tmpdir d;
    const stop_model m = make_stop_model(d, "chat", 2, {});
    const std::string data = d.file("d.jsonl");
    write_file(data, "{\"text\": \"abc abc abc\"}\n"
                     "{\"txet\": \"a typo\"}\n"
                     "{\"prompt\": \"Q\", \"completion\": \" b\"}\n");
    std::string out;
    // a bad line stops the loader, as it stops finetune; --skip-bad-lines shows the rest, with finetune's warning
    CHECK(run("./tokenize -m " + m.path + " --data " + data, &out) == 1);
    CHECK_MESSAGE(has(out, "d.jsonl:2: "), out);
    REQUIRE_MESSAGE(run("./tokenize -m " + m.path + " --data " + data + " --skip-bad-lines 2>&1", &out) == 0, out);
    CHECK_MESSAGE(has(out, "tokenize: warning: skipped 1 bad line of " + data + "; the first: " + data + ":2: "), out);
    CHECK(has(out, "line 1: "));
    CHECK(has(out, "line 3: "));
    CHECK(!has(out, "line 2: "));
    CHECK(run("./tokenize -m " + m.path + " --data " + data + " --skip-bad-lines --line 2", &out) == 1);
    CHECK_MESSAGE(has(out, "a bad line --skip-bad-lines skipped"), out);
    CHECK(run("./tokenize -m " + m.path + " -p hi --skip-bad-lines", &out) == 2);
    CHECK_MESSAGE(has(out, "--skip-bad-lines goes with --data FILE.jsonl"), out);

    // line 1's length as the loader makes it; an --seq-len of exactly that cuts nothing, one less cuts
    char err[512];
    ql_gguf *g = ql_gguf_open(m.path.c_str(), err, sizeof(err));
    REQUIRE(g);
    ql_vocab *v = ql_vocab_load(g, err, sizeof(err));
    REQUIRE(v);
    ql_data_options o;
    std::string e;
    REQUIRE(ql_data_options_for(g, v, nullptr, &o, &e));
    o.skip_bad_lines = true;
    ql_dataset ds;
    REQUIRE_MESSAGE(ql_dataset_load(data.c_str(), v, o, &ds, &e), e);
    REQUIRE(ds.examples.size() == 2);
    const size_t n = ds.examples[0].tokens.size();
    CHECK(!ds.examples[0].truncated);
    ql_vocab_free(v);
    ql_gguf_close(g);
    REQUIRE(n > 3);
    const std::string at = data + " --skip-bad-lines --line 1 --seq-len ";
    REQUIRE_MESSAGE(run("./tokenize -m " + m.path + " --data " + at + std::to_string(n) + " 2>/dev/null", &out) == 0, out);
    CHECK_MESSAGE(has(out, "line 1: " + std::to_string(n) + " tokens"), out);
    CHECK_MESSAGE(!has(out, "seq-len"), out);  // exactly seq_len long, not cut
    REQUIRE_MESSAGE(run("./tokenize -m " + m.path + " --data " + at + std::to_string(n - 1) + " 2>/dev/null", &out) == 0, out);
    CHECK_MESSAGE(has(out, "line 1: " + std::to_string(n - 1) + " tokens"), out);
    CHECK_MESSAGE(has(out, "; cut to --seq-len " + std::to_string(n - 1) + "\n"), out);
}
