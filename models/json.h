// models/json.h - the one JSON reader (RFC 8259, strict) behind JSONL data, adapter_config.json
// and safetensors headers, and the small text helpers (UTF-8, printf to string) models/ shares.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <string_view>
#include <vector>

struct ql_json {
    enum kind_t : uint8_t { NUL, BOOL, NUM, STR, ARR, OBJ } kind = NUL;
    bool b = false;
    std::string str;                // STR: the decoded UTF-8; NUM: the number as written
    std::vector<ql_json> items;     // ARR: elements; OBJ: values, parallel to keys
    std::vector<std::string> keys;  // OBJ, in file order

    const ql_json *get(const char *key) const;  // NULL when absent
    double num() const;                         // NUM as a double
    bool as_u64(uint64_t *v) const;             // digits only, no sign, fraction or exponent; fits in 64 bits
    bool as_int(int64_t *v) const;              // an integral value, also written 8.0 or 1e1 (Python floats)
};
const char *ql_json_kind_name(ql_json::kind_t k);  // "null", "a boolean", "a number", ...

enum ql_json_mode {
    QL_JSON_DOCUMENT,  // one value, whitespace around it: positions "at line L, column C"
    QL_JSON_LINE,      // a JSONL line: one object: positions "at column C", "the end of the line"
};
// Errors (in *why, with the position): raw control characters, bad escapes and unpaired
// surrogates, leading zeros, trailing commas, duplicate keys, nesting deeper than 64, anything
// after the value. The text must already be valid UTF-8 (ql_utf8_invalid_at).
bool ql_json_parse(std::string_view text, ql_json_mode mode, ql_json *out, std::string *why);
std::string ql_json_quote(std::string_view s);  // s as a JSON string literal

// ---- text ----
std::string ql_strf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));  // up to 1023 bytes

void   ql_utf8_append(std::string &out, uint32_t cp);
// length of the well-formed sequence at s[0..n) (RFC 3629: no overlongs, no surrogates, at
// most U+10FFFF) with its code point in *cp, or 0 when there is none
size_t ql_utf8_seq(const unsigned char *s, size_t n, uint32_t *cp);
size_t ql_utf8_invalid_at(std::string_view s);  // offset of the first ill-formed byte, or npos
// at most 40 bytes of s, control and non-ASCII bytes as \xNN: for quoting user data in errors
std::string ql_printable(std::string_view s);
