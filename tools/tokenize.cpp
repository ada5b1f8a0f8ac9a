// tools/tokenize - text to token ids with a GGUF file's vocabulary, as llama.cpp tokenizes.
//
//   ./tokenize -m model.gguf (-p TEXT | -f FILE) [--no-bos] [--parse-special]
//
// Prints the ids on one line, separated by spaces. BOS (and EOS) are added as the vocabulary's
// add_bos_token / add_eos_token say, unless --no-bos; --parse-special turns control-token texts
// in the input (e.g. "<|eot_id|>") into those tokens instead of tokenizing them as text.
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "own.h"

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

static const char USAGE[] = "usage: tokenize -m model.gguf (-p TEXT | -f FILE) [--no-bos] [--parse-special]";

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

int main(int argc, char **argv) {
    const char *model = nullptr, *prompt = nullptr, *file = nullptr;
    bool add_special = true, parse_special = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = nullptr;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) dst = &model;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) dst = &prompt;
        else if (!strcmp(a, "-f") || !strcmp(a, "--file")) dst = &file;
        else if (!strcmp(a, "--no-bos")) add_special = false;
        else if (!strcmp(a, "--parse-special")) parse_special = true;
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
    if (!prompt == !file) return bad_args("give exactly one of -p TEXT and -f FILE");

    std::string text;
    if (prompt) text = prompt;
    else if (!read_file(file, &text)) return 1;

    char err[512];
    ql_gguf *g = ql_gguf_open(model, err, sizeof(err));
    if (!g) {
        fprintf(stderr, "tokenize: %s\n", err);
        return 1;
    }
    ql_vocab *v = ql_vocab_load(g, err, sizeof(err));
    ql_gguf_close(g);  // the vocabulary keeps its own copies
    owned<ql_vocab> v_(v, ql_vocab_free);
    if (!v) {
        fprintf(stderr, "tokenize: %s: %s\n", model, err);
        return 1;
    }
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
