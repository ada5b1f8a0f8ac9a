// models/tokenizer.cpp - llama.cpp-exact tokenizers over a GGUF vocabulary, and two converters.
//
// The behaviour follows llama.cpp's src/llama-vocab.cpp (llm_tokenizer_spm, llm_tokenizer_bpe,
// tokenizer_st_partition, token_to_piece, the load-time defaults) and src/unicode.cpp (the
// hand-written GPT-2 and Llama-3 splitters, bytes_to_unicode, the UTF-8 decoder), read for what
// they do; the code here is written independently. Where llama.cpp throws or aborts on odd
// input, this file picks a defined result instead and says so with a `// deviation:` comment.
//
// Reading order: errors -> Unicode -> pre-tokenizers -> the vocabulary (load) -> tokenize
// (special-token partition, SPM, BPE) -> pieces -> converters.
#include "tokenizer.h"
#include "json.h"  // the UTF-8 helpers

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string_view>
#include <unordered_map>
#include <vector>

// ============================================================================================
// errors
// ============================================================================================

static void tok_err(char *err, size_t err_size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void tok_err(char *err, size_t err_size, const char *fmt, ...) {
    if (!err || !err_size) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
    for (char *p = err; *p; p++)  // one line, whatever ended up in the message
        if (*p == '\n' || *p == '\r') *p = ' ';
}

// a token's text for an error message: printable ASCII kept, the rest as \xNN, cut at 40 bytes
static std::string printable(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size() && i < 40; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f) out += (char)c;
        else {
            char b[5];
            snprintf(b, sizeof(b), "\\x%02x", c);
            out += b;
        }
    }
    if (s.size() > 40) out += "...";
    return out;
}

// ============================================================================================
// Unicode: code point flags (models/unicode-data.inc), UTF-8, GPT-2's byte <-> unicode map
// ============================================================================================

#include "unicode-data.inc"

enum {  // llama.cpp's unicode_cpt_flags bits, the values the generated table uses
    UCD_UNDEFINED   = 0x001,
    UCD_NUMBER      = 0x002,
    UCD_LETTER      = 0x004,
    UCD_SEPARATOR   = 0x008,
    UCD_MARK        = 0x010,
    UCD_PUNCTUATION = 0x020,
    UCD_SYMBOL      = 0x040,
    UCD_CONTROL     = 0x080,
    UCD_WHITESPACE  = 0x100,
};
static const uint32_t UCD_MAX_CODEPOINT = 0x10FFFF;

static uint16_t ucd_lookup(uint32_t cp) {
    if (cp > UCD_MAX_CODEPOINT) return UCD_UNDEFINED;  // llama.cpp: past the table is "undefined"
    const size_t n = sizeof(ql_unicode_ranges) / sizeof(ql_unicode_ranges[0]);
    size_t lo = 0, hi = n;  // last entry whose first code point <= cp
    while (hi - lo > 1) {
        const size_t mid = (lo + hi) / 2;
        if (ql_unicode_ranges[mid][0] <= cp) lo = mid;
        else hi = mid;
    }
    return (uint16_t)ql_unicode_ranges[lo][1];
}

static uint16_t ucd_flags(uint32_t cp) {
    static const std::vector<uint16_t> low = [] {  // the first 64K without a search
        std::vector<uint16_t> t(0x10000);
        for (uint32_t c = 0; c < 0x10000; c++) t[c] = ucd_lookup(c);
        return t;
    }();
    return cp < 0x10000 ? low[cp] : ucd_lookup(cp);
}

// llama.cpp's decoder (unicode_cpt_from_utf8 + unicode_cpts_from_utf8): a lead byte whose
// continuation bytes are missing or malformed gives U+FFFD and consumes that one byte; overlong
// forms and surrogates are not checked.
// deviation: sequences above U+10FFFF (lead bytes F4..F7) are replaced too; llama.cpp decodes
// them and later throws when re-encoding them.
static uint32_t utf8_next(std::string_view s, size_t *off) {
    const size_t o = *off;
    const unsigned char c0 = (unsigned char)s[o];
    auto cont = [&](size_t k) { return o + k < s.size() && ((unsigned char)s[o + k] & 0xC0) == 0x80; };
    if (!(c0 & 0x80)) {
        *off += 1;
        return c0;
    }
    if ((c0 & 0x40) && !(c0 & 0x20) && cont(1)) {
        *off += 2;
        return ((c0 & 0x1Fu) << 6) | ((unsigned char)s[o + 1] & 0x3Fu);
    }
    if ((c0 & 0x40) && (c0 & 0x20) && !(c0 & 0x10) && cont(1) && cont(2)) {
        *off += 3;
        return ((c0 & 0x0Fu) << 12) | (((unsigned char)s[o + 1] & 0x3Fu) << 6) | ((unsigned char)s[o + 2] & 0x3Fu);
    }
    if ((c0 & 0x40) && (c0 & 0x20) && (c0 & 0x10) && !(c0 & 0x08) && cont(1) && cont(2) && cont(3)) {
        const uint32_t cp = ((c0 & 0x07u) << 18) | (((unsigned char)s[o + 1] & 0x3Fu) << 12) |
                            (((unsigned char)s[o + 2] & 0x3Fu) << 6) | ((unsigned char)s[o + 3] & 0x3Fu);
        if (cp <= UCD_MAX_CODEPOINT) {
            *off += 4;
            return cp;
        }
    }
    *off += 1;
    return 0xFFFD;
}

// how many bytes SentencePiece-style splitting takes for a character, from its first byte
// (llama.cpp's unicode_len_utf8: continuation and invalid bytes count as one)
static size_t utf8_len(char c) {
    static const uint8_t len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[(unsigned char)c >> 4];
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// take U+0100.. in byte order, so every byte has a visible, non-space character.
struct byte_map {
    std::string utf8[256];  // byte -> its character, UTF-8
    int16_t byte_of[0x144]; // code point -> byte, or -1 (the largest code point used is U+0143)
    byte_map() {
        uint32_t cp_of[256];
        int n = 0;
        for (int b = 0; b < 256; b++) {
            const bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            cp_of[b] = self ? (uint32_t)b : (uint32_t)(256 + n++);
        }
        for (int16_t &x : byte_of) x = -1;
        for (int b = 0; b < 256; b++) {
            ql_utf8_append(utf8[b], cp_of[b]);
            byte_of[cp_of[b]] = (int16_t)b;
        }
    }
};
static const byte_map &bytes_unicode() {
    static const byte_map m;
    return m;
}

static std::string bytes_to_unicode_text(std::string_view bytes) {
    const byte_map &m = bytes_unicode();
    std::string out;
    out.reserve(bytes.size() * 2);
    for (unsigned char c : bytes) out += m.utf8[c];
    return out;
}

// ============================================================================================
// pre-tokenizers: split a fragment into words, as lengths in code points (llama.cpp's
// "offsets"). Each splitter runs over every piece of the previous split separately, so one can
// follow another (the "default" pre-tokenizer chains four).
// ============================================================================================

enum pre_kind { PRE_DEFAULT, PRE_GPT2, PRE_LLAMA3, PRE_QWEN2, PRE_COUNT };
static const char *const PRE_NAMES[] = {"default", "gpt-2", "llama3", "qwen2"};
static_assert(sizeof(PRE_NAMES) / sizeof(PRE_NAMES[0]) == PRE_COUNT, "PRE_NAMES");

struct split_text {
    std::vector<uint32_t> cpt;   // the fragment's code points
    std::vector<uint16_t> flags; // their flags
};

static const uint32_t OUT_OF_RANGE = 0xFFFFFFFF;

// One piece [ini, end) of cpt; positions past the piece read as OUT_OF_RANGE / no flags, as in
// llama.cpp's _get_cpt/_get_flags. add(e) closes the word that ends at e.
struct piece_cursor {
    const split_text &t;
    size_t ini, end, prev;
    std::vector<size_t> &out;
    uint32_t cpt(size_t p) const { return p < end ? t.cpt[p] : OUT_OF_RANGE; }
    uint16_t flags(size_t p) const { return p < end ? t.flags[p] : 0; }
    void add(size_t e) {
        if (e > prev) out.push_back(e - prev);
        prev = e;
    }
};

static uint32_t ascii_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

// 's 't 're 've 'm 'll 'd at pos: the length of the match, or 0. case_insensitive: the Llama-3
// form (llama.cpp lower-cases with Unicode's simple mapping, which only maps ASCII onto these
// letters: tests/reference/gen_unicode.py checks it).
static size_t contraction(const piece_cursor &c, size_t pos, bool case_insensitive) {
    if (c.cpt(pos) != '\'' || pos + 1 >= c.end) return 0;
    auto low = [&](uint32_t x) { return case_insensitive ? ascii_lower(x) : x; };
    const uint32_t n1 = low(c.cpt(pos + 1));
    if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') return 2;
    if (pos + 2 < c.end) {
        const uint32_t n2 = low(c.cpt(pos + 2));
        if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) return 3;
    }
    return 0;
}

// GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (llama.cpp's unicode_regex_split_custom_gpt2, step for step)
static void split_gpt2_piece(piece_cursor &c) {
    const uint16_t WLN = UCD_WHITESPACE | UCD_LETTER | UCD_NUMBER;
    size_t pos = c.ini;
    while (pos < c.end) {
        const uint32_t cp = c.cpt(pos);
        const uint16_t f = c.flags(pos);
        if (const size_t n = contraction(c, pos, false)) {
            pos += n;
            c.add(pos);
            continue;
        }
        uint16_t f2 = cp == ' ' ? c.flags(pos + 1) : f;
        if (f2 & UCD_LETTER) {  // <space>?\p{L}+
            pos += (cp == ' ');
            while (f2 & UCD_LETTER) f2 = c.flags(++pos);
            c.add(pos);
            continue;
        }
        if (f2 & UCD_NUMBER) {  // <space>?\p{N}+
            pos += (cp == ' ');
            while (f2 & UCD_NUMBER) f2 = c.flags(++pos);
            c.add(pos);
            continue;
        }
        if (!(f2 & WLN) && f2) {  // <space>?[^\s\p{L}\p{N}]+
            pos += (cp == ' ');
            while (!(f2 & WLN) && f2) f2 = c.flags(++pos);
            c.add(pos);
            continue;
        }
        size_t n_ws = 0;
        while (c.flags(pos + n_ws) & UCD_WHITESPACE) n_ws++;
        if (n_ws > 1 && c.cpt(pos + n_ws) != OUT_OF_RANGE) {  // \s+(?!\S)
            pos += n_ws - 1;
            c.add(pos);
            continue;
        }
        if (n_ws > 0) {  // \s+
            pos += n_ws;
            c.add(pos);
            continue;
        }
        c.add(++pos);  // no match: one code point
    }
}

// Llama 3 (max_digits 3):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// Qwen2 (max_digits 1) is the same expression with \p{N} alone. llama.cpp runs Qwen2's through
// std::regex; this is the Llama-3 splitter (unicode_regex_split_custom_llama3, step for step)
// with single digits, which reads the expression the same way.
static void split_llama3_piece(piece_cursor &c, size_t max_digits) {
    const uint16_t WLN = UCD_WHITESPACE | UCD_LETTER | UCD_NUMBER;
    size_t pos = c.ini;
    while (pos < c.end) {
        const uint32_t cp = c.cpt(pos);
        const uint16_t f = c.flags(pos);
        if (const size_t n = contraction(c, pos, true)) {
            pos += n;
            c.add(pos);
            continue;
        }
        if (!(cp == '\r' || cp == '\n' || (f & UCD_NUMBER))) {  // [^\r\n\p{L}\p{N}]?\p{L}+
            if ((f & UCD_LETTER) || (c.flags(pos + 1) & UCD_LETTER)) {
                pos++;
                while (c.flags(pos) & UCD_LETTER) pos++;
                c.add(pos);
                continue;
            }
        }
        if (f & UCD_NUMBER) {  // \p{N}{1,max_digits}
            size_t ini = pos;
            while (c.flags(pos) & UCD_NUMBER) {
                if (++pos - ini >= max_digits) {
                    c.add(pos);
                    ini = pos;
                }
            }
            c.add(pos);
            continue;
        }
        // <space>?[^\s\p{L}\p{N}]+[\r\n]* - llama.cpp tests the current code point's flags (f)
        // here, not f2; kept, it decides nothing different because f is never empty in range
        uint16_t f2 = cp == ' ' ? c.flags(pos + 1) : f;
        if (!(f2 & WLN) && f) {
            pos += (cp == ' ');
            while (!(f2 & WLN) && f2) f2 = c.flags(++pos);
            uint32_t c2 = c.cpt(pos);
            while (c2 == '\r' || c2 == '\n') c2 = c.cpt(++pos);
            c.add(pos);
            continue;
        }
        size_t n_ws = 0, last_rn = 0;
        while (c.flags(pos + n_ws) & UCD_WHITESPACE) {
            const uint32_t c2 = c.cpt(pos + n_ws);
            if (c2 == '\r' || c2 == '\n') last_rn = pos + n_ws + 1;
            n_ws++;
        }
        if (last_rn > 0) {  // \s*[\r\n]+
            pos = last_rn;
            c.add(pos);
            continue;
        }
        if (n_ws > 1 && c.cpt(pos + n_ws) != OUT_OF_RANGE) {  // \s+(?!\S)
            pos += n_ws - 1;
            c.add(pos);
            continue;
        }
        if (n_ws > 0) {  // \s+
            pos += n_ws;
            c.add(pos);
            continue;
        }
        c.add(++pos);
    }
}

// "X+" as llama.cpp's std::regex fallback splits: maximal runs of code points that match become
// words, and so do the stretches between them.
template <class Pred>
static void split_runs_piece(piece_cursor &c, Pred match) {
    size_t pos = c.ini;
    while (pos < c.end) {
        if (match(pos)) {
            c.add(pos);
            while (pos < c.end && match(pos)) pos++;
            c.add(pos);
        } else {
            pos++;
        }
    }
    c.add(c.end);
}

template <class Piece>
static std::vector<size_t> split_pass(const split_text &t, const std::vector<size_t> &in, Piece piece) {
    std::vector<size_t> out;
    out.reserve(in.size() + in.size() / 4 + 4);
    size_t start = 0;
    for (size_t len : in) {
        piece_cursor c{t, start, start + len, start, out};
        piece(c);
        start += len;
    }
    return out;
}

// The words of one fragment, each already in byte-level form (GPT-2's byte -> unicode map over
// its UTF-8 bytes, malformed input re-encoded as U+FFFD first, as llama.cpp does).
static std::vector<std::string> pre_tokenize(pre_kind kind, std::string_view text) {
    split_text t;
    t.cpt.reserve(text.size());
    for (size_t off = 0; off < text.size();) t.cpt.push_back(utf8_next(text, &off));
    t.flags.resize(t.cpt.size());
    for (size_t i = 0; i < t.cpt.size(); i++) t.flags[i] = ucd_flags(t.cpt[i]);

    std::vector<size_t> lens = {t.cpt.size()};
    switch (kind) {
    case PRE_GPT2:
        lens = split_pass(t, lens, [](piece_cursor &c) { split_gpt2_piece(c); });
        break;
    case PRE_LLAMA3:
        lens = split_pass(t, lens, [](piece_cursor &c) { split_llama3_piece(c, 3); });
        break;
    case PRE_QWEN2:
        lens = split_pass(t, lens, [](piece_cursor &c) { split_llama3_piece(c, 1); });
        break;
    case PRE_DEFAULT:
    case PRE_COUNT: {
        // llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT chain: "[\p{P}\$\+<=>\^~\|]+", then GPT-2's
        // expression, then "\p{N}+", then "[0-9][0-9][0-9]". Its std::regex passes see
        // non-ASCII code points through one byte per category (whitespace first), so \p{P}
        // and \p{N} mean: ASCII by the character itself, the rest by category and not
        // whitespace.
        auto cat = [&](size_t p, uint16_t want) {
            const uint32_t cp = t.cpt[p];
            const uint16_t f = t.flags[p];
            return (f & want) && (cp < 0x80 || !(f & UCD_WHITESPACE));
        };
        lens = split_pass(t, lens, [&](piece_cursor &c) {
            split_runs_piece(c, [&](size_t p) {
                const uint32_t cp = t.cpt[p];
                return cat(p, UCD_PUNCTUATION) || cp == '$' || cp == '+' || cp == '<' || cp == '=' || cp == '>' ||
                       cp == '^' || cp == '~' || cp == '|';
            });
        });
        lens = split_pass(t, lens, [](piece_cursor &c) { split_gpt2_piece(c); });
        lens = split_pass(t, lens, [&](piece_cursor &c) {
            split_runs_piece(c, [&](size_t p) { return cat(p, UCD_NUMBER); });
        });
        lens = split_pass(t, lens, [&](piece_cursor &c) {  // leftmost non-overlapping digit triples
            auto digit = [&](size_t p) { return p < c.end && t.cpt[p] >= '0' && t.cpt[p] <= '9'; };
            size_t pos = c.ini;
            while (pos < c.end) {
                if (digit(pos) && digit(pos + 1) && digit(pos + 2)) {
                    c.add(pos);
                    pos += 3;
                    c.add(pos);
                } else {
                    pos++;
                }
            }
            c.add(c.end);
        });
        break;
    }
    }

    const byte_map &bm = bytes_unicode();
    std::vector<std::string> words;
    words.reserve(lens.size());
    std::string utf8;
    size_t start = 0;
    for (size_t len : lens) {
        utf8.clear();
        for (size_t i = start; i < start + len; i++) ql_utf8_append(utf8, t.cpt[i]);
        std::string w;
        w.reserve(utf8.size() * 2);
        for (unsigned char b : utf8) w += bm.utf8[b];
        words.push_back(std::move(w));
        start += len;
    }
    return words;
}

// ============================================================================================
// the vocabulary
// ============================================================================================

enum tok_attr : uint8_t {  // llama.cpp's token attributes (the subset its tokenizers read)
    ATTR_UNKNOWN      = 1 << 0,
    ATTR_UNUSED       = 1 << 1,
    ATTR_NORMAL       = 1 << 2,
    ATTR_CONTROL      = 1 << 3,
    ATTR_USER_DEFINED = 1 << 4,
    ATTR_BYTE         = 1 << 5,
};

enum vocab_kind { VOCAB_SPM, VOCAB_BPE };

struct bpe_merge {
    int32_t rank;
    int32_t result;  // the merged text's token id, or -1 when it is not a token
};

struct ql_vocab {
    vocab_kind kind = VOCAB_SPM;
    pre_kind pre = PRE_DEFAULT;
    bool ignore_merges = false;  // a word that is itself a token skips the merges (Llama 3)
    bool spm_word_chunks = false;  // SPM: no token has "▁" after another character (see tokenize_spm)
    bool add_space_prefix = false;
    bool add_bos = false, add_eos = false;
    int32_t bos = -1, eos = -1, eot = -1, eom = -1, unk = -1, pad = -1;

    std::vector<std::string> text;
    std::vector<float> score;
    std::vector<int32_t> file_type;  // tokenizer.ggml.token_type as stored
    std::vector<uint8_t> attr;
    std::vector<uint8_t> byte_value;  // BYTE tokens: the byte their <0xXX> text names
    std::unordered_map<std::string_view, int32_t> id_of;  // views into `text`, which never changes after load
    std::unordered_map<uint64_t, bpe_merge> merges;       // (left id << 32 | right id)
    std::vector<int32_t> specials;  // control / user-defined / unknown ids, longest text first
    std::vector<bool> eog;
    int32_t byte_token[256];        // SPM byte fallback: <0xXX> (or the byte itself) -> id, or -1
    int32_t single_byte_token[256]; // BPE: a one-byte string -> id, or -1

    int32_t find(std::string_view s) const {
        auto it = id_of.find(s);
        return it == id_of.end() ? -1 : it->second;
    }
};

static const char *const KEY_MODEL = "tokenizer.ggml.model";
static const char *const KEY_PRE = "tokenizer.ggml.pre";
static const char *const KEY_TOKENS = "tokenizer.ggml.tokens";
static const char *const KEY_SCORES = "tokenizer.ggml.scores";
static const char *const KEY_TYPES = "tokenizer.ggml.token_type";
static const char *const KEY_MERGES = "tokenizer.ggml.merges";
static const char *const KEY_BOS = "tokenizer.ggml.bos_token_id";
static const char *const KEY_EOS = "tokenizer.ggml.eos_token_id";
static const char *const KEY_EOT = "tokenizer.ggml.eot_token_id";
static const char *const KEY_EOM = "tokenizer.ggml.eom_token_id";
static const char *const KEY_UNK = "tokenizer.ggml.unknown_token_id";
static const char *const KEY_PAD = "tokenizer.ggml.padding_token_id";
static const char *const KEY_ADD_BOS = "tokenizer.ggml.add_bos_token";
static const char *const KEY_ADD_EOS = "tokenizer.ggml.add_eos_token";
static const char *const KEY_ADD_PREFIX = "tokenizer.ggml.add_space_prefix";

// tokenizer.ggml.pre names llama.cpp maps onto the three splits this file implements, with the
// flags it sets for them (add_bos: the default before tokenizer.ggml.add_bos_token).
struct pre_alias {
    const char *name;
    pre_kind kind;
    bool ignore_merges, add_bos;
};
static const pre_alias PRE_ALIASES[] = {
    {"default", PRE_DEFAULT, false, false},
    {"gpt-2", PRE_GPT2, false, false},     {"phi-2", PRE_GPT2, false, false},
    {"mpt", PRE_GPT2, false, false},       {"olmo", PRE_GPT2, false, false},
    {"jais", PRE_GPT2, false, false},      {"gigachat", PRE_GPT2, false, false},
    {"exaone4", PRE_GPT2, false, false},   {"a.x-4.0", PRE_GPT2, false, false},
    {"mellum", PRE_GPT2, false, false},    {"trillion", PRE_GPT2, false, false},
    {"granite-docling", PRE_GPT2, false, false},
    {"llama3", PRE_LLAMA3, true, true},    {"llama-v3", PRE_LLAMA3, true, true},
    {"llama-bpe", PRE_LLAMA3, true, true}, {"falcon3", PRE_LLAMA3, true, true},
    {"falcon-h1", PRE_LLAMA3, true, true}, {"pixtral", PRE_LLAMA3, true, true},
    {"midm-2.0", PRE_LLAMA3, true, true},  {"lfm2", PRE_LLAMA3, true, true},
    {"dbrx", PRE_LLAMA3, false, false},    {"smaug-bpe", PRE_LLAMA3, false, false},
    {"qwen2", PRE_QWEN2, false, false},    {"deepseek-r1-qwen", PRE_QWEN2, false, false},
    {"megrez", PRE_QWEN2, false, false},   {"stablelm2", PRE_QWEN2, false, false},
    {"hunyuan", PRE_QWEN2, false, false},  {"kormo", PRE_QWEN2, false, false},
    {"grok-2", PRE_QWEN2, false, false},   {"solar-open", PRE_QWEN2, false, false},
};

// texts llama.cpp recognises when the file names no id (first match in this order; llama.cpp
// walks a hash map, so among several candidates its pick is unspecified)
static const char *const EOT_TEXTS[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                                        "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>",
                                        "<end_of_utterance>"};
static const char *const FIM_PAD_TEXTS[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
static const char *const FIM_REP_TEXTS[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"};
static const char *const FIM_SEP_TEXTS[] = {"<|file_sep|>"};
// tokens that end generation by their text alone
static const char *const EOG_TEXTS[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>", "[e~["};
// limitation: llama.cpp's model-specific fix-ups (gpt-oss dropping <|end|> from end-of-generation,
// gemma4 dropping </s>, phi-3 / jina strip flags, gpt-oss channel tokens made user-defined) are
// left out: none of them applies to the llama / qwen2 families this project targets.

struct load_ctx {
    const ql_gguf *g;
    char *err;
    size_t err_size;
};

// an optional string key: true with *out set (or untouched when absent); false on a wrong type
static bool get_str_key(const load_ctx &c, const char *key, std::string *out, bool *present) {
    const int64_t i = ql_gguf_find_kv(c.g, key);
    *present = i >= 0;
    if (i < 0) return true;
    size_t len = 0;
    const char *s = ql_gguf_get_str(c.g, i, &len);
    if (!s) {
        tok_err(c.err, c.err_size, "%s is not a string", key);
        return false;
    }
    out->assign(s, len);
    return true;
}

static bool get_bool_key(const load_ctx &c, const char *key, bool *v) {
    const int64_t i = ql_gguf_find_kv(c.g, key);
    if (i < 0) return true;
    if (!ql_gguf_get_bool(c.g, i, v)) {
        tok_err(c.err, c.err_size, "%s is not a bool", key);
        return false;
    }
    return true;
}

// A special token id. As in llama.cpp an id outside the vocabulary keeps the default (llama.cpp
// logs a warning; some converted files carry a padding id one past the end).
static bool get_id_key(const load_ctx &c, const char *key, int32_t n_tokens, int32_t *id, bool *present) {
    const int64_t i = ql_gguf_find_kv(c.g, key);
    if (present) *present = false;
    if (i < 0) return true;
    int64_t v;
    if (!ql_gguf_get_i64(c.g, i, &v)) {
        tok_err(c.err, c.err_size, "%s is not an integer", key);
        return false;
    }
    if (v >= 0 && v < n_tokens) {
        *id = (int32_t)v;
        if (present) *present = true;
    }
    return true;
}

static int32_t find_first(const ql_vocab &v, const char *const *texts, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const int32_t id = v.find(texts[i]);
        if (id >= 0) return id;
    }
    return -1;
}

static bool load_tokens(const load_ctx &c, ql_vocab &v) {
    const int64_t ti = ql_gguf_find_kv(c.g, KEY_TOKENS);
    if (ti < 0) {
        tok_err(c.err, c.err_size, "no %s in the file", KEY_TOKENS);
        return false;
    }
    if (ql_gguf_arr_type(c.g, ti) != QL_GGUF_STRING) {
        tok_err(c.err, c.err_size, "%s is not an array of strings", KEY_TOKENS);
        return false;
    }
    const uint64_t n = ql_gguf_arr_n(c.g, ti);
    if (n == 0 || n > (uint64_t)INT32_MAX) {
        tok_err(c.err, c.err_size, "%s has %llu entries", KEY_TOKENS, (unsigned long long)n);
        return false;
    }
    v.text.resize((size_t)n);
    for (uint64_t j = 0; j < n; j++) {
        size_t len = 0;
        const char *s = ql_gguf_arr_str(c.g, ti, j, &len);
        if (len == 0) v.text[(size_t)j] = "[EMPTY_" + std::to_string(j) + "]";  // as llama.cpp names them
        else v.text[(size_t)j].assign(s, len);
    }

    v.score.assign((size_t)n, 0.0f);
    const int64_t si = ql_gguf_find_kv(c.g, KEY_SCORES);
    if (si >= 0) {
        const ql_gguf_type st = ql_gguf_arr_type(c.g, si);
        if (st != QL_GGUF_F32 && st != QL_GGUF_I32) {
            tok_err(c.err, c.err_size, "%s is not an array of f32 or i32", KEY_SCORES);
            return false;
        }
        if (ql_gguf_arr_n(c.g, si) != n) {
            tok_err(c.err, c.err_size, "%s has %llu entries for %llu tokens", KEY_SCORES,
                    (unsigned long long)ql_gguf_arr_n(c.g, si), (unsigned long long)n);
            return false;
        }
        const uint8_t *d = (const uint8_t *)ql_gguf_arr_data(c.g, si);
        for (size_t j = 0; j < (size_t)n; j++) {
            if (st == QL_GGUF_F32) {
                memcpy(&v.score[j], d + 4 * j, 4);
            } else {
                int32_t x;
                memcpy(&x, d + 4 * j, 4);
                v.score[j] = (float)x;
            }
        }
    }

    v.file_type.assign((size_t)n, QL_TOKEN_NORMAL);
    const int64_t yi = ql_gguf_find_kv(c.g, KEY_TYPES);
    if (yi >= 0) {
        if (ql_gguf_arr_type(c.g, yi) != QL_GGUF_I32) {
            tok_err(c.err, c.err_size, "%s is not an array of i32", KEY_TYPES);
            return false;
        }
        if (ql_gguf_arr_n(c.g, yi) != n) {
            tok_err(c.err, c.err_size, "%s has %llu entries for %llu tokens", KEY_TYPES,
                    (unsigned long long)ql_gguf_arr_n(c.g, yi), (unsigned long long)n);
            return false;
        }
        memcpy(v.file_type.data(), ql_gguf_arr_data(c.g, yi), 4 * (size_t)n);
    }
    v.attr.resize((size_t)n);
    v.byte_value.assign((size_t)n, 0);
    for (size_t j = 0; j < (size_t)n; j++) {
        switch (v.file_type[j]) {
        case QL_TOKEN_NORMAL: v.attr[j] = ATTR_NORMAL; break;
        case QL_TOKEN_UNKNOWN: v.attr[j] = ATTR_UNKNOWN; break;
        case QL_TOKEN_CONTROL: v.attr[j] = ATTR_CONTROL; break;
        case QL_TOKEN_USER_DEFINED: v.attr[j] = ATTR_USER_DEFINED; break;
        case QL_TOKEN_UNUSED: v.attr[j] = ATTR_UNUSED; break;
        case QL_TOKEN_BYTE: v.attr[j] = ATTR_BYTE; break;
        default: v.attr[j] = 0; break;  // undefined: rendered as nothing, like llama.cpp
        }
        if (v.attr[j] & ATTR_BYTE) {  // llama.cpp: strtol(text.substr(3, 2), 16)
            const std::string hex = v.text[j].size() > 3 ? v.text[j].substr(3, 2) : std::string();
            v.byte_value[j] = (uint8_t)strtol(hex.c_str(), nullptr, 16);
        }
    }

    v.id_of.reserve((size_t)n);
    for (size_t j = 0; j < (size_t)n; j++) {
        auto r = v.id_of.emplace(std::string_view(v.text[j]), (int32_t)j);
        if (!r.second) {
            tok_err(c.err, c.err_size, "duplicate token in %s: '%s' has ids %d and %zu", KEY_TOKENS,
                    printable(v.text[j]).c_str(), r.first->second, j);
            return false;
        }
    }
    return true;
}

static bool load_merges(const load_ctx &c, ql_vocab &v) {
    const int64_t mi = ql_gguf_find_kv(c.g, KEY_MERGES);
    if (mi < 0) {
        tok_err(c.err, c.err_size, "a \"gpt2\" vocabulary needs %s, and the file has none", KEY_MERGES);
        return false;
    }
    if (ql_gguf_arr_type(c.g, mi) != QL_GGUF_STRING) {
        tok_err(c.err, c.err_size, "%s is not an array of strings", KEY_MERGES);
        return false;
    }
    const uint64_t n = ql_gguf_arr_n(c.g, mi);
    if (n > (uint64_t)INT32_MAX) {
        tok_err(c.err, c.err_size, "%s has %llu entries", KEY_MERGES, (unsigned long long)n);
        return false;
    }
    v.merges.reserve((size_t)n);
    for (uint64_t j = 0; j < n; j++) {
        size_t len = 0;
        const char *s = ql_gguf_arr_str(c.g, mi, j, &len);
        const std::string_view m(s, len);
        // split at the first space after the first byte, so a merge may start with a space token
        const size_t sp = len > 1 ? m.find(' ', 1) : std::string_view::npos;
        if (sp == std::string_view::npos) {
            tok_err(c.err, c.err_size, "%s[%llu] '%s' is not two tokens separated by a space", KEY_MERGES,
                    (unsigned long long)j, printable(m).c_str());
            return false;
        }
        const std::string_view a = m.substr(0, sp), b = m.substr(sp + 1);
        const int32_t ia = v.find(a), ib = v.find(b);
        if (ia < 0 || ib < 0) {
            tok_err(c.err, c.err_size, "%s[%llu] '%s' names '%s', which is not a token", KEY_MERGES,
                    (unsigned long long)j, printable(m).c_str(), printable(ia < 0 ? a : b).c_str());
            return false;
        }
        std::string ab(a);
        ab += b;
        // the first occurrence of a pair keeps its rank, as in llama.cpp (emplace)
        v.merges.emplace(((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib, bpe_merge{(int32_t)j, v.find(ab)});
    }
    return true;
}

static bool load_vocab(const load_ctx &c, ql_vocab &v) {
    std::string model, pre_name;
    bool has_model, has_pre;
    if (!get_str_key(c, KEY_MODEL, &model, &has_model)) return false;
    if (!has_model) {
        tok_err(c.err, c.err_size, "no vocabulary: the file has no %s", KEY_MODEL);
        return false;
    }
    if (!get_str_key(c, KEY_PRE, &pre_name, &has_pre)) return false;
    if (model == "llama") {
        v.kind = VOCAB_SPM;
    } else if (model == "gpt2") {
        v.kind = VOCAB_BPE;
    } else {
        tok_err(c.err, c.err_size, "%s '%s' is not supported (qlora reads \"llama\" and \"gpt2\")", KEY_MODEL,
                printable(model).c_str());
        return false;
    }
    if (!load_tokens(c, v)) return false;
    const int32_t n = (int32_t)v.text.size();

    // llama.cpp's defaults per model type, then the file's keys
    if (v.kind == VOCAB_SPM) {
        v.bos = 1, v.eos = 2, v.unk = 0;  // SentencePiece's ids
        v.pre = PRE_DEFAULT;              // SPM has no pre-tokenizer; llama.cpp records "default"
        v.add_space_prefix = true;
        v.add_bos = true, v.add_eos = false;
    } else {
        if (!load_merges(c, v)) return false;
        v.bos = 11, v.eos = 11;  // llama.cpp's BPE defaults (ids of no particular token)
        v.add_space_prefix = false;
        const std::string name = pre_name.empty() ? "default" : pre_name;  // llama.cpp: empty -> default
        const pre_alias *a = nullptr;
        for (const pre_alias &p : PRE_ALIASES)
            if (name == p.name) a = &p;
        if (!a) {
            tok_err(c.err, c.err_size, "%s '%s' is not a pre-tokenizer qlora implements (it reads the splits "
                    "\"default\", \"gpt-2\", \"llama3\"/\"llama-bpe\", \"qwen2\" and their llama.cpp aliases)",
                    KEY_PRE, printable(name).c_str());
            return false;
        }
        v.pre = a->kind;
        v.ignore_merges = a->ignore_merges;
        v.add_bos = a->add_bos;
    }
    for (int32_t *id : {&v.bos, &v.eos, &v.unk})
        if (*id >= n) *id = -1;  // a default outside a small vocabulary: none

    bool has_eot = false, has_eom = false;
    if (!get_id_key(c, KEY_BOS, n, &v.bos, nullptr) || !get_id_key(c, KEY_EOS, n, &v.eos, nullptr) ||
        !get_id_key(c, KEY_UNK, n, &v.unk, nullptr) || !get_id_key(c, KEY_PAD, n, &v.pad, nullptr) ||
        !get_id_key(c, KEY_EOT, n, &v.eot, &has_eot) || !get_id_key(c, KEY_EOM, n, &v.eom, &has_eom))
        return false;
    int32_t fim_pad = -1, fim_rep = -1, fim_sep = -1;
    bool has_fim_pad = false, has_fim_rep = false, has_fim_sep = false;
    if (!get_id_key(c, "tokenizer.ggml.fim_pad_token_id", n, &fim_pad, &has_fim_pad) ||
        !get_id_key(c, "tokenizer.ggml.fim_rep_token_id", n, &fim_rep, &has_fim_rep) ||
        !get_id_key(c, "tokenizer.ggml.fim_sep_token_id", n, &fim_sep, &has_fim_sep))
        return false;
    if (!get_bool_key(c, KEY_ADD_PREFIX, &v.add_space_prefix) || !get_bool_key(c, KEY_ADD_BOS, &v.add_bos) ||
        !get_bool_key(c, KEY_ADD_EOS, &v.add_eos))
        return false;
    if (v.add_bos && v.bos < 0) {
        tok_err(c.err, c.err_size, "%s is true, but %s is not set", KEY_ADD_BOS, KEY_BOS);
        return false;
    }
    if (v.add_eos && v.eos < 0) {
        tok_err(c.err, c.err_size, "%s is true, but %s is not set", KEY_ADD_EOS, KEY_EOS);
        return false;
    }

    // special tokens found by their text; llama.cpp makes each of them a control token
    auto by_text = [&](int32_t *id, bool present, const char *const *texts, size_t k) {
        if (!present) *id = find_first(v, texts, k);
        if (*id >= 0 && !present) v.attr[(size_t)*id] |= ATTR_CONTROL;
    };
    static const char *const EOM_TEXTS[] = {"<|eom_id|>"};
    by_text(&v.eot, has_eot, EOT_TEXTS, sizeof(EOT_TEXTS) / sizeof(EOT_TEXTS[0]));
    by_text(&v.eom, has_eom, EOM_TEXTS, 1);
    by_text(&fim_pad, has_fim_pad, FIM_PAD_TEXTS, sizeof(FIM_PAD_TEXTS) / sizeof(FIM_PAD_TEXTS[0]));
    by_text(&fim_rep, has_fim_rep, FIM_REP_TEXTS, sizeof(FIM_REP_TEXTS) / sizeof(FIM_REP_TEXTS[0]));
    by_text(&fim_sep, has_fim_sep, FIM_SEP_TEXTS, sizeof(FIM_SEP_TEXTS) / sizeof(FIM_SEP_TEXTS[0]));

    v.eog.assign((size_t)n, false);
    for (const char *t : EOG_TEXTS) {
        const int32_t id = v.find(t);
        if (id < 0) continue;
        v.eog[(size_t)id] = true;
        v.attr[(size_t)id] |= ATTR_CONTROL;
    }
    for (int32_t id : {v.eos, v.eot, v.eom, fim_pad, fim_rep, fim_sep})
        if (id >= 0) v.eog[(size_t)id] = true;

    for (int32_t id = 0; id < n; id++)
        if (v.attr[(size_t)id] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)) v.specials.push_back(id);
    // longest first, so "<|eot_id|>" wins over any shorter special inside it; llama.cpp sorts
    // with std::sort (ties in any order), ties here stay in id order
    std::stable_sort(v.specials.begin(), v.specials.end(),
                     [&](int32_t a, int32_t b) { return v.text[(size_t)a].size() > v.text[(size_t)b].size(); });

    if (v.kind == VOCAB_SPM) {  // tokenize_spm's chunking condition
        v.spm_word_chunks = true;
        for (const std::string &t : v.text) {
            for (size_t k = t.find("\xe2\x96\x81", 1); k != std::string::npos; k = t.find("\xe2\x96\x81", k + 1))
                if (k < 3 || t.compare(k - 3, 3, "\xe2\x96\x81") != 0) v.spm_word_chunks = false;
            if (!v.spm_word_chunks) break;
        }
    }

    static const char HEX[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        const char name[7] = {'<', '0', 'x', HEX[b >> 4], HEX[b & 15], '>', 0};
        const char one[1] = {(char)b};
        v.byte_token[b] = v.find(name);
        if (v.byte_token[b] < 0) v.byte_token[b] = v.find(std::string_view(one, 1));
        v.single_byte_token[b] = v.find(std::string_view(one, 1));
    }
    return true;
}

ql_vocab *ql_vocab_load(const ql_gguf *g, char *err, size_t err_size) {
    if (!g) {
        tok_err(err, err_size, "ql_vocab_load: no GGUF (NULL)");
        return nullptr;
    }
    ql_vocab *v = nullptr;
    try {
        v = new ql_vocab();
        const load_ctx c{g, err, err_size};
        if (!load_vocab(c, *v)) {
            delete v;
            return nullptr;
        }
        // a model whose embedding has fewer rows than the vocabulary has tokens: the first text
        // with a token beyond them would fail deep inside a graph - refused here, by name
        const int64_t ie = ql_gguf_find_tensor(g, "token_embd.weight");
        int64_t ne[4] = {0, 0, 0, 0};
        if (ie >= 0 && ql_gguf_tensor_ne(g, ie, ne) >= 2 && ne[1] < (int64_t)v->text.size()) {
            tok_err(err, err_size, "tokenizer.ggml.tokens has %zu tokens but token_embd.weight only %lld rows", v->text.size(),
                    (long long)ne[1]);
            delete v;
            return nullptr;
        }
    } catch (const std::bad_alloc &) {
        delete v;
        tok_err(err, err_size, "ql_vocab_load: out of memory");
        return nullptr;
    }
    return v;
}

void ql_vocab_free(ql_vocab *v) { delete v; }

int32_t ql_vocab_n_tokens(const ql_vocab *v) { return v ? (int32_t)v->text.size() : 0; }
const char *ql_vocab_model(const ql_vocab *v) { return !v ? "" : v->kind == VOCAB_SPM ? "llama" : "gpt2"; }
const char *ql_vocab_pre(const ql_vocab *v) { return v ? PRE_NAMES[v->pre] : ""; }
int32_t ql_vocab_bos(const ql_vocab *v) { return v ? v->bos : -1; }
int32_t ql_vocab_eos(const ql_vocab *v) { return v ? v->eos : -1; }
int32_t ql_vocab_eot(const ql_vocab *v) { return v ? v->eot : -1; }
int32_t ql_vocab_pad(const ql_vocab *v) { return v ? v->pad : -1; }
bool ql_vocab_add_bos(const ql_vocab *v) { return v && v->add_bos; }
bool ql_vocab_add_eos(const ql_vocab *v) { return v && v->add_eos; }

static bool valid_id(const ql_vocab *v, int32_t id) { return v && id >= 0 && (size_t)id < v->text.size(); }

bool ql_vocab_is_eog(const ql_vocab *v, int32_t id) { return valid_id(v, id) && v->eog[(size_t)id]; }
int ql_vocab_token_type(const ql_vocab *v, int32_t id) {
    return valid_id(v, id) ? v->file_type[(size_t)id] : QL_TOKEN_UNDEFINED;
}
const char *ql_vocab_token_text(const ql_vocab *v, int32_t id) {
    return valid_id(v, id) ? v->text[(size_t)id].c_str() : nullptr;
}
int32_t ql_vocab_find(const ql_vocab *v, const char *text) { return v && text ? v->find(text) : -1; }

// ============================================================================================
// tokenize
// ============================================================================================

struct fragment {
    int32_t token;  // >= 0: a special token; -1: raw text [off, off + len)
    size_t off, len;
};

// llama.cpp's tokenizer_st_partition: special tokens in turn, longest first, each splitting
// every raw fragment at all its occurrences. Without parse_special only user-defined tokens
// are looked for (control and unknown ones stay text), as Hugging Face's tokenizers do.
static std::vector<fragment> partition(const ql_vocab &v, const std::string &text, bool parse_special) {
    std::vector<fragment> frags;
    if (text.empty()) return frags;
    frags.push_back({-1, 0, text.size()});
    std::vector<fragment> next;
    for (int32_t id : v.specials) {
        const uint8_t a = v.attr[(size_t)id];
        if (!parse_special && (a & (ATTR_CONTROL | ATTR_UNKNOWN))) continue;
        const std::string &t = v.text[(size_t)id];
        next.clear();
        bool hit = false;
        for (const fragment &f : frags) {
            if (f.token >= 0) {
                next.push_back(f);
                continue;
            }
            const std::string_view all(text.data(), f.off + f.len);  // matches may not run past the fragment
            size_t pos = f.off;
            for (;;) {
                const size_t m = all.find(t, pos);
                if (m == std::string_view::npos) {
                    if (f.off + f.len > pos) next.push_back({-1, pos, f.off + f.len - pos});
                    break;
                }
                hit = true;
                if (m > pos) next.push_back({-1, pos, m - pos});
                next.push_back({id, 0, 0});
                pos = m + t.size();
            }
        }
        if (hit) frags.swap(next);
    }
    return frags;
}

// SentencePiece BPE (llm_tokenizer_spm): characters, then repeatedly the adjacent pair whose
// concatenation is the highest-scoring token (leftmost on ties), until no pair is a token.
struct spm_symbol {
    int prev, next;
    const char *text;
    size_t n;
};
struct spm_bigram {
    int left, right;
    float score;
    size_t size;
};
struct spm_cmp {  // top of the heap: highest score, then leftmost
    bool operator()(const spm_bigram &l, const spm_bigram &r) const {
        return l.score < r.score || (l.score == r.score && l.left > r.left);
    }
};

static void tokenize_spm_chunk(const ql_vocab &v, std::string_view text, std::vector<spm_symbol> &sym,
                               std::vector<spm_bigram> &heap, std::vector<int32_t> &out) {
    sym.clear();
    for (size_t off = 0; off < text.size();) {
        const size_t n = std::min(utf8_len(text[off]), text.size() - off);
        const int idx = (int)sym.size();
        sym.push_back({idx - 1, off + n == text.size() ? -1 : idx + 1, text.data() + off, n});
        off += n;
    }
    if (sym.empty()) return;
    heap.clear();  // a binary heap (std::push_heap / pop_heap)
    auto try_add = [&](int l, int r) {
        if (l < 0 || r < 0) return;
        const std::string_view s(sym[(size_t)l].text, sym[(size_t)l].n + sym[(size_t)r].n);
        const int32_t id = v.find(s);
        if (id < 0) return;
        heap.push_back({l, r, v.score[(size_t)id], s.size()});
        std::push_heap(heap.begin(), heap.end(), spm_cmp());
    };
    for (int i = 1; i < (int)sym.size(); i++) try_add(i - 1, i);
    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), spm_cmp());
        const spm_bigram b = heap.back();
        heap.pop_back();
        spm_symbol &l = sym[(size_t)b.left];
        spm_symbol &r = sym[(size_t)b.right];
        if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;  // one side merged since
        l.n += r.n;
        r.n = 0;
        l.next = r.next;
        if (r.next >= 0) sym[(size_t)r.next].prev = b.left;
        try_add(l.prev, b.left);
        try_add(b.left, l.next);
    }
    // every merged symbol is a token (merges only make tokens); a single character that is not
    // falls back to its bytes
    for (int i = 0; i != -1; i = sym[(size_t)i].next) {
        const spm_symbol &s = sym[(size_t)i];
        const int32_t id = v.find(std::string_view(s.text, s.n));
        if (id >= 0) {
            out.push_back(id);
            continue;
        }
        bool all = true;
        for (size_t j = 0; j < s.n; j++) all = all && v.byte_token[(unsigned char)s.text[j]] >= 0;
        if (all) {
            for (size_t j = 0; j < s.n; j++) out.push_back(v.byte_token[(unsigned char)s.text[j]]);
        } else if (v.unk >= 0) {
            // deviation: llama.cpp throws (std::out_of_range) when a vocabulary has no byte
            // tokens; SentencePiece without byte fallback gives <unk> for the character
            out.push_back(v.unk);
        }
    }
}

// every lead byte followed by the continuation bytes utf8_len promises, so that the symbols
// tokenize_spm_chunk makes are whole characters
static bool utf8_whole_chars(std::string_view s) {
    for (size_t off = 0; off < s.size();) {
        const unsigned char c = (unsigned char)s[off];
        const size_t n = utf8_len(s[off]);
        if ((c & 0xC0) == 0x80 || c >= 0xF8 || off + n > s.size()) return false;
        for (size_t k = 1; k < n; k++)
            if (((unsigned char)s[off + k] & 0xC0) != 0x80) return false;
        off += n;
    }
    return true;
}

// One SPM pass over a whole fragment keeps a heap as long as the text (llama.cpp's cost). When
// no token has "▁" right after another character (true of Llama 2's vocabulary: checked at
// load), no merge can ever join the character before a word-starting "▁" to it, so the
// fragment splits there into chunks that merge independently - and in the same order among
// themselves as in one pass (each pop is the best of its own chunk too): the same tokens,
// with a heap the size of a word.
static void tokenize_spm(const ql_vocab &v, const std::string &text, std::vector<int32_t> &out) {
    std::vector<spm_symbol> sym;
    std::vector<spm_bigram> heap;
    if (!v.spm_word_chunks || !utf8_whole_chars(text)) {
        tokenize_spm_chunk(v, text, sym, heap, out);
        return;
    }
    static const char SPACE[] = "\xe2\x96\x81";
    size_t start = 0;
    bool prev_space = false;
    for (size_t off = 0; off < text.size();) {
        const size_t n = utf8_len(text[off]);
        const bool space = n == 3 && text.compare(off, 3, SPACE) == 0;
        if (space && !prev_space && off > start) {
            tokenize_spm_chunk(v, std::string_view(text).substr(start, off - start), sym, heap, out);
            start = off;
        }
        prev_space = space;
        off += n;
    }
    tokenize_spm_chunk(v, std::string_view(text).substr(start), sym, heap, out);
}

// byte-level BPE (llm_tokenizer_bpe): per word, characters, then repeatedly the adjacent pair
// with the lowest merge rank (leftmost on ties). Symbols carry token ids: every merge names two
// tokens (checked at load), so a symbol that is not a token can never merge again, exactly as
// llama.cpp's text lookups behave.
struct bpe_symbol {
    int prev, next;
    int32_t id;  // token id of the symbol's text, or -1
    size_t off, n;
};
struct bpe_bigram {
    int left, right;
    int32_t rank;
    size_t nl, nr;  // the sides' lengths when queued: a change means one side merged since
};
struct bpe_cmp {  // top of the heap: lowest rank, then leftmost
    bool operator()(const bpe_bigram &l, const bpe_bigram &r) const {
        return l.rank > r.rank || (l.rank == r.rank && l.left > r.left);
    }
};

static void tokenize_bpe(const ql_vocab &v, const std::string &text, std::vector<int32_t> &out) {
    const std::vector<std::string> words = pre_tokenize(v.pre, text);
    std::vector<bpe_symbol> sym;
    std::vector<bpe_bigram> heap;  // a binary heap (std::push_heap / pop_heap), reused across words
    for (const std::string &w : words) {
        if (v.ignore_merges) {
            const int32_t id = v.find(w);
            if (id >= 0) {
                out.push_back(id);
                continue;
            }
        }
        sym.clear();
        for (size_t off = 0; off < w.size();) {
            const size_t n = std::min(utf8_len(w[off]), w.size() - off);
            const int idx = (int)sym.size();
            const int32_t id = v.find(std::string_view(w).substr(off, n));
            sym.push_back({idx - 1, off + n == w.size() ? -1 : idx + 1, id, off, n});
            off += n;
        }
        heap.clear();
        auto try_add = [&](int l, int r) {
            if (l < 0 || r < 0) return;
            const bpe_symbol &a = sym[(size_t)l], &b = sym[(size_t)r];
            if (a.id < 0 || b.id < 0) return;
            auto it = v.merges.find(((uint64_t)(uint32_t)a.id << 32) | (uint32_t)b.id);
            if (it == v.merges.end()) return;
            heap.push_back({l, r, it->second.rank, a.n, b.n});
            std::push_heap(heap.begin(), heap.end(), bpe_cmp());
        };
        for (int i = 1; i < (int)sym.size(); i++) try_add(i - 1, i);
        while (!heap.empty()) {
            std::pop_heap(heap.begin(), heap.end(), bpe_cmp());
            const bpe_bigram b = heap.back();
            heap.pop_back();
            bpe_symbol &l = sym[(size_t)b.left];
            bpe_symbol &r = sym[(size_t)b.right];
            if (l.n != b.nl || r.n != b.nr) continue;
            l.id = v.merges.find(((uint64_t)(uint32_t)l.id << 32) | (uint32_t)r.id)->second.result;
            l.n += r.n;
            r.n = 0;
            l.next = r.next;
            if (r.next >= 0) sym[(size_t)r.next].prev = b.left;
            try_add(l.prev, b.left);
            try_add(b.left, l.next);
        }
        for (int i = sym.empty() ? -1 : 0; i != -1; i = sym[(size_t)i].next) {
            const bpe_symbol &s = sym[(size_t)i];
            if (s.id >= 0) {
                out.push_back(s.id);
                continue;
            }
            // not a token: each byte of its (byte-level) text as a one-byte token where there
            // is one, else nothing - llama.cpp's fallback, which drops what it cannot spell
            for (size_t j = 0; j < s.n; j++) {
                const int32_t id = v.single_byte_token[(unsigned char)w[s.off + j]];
                if (id >= 0) out.push_back(id);
            }
        }
    }
}

std::vector<int32_t> ql_tokenize(const ql_vocab *v, const std::string &text, bool add_special, bool parse_special) {
    std::vector<int32_t> out;
    if (!v) return out;
    const std::vector<fragment> frags = partition(*v, text, parse_special);
    if (add_special && v->add_bos) out.push_back(v->bos);
    if (v->kind == VOCAB_SPM) {
        static const std::string SPACE = "\xe2\x96\x81";  // U+2581, SentencePiece's space
        bool prev_special = true;  // the first fragment, and each one after a special token, gets the prefix
        std::string s;
        for (const fragment &f : frags) {
            if (f.token >= 0) {
                out.push_back(f.token);
                prev_special = true;
                continue;
            }
            s.clear();
            if (v->add_space_prefix && prev_special) s += SPACE;
            for (size_t i = f.off; i < f.off + f.len; i++) {
                if (text[i] == ' ') s += SPACE;
                else s += text[i];
            }
            tokenize_spm(*v, s, out);
            prev_special = false;
        }
    } else {
        for (const fragment &f : frags) {
            if (f.token >= 0) out.push_back(f.token);
            else tokenize_bpe(*v, text.substr(f.off, f.len), out);
        }
    }
    if (add_special && v->add_eos) out.push_back(v->eos);
    return out;
}

// ============================================================================================
// pieces
// ============================================================================================

std::string ql_token_to_piece(const ql_vocab *v, int32_t id, bool render_special) {
    if (!valid_id(v, id)) return std::string();
    const uint8_t a = v->attr[(size_t)id];
    const std::string &t = v->text[(size_t)id];
    if (!render_special && (a & (ATTR_UNKNOWN | ATTR_CONTROL))) return std::string();
    if (a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED)) return t;
    if (a & ATTR_NORMAL) {
        std::string out;
        if (v->kind == VOCAB_SPM) {  // "▁" -> " "
            for (size_t i = 0; i < t.size(); i++) {
                if (t.compare(i, 3, "\xe2\x96\x81") == 0) {
                    out += ' ';
                    i += 2;
                } else {
                    out += t[i];
                }
            }
            return out;
        }
        const byte_map &m = bytes_unicode();  // byte-level: each character back to its byte
        for (size_t off = 0; off < t.size();) {
            const uint32_t cp = utf8_next(t, &off);
            if (cp < 0x144 && m.byte_of[cp] >= 0) {
                out += (char)m.byte_of[cp];
            } else {  // llama.cpp's marker for a character outside the map
                std::string u;
                ql_utf8_append(u, cp);
                out += "[UNK_BYTE_0x";
                for (unsigned char c : u) {
                    char hx[3];
                    snprintf(hx, sizeof(hx), "%02x", c);
                    out += hx;
                }
                out += t + "]";
            }
        }
        return out;
    }
    if (a & ATTR_BYTE) return std::string(1, (char)v->byte_value[(size_t)id]);
    return std::string();  // unused / undefined tokens render as nothing
}

std::string ql_detokenize(const ql_vocab *v, const std::vector<int32_t> &ids, bool render_special) {
    std::string out;
    for (int32_t id : ids) out += ql_token_to_piece(v, id, render_special);
    return out;
}

// ============================================================================================
// converters
// ============================================================================================

static bool read_whole_file(const char *path, std::vector<uint8_t> *buf, char *err, size_t err_size) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        tok_err(err, err_size, "%s: cannot open: %s", path, strerror(errno));
        return false;
    }
    bool ok = fseek(f, 0, SEEK_END) == 0;
    const long size = ok ? ftell(f) : -1;
    ok = ok && size >= 0 && fseek(f, 0, SEEK_SET) == 0;
    if (ok) {
        buf->resize((size_t)size);
        ok = size == 0 || fread(buf->data(), 1, (size_t)size, f) == (size_t)size;
    }
    fclose(f);
    if (!ok) tok_err(err, err_size, "%s: cannot read", path);
    return ok;
}

static void set_strings(ql_gguf_writer *w, const char *key, const std::vector<std::string> &v) {
    std::vector<const char *> p(v.size());
    for (size_t i = 0; i < v.size(); i++) p[i] = v[i].c_str();
    ql_gguf_set_arr_str(w, key, p.data(), p.size());
}

static ql_status from_llama2c(const char *tokenizer_bin, ql_gguf_writer *w, char *err, size_t err_size) {
    if (!tokenizer_bin || !w) {
        tok_err(err, err_size, "ql_vocab_from_llama2c: NULL %s", !tokenizer_bin ? "path" : "writer");
        return QL_ERR_INVALID;
    }
    const char *path = tokenizer_bin;
    std::vector<uint8_t> b;
    if (!read_whole_file(path, &b, err, err_size)) return QL_ERR_IO;
    if (b.size() < 4) {
        tok_err(err, err_size, "%s: truncated: %zu bytes, not even the max_token_length header", path, b.size());
        return QL_ERR_INVALID;
    }
    int32_t max_len;
    memcpy(&max_len, b.data(), 4);
    if (max_len <= 0) {
        tok_err(err, err_size, "%s: max_token_length %d is not positive (not a llama2.c tokenizer.bin?)", path,
                max_len);
        return QL_ERR_INVALID;
    }
    std::vector<std::string> texts;
    std::vector<float> scores;
    std::vector<int32_t> types;
    size_t off = 4;
    while (off < b.size()) {
        const size_t id = texts.size();
        if (b.size() - off < 8) {
            tok_err(err, err_size, "%s: truncated: token %zu at offset %zu needs 8 header bytes, %zu left", path, id,
                    off, b.size() - off);
            return QL_ERR_INVALID;
        }
        float score;
        int32_t len;
        memcpy(&score, b.data() + off, 4);
        memcpy(&len, b.data() + off + 4, 4);
        off += 8;
        if (len < 0) {
            tok_err(err, err_size, "%s: token %zu at offset %zu has a negative length %d", path, id, off - 4, len);
            return QL_ERR_INVALID;
        }
        if ((size_t)len > b.size() - off) {
            tok_err(err, err_size, "%s: token %zu at offset %zu: length %d runs past the end of the file "
                    "(%zu bytes left)", path, id, off - 4, len, b.size() - off);
            return QL_ERR_INVALID;
        }
        std::string piece((const char *)b.data() + off, (size_t)len);
        off += (size_t)len;
        if (piece.find('\0') != std::string::npos) {
            tok_err(err, err_size, "%s: token %zu contains a NUL byte", path, id);
            return QL_ERR_INVALID;
        }
        // llama2.c's export wrote <s>, </s> as "\n<s>\n", "\n</s>\n" and every "▁" as a space;
        // SentencePiece stores the pieces with "▁", so undo both
        int32_t type = QL_TOKEN_NORMAL;
        if (id == 0) {
            type = QL_TOKEN_UNKNOWN;
        } else if (id == 1 || id == 2) {
            type = QL_TOKEN_CONTROL;
            const size_t a = piece.find_first_not_of('\n'), e = piece.find_last_not_of('\n');
            piece = a == std::string::npos ? std::string() : piece.substr(a, e - a + 1);
        } else if (piece.size() == 6 && piece.compare(0, 3, "<0x") == 0 && piece[5] == '>' &&
                   isxdigit((unsigned char)piece[3]) && isxdigit((unsigned char)piece[4])) {
            type = QL_TOKEN_BYTE;
        } else {
            std::string s;
            for (char ch : piece) {
                if (ch == ' ') s += "\xe2\x96\x81";
                else s += ch;
            }
            piece.swap(s);
        }
        texts.push_back(std::move(piece));
        scores.push_back(score);
        types.push_back(type);
    }
    if (texts.size() < 3) {
        tok_err(err, err_size, "%s: %zu tokens; a llama2.c vocabulary starts with <unk>, <s>, </s>", path,
                texts.size());
        return QL_ERR_INVALID;
    }
    ql_gguf_set_str(w, KEY_MODEL, "llama");
    ql_gguf_set_str(w, KEY_PRE, "default");
    set_strings(w, KEY_TOKENS, texts);
    ql_gguf_set_arr(w, KEY_SCORES, QL_GGUF_F32, scores.data(), scores.size());
    ql_gguf_set_arr(w, KEY_TYPES, QL_GGUF_I32, types.data(), types.size());
    ql_gguf_set_u32(w, KEY_BOS, 1);
    ql_gguf_set_u32(w, KEY_EOS, 2);
    ql_gguf_set_u32(w, KEY_UNK, 0);
    ql_gguf_set_bool(w, KEY_ADD_BOS, true);
    ql_gguf_set_bool(w, KEY_ADD_EOS, false);
    ql_gguf_set_bool(w, KEY_ADD_PREFIX, true);
    return QL_OK;
}

// strict standard base64 (padding required): false on anything else
static bool base64_decode(std::string_view s, std::string *out) {
    auto val = [](char c) -> int {
        if (c >= 'A' && c <= 'Z') return c - 'A';
        if (c >= 'a' && c <= 'z') return c - 'a' + 26;
        if (c >= '0' && c <= '9') return c - '0' + 52;
        if (c == '+') return 62;
        if (c == '/') return 63;
        return -1;
    };
    out->clear();
    if (s.empty() || s.size() % 4) return false;
    for (size_t i = 0; i < s.size(); i += 4) {
        const bool last = i + 4 == s.size();
        const int pad = (s[i + 3] == '=') + (s[i + 2] == '=' && s[i + 3] == '=');
        if (pad && !last) return false;
        int v[4];
        for (int k = 0; k < 4 - pad; k++)
            if ((v[k] = val(s[i + k])) < 0) return false;
        if (pad == 1 && s[i + 2] == '=') return false;
        const uint32_t x = ((uint32_t)v[0] << 18) | ((uint32_t)v[1] << 12) | (pad < 2 ? (uint32_t)v[2] << 6 : 0) |
                           (pad < 1 ? (uint32_t)v[3] : 0);
        *out += (char)(x >> 16);
        if (pad < 2) *out += (char)((x >> 8) & 0xFF);
        if (pad < 1) *out += (char)(x & 0xFF);
    }
    return true;
}

// Meta's Llama 3 special tokens (llama-models, models/llama3/tokenizer.py), in id order from
// the first id after the ranks: 12 named ones, then reserved ones numbered on from 2.
static std::vector<std::string> llama3_special_tokens() {
    std::vector<std::string> s = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                                  "<|python_tag|>", "<|image|>"};
    const size_t named = s.size();
    for (size_t i = 0; i < 256 - named; i++) s.push_back("<|reserved_special_token_" + std::to_string(2 + i) + "|>");
    return s;
}

static ql_status from_tiktoken(const char *path, const char *pre, ql_gguf_writer *w, char *err, size_t err_size) {
    if (!path || !w) {
        tok_err(err, err_size, "ql_vocab_from_tiktoken: NULL %s", !path ? "path" : "writer");
        return QL_ERR_INVALID;
    }
    if (!pre || (strcmp(pre, "llama3") != 0 && strcmp(pre, "llama-bpe") != 0)) {
        tok_err(err, err_size, "ql_vocab_from_tiktoken: pre-tokenizer '%s' is not supported (\"llama3\" or "
                "\"llama-bpe\")", pre ? printable(pre).c_str() : "(null)");
        return QL_ERR_INVALID;
    }
    std::vector<uint8_t> buf;
    if (!read_whole_file(path, &buf, err, err_size)) return QL_ERR_IO;
    const std::string_view all((const char *)buf.data(), buf.size());
    const size_t n_lines = (size_t)std::count(all.begin(), all.end(), '\n') + 1;

    std::vector<std::string> by_rank;  // token bytes, indexed by rank
    std::vector<size_t> line_of;       // where each rank was defined (0: not yet)
    size_t line_no = 0;
    for (size_t pos = 0; pos < all.size();) {
        size_t eol = all.find('\n', pos);
        if (eol == std::string_view::npos) eol = all.size();
        std::string_view line = all.substr(pos, eol - pos);
        pos = eol + 1;
        line_no++;
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        if (line.empty()) continue;
        const size_t sp = line.find(' ');
        if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos) {
            tok_err(err, err_size, "%s:%zu: expected 'base64 rank'", path, line_no);
            return QL_ERR_INVALID;
        }
        std::string bytes;
        if (!base64_decode(line.substr(0, sp), &bytes)) {
            tok_err(err, err_size, "%s:%zu: bad base64 '%s'", path, line_no, printable(line.substr(0, sp)).c_str());
            return QL_ERR_INVALID;
        }
        const std::string_view rs = line.substr(sp + 1);
        uint64_t rank = 0;
        bool ok = !rs.empty() && rs.size() <= 10;
        for (char ch : rs) {
            ok = ok && ch >= '0' && ch <= '9';
            rank = rank * 10 + (uint64_t)(ch - '0');
        }
        if (!ok || rank >= (1u << 30)) {
            tok_err(err, err_size, "%s:%zu: bad rank '%s'", path, line_no, printable(rs).c_str());
            return QL_ERR_INVALID;
        }
        if (rank >= n_lines) {  // ranks run 0.. without gaps, one per line: a bigger one cannot be right (and
                                // would size the table by it: 4 GB for a 15-byte file)
            tok_err(err, err_size, "%s:%zu: rank %llu, but the file has only %zu line%s (ranks run 0..n-1 without gaps)", path,
                    line_no, (unsigned long long)rank, n_lines, n_lines == 1 ? "" : "s");
            return QL_ERR_INVALID;
        }
        if (rank >= by_rank.size()) {
            by_rank.resize((size_t)rank + 1);
            line_of.resize((size_t)rank + 1, 0);
        }
        if (line_of[(size_t)rank]) {
            tok_err(err, err_size, "%s:%zu: duplicate rank %llu (first on line %zu)", path, line_no,
                    (unsigned long long)rank, line_of[(size_t)rank]);
            return QL_ERR_INVALID;
        }
        by_rank[(size_t)rank] = std::move(bytes);
        line_of[(size_t)rank] = line_no;
    }
    if (by_rank.empty()) {
        tok_err(err, err_size, "%s: no tokens", path);
        return QL_ERR_INVALID;
    }
    for (size_t r = 0; r < by_rank.size(); r++) {
        if (!line_of[r]) {
            tok_err(err, err_size, "%s: rank %zu is missing (ranks must run 0..%zu without gaps)", path, r,
                    by_rank.size() - 1);
            return QL_ERR_INVALID;
        }
    }
    const size_t n = by_rank.size();
    std::unordered_map<std::string_view, int32_t> rank_of;
    rank_of.reserve(n);
    for (size_t r = 0; r < n; r++) {
        auto ins = rank_of.emplace(std::string_view(by_rank[r]), (int32_t)r);
        if (!ins.second) {
            tok_err(err, err_size, "%s:%zu: token of rank %zu repeats rank %d's bytes", path, line_of[r], r,
                    ins.first->second);
            return QL_ERR_INVALID;
        }
    }

    // Merges as Hugging Face's TikTokenConverter rebuilds them (the Llama-3 tokenizer.json that
    // llama.cpp converts: 280,147 merges): for each token of two or more bytes, every split
    // into two tokens is a merge; ordered by the token's rank, then the left and right ranks.
    // (Keeping only the split a lower-ranked BPE reaches does not work for this vocabulary:
    // ".:.:" is not reachable as two tokens that way.)
    struct split {
        int32_t rank, left, right;
    };
    std::vector<split> merges, local;
    merges.reserve(n * 3);
    for (size_t r = 0; r < n; r++) {
        const std::string_view t(by_rank[r]);
        local.clear();
        for (size_t i = 1; i < t.size(); i++) {
            auto a = rank_of.find(t.substr(0, i)), b = rank_of.find(t.substr(i));
            if (a != rank_of.end() && b != rank_of.end()) local.push_back({(int32_t)r, a->second, b->second});
        }
        std::sort(local.begin(), local.end(), [](const split &x, const split &y) {
            return x.left != y.left ? x.left < y.left : x.right < y.right;
        });
        merges.insert(merges.end(), local.begin(), local.end());
    }

    std::vector<std::string> texts(n), merge_texts(merges.size());
    for (size_t r = 0; r < n; r++) texts[r] = bytes_to_unicode_text(by_rank[r]);
    for (size_t i = 0; i < merges.size(); i++)
        merge_texts[i] = texts[(size_t)merges[i].left] + " " + texts[(size_t)merges[i].right];
    std::vector<int32_t> types(n, QL_TOKEN_NORMAL);
    const std::vector<std::string> special = llama3_special_tokens();
    for (const std::string &s : special) {
        texts.push_back(s);
        types.push_back(QL_TOKEN_CONTROL);
    }

    ql_gguf_set_str(w, KEY_MODEL, "gpt2");
    ql_gguf_set_str(w, KEY_PRE, pre);
    set_strings(w, KEY_TOKENS, texts);
    ql_gguf_set_arr(w, KEY_TYPES, QL_GGUF_I32, types.data(), types.size());
    set_strings(w, KEY_MERGES, merge_texts);
    ql_gguf_set_u32(w, KEY_BOS, (uint32_t)n);      // <|begin_of_text|>
    ql_gguf_set_u32(w, KEY_EOS, (uint32_t)n + 1);  // <|end_of_text|>
    ql_gguf_set_u32(w, KEY_EOT, (uint32_t)n + 9);  // <|eot_id|>
    ql_gguf_set_bool(w, KEY_ADD_BOS, true);
    ql_gguf_set_bool(w, KEY_ADD_EOS, false);
    return QL_OK;
}

ql_status ql_vocab_from_llama2c(const char *tokenizer_bin, ql_gguf_writer *w, char *err, size_t err_size) {
    try {
        return from_llama2c(tokenizer_bin, w, err, err_size);
    } catch (const std::bad_alloc &) {
        tok_err(err, err_size, "%s: out of memory", tokenizer_bin);
        return QL_ERR_NOMEM;
    }
}

ql_status ql_vocab_from_tiktoken(const char *path, const char *pre, ql_gguf_writer *w, char *err, size_t err_size) {
    try {
        return from_tiktoken(path, pre, w, err, err_size);
    } catch (const std::bad_alloc &) {
        tok_err(err, err_size, "%s: out of memory", path);
        return QL_ERR_NOMEM;
    }
}
