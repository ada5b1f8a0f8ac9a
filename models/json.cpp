// models/json.cpp - the strict JSON reader and UTF-8 helpers (models/json.h).
#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <set>

std::string ql_strf(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

// ============================================================================================
// UTF-8
// ============================================================================================

void ql_utf8_append(std::string &out, uint32_t cp) {
    if (cp < 0x80) {
        out += (char)cp;
    } else if (cp < 0x800) {
        out += (char)(0xC0 | (cp >> 6));
        out += (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += (char)(0xE0 | (cp >> 12));
        out += (char)(0x80 | ((cp >> 6) & 0x3F));
        out += (char)(0x80 | (cp & 0x3F));
    } else {
        out += (char)(0xF0 | (cp >> 18));
        out += (char)(0x80 | ((cp >> 12) & 0x3F));
        out += (char)(0x80 | ((cp >> 6) & 0x3F));
        out += (char)(0x80 | (cp & 0x3F));
    }
}


size_t ql_utf8_seq(const unsigned char *s, size_t n, uint32_t *cp) {
    const unsigned char c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) len = 2, v = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, v = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, v = c & 0x07, min = 0x10000;
    else return 0;  // continuation byte, C0/C1 (always overlong) or F5..FF
    if (n < len) return 0;
    for (size_t k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[k] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    *cp = v;
    return len;
}


size_t ql_utf8_invalid_at(std::string_view s) {
    const unsigned char *p = (const unsigned char *)s.data();
    uint32_t cp;
    for (size_t i = 0; i < s.size();) {
        const size_t n = ql_utf8_seq(p + i, s.size() - i, &cp);
        if (!n) return i;
        i += n;
    }
    return std::string_view::npos;
}


std::string ql_printable(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size() && i < 40; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') out += (char)c;
        else out += ql_strf("\\x%02x", c);
    }
    if (s.size() > 40) out += "...";
    return out;
}


// ============================================================================================
// values
// ============================================================================================

const ql_json *ql_json::get(const char *key) const {
    for (size_t i = 0; i < keys.size(); i++)
        if (keys[i] == key) return &items[i];
    return nullptr;
}

double ql_json::num() const { return strtod(str.c_str(), nullptr); }

bool ql_json::as_u64(uint64_t *v) const {
    if (kind != NUM || str.empty()) return false;
    uint64_t x = 0;
    for (char c : str) {
        if (c < '0' || c > '9') return false;
        const uint64_t d = (uint64_t)(c - '0');
        if (x > (UINT64_MAX - d) / 10) return false;
        x = x * 10 + d;
    }
    *v = x;
    return true;
}

bool ql_json::as_int(int64_t *v) const {
    if (kind != NUM) return false;
    const double d = num();
    if (!(std::fabs(d) < 9.0e15) || d != std::floor(d)) return false;
    *v = (int64_t)d;
    return true;
}

const char *ql_json_kind_name(ql_json::kind_t k) {
    switch (k) {
    case ql_json::NUL: return "null";
    case ql_json::BOOL: return "a boolean";
    case ql_json::NUM: return "a number";
    case ql_json::STR: return "a string";
    case ql_json::ARR: return "an array";
    case ql_json::OBJ: return "an object";
    }
    return "?";
}

std::string ql_json_quote(std::string_view s) {
    std::string o = "\"";
    for (unsigned char c : s) {
        if (c == '"') o += "\\\"";
        else if (c == '\\') o += "\\\\";
        else if (c == '\n') o += "\\n";
        else if (c == '\t') o += "\\t";
        else if (c == '\r') o += "\\r";
        else if (c < 0x20) o += ql_strf("\\u%04x", c);
        else o += (char)c;
    }
    return o + "\"";
}

// ============================================================================================
// the parser
// ============================================================================================

namespace {

const int JSON_MAX_DEPTH = 64;  // objects and arrays nested deeper are an error

struct json_parser {
    const char *begin, *p, *end;
    std::string err;

    bool line_mode;

    json_parser(std::string_view text, bool line)
        : begin(text.data()), p(text.data()), end(text.data() + text.size()), line_mode(line) {}

    bool fail(const char *q, const std::string &msg) {  // the first failure wins
        if (!err.empty()) return false;
        if (line_mode) {
            err = msg + ql_strf(" at column %zu", (size_t)(q - begin) + 1);
        } else {
            size_t line = 1;
            const char *bol = begin;
            for (const char *c = begin; c < q; c++)
                if (*c == '\n') line++, bol = c + 1;
            err = msg + ql_strf(" at line %zu, column %zu", line, (size_t)(q - bol) + 1);
        }
        return false;
    }
    const char *end_name() const { return line_mode ? "the end of the line" : "the end of the text"; }

    std::string describe(const char *q) const {  // the character at q, for messages
        if (q >= end) return end_name();
        const unsigned char c = (unsigned char)*q;
        if (c >= 0x20 && c < 0x7f) return ql_strf("'%c'", c);
        if (c < 0x80) return ql_strf("byte 0x%02x", c);
        uint32_t cp;
        if (ql_utf8_seq((const unsigned char *)q, (size_t)(end - q), &cp)) return ql_strf("U+%04X", cp);
        return ql_strf("byte 0x%02x", c);
    }

    void skip_ws() {
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
    }

    static bool is_digit(char c) { return c >= '0' && c <= '9'; }

    static bool hex4(const char *q, const char *e, uint32_t *v) {
        if (e - q < 4) return false;
        uint32_t x = 0;
        for (int i = 0; i < 4; i++) {
            const char c = q[i];
            x <<= 4;
            if (c >= '0' && c <= '9') x |= (uint32_t)(c - '0');
            else if (c >= 'a' && c <= 'f') x |= (uint32_t)(c - 'a' + 10);
            else if (c >= 'A' && c <= 'F') x |= (uint32_t)(c - 'A' + 10);
            else return false;
        }
        *v = x;
        return true;
    }

    bool parse_string(std::string &out) {
        const char *start = p++;  // the opening quote
        out.clear();
        for (;;) {
            const char *run = p;
            while (p < end && *p != '"' && *p != '\\' && (unsigned char)*p >= 0x20) p++;
            out.append(run, (size_t)(p - run));
            if (p == end) return fail(start, "unterminated string (no closing '\"') starting");
            const unsigned char c = (unsigned char)*p;
            if (c == '"') {
                p++;
                return true;
            }
            if (c < 0x20) return fail(p, ql_strf("raw control character 0x%02x in a string (it must be escaped)", c));
            const char *esc = p++;  // backslash
            if (p == end) return fail(start, "unterminated string (no closing '\"') starting");
            switch (*p) {
            case '"': out += '"'; break;
            case '\\': out += '\\'; break;
            case '/': out += '/'; break;
            case 'b': out += '\b'; break;
            case 'f': out += '\f'; break;
            case 'n': out += '\n'; break;
            case 'r': out += '\r'; break;
            case 't': out += '\t'; break;
            case 'u': {
                uint32_t cp;
                if (!hex4(p + 1, end, &cp)) return fail(esc, "invalid \\u escape (expected four hex digits)");
                p += 4;
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    uint32_t lo;
                    if (end - p >= 7 && p[1] == '\\' && p[2] == 'u' && hex4(p + 3, end, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                        p += 6;
                    } else {
                        return fail(esc, ql_strf("invalid \\u escape: high surrogate \\u%04X is not followed by a low "
                                              "surrogate \\uDC00-\\uDFFF", cp));
                    }
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    return fail(esc, ql_strf("invalid \\u escape: low surrogate \\u%04X without a high surrogate before it", cp));
                }
                ql_utf8_append(out, cp);
                break;
            }
            default:
                if ((unsigned char)*p > 0x20 && (unsigned char)*p < 0x7f) return fail(esc, ql_strf("invalid escape '\\%c' in a string", *p));
                return fail(esc, "invalid escape in a string: a backslash followed by " + describe(p));
            }
            p++;
        }
    }

    bool parse_number(ql_json &out) {
        const char *s = p;
        if (*p == '-') p++;
        if (p == end || !is_digit(*p)) return fail(s, "invalid number (a digit must follow '-')");
        if (*p == '0') {
            p++;
            if (p < end && is_digit(*p)) return fail(s, "invalid number (leading zero)");
        } else {
            while (p < end && is_digit(*p)) p++;
        }
        if (p < end && *p == '.') {
            p++;
            if (p == end || !is_digit(*p)) return fail(s, "invalid number (a digit must follow '.')");
            while (p < end && is_digit(*p)) p++;
        }
        if (p < end && (*p == 'e' || *p == 'E')) {
            p++;
            if (p < end && (*p == '+' || *p == '-')) p++;
            if (p == end || !is_digit(*p)) return fail(s, "invalid number (a digit must follow the exponent)");
            while (p < end && is_digit(*p)) p++;
        }
        out.kind = ql_json::NUM;
        out.str.assign(s, (size_t)(p - s));
        return true;
    }

    bool parse_literal(ql_json &out, const char *word, ql_json::kind_t kind, bool b) {
        const size_t n = strlen(word);
        const bool ok = (size_t)(end - p) >= n && !memcmp(p, word, n) &&
                        (p + n == end || !((p[n] >= 'a' && p[n] <= 'z') || (p[n] >= 'A' && p[n] <= 'Z') || is_digit(p[n])));
        if (!ok) return fail(p, "invalid literal (expected true, false or null)");
        p += n;
        out.kind = kind;
        out.b = b;
        return true;
    }

    bool parse_object(ql_json &out, int depth) {
        if (depth > JSON_MAX_DEPTH) return fail(p, ql_strf("objects and arrays nested deeper than %d levels", JSON_MAX_DEPTH));
        out.kind = ql_json::OBJ;
        p++;  // '{'
        skip_ws();
        if (p < end && *p == '}') {
            p++;
            return true;
        }
        std::set<std::string> seen;  // used once an object has many keys (linear search before)
        bool after_comma = false;
        for (;;) {
            skip_ws();
            if (p == end) return fail(p, std::string("unterminated object (expected '\"' to start a key, found ") + end_name() + ")");
            if (*p != '"') {
                if (*p == '}' && after_comma) return fail(p, "trailing comma before '}'");
                return fail(p, "expected '\"' to start a key, found " + describe(p));
            }
            const char *key_at = p;
            std::string key;
            if (!parse_string(key)) return false;
            bool dup;
            if (out.keys.size() < 16) {
                dup = std::find(out.keys.begin(), out.keys.end(), key) != out.keys.end();
            } else {
                if (seen.empty()) seen.insert(out.keys.begin(), out.keys.end());
                dup = !seen.insert(key).second;
            }
            if (dup) return fail(key_at, "duplicate key \"" + ql_printable(key) + "\"");
            skip_ws();
            if (p == end || *p != ':') return fail(p, "expected ':' after key");
            p++;
            out.keys.push_back(std::move(key));
            out.items.emplace_back();
            if (!parse_value(out.items.back(), depth)) return false;
            skip_ws();
            if (p == end) return fail(p, std::string("unterminated object (expected ',' or '}', found ") + end_name() + ")");
            if (*p == '}') {
                p++;
                return true;
            }
            if (*p != ',') return fail(p, "expected ',' or '}' after a value in an object, found " + describe(p));
            p++;
            after_comma = true;
        }
    }

    bool parse_array(ql_json &out, int depth) {
        if (depth > JSON_MAX_DEPTH) return fail(p, ql_strf("objects and arrays nested deeper than %d levels", JSON_MAX_DEPTH));
        out.kind = ql_json::ARR;
        p++;  // '['
        skip_ws();
        if (p < end && *p == ']') {
            p++;
            return true;
        }
        for (;;) {
            skip_ws();
            if (p < end && *p == ']' && !out.items.empty()) return fail(p, "trailing comma before ']'");
            out.items.emplace_back();
            if (!parse_value(out.items.back(), depth)) return false;
            skip_ws();
            if (p == end) return fail(p, std::string("unterminated array (expected ',' or ']', found ") + end_name() + ")");
            if (*p == ']') {
                p++;
                return true;
            }
            if (*p != ',') return fail(p, "expected ',' or ']' after a value in an array, found " + describe(p));
            p++;
        }
    }

    // depth: of the enclosing container (the line's object is depth 1)
    bool parse_value(ql_json &out, int depth) {
        skip_ws();
        if (p == end) return fail(p, std::string("expected a value, found ") + end_name());
        switch (*p) {
        case '{': return parse_object(out, depth + 1);
        case '[': return parse_array(out, depth + 1);
        case '"': out.kind = ql_json::STR; return parse_string(out.str);
        case 't': return parse_literal(out, "true", ql_json::BOOL, true);
        case 'f': return parse_literal(out, "false", ql_json::BOOL, false);
        case 'n': return parse_literal(out, "null", ql_json::NUL, false);
        default:
            if (*p == '-' || is_digit(*p)) return parse_number(out);
            return fail(p, "expected a value, found " + describe(p));
        }
    }

    // a line: one object, then only whitespace; a document: any value
    bool parse_all(ql_json &out) {
        skip_ws();
        if (line_mode) {
            if (p == end || *p != '{') return fail(p, "expected a JSON object ('{'), found " + describe(p));
            if (!parse_object(out, 1)) return false;
        } else if (!parse_value(out, 0)) {
            return false;
        }
        skip_ws();
        if (p != end) return fail(p, "unexpected " + describe(p) + (line_mode ? " after the object (one object per line)" : " after the value"));
        return true;
    }
};

}  // namespace

bool ql_json_parse(std::string_view text, ql_json_mode mode, ql_json *out, std::string *why) {
    json_parser jp(text, mode == QL_JSON_LINE);
    *out = ql_json();
    if (jp.parse_all(*out)) return true;
    if (why) *why = jp.err;
    return false;
}
