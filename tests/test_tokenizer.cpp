// The tokenizers (models/tokenizer.h): llama.cpp's own test vectors on the real vocabularies,
// small hand-made vocabularies for the rules the vectors do not isolate, the converters, load
// errors and tools/tokenize.
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "util.h"

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

bool one_line(const std::string &e) { return !e.empty() && e.find('\n') == std::string::npos; }

std::string printable(const std::string &s) {
    std::string out;
    for (unsigned char c : s) {
        if (c >= 0x20 && c < 0x7f) out += (char)c;
        else {
            char b[5];
            snprintf(b, sizeof(b), "\\x%02x", c);
            out += b;
        }
    }
    return out;
}

// Writes w to path, opens it and loads the vocabulary; NULL with *err on failure.
ql_vocab *load_written(ql_gguf_writer *w, const std::string &path, std::string *err) {
    char e[512] = "";
    if (ql_gguf_write(w, path.c_str(), e, sizeof(e)) != QL_OK) {
        *err = std::string("write: ") + e;
        return nullptr;
    }
    ql_gguf *g = ql_gguf_open(path.c_str(), e, sizeof(e));
    if (!g) {
        *err = std::string("open: ") + e;
        return nullptr;
    }
    ql_vocab *v = ql_vocab_load(g, e, sizeof(e));
    ql_gguf_close(g);
    if (!v) *err = e;
    return v;
}

struct vocab_deleter {
    void operator()(ql_vocab *v) const { ql_vocab_free(v); }
};
using vocab_ptr = std::unique_ptr<ql_vocab, vocab_deleter>;

// The converted real vocabularies, built once (the Llama 3 one takes a few tenths of a second).
// NULL without fixtures.
const ql_vocab *llama2_vocab() {
    static vocab_ptr v = [] {
        const std::string fx = fixtures_dir();
        if (fx.empty()) return vocab_ptr();
        tmpdir dir;
        char err[512] = "";
        ql_gguf_writer *w = ql_gguf_writer_new();
        const std::string bin = fx + "/llama2-vocab/tokenizer.bin";
        REQUIRE_MESSAGE(ql_vocab_from_llama2c(bin.c_str(), w, err, sizeof(err)) == QL_OK, err);
        std::string e;
        vocab_ptr p(load_written(w, dir.file("llama2.gguf"), &e));
        ql_gguf_writer_free(w);
        REQUIRE_MESSAGE(p, e);
        return p;
    }();
    return v.get();
}

uint64_t g_llama3_merges = 0;  // the merge count the converter wrote

const ql_vocab *llama3_vocab() {
    static vocab_ptr v = [] {
        const std::string fx = fixtures_dir();
        if (fx.empty()) return vocab_ptr();
        tmpdir dir;
        char err[512] = "";
        ql_gguf_writer *w = ql_gguf_writer_new();
        const std::string model = fx + "/tokenizer-vectors/llama3/tokenizer.model";
        REQUIRE_MESSAGE(ql_vocab_from_tiktoken(model.c_str(), "llama-bpe", w, err, sizeof(err)) == QL_OK, err);
        const std::string path = dir.file("llama3.gguf");
        std::string e;
        vocab_ptr p(load_written(w, path, &e));
        ql_gguf_writer_free(w);
        REQUIRE_MESSAGE(p, e);
        if (ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err))) {
            g_llama3_merges = ql_gguf_arr_n(g, ql_gguf_find_kv(g, "tokenizer.ggml.merges"));
            ql_gguf_close(g);
        }
        return p;
    }();
    return v.get();
}

// llama.cpp's .inp/.out pair, read as its tests/test-tokenizer-0.cpp reads it: strings each
// followed by "\n__ggml_vocab_test__\n"; one line of ids per string (trimmed).
struct vectors {
    std::vector<std::string> text;
    std::vector<std::vector<int32_t>> ids;
};

vectors read_vectors(const std::string &base) {
    vectors t;
    const std::string inp = read_file(base + ".inp"), out = read_file(base + ".out");
    const std::string sep = "\n__ggml_vocab_test__\n";
    for (size_t pos = 0; pos < inp.size();) {
        const size_t next = inp.find(sep, pos);
        if (next == std::string::npos) {
            t.text.push_back(inp.substr(pos));
            break;
        }
        t.text.push_back(inp.substr(pos, next - pos));
        pos = next + sep.size();
    }
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
        std::istringstream ls(line);
        std::vector<int32_t> ids;
        for (long x; ls >> x;) ids.push_back((int32_t)x);
        t.ids.push_back(ids);
    }
    return t;
}

// tokenize as test-tokenizer-0 does (add_special false, parse_special false); report per string
void run_vectors(const std::string &name, const ql_vocab *v, const vectors &t) {
    REQUIRE(!t.text.empty());
    REQUIRE(t.text.size() == t.ids.size());
    size_t pass = 0;
    for (size_t i = 0; i < t.text.size(); i++) {
        const std::vector<int32_t> got = ql_tokenize(v, t.text[i], false, false);
        if (got == t.ids[i]) pass++;
        CHECK_MESSAGE(got == t.ids[i], name << " string " << i << " '" << printable(t.text[i]) << "': expected "
                                           << ids_str(t.ids[i]) << ", got " << ids_str(got));
    }
    MESSAGE(name << ": " << pass << "/" << t.text.size() << " llama.cpp test vectors pass");
}

// ---- hand-made vocabularies ----------------------------------------------------------------

const char *const SP = "\xe2\x96\x81";  // "▁"

// A SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces chosen so that
// the merge order shows (scores decide, not lengths), a user-defined and a control token.
struct toy_spm {
    std::vector<std::string> text;
    std::vector<float> score;
    std::vector<int32_t> type;
    int32_t add(const std::string &t, float s, int32_t ty) {
        text.push_back(t);
        score.push_back(s);
        type.push_back(ty);
        return (int32_t)text.size() - 1;
    }
    toy_spm() {
        add("<unk>", 0, QL_TOKEN_UNKNOWN);
        add("<s>", 0, QL_TOKEN_CONTROL);
        add("</s>", 0, QL_TOKEN_CONTROL);
        for (int b = 0; b < 256; b++) {
            char name[8];
            snprintf(name, sizeof(name), "<0x%02X>", b);
            add(name, 0, QL_TOKEN_BYTE);
        }
        add(SP, -5, QL_TOKEN_NORMAL);                       // 259
        add("a", -6, QL_TOKEN_NORMAL);                      // 260
        add("b", -7, QL_TOKEN_NORMAL);                      // 261
        add("c", -8, QL_TOKEN_NORMAL);                      // 262
        add(std::string(SP) + "a", -2, QL_TOKEN_NORMAL);    // 263
        add("ab", -3, QL_TOKEN_NORMAL);                     // 264
        add(std::string(SP) + "ab", -1, QL_TOKEN_NORMAL);   // 265
        add("bc", -0.5f, QL_TOKEN_NORMAL);                  // 266
        add("<tool>", 0, QL_TOKEN_USER_DEFINED);            // 267
        add("<|im_end|>", 0, QL_TOKEN_CONTROL);             // 268
        add("zz", -9, QL_TOKEN_UNUSED);                     // 269
    }
    ql_gguf_writer *writer() const {
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_str(w, "general.architecture", "llama");
        ql_gguf_set_str(w, "tokenizer.ggml.model", "llama");
        std::vector<const char *> p;
        for (const std::string &s : text) p.push_back(s.c_str());
        ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", p.data(), p.size());
        ql_gguf_set_arr(w, "tokenizer.ggml.scores", QL_GGUF_F32, score.data(), score.size());
        ql_gguf_set_arr(w, "tokenizer.ggml.token_type", QL_GGUF_I32, type.data(), type.size());
        return w;
    }
};

vocab_ptr load_toy(ql_gguf_writer *w, const tmpdir &dir) {
    std::string e;
    vocab_ptr v(load_written(w, dir.file("toy.gguf"), &e));
    ql_gguf_writer_free(w);
    REQUIRE_MESSAGE(v, e);
    return v;
}

// GPT-2's bytes_to_unicode, written out again here so the tests do not share the library's
std::string byte_char(unsigned char b) {
    int n = 0;
    for (int x = 0; x < 256; x++) {
        const bool self = (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
        const unsigned cp = self ? (unsigned)x : 256u + (unsigned)n++;
        if (x == b) {
            std::string s;
            if (cp < 0x80) s += (char)cp;
            else {
                s += (char)(0xC0 | (cp >> 6));
                s += (char)(0x80 | (cp & 0x3F));
            }
            return s;
        }
    }
    return "";
}

// A byte-level BPE vocabulary in which each expected word of `text` is one token, built by a
// left-to-right chain of merges; the pair across each word boundary is a merge too, ranked
// first, so a splitter that joined two words would merge across and give other tokens.
struct toy_bpe {
    std::vector<std::string> tokens, merges;
    std::map<std::string, int32_t> id;
    int32_t tok(const std::string &t) {
        auto it = id.find(t);
        if (it != id.end()) return it->second;
        tokens.push_back(t);
        return id[t] = (int32_t)tokens.size() - 1;
    }
    explicit toy_bpe(const std::vector<std::string> &words) {
        for (int b = 0; b < 256; b++) tok(byte_char((unsigned char)b));
        std::vector<std::vector<std::string>> chars;
        for (const std::string &w : words) {
            chars.emplace_back();
            for (unsigned char c : w) chars.back().push_back(byte_char(c));
        }
        for (size_t i = 0; i + 1 < chars.size(); i++) {
            const std::string l = chars[i].back(), r = chars[i + 1].front();
            bool inside = false;  // a pair that also occurs inside a word would break that word
            for (const auto &cw : chars)
                for (size_t k = 0; k + 1 < cw.size(); k++) inside = inside || (cw[k] == l && cw[k + 1] == r);
            if (!inside && !id.count(l + r)) {
                tok(l + r);
                merges.push_back(l + " " + r);
            }
        }
        for (const auto &cw : chars) {
            std::string pre = cw[0];
            for (size_t k = 1; k < cw.size(); k++) {
                if (!id.count(pre + cw[k])) {
                    tok(pre + cw[k]);
                    merges.push_back(pre + " " + cw[k]);
                }
                pre += cw[k];
            }
        }
    }
    int32_t word_id(const std::string &w) {
        std::string t;
        for (unsigned char c : w) t += byte_char(c);
        return id.count(t) ? id[t] : -1;
    }
    ql_gguf_writer *writer(const char *pre) const {
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_str(w, "general.architecture", "gpt2");
        ql_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
        if (pre) ql_gguf_set_str(w, "tokenizer.ggml.pre", pre);
        std::vector<const char *> p;
        for (const std::string &s : tokens) p.push_back(s.c_str());
        ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", p.data(), p.size());
        p.clear();
        for (const std::string &s : merges) p.push_back(s.c_str());
        ql_gguf_set_arr_str(w, "tokenizer.ggml.merges", p.data(), p.size());
        return w;
    }
};

void check_split(const char *pre, const std::string &text, const std::vector<std::string> &words) {
    INFO("pre-tokenizer " << pre << ", text '" << printable(text) << "'");
    tmpdir dir;
    toy_bpe t(words);
    std::vector<int32_t> want;
    for (const std::string &w : words) want.push_back(t.word_id(w));
    vocab_ptr v = load_toy(t.writer(pre), dir);
    const std::vector<int32_t> got = ql_tokenize(v.get(), text, false, false);
    CHECK_MESSAGE(got == want, "expected " << ids_str(want) << ", got " << ids_str(got));
    CHECK(ql_detokenize(v.get(), got, false) == text);
}

std::string b64(const std::string &in) {
    static const char *A = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    size_t i = 0;
    for (; i + 2 < in.size(); i += 3) {
        const unsigned x = ((unsigned char)in[i] << 16) | ((unsigned char)in[i + 1] << 8) | (unsigned char)in[i + 2];
        out += A[x >> 18], out += A[(x >> 12) & 63], out += A[(x >> 6) & 63], out += A[x & 63];
    }
    if (i + 1 == in.size()) {
        const unsigned x = (unsigned char)in[i] << 16;
        out += A[x >> 18], out += A[(x >> 12) & 63], out += "==";
    } else if (i + 2 == in.size()) {
        const unsigned x = ((unsigned char)in[i] << 16) | ((unsigned char)in[i + 1] << 8);
        out += A[x >> 18], out += A[(x >> 12) & 63], out += A[(x >> 6) & 63], out += '=';
    }
    return out;
}

// a llama2.c tokenizer.bin: i32 max_token_length, then per token f32 score, i32 length, bytes
std::string llama2c_bin(const std::vector<std::pair<std::string, float>> &toks, int32_t max_len = 16) {
    std::string b((const char *)&max_len, 4);
    for (const auto &t : toks) {
        const int32_t n = (int32_t)t.first.size();
        b.append((const char *)&t.second, 4);
        b.append((const char *)&n, 4);
        b += t.first;
    }
    return b;
}

}  // namespace

// ---- llama.cpp's test vectors ---------------------------------------------------------------

TEST_CASE("tokenizer: llama-spm vectors on the Llama 2 vocabulary from llama2.c's tokenizer.bin" * needs_fixture("llama2-vocab/tokenizer.bin") *
          needs_fixture("tokenizer-vectors/ggml-vocab-llama-spm.gguf")) {
    const std::string fx = fixtures_dir();
    fixture("llama2-vocab/tokenizer.bin");
    const ql_vocab *v = llama2_vocab();
    REQUIRE(v);
    CHECK(std::string(ql_vocab_model(v)) == "llama");
    CHECK(ql_vocab_n_tokens(v) == 32000);
    CHECK(ql_vocab_bos(v) == 1);
    CHECK(ql_vocab_eos(v) == 2);
    CHECK(ql_vocab_add_bos(v));
    CHECK_FALSE(ql_vocab_add_eos(v));
    // the converter undid llama2.c's export: "\n<s>\n" -> "<s>", " " -> "▁"; types as SentencePiece's
    CHECK(std::string(ql_vocab_token_text(v, 0)) == "<unk>");
    CHECK(std::string(ql_vocab_token_text(v, 1)) == "<s>");
    CHECK(std::string(ql_vocab_token_text(v, 2)) == "</s>");
    CHECK(std::string(ql_vocab_token_text(v, 3)) == "<0x00>");
    CHECK(std::string(ql_vocab_token_text(v, 259)) == std::string(SP) + SP);
    CHECK(ql_vocab_token_type(v, 0) == QL_TOKEN_UNKNOWN);
    CHECK(ql_vocab_token_type(v, 1) == QL_TOKEN_CONTROL);
    CHECK(ql_vocab_token_type(v, 258) == QL_TOKEN_BYTE);
    CHECK(ql_vocab_token_type(v, 259) == QL_TOKEN_NORMAL);
    CHECK(ql_vocab_find(v, (std::string(SP) + "Hello").c_str()) == 15043);

    const vectors t = read_vectors(fx + "/tokenizer-vectors/ggml-vocab-llama-spm.gguf");
    run_vectors("llama-spm (llama2.c tokenizer.bin)", v, t);

    // decoding gives the input back behind the space the prefix added
    for (const std::string &s : t.text) {
        const std::string d = ql_detokenize(v, ql_tokenize(v, s, false, false), false);
        CHECK_MESSAGE(d == (s.empty() ? s : " " + s), "'" << printable(s) << "' decoded to '" << printable(d) << "'");
    }

    // llama.cpp's own GGUF of this vocabulary (an earlier copy, damaged by a text conversion, did
    // not open: a failure here, not a skip)
    const std::string path = fixture("tokenizer-vectors/ggml-vocab-llama-spm.gguf");
    char err[512];
    ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, path << " does not open (" << err << "): it must be llama.cpp's models/ggml-vocab-llama-spm.gguf, byte for byte");
    vocab_ptr orig(ql_vocab_load(g, err, sizeof(err)));
    ql_gguf_close(g);
    REQUIRE_MESSAGE(orig, err);
    run_vectors("llama-spm (ggml-vocab-llama-spm.gguf)", orig.get(), t);
}

TEST_CASE("tokenizer: gpt-2 vectors on llama.cpp's GGUF" * needs_fixture("tokenizer-vectors/ggml-vocab-gpt-2.gguf")) {
    const std::string fx = fixtures_dir();
    const std::string path = fixture("tokenizer-vectors/ggml-vocab-gpt-2.gguf");
    char err[512];
    ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, path << " does not open (" << err << "): it must be llama.cpp's models/ggml-vocab-gpt-2.gguf, byte for byte");
    vocab_ptr v(ql_vocab_load(g, err, sizeof(err)));
    ql_gguf_close(g);
    REQUIRE_MESSAGE(v, err);
    CHECK(std::string(ql_vocab_pre(v.get())) == "gpt-2");
    const vectors t = read_vectors(fx + "/tokenizer-vectors/ggml-vocab-gpt-2.gguf");
    run_vectors("gpt-2", v.get(), t);
    for (const std::string &s : t.text)
        CHECK(ql_detokenize(v.get(), ql_tokenize(v.get(), s, false, false), false) == s);
}

TEST_CASE("tokenizer: llama-bpe vectors on Llama 3's tiktoken vocabulary" * needs_fixture("tokenizer-vectors/llama3/tokenizer.model")) {
    fixture("tokenizer-vectors/llama3/tokenizer.model");
    const ql_vocab *v = llama3_vocab();
    REQUIRE(v);
    CHECK(std::string(ql_vocab_model(v)) == "gpt2");
    CHECK(std::string(ql_vocab_pre(v)) == "llama3");
    CHECK(ql_vocab_n_tokens(v) == 128256);
    CHECK(g_llama3_merges == 280147);  // as many as Meta-Llama-3's tokenizer.json holds
    CHECK(ql_vocab_bos(v) == 128000);
    CHECK(ql_vocab_eos(v) == 128001);
    CHECK(ql_vocab_eot(v) == 128009);
    CHECK(ql_vocab_add_bos(v));
    CHECK_FALSE(ql_vocab_add_eos(v));
    // Meta's names (llama-models, models/llama3/tokenizer.py)
    const std::map<int32_t, std::string> names = {
        {128000, "<|begin_of_text|>"}, {128001, "<|end_of_text|>"}, {128002, "<|reserved_special_token_0|>"},
        {128003, "<|reserved_special_token_1|>"}, {128004, "<|finetune_right_pad_id|>"}, {128005, "<|step_id|>"},
        {128006, "<|start_header_id|>"}, {128007, "<|end_header_id|>"}, {128008, "<|eom_id|>"},
        {128009, "<|eot_id|>"}, {128010, "<|python_tag|>"}, {128011, "<|image|>"},
        {128012, "<|reserved_special_token_2|>"}, {128255, "<|reserved_special_token_245|>"}};
    for (const auto &kv : names) {
        CHECK(std::string(ql_vocab_token_text(v, kv.first)) == kv.second);
        CHECK(ql_vocab_token_type(v, kv.first) == QL_TOKEN_CONTROL);
    }
    CHECK(std::string(ql_vocab_token_text(v, 220)) == "\xc4\xa0");  // " " in byte-level form

    const vectors t = read_vectors(fixtures_dir() + "/tokenizer-vectors/ggml-vocab-llama-bpe.gguf");
    run_vectors("llama-bpe (tiktoken tokenizer.model)", v, t);
    for (const std::string &s : t.text) {
        const std::string d = ql_detokenize(v, ql_tokenize(v, s, false, false), false);
        CHECK_MESSAGE(d == s, "'" << printable(s) << "' decoded to '" << printable(d) << "'");
    }
}

TEST_CASE("tokenizer: special tokens, BOS/EOS and end of generation on the real vocabularies" *
          needs_fixture("tokenizer-vectors/llama3/tokenizer.model") * needs_fixture("llama2-vocab/tokenizer.bin")) {
    fixture("tokenizer-vectors/llama3/tokenizer.model");
    fixture("llama2-vocab/tokenizer.bin");
    const ql_vocab *l3 = llama3_vocab(), *l2 = llama2_vocab();
    REQUIRE(l3);
    REQUIRE(l2);
    const std::string chat = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>";
    const std::vector<int32_t> on = ql_tokenize(l3, chat, true, true);
    REQUIRE(on.size() >= 5);
    CHECK(on.front() == 128000);  // add_bos
    CHECK(on[1] == 128006);
    CHECK(on.back() == 128009);   // no EOS: add_eos is false
    CHECK(ql_detokenize(l3, on, true) == "<|begin_of_text|>" + chat);
    CHECK(ql_detokenize(l3, on, false) == "user\n\nHi");  // control tokens render as nothing
    const std::vector<int32_t> off = ql_tokenize(l3, chat, false, false);
    for (int32_t id : off) CHECK(id < 128000);  // the same text, spelled as text
    CHECK(ql_detokenize(l3, off, false) == chat);
    CHECK(ql_vocab_is_eog(l3, 128009));
    CHECK(ql_vocab_is_eog(l3, 128001));
    CHECK(ql_vocab_is_eog(l3, 128008));  // <|eom_id|>
    CHECK_FALSE(ql_vocab_is_eog(l3, 128000));
    CHECK_FALSE(ql_vocab_is_eog(l3, 9906));
    CHECK(ql_token_to_piece(l3, 128009, false).empty());
    CHECK(ql_token_to_piece(l3, 128009, true) == "<|eot_id|>");
    CHECK(ql_token_to_piece(l3, 22691, false) == " Hello");
    // malformed UTF-8 becomes U+FFFD before the byte-level encoding, as in llama.cpp
    CHECK(ql_detokenize(l3, ql_tokenize(l3, "a\xff", false, false), false) == "a\xef\xbf\xbd");

    // Llama 2: the space prefix starts again after each special token
    const std::vector<int32_t> s = ql_tokenize(l2, "<s>Hello</s>", false, true);
    CHECK(s == std::vector<int32_t>{1, 15043, 2});
    CHECK(ql_tokenize(l2, "Hello", true, false) == std::vector<int32_t>{1, 15043});
    CHECK(ql_tokenize(l2, "<s>", false, false) != std::vector<int32_t>{1});
    CHECK(ql_vocab_is_eog(l2, 2));
    CHECK(ql_vocab_eot(l2) == -1);
    // byte fallback: 🦙 is not a piece of Llama 2
    const std::vector<int32_t> llama = ql_tokenize(l2, "\xf0\x9f\xa6\x99", false, false);
    CHECK(llama == std::vector<int32_t>{29871, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x99});
    CHECK(ql_detokenize(l2, llama, false) == " \xf0\x9f\xa6\x99");
    CHECK(ql_token_to_piece(l2, 3 + 0xF0, false) == "\xf0");
    CHECK(ql_detokenize(l2, ql_tokenize(l2, "x\xff", false, false), false) == " x\xff");
}

// ---- the rules, on small vocabularies ------------------------------------------------------------

TEST_CASE("tokenizer: SentencePiece merges by score, space prefix, byte fallback, special tokens") {
    tmpdir dir;
    toy_spm t;
    vocab_ptr v = load_toy(t.writer(), dir);
    const ql_vocab *p = v.get();
    CHECK(ql_vocab_bos(p) == 1);  // llama.cpp's defaults for a "llama" vocabulary without the keys
    CHECK(ql_vocab_eos(p) == 2);
    CHECK(ql_vocab_add_bos(p));
    CHECK_FALSE(ql_vocab_add_eos(p));
    CHECK(std::string(ql_vocab_pre(p)) == "default");

    // "▁ab": ▁a (-2) beats ab (-3), then ▁ab (-1)
    CHECK(ql_tokenize(p, "ab", false, false) == std::vector<int32_t>{265});
    // "▁abc": bc (-0.5) first, then ▁a; ▁abc is no token, and ▁ab is never reached
    CHECK(ql_tokenize(p, "abc", false, false) == std::vector<int32_t>{263, 266});
    CHECK(ql_tokenize(p, "a b", false, false) == std::vector<int32_t>{263, 259, 261});
    CHECK(ql_tokenize(p, "ab", true, false) == std::vector<int32_t>{1, 265});
    CHECK(ql_tokenize(p, "", true, false) == std::vector<int32_t>{1});
    CHECK(ql_tokenize(p, "", false, false).empty());
    // byte fallback: characters without a piece become their UTF-8 bytes; so does bad UTF-8
    CHECK(ql_tokenize(p, "z\xc3\xa9", false, false) == std::vector<int32_t>{259, 3 + 'z', 3 + 0xC3, 3 + 0xA9});
    CHECK(ql_tokenize(p, "\xff", false, false) == std::vector<int32_t>{259, 3 + 0xFF});
    CHECK(ql_detokenize(p, ql_tokenize(p, "z\xc3\xa9 a\xff", false, false), false) == " z\xc3\xa9 a\xff");
    // a user-defined token splits the text even without parse_special; the prefix starts again after it
    CHECK(ql_tokenize(p, "a<tool>b", false, false) == std::vector<int32_t>{263, 267, 259, 261});
    // a control token only with parse_special
    CHECK(ql_tokenize(p, "<|im_end|>ab", false, true) == std::vector<int32_t>{268, 265});
    for (int32_t id : ql_tokenize(p, "<|im_end|>ab", false, false)) CHECK(id != 268);
    // <|im_end|> is the end of turn when no id names one, and ends generation
    CHECK(ql_vocab_eot(p) == 268);
    CHECK(ql_vocab_is_eog(p, 268));
    CHECK(ql_vocab_is_eog(p, 2));
    CHECK_FALSE(ql_vocab_is_eog(p, 1));
    // pieces
    CHECK(ql_token_to_piece(p, 265, false) == " ab");
    CHECK(ql_token_to_piece(p, 3 + 'A', false) == "A");
    CHECK(ql_token_to_piece(p, 0, false).empty());
    CHECK(ql_token_to_piece(p, 0, true) == "<unk>");
    CHECK(ql_token_to_piece(p, 1, false).empty());
    CHECK(ql_token_to_piece(p, 1, true) == "<s>");
    CHECK(ql_token_to_piece(p, 267, false) == "<tool>");  // user-defined: always its text
    CHECK(ql_token_to_piece(p, 269, true).empty());       // unused: nothing
    CHECK(ql_token_to_piece(p, -1, true).empty());
    CHECK(ql_token_to_piece(p, 100000, true).empty());
    CHECK(ql_detokenize(p, {1, 265, 2}, true) == "<s> ab</s>");
    CHECK(ql_vocab_find(p, "bc") == 266);
    CHECK(ql_vocab_find(p, "nope") == -1);

    // the file's flags win over the defaults
    ql_gguf_writer *w = t.writer();
    ql_gguf_set_bool(w, "tokenizer.ggml.add_space_prefix", false);
    ql_gguf_set_bool(w, "tokenizer.ggml.add_eos_token", true);
    ql_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", false);
    ql_gguf_set_u32(w, "tokenizer.ggml.eot_token_id", 2);
    tmpdir dir2;
    vocab_ptr v2 = load_toy(w, dir2);
    CHECK(ql_tokenize(v2.get(), "ab", false, false) == std::vector<int32_t>{264});
    CHECK(ql_tokenize(v2.get(), "ab", true, false) == std::vector<int32_t>{264, 2});
    CHECK(ql_vocab_eot(v2.get()) == 2);
}

TEST_CASE("tokenizer: a control-looking token stored as normal is made control, as llama.cpp does") {
    tmpdir dir;
    toy_spm t;
    t.type[268] = QL_TOKEN_NORMAL;  // <|im_end|>
    vocab_ptr v = load_toy(t.writer(), dir);
    CHECK(ql_vocab_token_type(v.get(), 268) == QL_TOKEN_NORMAL);  // as stored
    CHECK(ql_vocab_eot(v.get()) == 268);
    CHECK(ql_token_to_piece(v.get(), 268, false).empty());
    CHECK(ql_tokenize(v.get(), "<|im_end|>", false, true) == std::vector<int32_t>{268});
}

TEST_CASE("tokenizer: pre-tokenizer splits (gpt-2, llama3, qwen2, default)") {
    // expected words from the reference expressions (Python's regex module), and for "default"
    // from llama.cpp's chain of four splits
    const std::string s1 = "Hello world's  123!!";
    check_split("gpt-2", s1, {"Hello", " world", "'s", " ", " 123", "!!"});
    check_split("llama3", s1, {"Hello", " world", "'s", " ", " ", "123", "!!"});
    check_split("qwen2", s1, {"Hello", " world", "'s", " ", " ", "1", "2", "3", "!!"});
    check_split("default", s1, {"Hello", " world", "'", "s", " ", " ", "123", "!!"});
    const std::string s2 = "I'M don't\n\n  x 12345";
    check_split("gpt-2", s2, {"I", "'", "M", " don", "'t", "\n\n ", " x", " 12345"});
    check_split("llama-bpe", s2, {"I", "'M", " don", "'t", "\n\n", " ", " x", " ", "123", "45"});
    check_split("qwen2", s2, {"I", "'M", " don", "'t", "\n\n", " ", " x", " ", "1", "2", "3", "4", "5"});
    check_split("default", s2, {"I", "'", "M", " don", "'", "t", "\n\n ", " x", " ", "123", "45"});
    // a NBSP b IDEOGRAPHIC-SPACE " été 中文 ...?"
    const std::string nbsp = "\xc2\xa0", ideo = "\xe3\x80\x80", ete = " \xc3\xa9t\xc3\xa9", zh = " \xe4\xb8\xad\xe6\x96\x87";
    const std::string s3 = "a" + nbsp + "b" + ideo + ete + zh + " ...?";
    check_split("gpt-2", s3, {"a", nbsp, "b", ideo, ete, zh, " ...?"});
    check_split("llama3", s3, {"a", nbsp + "b", ideo, ete, zh, " ...?"});
    check_split("default", s3, {"a", nbsp, "b", ideo, ete, zh, " ", "...?"});
    // no tokenizer.ggml.pre: llama.cpp's "default"
    check_split(nullptr, s1, {"Hello", " world", "'", "s", " ", " ", "123", "!!"});
}

TEST_CASE("tokenizer: byte-level BPE merges by rank, and its pieces") {
    tmpdir dir;
    toy_bpe t({"ab"});
    // extra: "bc" ranked before "ab" - in "abc" it wins, leaving "a" "bc"
    t.tok(byte_char('b') + byte_char('c'));
    t.merges.insert(t.merges.begin(), byte_char('b') + " " + byte_char('c'));
    t.tok("\xe2\x86\x92");  // a character outside the byte map
    vocab_ptr v = load_toy(t.writer("gpt-2"), dir);
    const ql_vocab *p = v.get();
    const int32_t bc = ql_vocab_find(p, "bc"), ab = ql_vocab_find(p, "ab");
    CHECK(ql_tokenize(p, "abc", false, false) == std::vector<int32_t>{'a', bc});
    CHECK(ql_tokenize(p, "ab", false, false) == std::vector<int32_t>{ab});
    CHECK(ql_vocab_bos(p) == 11);  // llama.cpp's BPE default, kept
    CHECK_FALSE(ql_vocab_add_bos(p));
    CHECK(ql_tokenize(p, "ab", true, false) == std::vector<int32_t>{ab});
    // malformed UTF-8: U+FFFD's three bytes
    const std::vector<int32_t> ff = ql_tokenize(p, "\xff", false, false);
    CHECK(ff == std::vector<int32_t>{0xEF, 0xBF, 0xBD});
    CHECK(ql_detokenize(p, ff, false) == "\xef\xbf\xbd");
    CHECK(ql_token_to_piece(p, ql_vocab_find(p, byte_char(' ').c_str()), false) == " ");
    CHECK(ql_token_to_piece(p, ql_vocab_find(p, "\xe2\x86\x92"), false) == "[UNK_BYTE_0xe28692\xe2\x86\x92]");
}

// ---- converters -------------------------------------------------------------------------------

TEST_CASE("tokenizer: llama2.c tokenizer.bin: a small valid file, and bad ones refused in one line") {
    tmpdir dir;
    std::vector<std::pair<std::string, float>> toks = {{"<unk>", 0}, {"\n<s>\n", 0}, {"\n</s>\n", 0}};
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        toks.push_back({name, 0});
    }
    toks.push_back({" a", -1});
    toks.push_back({"b", -2});
    const std::string good = dir.file("good.bin");
    write_file(good, llama2c_bin(toks));
    char err[512] = "";
    ql_gguf_writer *w = ql_gguf_writer_new();
    REQUIRE_MESSAGE(ql_vocab_from_llama2c(good.c_str(), w, err, sizeof(err)) == QL_OK, err);
    vocab_ptr v = load_toy(w, dir);
    CHECK(ql_vocab_n_tokens(v.get()) == 261);
    CHECK(std::string(ql_vocab_token_text(v.get(), 259)) == std::string(SP) + "a");
    CHECK(ql_tokenize(v.get(), "ab", true, false) == std::vector<int32_t>{1, 259, 260});

    struct bad_case {
        const char *name;
        std::string bytes;
        const char *needle;
    };
    std::string negative = llama2c_bin({{"<unk>", 0}});
    const int32_t neg = -3;
    memcpy(&negative[8], &neg, 4);
    std::string past = llama2c_bin({{"<unk>", 0}});
    const int32_t big = 1000;
    memcpy(&past[8], &big, 4);
    const bad_case bad[] = {
        {"empty.bin", "", "truncated"},
        {"header.bin", std::string("\x10\x00", 2), "truncated"},
        {"half_token.bin", llama2c_bin({{"<unk>", 0}}).substr(0, 4 + 6), "truncated"},
        {"cut_token.bin", llama2c_bin({{"<unk>", 0}, {"<s>", 0}}).substr(0, 4 + 13 + 8 + 1), "past the end"},
        {"negative.bin", negative, "negative"},
        {"past.bin", past, "past the end"},
        {"max_len.bin", llama2c_bin({{"<unk>", 0}, {"<s>", 0}, {"</s>", 0}}, 0), "max_token_length"},
        {"few.bin", llama2c_bin({{"<unk>", 0}}), "tokens"},
        {"nul.bin", llama2c_bin({{"<unk>", 0}, {std::string("a\0b", 3), 0}, {"</s>", 0}}), "NUL"},
    };
    for (const bad_case &c : bad) {
        INFO(c.name);
        const std::string path = dir.file(c.name);
        write_file(path, c.bytes);
        ql_gguf_writer *bw = ql_gguf_writer_new();
        err[0] = 0;
        CHECK(ql_vocab_from_llama2c(path.c_str(), bw, err, sizeof(err)) != QL_OK);
        CHECK_MESSAGE(one_line(err), err);
        CHECK_MESSAGE(has(err, path), err);
        CHECK_MESSAGE(has(err, c.needle), err);
        ql_gguf_writer_free(bw);
    }
    ql_gguf_writer *bw = ql_gguf_writer_new();
    const std::string missing = dir.file("missing.bin");
    CHECK(ql_vocab_from_llama2c(missing.c_str(), bw, err, sizeof(err)) == QL_ERR_IO);
    CHECK(has(err, missing));
    CHECK(ql_vocab_from_llama2c(nullptr, bw, err, sizeof(err)) == QL_ERR_INVALID);
    ql_gguf_writer_free(bw);
}

TEST_CASE("tokenizer: llama2.c stories260K vocabulary converts and round-trips" * needs_fixture("stories260K/tok512.bin")) {
    const std::string fx = fixtures_dir();
    fixture("stories260K/tok512.bin");
    tmpdir dir;
    char err[512] = "";
    ql_gguf_writer *w = ql_gguf_writer_new();
    REQUIRE_MESSAGE(ql_vocab_from_llama2c((fx + "/stories260K/tok512.bin").c_str(), w, err, sizeof(err)) == QL_OK, err);
    vocab_ptr v = load_toy(w, dir);
    CHECK(ql_vocab_n_tokens(v.get()) == 512);
    const std::string s = "Once upon a time, there was a little girl named Lily.";
    const std::vector<int32_t> ids = ql_tokenize(v.get(), s, true, false);
    CHECK(ids.front() == 1);
    CHECK(ql_detokenize(v.get(), ids, false) == " " + s);
}

TEST_CASE("tokenizer: tiktoken files: a small valid one, and bad ones refused in one line") {
    tmpdir dir;
    std::string file;
    for (int b = 0; b < 256; b++) file += b64(std::string(1, (char)b)) + " " + std::to_string(b) + "\n";
    file += b64("ab") + " 256\n" + b64("abc") + " 257\n";
    const std::string good = dir.file("good.tiktoken");
    write_file(good, file);
    char err[512] = "";
    ql_gguf_writer *w = ql_gguf_writer_new();
    REQUIRE_MESSAGE(ql_vocab_from_tiktoken(good.c_str(), "llama3", w, err, sizeof(err)) == QL_OK, err);
    vocab_ptr v = load_toy(w, dir);
    const ql_vocab *p = v.get();
    CHECK(ql_vocab_n_tokens(p) == 258 + 256);
    CHECK(ql_vocab_bos(p) == 258);
    CHECK(ql_vocab_eos(p) == 259);
    CHECK(ql_vocab_eot(p) == 267);
    CHECK(std::string(ql_vocab_token_text(p, 258)) == "<|begin_of_text|>");
    // "abc" is a token (Llama 3 takes a word that is a token whole); " abd" merges a+b only
    CHECK(ql_tokenize(p, "abc abd", false, false) == std::vector<int32_t>{257, ' ', 256, 'd'});
    CHECK(ql_tokenize(p, "<|begin_of_text|>ab", false, true) == std::vector<int32_t>{258, 256});
    CHECK(ql_tokenize(p, "ab", true, false) == std::vector<int32_t>{258, 256});

    struct bad_case {
        const char *name;
        std::string text;
        const char *needle;
    };
    const bad_case bad[] = {
        {"b64.tiktoken", "YQ== 0\nY@== 1\n", "base64"},
        {"pad.tiktoken", "YQ= 0\n", "base64"},
        {"dup_rank.tiktoken", "YQ== 0\nYg== 0\n", "duplicate rank"},
        {"gap.tiktoken", "YQ== 0\nYg== 2\n", "rank 1 is missing"},
        {"rank.tiktoken", "YQ== x\n", "rank"},
        {"fields.tiktoken", "YQ==\n", "base64 rank"},
        {"three.tiktoken", "YQ== 0 1\n", "base64 rank"},
        {"dup_bytes.tiktoken", "YQ== 0\nYQ== 1\n", "repeats"},
        {"empty.tiktoken", "", "no tokens"},
        {"huge_rank.tiktoken", "QQ== 100000000", "rank 100000000, but the file has only 1 line "},  // once: 4 GB, 44 s
    };
    for (const bad_case &c : bad) {
        INFO(c.name);
        const std::string path = dir.file(c.name);
        write_file(path, c.text);
        ql_gguf_writer *bw = ql_gguf_writer_new();
        err[0] = 0;
        CHECK(ql_vocab_from_tiktoken(path.c_str(), "llama3", bw, err, sizeof(err)) != QL_OK);
        CHECK_MESSAGE(one_line(err), err);
        CHECK_MESSAGE(has(err, path), err);
        CHECK_MESSAGE(has(err, c.needle), err);
        ql_gguf_writer_free(bw);
    }
    ql_gguf_writer *bw = ql_gguf_writer_new();
    CHECK(ql_vocab_from_tiktoken(good.c_str(), "qwen2", bw, err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(has(err, "qwen2"));
    CHECK(ql_vocab_from_tiktoken(dir.file("missing").c_str(), "llama3", bw, err, sizeof(err)) == QL_ERR_IO);
    CHECK(has(err, "missing"));
    ql_gguf_writer_free(bw);
}

// ---- load errors ------------------------------------------------------------------------------

TEST_CASE("tokenizer: ql_vocab_load refuses what it cannot read, in one line") {
    struct bad_case {
        const char *name;
        ql_gguf_writer *w;
        const char *needle;
    };
    std::vector<bad_case> bad;
    {
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_str(w, "general.architecture", "llama");
        bad.push_back({"no tokenizer keys", w, "tokenizer.ggml.model"});
    }
    {
        ql_gguf_writer *w = toy_spm().writer();
        ql_gguf_set_str(w, "tokenizer.ggml.model", "bert");
        bad.push_back({"unknown model", w, "'bert'"});
    }
    {
        toy_spm t;
        t.score.pop_back();
        bad.push_back({"scores count", t.writer(), "tokenizer.ggml.scores"});
    }
    {
        toy_spm t;
        t.type.push_back(1);
        bad.push_back({"token_type count", t.writer(), "tokenizer.ggml.token_type"});
    }
    {
        toy_spm t;
        t.text[261] = "a";  // "b" -> a second "a"
        bad.push_back({"duplicate token", t.writer(), "duplicate"});
    }
    {
        ql_gguf_writer *w = toy_spm().writer();
        const int32_t n[2] = {1, 2};
        ql_gguf_set_arr(w, "tokenizer.ggml.tokens", QL_GGUF_I32, n, 2);
        bad.push_back({"tokens not strings", w, "tokenizer.ggml.tokens"});
    }
    {
        ql_gguf_writer *w = toy_spm().writer();
        ql_gguf_set_str(w, "tokenizer.ggml.bos_token_id", "one");
        bad.push_back({"bos not an integer", w, "bos_token_id"});
    }
    {
        toy_bpe t({"ab"});
        t.merges.push_back(byte_char('a') + " zz");
        bad.push_back({"merge naming an unknown token", t.writer("gpt-2"), "'zz'"});
    }
    {
        toy_bpe t({"ab"});
        t.merges.push_back("ab");
        bad.push_back({"merge without a space", t.writer("gpt-2"), "tokenizer.ggml.merges"});
    }
    {
        ql_gguf_writer *w = toy_bpe({"ab"}).writer("gpt-2");
        ql_gguf_remove_kv(w, "tokenizer.ggml.merges");
        bad.push_back({"gpt2 without merges", w, "tokenizer.ggml.merges"});
    }
    bad.push_back({"unknown pre-tokenizer", toy_bpe({"ab"}).writer("klingon"), "'klingon'"});
    {
        ql_gguf_writer *w = ql_gguf_writer_new();  // 3 tokens: llama.cpp's default BPE BOS (11) is out of range
        const char *toks[3] = {"a", "b", "ab"};
        const char *merges[1] = {"a b"};
        ql_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
        ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
        ql_gguf_set_arr_str(w, "tokenizer.ggml.merges", merges, 1);
        ql_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", true);
        bad.push_back({"add_bos without a BOS", w, "add_bos_token"});
    }
    for (const bad_case &c : bad) {
        INFO(c.name);
        tmpdir dir;
        std::string e;
        vocab_ptr v(load_written(c.w, dir.file("bad.gguf"), &e));
        ql_gguf_writer_free(c.w);
        CHECK(!v);
        CHECK_MESSAGE(one_line(e), e);
        CHECK_MESSAGE(has(e, c.needle), e);
    }
    char err[64];
    CHECK(ql_vocab_load(nullptr, err, sizeof(err)) == nullptr);
    CHECK(one_line(err));
    // a NULL vocabulary answers quietly
    CHECK(ql_tokenize(nullptr, "x", true, true).empty());
    CHECK(ql_vocab_n_tokens(nullptr) == 0);
    ql_vocab_free(nullptr);
}

// ---- tools/tokenize -------------------------------------------------------------------------------

TEST_CASE("tokenizer: tools/tokenize prints ids and refuses bad input in one line" * needs_tools("tokenize")) {
    tmpdir dir;
    const std::string model = dir.file("toy.gguf");
    {
        std::string e;
        ql_gguf_writer *w = toy_spm().writer();
        vocab_ptr v(load_written(w, model, &e));
        ql_gguf_writer_free(w);
        REQUIRE_MESSAGE(v, e);
    }
    const std::string text = dir.file("text.txt");
    write_file(text, "ab abc");
    const std::string novocab = dir.file("novocab.gguf");
    {
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_str(w, "general.architecture", "llama");
        char e[256];
        REQUIRE(ql_gguf_write(w, novocab.c_str(), e, sizeof(e)) == QL_OK);
        ql_gguf_writer_free(w);
    }
    std::string out;
    CHECK(run("./tokenize -m " + model + " -p 'ab abc'", &out) == 0);
    CHECK(out == "1 265 263 266\n");  // "▁ab" "▁a" "bc"
    CHECK(run("./tokenize -m " + model + " -f " + text + " --no-bos", &out) == 0);
    CHECK(out == "265 263 266\n");
    CHECK(run("./tokenize -m " + model + " -p '<|im_end|>ab' --parse-special --no-bos", &out) == 0);
    CHECK(out == "268 265\n");
    CHECK(run("./tokenize -m " + model + " -p '' --no-bos", &out) == 0);
    CHECK(out == "\n");

    struct bad_case {
        std::string args, needle;
    };
    const bad_case bad[] = {
        {"-m " + dir.file("missing.gguf") + " -p x", dir.file("missing.gguf")},
        {"-m " + novocab + " -p x", novocab},
        {"-m " + text + " -p x", text},  // not a GGUF
        {"-m " + model + " -f " + dir.file("missing.txt"), dir.file("missing.txt")},
        {"-m " + model, "-p"},
        {"-m " + model + " -p x -f " + text, "-f"},
        {"-p x", "-m"},
        {"-m " + model + " -p x --frobnicate", "--frobnicate"},
        {"-m " + model + " -p", "-p"},
    };
    for (const bad_case &c : bad) {
        INFO("./tokenize " << c.args);
        CHECK(run("./tokenize " + c.args, &out) != 0);
        const bool single_line = out.size() > 1 && out.find('\n') == out.size() - 1;
        CHECK_MESSAGE(single_line, out);
        CHECK_MESSAGE(has(out, c.needle), out);
    }
}
