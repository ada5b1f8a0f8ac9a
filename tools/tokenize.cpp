// tools/tokenize - text to token ids with a GGUF file's vocabulary, as llama.cpp tokenizes.
//
//   ./tokenize -m model.gguf (-p TEXT | -f FILE) [--no-bos] [--parse-special]
//   ./tokenize -m model.gguf --data FILE.jsonl [--line N] [--chat-template NAME] [--seq-len N] [--no-eos]
//              [--skip-bad-lines]
//
// Prints the ids on one line, separated by spaces. BOS (and EOS) are added as the vocabulary's
// add_bos_token / add_eos_token say, unless --no-bos; --parse-special turns control-token texts
// in the input (e.g. "<|eot_id|>") into those tokens instead of tokenizing them as text.
//
// --data shows what finetune trains on: each example of a JSONL file (or line N's), rendered by
// finetune's own loader (ql_dataset_load, with finetune's --chat-template, --seq-len, --no-eos,
// --skip-bad-lines, and its options for the model: ql_data_options_for, the template found in the
// model when none is given, its BOS rule), one token a line: its id, "+" where it is a prediction
// target (the loss mask) or "." where not, and its text.
#include "cli.h"
#include "../models/data.h"
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "own.h"

#include <cerrno>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static const char USAGE[] = "usage: tokenize -m model.gguf (-p TEXT | -f FILE) [--no-bos] [--parse-special] | "
                            "tokenize -m model.gguf --data FILE.jsonl [--line N] [--chat-template NAME] [--seq-len N] [--no-eos] "
                            "[--skip-bad-lines]";

// a command-line mistake: one line, the problem and the usage
static int bad_args(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad_args(const char *fmt, ...) {
    fprintf(stderr, "tokenize: ");
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (%s)\n", USAGE);
    return 2;
}

static bool read_file(const char *path, std::string *out) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "tokenize: cannot open '%s': %s\n", path, strerror(errno));
        return false;
    }
    char buf[65536];
    size_t n;
    errno = 0;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out->append(buf, n);
    const bool ok = !ferror(f);
    const int e = errno;
    fclose(f);
    if (!ok) fprintf(stderr, "tokenize: cannot read '%s': %s\n", path, strerror(e));
    return ok;
}

// a token's text, quoted, its control characters, quote and backslash escaped, bytes that are
// not UTF-8 on their own (a character split over byte tokens) as \xNN
static std::string quoted(const std::string &s) {
    std::string q = "\"";
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = (unsigned char)s[i];
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool whole = n > 1 && i + n <= s.size();
        for (size_t k = 1; whole && k < n; k++) whole = ((unsigned char)s[i + k] & 0xc0) == 0x80;
        char b[8];
        if (whole) q.append(s, i, n), i += n;
        else {
            if (c == '\n') q += "\\n";
            else if (c == '\t') q += "\\t";
            else if (c == '"' || c == '\\') q += '\\', q += (char)c;
            else if (c < 0x20 || c >= 0x7f) snprintf(b, sizeof(b), "\\x%02x", c), q += b;
            else q += (char)c;
            i++;
        }
    }
    return q + "\"";
}

// --data: finetune's examples of a JSONL file, one token a line
static int show_data(const ql_gguf *g, const ql_vocab *v, const char *data, long line,
                     const char *chat, long seq_len, bool add_eos, bool skip_bad) {
    ql_data_options o;  // as finetune sets them
    std::string err;
    if (!ql_data_options_for(g, v, chat, &o, &err)) return bad_args("--chat-template: %s", err.c_str());
    if (seq_len > 0) o.seq_len = (int)seq_len;
    o.add_eos = add_eos;
    o.skip_bad_lines = skip_bad;
    ql_dataset ds;
    if (!ql_dataset_load(data, v, o, &ds, &err)) {
        fprintf(stderr, "tokenize: %s\n", err.c_str());
        return 1;
    }
    if (ds.n_bad > 0)  // finetune's warning, word for word
        fprintf(stderr, "tokenize: warning: skipped %lld bad line%s of %s; the first: %s\n", (long long)ds.n_bad,
                ds.n_bad == 1 ? "" : "s", data, err.c_str());
    std::string out;
    int shown = 0;
    for (const ql_example &ex : ds.examples) {
        if (line > 0 && ex.line != line) continue;
        int64_t n_sup = 0;
        for (uint8_t x : ex.supervised) n_sup += x;
        char b[256];
        snprintf(b, sizeof(b), "%sline %d: %zu tokens, %lld trained (+); chat template %s%s%s\n", shown ? "\n" : "", ex.line,
                 ex.tokens.size(), (long long)n_sup, ql_chat_template_name(o.chat),
                 ex.truncated ? "; cut to --seq-len " : "", ex.truncated ? std::to_string(o.seq_len).c_str() : "");
        out += b;
        for (size_t i = 0; i < ex.tokens.size(); i++) {
            snprintf(b, sizeof(b), "%8d %c ", (int)ex.tokens[i], ex.supervised[i] ? '+' : '.');
            out += b + quoted(ql_token_to_piece(v, ex.tokens[i], true)) + "\n";
        }
        shown++;
    }
    if (shown == 0) {
        if (line > 0)
            fprintf(stderr, "tokenize: %s: no example at line %ld (a blank line, past the end, %sone with nothing to train on, "
                            "which finetune skips)\n", data, line, skip_bad ? "a bad line --skip-bad-lines skipped, or " : "or ");
        else
            fprintf(stderr, "tokenize: %s: no examples (finetune would refuse it)\n", data);
        return 1;
    }
    const bool ok = fwrite(out.data(), 1, out.size(), stdout) == out.size() && fflush(stdout) == 0;
    if (!ok) {
        fprintf(stderr, "tokenize: cannot write the tokens: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}

// a whole number in [lo, hi], or -1 (with the message and the usage)
static long long whole_arg(const char *flag, const char *s, long long lo, long long hi) {
    long long v = 0;
    if (parse_whole(s, lo, hi, &v)) return v;
    bad_args("%s: '%s' is not a whole number in [%lld, %lld]", flag, s, lo, hi);
    return -1;
}

int main(int argc, char **argv) {
    const char *model = nullptr, *prompt = nullptr, *file = nullptr, *data = nullptr, *line_s = nullptr, *chat = nullptr,
               *seq_s = nullptr;
    bool add_special = true, parse_special = false, add_eos = true, skip_bad = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = nullptr;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) dst = &model;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) dst = &prompt;
        else if (!strcmp(a, "-f") || !strcmp(a, "--file")) dst = &file;
        else if (!strcmp(a, "--data")) dst = &data;
        else if (!strcmp(a, "--line")) dst = &line_s;
        else if (!strcmp(a, "--chat-template")) dst = &chat;
        else if (!strcmp(a, "--seq-len")) dst = &seq_s;
        else if (!strcmp(a, "--no-bos")) add_special = false;
        else if (!strcmp(a, "--parse-special")) parse_special = true;
        else if (!strcmp(a, "--no-eos")) add_eos = false;
        else if (!strcmp(a, "--skip-bad-lines")) skip_bad = true;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("%s\n", USAGE);
            return 0;
        } else return bad_args("unknown argument '%s'", a);
        if (dst) {
            if (i + 1 >= argc) return bad_args("%s needs a value", a);
            if (*dst) return bad_args("%s given twice", a);
            *dst = argv[++i];
        }
    }
    if (!model) return bad_args("no model: give -m model.gguf");
    long long line_no = 0, seq_len = 0;
    if (data) {
        if (prompt || file) return bad_args("--data shows a JSONL file's examples: -p and -f do not go with it");
        if (!add_special || parse_special)
            return bad_args("--data renders as finetune does: %s does not go with it", !add_special ? "--no-bos" : "--parse-special");
        if (line_s && (line_no = whole_arg("--line", line_s, 1, LLONG_MAX)) < 0) return 2;
        if (seq_s && (seq_len = whole_arg("--seq-len", seq_s, 2, 1 << 20)) < 0) return 2;
    } else {
        if (line_s || chat || seq_s || !add_eos || skip_bad)
            return bad_args("%s goes with --data FILE.jsonl", line_s ? "--line" : chat ? "--chat-template" : seq_s ? "--seq-len"
                                                              : !add_eos ? "--no-eos" : "--skip-bad-lines");
        if (!prompt == !file) return bad_args("give exactly one of -p TEXT, -f FILE and --data FILE.jsonl");
    }

    std::string text;
    if (prompt) text = prompt;
    else if (file && !read_file(file, &text)) return 1;

    char err[512];
    ql_gguf *g = ql_gguf_open(model, err, sizeof(err));
    if (!g) {
        fprintf(stderr, "tokenize: %s\n", err);
        return 1;
    }
    owned<ql_gguf> g_(g, ql_gguf_close);
    ql_vocab *v = ql_vocab_load(g, err, sizeof(err));
    owned<ql_vocab> v_(v, ql_vocab_free);
    if (!v) {
        fprintf(stderr, "tokenize: %s: %s\n", model, err);
        return 1;
    }
    if (data) return show_data(g, v, data, line_no, chat, seq_len, add_eos, skip_bad);
    const std::vector<int32_t> ids = ql_tokenize(v, text, add_special, parse_special);
    std::string line;
    for (size_t i = 0; i < ids.size(); i++) {
        if (i) line += ' ';
        line += std::to_string(ids[i]);
    }
    line += '\n';
    const bool ok = fwrite(line.data(), 1, line.size(), stdout) == line.size() && fflush(stdout) == 0;
    if (!ok) {
        fprintf(stderr, "tokenize: cannot write the ids: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}
