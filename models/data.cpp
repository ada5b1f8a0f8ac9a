// models/data.cpp - fine-tuning data (models/data.h): chat template names, a strict JSONL
// reader, the four dataset formats rendered into text parts with a loss mask, tokenization of
// those parts consistent with tokenizing the whole text, truncation, splits and packing.
//
// Choices, in one place:
// - A line's format comes from its keys: "messages", or "prompt" + "completion", or
//   "instruction" + "output" (Alpaca; "input" optional), or "text"; two of the first three in one
//   line are refused as ambiguous, as is "text" beside prompt/completion. Other keys are ignored
//   (tatsu-lab/alpaca lines carry a rendered "text" beside instruction/output).
// - text / prompt+completion / Alpaca text is tokenized as Hugging Face's tokenizers do it:
//   special-token texts in it become special tokens (so pre-rendered chat text works). In
//   "messages", contents are never parsed for special tokens; only the template's markers are.
// - BOS (o.add_bos, when the vocabulary has one and the example does not already start with
//   it) is never supervised: position 0 is never a target. EOS (o.add_eos) follows every
//   example unless it already ends with EOS (a text ending in "</s>", or a chat whose last turn
//   ends with the EOS token: llama2, zephyr, or chatml when EOS is <|im_end|>); it is supervised
//   exactly when the example's end is (text, completion, output, a final assistant turn).
// - Assistant turns: the content and the token that ends the turn are supervised (<|eot_id|>,
//   <|im_end|>, </s>, <|end|>, <end_of_turn>), as axolotl's train_on_eos "turn" and TRL's
//   {% generation %} templates do; the separator after it ("\n") and the next header are not.
// - n_lines counts non-blank lines; each ends up an example, in n_bad, or in n_empty.
//   n_per_format counts the examples kept.
#include "data.h"
#include "json.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <string>
#include <string_view>
#include <vector>

// ============================================================================================
// errors and small helpers
// ============================================================================================

// Python's str.isspace (what Jinja's trim and str.strip() remove)
static bool py_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Python's s.strip() on valid UTF-8
static std::string py_strip(const std::string &s) {
    const unsigned char *p = (const unsigned char *)s.data();
    size_t b = 0, e = s.size();
    uint32_t cp;
    while (b < e) {
        const size_t n = ql_utf8_seq(p + b, e - b, &cp);
        if (!n || !py_space(cp)) break;
        b += n;
    }
    while (e > b) {
        size_t start = e - 1;
        while (start > b && (p[start] & 0xC0) == 0x80) start--;
        const size_t n = ql_utf8_seq(p + start, e - start, &cp);
        if (n != e - start || !py_space(cp)) break;
        e = start;
    }
    return s.substr(b, e - b);
}

// ============================================================================================
// chat template names and detection
// ============================================================================================

static const char *const CHAT_NAMES[] = {"none", "llama3", "chatml", "llama2", "phi3", "gemma", "zephyr"};
static_assert(sizeof(CHAT_NAMES) / sizeof(CHAT_NAMES[0]) == QL_CHAT_COUNT, "CHAT_NAMES");

const char *ql_chat_template_name(ql_chat_template t) {
    return (unsigned)t < (unsigned)QL_CHAT_COUNT ? CHAT_NAMES[t] : "unknown";
}

ql_chat_template ql_chat_template_from_name(const char *name) {
    if (!name) return QL_CHAT_COUNT;
    for (int i = 0; i < QL_CHAT_COUNT; i++)
        if (!strcmp(name, CHAT_NAMES[i])) return (ql_chat_template)i;
    return QL_CHAT_COUNT;
}

// Characteristic substrings of each family's tokenizer.chat_template, most specific first
// (llama.cpp's llm_chat_detect_template looks for the same markers).
ql_chat_template ql_chat_template_detect(const char *jinja) {
    if (!jinja || !*jinja) return QL_CHAT_NONE;
    const std::string_view t(jinja);
    auto has = [&](const char *s) { return t.find(s) != std::string_view::npos; };
    if (has("<|im_start|>")) return has("<|im_sep|>") ? QL_CHAT_NONE : QL_CHAT_CHATML;  // <|im_sep|>: Phi-4, not ChatML
    if (has("<|start_header_id|>") && has("<|end_header_id|>")) return QL_CHAT_LLAMA3;
    if (has("<start_of_turn>")) return QL_CHAT_GEMMA;
    if (has("[INST]")) return QL_CHAT_LLAMA2;
    if (has("<|assistant|>") && has("<|end|>")) return QL_CHAT_PHI3;
    // zephyr-7b-beta writes the turn end as eos_token; others spell it out
    if (has("<|assistant|>") && (has("</s>") || has("eos_token") || has("<|endoftext|>"))) return QL_CHAT_ZEPHYR;
    return QL_CHAT_NONE;
}

// ============================================================================================
// rendering: a line's object -> text parts with a loss mask
// ============================================================================================

// A run of text or one special token; `sup`: its tokens are prediction targets.
struct text_part {
    std::string text;
    int32_t token = -1;  // >= 0: this special token (text unused)
    bool sup = false;
};

struct render_out {
    std::vector<text_part> parts;
    bool parse_special = true;  // special-token texts inside `text` parts become special tokens
    bool end_sup = false;       // the example's end is supervised (so is the EOS after it)
    bool ends_with_eos = false; // the rendering already ends its last turn with EOS: add no other
};

enum data_format { FMT_TEXT = 0, FMT_PROMPT_COMPLETION, FMT_MESSAGES, FMT_ALPACA };

// The template markers as the vocabulary sees them: a marker is a special token when
// parse_special turns it into one token that plain tokenization does not give (control
// tokens, and "control-looking" tokens llama.cpp promotes); otherwise it is ordinary text
// (Llama 2's "[INST]", zephyr's "<|user|>").
struct marker_cache {
    const ql_vocab *v;
    std::map<std::string, int32_t> ids;
    int32_t id(const std::string &m) {
        auto it = ids.find(m);
        if (it != ids.end()) return it->second;
        const std::vector<int32_t> on = ql_tokenize(v, m, false, true);
        int32_t r = -1;
        if (on.size() == 1 && ql_tokenize(v, m, false, false) != on) r = on[0];
        ids[m] = r;
        return r;
    }
    // the marker is one token of the vocabulary (special, or user-defined and so split out anyway)
    bool present(const std::string &m) {
        if (id(m) >= 0) return true;
        const std::vector<int32_t> t = ql_tokenize(v, m, false, false);
        return t.size() == 1 && m == ql_vocab_token_text(v, t[0]);
    }
};

struct renderer {
    marker_cache *mc;
    render_out *out;
    int32_t last_end = -1;  // the token that ended the last turn

    void text(const std::string &s, bool sup) {
        if (s.empty()) return;
        std::vector<text_part> &p = out->parts;
        if (!p.empty() && p.back().token < 0 && p.back().sup == sup) p.back().text += s;
        else p.push_back({s, -1, sup});
    }
    void token(int32_t id, bool sup) {
        if (id >= 0) out->parts.push_back({std::string(), id, sup});
    }
    void mark(const std::string &m, bool sup) {
        const int32_t id = mc->id(m);
        if (id >= 0) token(id, sup);
        else text(m, sup);
    }
    void end_turn(const std::string &m, bool sup) {  // a marker that ends a turn
        mark(m, sup);
        last_end = mc->id(m);
    }
    void end_turn_eos(int32_t eos, bool sup) {
        token(eos, sup);
        last_end = eos;
    }
};

struct chat_message {
    std::string role, content;
};

// The markers a family cannot do without: each must be one token of the vocabulary.
static std::vector<std::string> chat_required_markers(ql_chat_template t) {
    switch (t) {
    case QL_CHAT_LLAMA3: return {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    case QL_CHAT_CHATML: return {"<|im_start|>", "<|im_end|>"};
    case QL_CHAT_PHI3: return {"<|user|>", "<|assistant|>", "<|end|>"};
    case QL_CHAT_GEMMA: return {"<start_of_turn>", "<end_of_turn>"};
    default: return {};
    }
}

// llama2 and gemma: an optional system message first, then user/assistant alternating from user
static bool check_alternation(const std::vector<chat_message> &m, ql_chat_template t, std::string *reason) {
    const size_t first = !m.empty() && m[0].role == "system" ? 1 : 0;
    for (size_t i = first; i < m.size(); i++) {
        const char *want = (i - first) % 2 == 0 ? "user" : "assistant";
        if (m[i].role != want) {
            *reason = ql_strf("messages[%zu].role is \"%s\" where the %s template needs \"%s\" (an optional system "
                           "message first, then user and assistant turns alternating, starting with user)",
                           i, ql_printable(m[i].role).c_str(), ql_chat_template_name(t), want);
            return false;
        }
    }
    return true;
}

// Renders a conversation with the family's template, checked against each model's published
// tokenizer_config.json chat_template (C: content, A: assistant content):
//   llama3  <|start_header_id|>ROLE<|end_header_id|>\n\nTRIM(C)<|eot_id|>          Meta-Llama-3-8B-Instruct
//   chatml  <|im_start|>ROLE\nC<|im_end|>\n                                        Qwen2-Instruct, minus its
//                                                                                  default system message
//   llama2  [INST] STRIP(C) [/INST] STRIP(A) </s><s>[INST] ...                      Llama-2-chat; the system
//           message as "<<SYS>>\nS\n<</SYS>>\n\n" before the first user content     (BOS per turn after the first)
//   phi3    <|ROLE|>\nC<|end|>\n                                                   Phi-3-mini-4k-instruct
//   gemma   <start_of_turn>user|model\nTRIM(C)<end_of_turn>\n                      gemma-2-it; a system message
//                                                                                  becomes "S\n\n" before the first
//                                                                                  user content (gemma-3's way)
//   zephyr  <|ROLE|>\nC</s>\n                                                      zephyr-7b-beta
// The leading BOS of llama3/llama2/gemma is o.add_bos's; phi3's trailing eos_token is o.add_eos's.
// limitation: one rendering per family, so relatives differ: Mistral-7B-Instruct's template (the
// other [INST] user) has one BOS, no space before the answer and no system message; Qwen2's
// ChatML adds "You are a helpful assistant." when no system message is given (give it explicitly);
// Llama 3.1's adds a "Cutting Knowledge Date" system header; gemma-2-it refuses system messages.
static bool render_messages(const std::vector<chat_message> &m, ql_chat_template t, const ql_vocab *v,
                            marker_cache *mc, render_out *out, std::string *reason) {
    renderer r{mc, out};
    out->parse_special = false;  // contents stay text; markers were resolved to tokens above
    const int32_t bos = ql_vocab_bos(v), eos = ql_vocab_eos(v);
    if ((t == QL_CHAT_LLAMA2 || t == QL_CHAT_GEMMA) && !check_alternation(m, t, reason)) return false;
    const bool has_sys = m[0].role == "system";
    size_t turn = 0;  // among non-system messages (llama2, gemma)
    for (size_t i = 0; i < m.size(); i++) {
        const std::string &role = m[i].role, &c = m[i].content;
        const bool a = role == "assistant";
        switch (t) {
        case QL_CHAT_LLAMA3:
            r.mark("<|start_header_id|>", false);
            r.text(role, false);
            r.mark("<|end_header_id|>", false);
            r.text("\n\n", false);
            r.text(py_strip(c), a);
            r.end_turn("<|eot_id|>", a);
            break;
        case QL_CHAT_CHATML:
            r.mark("<|im_start|>", false);
            r.text(role + "\n", false);
            r.text(c, a);
            r.end_turn("<|im_end|>", a);
            r.text("\n", false);
            break;
        case QL_CHAT_LLAMA2:
            if (role == "system") break;  // folded into the first user turn
            if (!a) {
                if (turn > 0) r.token(bos, false);
                const std::string content =
                    turn == 0 && has_sys ? "<<SYS>>\n" + m[0].content + "\n<</SYS>>\n\n" + c : c;
                r.mark("[INST]", false);
                r.text(" " + py_strip(content) + " ", false);
                r.mark("[/INST]", false);
                r.last_end = -1;
            } else {
                r.text(" " + py_strip(c) + " ", true);
                r.end_turn_eos(eos, true);
            }
            turn++;
            break;
        case QL_CHAT_PHI3:
            r.mark("<|" + role + "|>", false);
            r.text("\n", false);
            r.text(c, a);
            r.end_turn("<|end|>", a);
            r.text("\n", false);
            break;
        case QL_CHAT_GEMMA:
            if (role == "system") break;  // becomes the first user turn's prefix
            r.mark("<start_of_turn>", false);
            r.text(a ? "model\n" : "user\n", false);
            if (turn == 0 && has_sys) r.text(m[0].content + "\n\n", false);
            r.text(py_strip(c), a);
            r.end_turn("<end_of_turn>", a);
            r.text("\n", false);
            turn++;
            break;
        case QL_CHAT_ZEPHYR:
            r.mark("<|" + role + "|>", false);
            r.text("\n", false);
            r.text(c, a);
            r.end_turn_eos(eos, a);
            r.text("\n", false);
            break;
        default: *reason = "no chat template"; return false;
        }
    }
    out->end_sup = m.back().role == "assistant";
    out->ends_with_eos = eos >= 0 && r.last_end == eos;
    return true;
}

static const char *const ALPACA_INPUT =
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n### Instruction:\n";
static const char *const ALPACA_NO_INPUT =
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n";

// Detects the format and renders. false: a bad line (*reason) or, with *fatal set, a dataset
// that cannot be used at all (messages without a usable template).
static bool render_line(const ql_json &obj, const ql_vocab *v, ql_chat_template chat, marker_cache *mc,
                        render_out *out, data_format *fmt, std::string *reason, bool *fatal) {
    auto str_field = [&](const char *key, const std::string **s) {
        const ql_json *x = obj.get(key);
        if (x->kind != ql_json::STR) {
            *reason = ql_strf("\"%s\" is not a string (it is %s)", key, ql_json_kind_name(x->kind));
            return false;
        }
        *s = &x->str;
        return true;
    };
    {  // two formats in one line: which one is the example is a guess we do not make
        const char *has[3];
        int n = 0;
        if (obj.get("messages")) has[n++] = "\"messages\"";
        if (obj.get("prompt") && obj.get("completion")) has[n++] = "\"prompt\"/\"completion\"";
        if (obj.get("instruction") && obj.get("output")) has[n++] = "\"instruction\"/\"output\"";
        if (n > 1) {
            *reason = ql_strf("both %s and %s: which to train on is ambiguous (keep one)", has[0], has[1]);
            return false;
        }
    }
    if (const ql_json *msgs = obj.get("messages")) {
        *fmt = FMT_MESSAGES;
        if (msgs->kind != ql_json::ARR) {
            *reason = ql_strf("\"messages\" is not an array (it is %s)", ql_json_kind_name(msgs->kind));
            return false;
        }
        if (msgs->items.empty()) {
            *reason = "\"messages\" is empty";
            return false;
        }
        std::vector<chat_message> m;
        for (size_t i = 0; i < msgs->items.size(); i++) {
            const ql_json &x = msgs->items[i];
            if (x.kind != ql_json::OBJ) {
                *reason = ql_strf("messages[%zu] is not an object (it is %s)", i, ql_json_kind_name(x.kind));
                return false;
            }
            const ql_json *role = x.get("role"), *content = x.get("content");
            if (!role || role->kind != ql_json::STR) {
                *reason = ql_strf("messages[%zu].role must be a string (it is %s)", i, role ? ql_json_kind_name(role->kind) : "missing");
                return false;
            }
            if (role->str != "system" && role->str != "user" && role->str != "assistant") {
                *reason = ql_strf("messages[%zu].role \"%s\" is not one of system, user, assistant", i, ql_printable(role->str).c_str());
                return false;
            }
            if (!content || content->kind != ql_json::STR) {
                *reason = ql_strf("messages[%zu].content must be a string (it is %s)", i,
                               content ? ql_json_kind_name(content->kind) : "missing");
                return false;
            }
            m.push_back({role->str, content->str});
        }
        {  // assistant turns that are all empty would train their end-of-turn tokens alone (as an
           // empty completion would its EOS); one empty turn among others is the data's business
            size_t n_assistant = 0, n_empty = 0;
            for (const chat_message &x : m)
                if (x.role == "assistant") n_assistant++, n_empty += x.content.empty();
            if (n_assistant > 0 && n_empty == n_assistant) {
                *reason = n_assistant == 1 ? std::string("empty assistant \"content\": nothing to learn")
                                           : ql_strf("every assistant \"content\" (%zu) is empty: nothing to learn", n_assistant);
                return false;
            }
        }
        if (chat == QL_CHAT_NONE || (unsigned)chat >= (unsigned)QL_CHAT_COUNT) {
            *fatal = true;
            *reason = chat == QL_CHAT_NONE
                          ? "a \"messages\" line needs a chat template, and none was given --> hint: pick one "
                            "(llama3, chatml, llama2, phi3, gemma, zephyr) or detect it from the model's "
                            "tokenizer.chat_template"
                          : ql_strf("unknown chat template %d", (int)chat);
            return false;
        }
        for (const std::string &mk : chat_required_markers(chat)) {
            if (!mc->present(mk)) {
                *fatal = true;
                *reason = ql_strf("chat template %s needs the special token %s, which the vocabulary does not have",
                               ql_chat_template_name(chat), mk.c_str());
                return false;
            }
        }
        if ((chat == QL_CHAT_LLAMA2 || chat == QL_CHAT_ZEPHYR) && ql_vocab_eos(v) < 0) {
            *fatal = true;
            *reason = ql_strf("chat template %s ends turns with EOS, and the vocabulary has none", ql_chat_template_name(chat));
            return false;
        }
        return render_messages(m, chat, v, mc, out, reason);
    }
    if (obj.get("prompt") && obj.get("completion")) {
        *fmt = FMT_PROMPT_COMPLETION;
        if (obj.get("text")) {  // two texts: which one is the example is a guess we do not make
            *reason = "both \"text\" and \"prompt\"/\"completion\": which to train on is ambiguous (keep one)";
            return false;
        }
        const std::string *prompt, *completion;
        if (!str_field("prompt", &prompt) || !str_field("completion", &completion)) return false;
        if (completion->empty()) {  // it would train a lone end-of-sequence token (loss ~22 on a fresh adapter)
            *reason = "empty \"completion\": nothing to learn";
            return false;
        }
        // TRL: the text is prompt + completion; the loss is on the completion's tokens
        out->parts = {{*prompt, -1, false}, {*completion, -1, true}};
        out->end_sup = true;
        return true;
    }
    if (obj.get("instruction") && obj.get("output")) {
        *fmt = FMT_ALPACA;
        const std::string *instruction, *output, *input = nullptr;
        if (!str_field("instruction", &instruction) || !str_field("output", &output)) return false;
        if (output->empty()) {
            *reason = "empty \"output\": nothing to learn";
            return false;
        }
        if (obj.get("input") && !str_field("input", &input)) return false;
        // Stanford Alpaca's PROMPT_DICT wording, with the newline after "### Response:" that
        // alpaca-lora's template, torchtune and the tatsu-lab/alpaca "text" field have
        // (Stanford's train.py itself ends the prompt at "### Response:")
        std::string prompt;
        if (input && !input->empty())
            prompt = ALPACA_INPUT + *instruction + "\n\n### Input:\n" + *input + "\n\n### Response:\n";
        else
            prompt = ALPACA_NO_INPUT + *instruction + "\n\n### Response:\n";
        out->parts = {{prompt, -1, false}, {*output, -1, true}};
        out->end_sup = true;
        return true;
    }
    if (obj.get("text")) {
        *fmt = FMT_TEXT;
        const std::string *text;
        if (!str_field("text", &text)) return false;
        if (text->empty()) {  // it would train a lone end-of-sequence token, as an empty completion would
            *reason = "empty \"text\": nothing to learn";
            return false;
        }
        out->parts = {{*text, -1, true}};
        out->end_sup = true;
        return true;
    }
    *reason = "unknown fields (expected text | prompt+completion | messages | instruction+output)";
    return false;
}

// ============================================================================================
// tokenizing parts
// ============================================================================================

// Tokens and mask of the parts, equal to tokenizing their concatenated text in one go (with the
// special tokens in place) wherever that is possible:
// - each maximal run of text parts between two special tokens is tokenized as one text, so a
//   SentencePiece space prefix is added exactly where the whole-text tokenization adds it (at the
//   start and after each special token) and never at a part boundary inside a run;
// - the mask boundary between two parts of a run is where the run's tokens stop agreeing with the
//   tokens of the run's text up to that boundary (TRL's prompt/prompt+completion comparison).
//   limitation: when a token spans the boundary (a merge across it, e.g. "a" + "b" -> "ab"), that
//   token is supervised if either side is, and the tokens after it belong to the later part.
static void tokenize_parts(const ql_vocab *v, const std::vector<text_part> &parts, bool parse_special,
                           std::vector<int32_t> &tok, std::vector<uint8_t> &sup) {
    std::string run, prefix;
    for (size_t i = 0; i < parts.size();) {
        if (parts[i].token >= 0) {
            tok.push_back(parts[i].token);
            sup.push_back(parts[i].sup);
            i++;
            continue;
        }
        size_t j = i;
        run.clear();
        while (j < parts.size() && parts[j].token < 0) run += parts[j++].text;
        const std::vector<int32_t> all = ql_tokenize(v, run, false, parse_special);
        size_t done = 0;
        bool pending = false;  // the next token also holds text of an earlier supervised part
        prefix.clear();
        for (size_t k = i; k < j; k++) {
            size_t upto = all.size();
            bool cross = false;
            if (k + 1 < j) {
                prefix += parts[k].text;
                const std::vector<int32_t> pre = ql_tokenize(v, prefix, false, parse_special);
                size_t l = 0;
                while (l < pre.size() && l < all.size() && pre[l] == all[l]) l++;
                cross = l < pre.size();
                upto = std::max(l, done);
            }
            for (size_t t = done; t < upto; t++) {
                tok.push_back(all[t]);
                sup.push_back(parts[k].sup || pending);
                pending = false;
            }
            pending = pending || (cross && parts[k].sup);
            done = upto;
        }
        i = j;
    }
}

// ============================================================================================
// loading
// ============================================================================================

// Lines of a file, read in blocks; '\n' ends a line, a '\r' before it is dropped.
struct line_reader {
    FILE *f;
    std::vector<char> buf = std::vector<char>(1 << 16);
    size_t pos = 0, len = 0;
    uint64_t offset = 0;  // file offset of buf[pos]
    bool eof = false;

    // false at the end of the file (or on a read error: check ferror)
    bool next(std::string &line, uint64_t *line_offset) {
        line.clear();
        *line_offset = offset;
        bool any = false;
        for (;;) {
            if (pos == len) {
                if (eof) break;
                len = fread(buf.data(), 1, buf.size(), f);
                pos = 0;
                if (len == 0) {
                    eof = true;
                    break;
                }
            }
            any = true;
            const char *s = buf.data() + pos;
            const char *nl = (const char *)memchr(s, '\n', len - pos);
            const size_t n = nl ? (size_t)(nl - s) : len - pos;
            line.append(s, n);
            pos += n;
            offset += n;
            if (nl) {
                pos++;
                offset++;
                break;
            }
        }
        if (!line.empty() && line.back() == '\r') line.pop_back();
        return any;
    }
};

bool ql_data_options_for(const ql_gguf *g, const ql_vocab *v, const char *template_name, ql_data_options *o, std::string *err) {
    if (template_name) {
        const ql_chat_template t = ql_chat_template_from_name(template_name);
        if (t == QL_CHAT_COUNT) {
            if (err) *err = ql_strf("unknown template '%s' (llama3, chatml, llama2, phi3, gemma, zephyr)", template_name);
            return false;
        }
        o->chat = t;
    } else {
        size_t len = 0;
        const int64_t ic = g ? ql_gguf_find_kv(g, "tokenizer.chat_template") : -1;
        const char *jinja = ic >= 0 ? ql_gguf_get_str(g, ic, &len) : nullptr;
        o->chat = jinja ? ql_chat_template_detect(jinja) : QL_CHAT_NONE;
    }
    o->add_bos = ql_vocab_bos(v) >= 0 && ql_vocab_add_bos(v);
    return true;
}

bool ql_dataset_load(const char *path, const ql_vocab *v, const ql_data_options &o, ql_dataset *out, std::string *err) {
    std::string e_local;
    std::string &e = err ? *err : e_local;
    e.clear();
    if (!out) {
        e = "ql_dataset_load: NULL dataset";
        return false;
    }
    *out = ql_dataset();
    if (!path || !v) {
        e = ql_strf("ql_dataset_load: NULL %s", !path ? "path" : "vocabulary");
        return false;
    }
    if (o.seq_len < 2) {
        e = ql_strf("%s: seq_len %d is too small (at least 2: a token and the one it predicts)", path, o.seq_len);
        return false;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        e = ql_strf("%s: cannot open: %s", path, strerror(errno));
        return false;
    }
    line_reader lr{f};
    marker_cache mc{v, {}};
    const int32_t bos = ql_vocab_bos(v), eos = ql_vocab_eos(v);
    std::string line, first_skipped;
    uint64_t line_off = 0;
    int64_t line_no = 0;
    bool ok = true;
    std::vector<int32_t> tok;
    std::vector<uint8_t> sup;
    while (lr.next(line, &line_off)) {
        line_no++;
        std::string_view s(line);
        uint64_t s_off = line_off;
        if (line_no == 1 && s.size() >= 3 && !memcmp(s.data(), "\xEF\xBB\xBF", 3)) {  // UTF-8 BOM
            s.remove_prefix(3);
            s_off += 3;
        }
        if (s.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank
        out->n_lines++;

        std::string reason;
        bool fatal = false;
        ql_json obj;
        render_out r;
        data_format fmt = FMT_TEXT;
        const size_t bad = ql_utf8_invalid_at(s);
        if (bad != std::string_view::npos) {
            reason = ql_strf("invalid UTF-8 (byte 0x%02x) at column %zu, byte offset %llu in the file",
                          (unsigned char)s[bad], bad + 1, (unsigned long long)(s_off + bad));
        } else {
            if (!ql_json_parse(s, QL_JSON_LINE, &obj, &reason)) {
                if (reason.empty()) reason = "bad JSON";
            } else if (!render_line(obj, v, o.chat, &mc, &r, &fmt, &reason, &fatal)) {
                if (reason.empty()) reason = "bad line";
            }
        }
        if (!reason.empty()) {
            const std::string msg = ql_strf("%s:%lld: ", path, (long long)line_no) + reason;
            if (fatal || !o.skip_bad_lines) {
                e = msg;
                ok = false;
                break;
            }
            if (first_skipped.empty()) first_skipped = msg;
            out->n_bad++;
            continue;
        }

        tok.clear();
        sup.clear();
        tokenize_parts(v, r.parts, r.parse_special, tok, sup);
        if (o.add_bos && bos >= 0 && (tok.empty() || tok[0] != bos)) {
            tok.insert(tok.begin(), bos);
            sup.insert(sup.begin(), 0);
        }
        if (o.add_eos && eos >= 0 && !r.ends_with_eos && (tok.empty() || tok.back() != eos)) {
            tok.push_back(eos);
            sup.push_back(r.end_sup);
        }
        if (!sup.empty()) sup[0] = 0;  // nothing predicts the first token
        const bool truncated = (int64_t)tok.size() > o.seq_len;
        if (truncated) {
            tok.resize((size_t)o.seq_len);
            sup.resize((size_t)o.seq_len);
            out->n_truncated++;
        }
        int64_t n_sup = 0;
        for (uint8_t x : sup) n_sup += x;
        if (n_sup == 0) {
            out->n_empty++;
            continue;
        }
        ql_example ex;
        ex.tokens = tok;
        ex.supervised = sup;
        ex.line = (int)line_no;
        ex.truncated = truncated;
        out->n_tokens += (int64_t)tok.size();
        out->n_supervised += n_sup;
        out->n_per_format[fmt]++;
        out->examples.push_back(std::move(ex));
    }
    if (ok && ferror(f)) {
        e = ql_strf("%s:%lld: read error: %s", path, (long long)line_no + 1, strerror(errno));
        ok = false;
    }
    fclose(f);
    if (ok) e = first_skipped;  // with skip_bad_lines: the first skipped line, for a warning
    return ok;
}

// ============================================================================================
// train/eval split
// ============================================================================================

// splitmix64 (Steele, Lea, Flood 2014): the same stream on every platform and standard library
static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// uniform in [0, n), without modulo bias (rejection of the short last interval)
static uint64_t rand_below(uint64_t *state, uint64_t n) {
    const uint64_t limit = (0 - n) % n;  // 2^64 mod n
    for (;;) {
        const uint64_t r = splitmix64(state);
        if (r >= limit) return r % n;
    }
}

static void dataset_recount(ql_dataset *d) {
    d->n_tokens = d->n_supervised = 0;
    for (const ql_example &ex : d->examples) {
        d->n_tokens += (int64_t)ex.tokens.size();
        for (uint8_t s : ex.supervised) d->n_supervised += s;
    }
}

// k = round(fraction * n), at least 1 and at most n - 1; the chosen examples are the first k of
// a Fisher-Yates shuffle of 0..n-1; both sets keep file order. The file-level counts (n_lines,
// n_bad, n_truncated, n_empty, n_per_format) stay with train; token counts are recomputed.
void ql_dataset_split(ql_dataset *train, double fraction, uint64_t seed, ql_dataset *eval) {
    if (!train || !eval) return;
    *eval = ql_dataset();
    const size_t n = train->examples.size();
    if (!(fraction > 0) || n < 2) return;
    double want = fraction * (double)n + 0.5;
    size_t k = want >= (double)n ? n - 1 : (size_t)want;
    k = std::max<size_t>(1, std::min(k, n - 1));
    std::vector<size_t> perm(n);
    for (size_t i = 0; i < n; i++) perm[i] = i;
    uint64_t state = seed;
    for (size_t i = n - 1; i > 0; i--) std::swap(perm[i], perm[(size_t)rand_below(&state, (uint64_t)i + 1)]);
    std::vector<uint8_t> to_eval(n, 0);
    for (size_t i = 0; i < k; i++) to_eval[perm[i]] = 1;
    std::vector<ql_example> keep;
    keep.reserve(n - k);
    eval->examples.reserve(k);
    for (size_t i = 0; i < n; i++) {
        if (to_eval[i]) eval->examples.push_back(std::move(train->examples[i]));
        else keep.push_back(std::move(train->examples[i]));
    }
    train->examples.swap(keep);
    dataset_recount(train);
    dataset_recount(eval);
}

// ============================================================================================
// training sequences
// ============================================================================================

// First-fit over bins of capacity L, in O(log n) per placement: a max tree over every bin that
// could ever open (one per example), each leaf its free space; the leftmost leaf with room is the
// first bin that fits (the unopened ones all sit to the right of the opened ones, full size).
struct fit_tree {
    size_t leaves = 1;
    std::vector<int32_t> t;  // [2 * leaves], node 1 the root
    fit_tree(size_t n, int32_t cap) {
        while (leaves < n) leaves *= 2;
        t.assign(2 * leaves, 0);
        for (size_t i = 0; i < n; i++) t[leaves + i] = cap;
        for (size_t i = leaves - 1; i >= 1; i--) t[i] = std::max(t[2 * i], t[2 * i + 1]);
    }
    // the leftmost bin with at least `need` free (need <= cap), its free space reduced
    size_t place_bin(int32_t need) {
        size_t i = 1;
        while (i < leaves) i = t[2 * i] >= need ? 2 * i : 2 * i + 1;
        const size_t bin = i - leaves;
        t[i] -= need;
        for (i /= 2; i >= 1; i /= 2) t[i] = std::max(t[2 * i], t[2 * i + 1]);
        return bin;
    }
};

void ql_dataset_sequences(const ql_dataset &d, const ql_data_options &o, int32_t pad_token, std::vector<ql_sequence> *out) {
    if (!out) return;
    out->clear();
    const int32_t L = o.seq_len;
    if (L <= 0) return;
    // which examples go into which sequence, in order
    std::vector<std::vector<size_t>> bins;
    auto len_of = [&](size_t i) { return (int32_t)std::min(d.examples[i].tokens.size(), (size_t)L); };
    if (!o.pack) {
        for (size_t i = 0; i < d.examples.size(); i++)
            if (len_of(i) > 0) bins.push_back({i});
    } else if (!d.examples.empty()) {
        fit_tree ft(d.examples.size(), L);
        for (size_t i = 0; i < d.examples.size(); i++) {
            const int32_t n = len_of(i);
            if (n == 0) continue;
            const size_t b = ft.place_bin(n);
            if (b >= bins.size()) bins.resize(b + 1);
            bins[b].push_back(i);
        }
    }
    out->resize(bins.size());
    for (size_t b = 0; b < bins.size(); b++) {
        ql_sequence &s = (*out)[b];
        s.tokens.assign((size_t)L, pad_token);
        s.pos.assign((size_t)L, 0);
        s.seg.assign((size_t)L, 0);
        s.targets.assign((size_t)L, -1);
        s.n_targets = 0;
        size_t at = 0;
        int32_t seg = 0;
        for (size_t i : bins[b]) {
            const ql_example &ex = d.examples[i];
            const size_t n = (size_t)len_of(i);
            for (size_t j = 0; j < n; j++) {
                s.tokens[at + j] = ex.tokens[j];
                s.pos[at + j] = (int32_t)j;
                s.seg[at + j] = seg;
                if (j + 1 < n && j + 1 < ex.supervised.size() && ex.supervised[j + 1]) {
                    s.targets[at + j] = ex.tokens[j + 1];
                    s.n_targets++;
                }
            }
            at += n;
            seg++;
        }
        s.len = (int64_t)at;
        for (size_t j = at; j < (size_t)L; j++) {  // padding: its own segment, positions from 0
            s.pos[j] = (int32_t)(j - at);
            s.seg[j] = seg;
        }
    }
}
