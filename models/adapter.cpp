// models/adapter.cpp - adapters in llama.cpp's and PEFT's files, merged models (see adapter.h).
//
// Reading order: errors and files -> a small JSON reader/writer -> safetensors -> module names and
// the q/k row permutation -> LoRA configuration -> llama.cpp adapter GGUF -> PEFT save/attach ->
// merged model.
#include "adapter.h"
#include "json.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <thread>
#include <unordered_map>

// ============================================================================================
// errors and files
// ============================================================================================

static bool fail(std::string *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(std::string *err, const char *fmt, ...) {
    char b[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, sizeof(b), fmt, ap);
    va_end(ap);
    if (err) *err = b;
    return false;
}

static bool is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

// The whole file into *out; *why says what went wrong (without the path).
static bool read_whole_file(const char *path, std::vector<uint8_t> *out, std::string *why) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO: refused below, not waited on
    if (fd < 0) return fail(why, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return fail(why, "not a regular file");
    }
    out->resize((size_t)st.st_size);
    size_t got = 0;
    while (got < out->size()) {
        const ssize_t n = read(fd, out->data() + got, out->size() - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            close(fd);
            return fail(why, "read failed after %zu of %zu bytes: %s", got, out->size(), n < 0 ? strerror(errno) : "end of file");
        }
        got += (size_t)n;
    }
    close(fd);
    return true;
}

struct chunk {
    const void *data;
    size_t size;
};

// Writes the chunks to path + ".tmp", fsyncs, renames over path (then fsyncs the folder, best
// effort): a crash leaves the old file or the new one, never half of one.
static bool write_atomic(const std::string &path, const std::vector<chunk> &chunks, std::string *err) {
    struct stat st;  // the rename would put a file where a device, a FIFO or a link was
    if (lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
        return fail(err, "%s: exists and is not a regular file (a %s): not replaced", path.c_str(),
                    S_ISLNK(st.st_mode) ? "symbolic link" : "device, FIFO or socket");
    const std::string tmp = path + ".tmp";
    unlink(tmp.c_str());  // a stale one is replaced by a new file, never opened through a link (to an input, say)
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return fail(err, "%s: cannot create %s: %s", path.c_str(), tmp.c_str(), strerror(errno));
    const char *what = nullptr;
    int e = 0;
    for (const chunk &c : chunks) {
        size_t done = 0;
        while (!what && done < c.size) {
            const ssize_t n = write(fd, (const uint8_t *)c.data + done, c.size - done);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                what = "write";
                e = n < 0 ? errno : ENOSPC;
            } else {
                done += (size_t)n;
            }
        }
    }
    if (!what && fsync(fd) != 0) {
        what = "fsync";
        e = errno;
    }
    if (close(fd) != 0 && !what) {
        what = "close";
        e = errno;
    }
    if (!what && rename(tmp.c_str(), path.c_str()) != 0) {
        what = "rename";
        e = errno;
    }
    if (what) {
        unlink(tmp.c_str());
        return fail(err, "%s: %s failed: %s", path.c_str(), what, strerror(e));
    }
    std::string dir = path.substr(0, path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/'));
    if (dir.empty()) dir = path[0] == '/' ? "/" : ".";
    const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        (void)fsync(dfd);  // some file systems refuse: the data itself is already durable
        close(dfd);
    }
    return true;
}

bool ql_write_file_atomic(const char *path, const void *data, size_t n, std::string *err) {
    return write_atomic(path, {{data, n}}, err);
}

// shortest decimal text that reads back as the same float (JSON and labels)
static std::string float_text(double v) {
    char b[64];
    for (int p = 6; p <= 17; p++) {
        snprintf(b, sizeof(b), "%.*g", p, v);
        if ((float)strtod(b, nullptr) == (float)v) break;
    }
    return b;
}

// ============================================================================================
// safetensors: u64 LE header length N, N bytes of JSON (space-padded to a multiple of 8 by
// writers), then the byte buffer the data_offsets [begin, end) index
// (huggingface/safetensors README "Format" and safetensors/src/tensor.rs)
// ============================================================================================

static const uint64_t k_st_max_header = 100000000;  // the reference implementation's MAX_HEADER_SIZE

size_t ql_st_dtype_size(const std::string &d) {
    if (d == "F32") return 4;
    if (d == "F16" || d == "BF16") return 2;
    if (d == "U8") return 1;  // bitsandbytes' packed 4-bit weights and their 8-bit absmax codes
    return 0;
}

bool ql_st_shape_count(const std::vector<int64_t> &shape, int64_t *n) {
    int64_t p = 1;  // the product of the dimensions that are not 0, each step checked
    bool empty = false;
    for (int64_t d : shape) {
        if (d < 0) return false;
        if (d == 0) empty = true;
        else if (__builtin_mul_overflow(p, d, &p)) return false;
    }
    *n = empty ? 0 : p;
    return true;
}

// product(shape) * elem, false on overflow (ql_st_shape_count's rule) or a negative dimension
static bool st_nbytes(const std::vector<int64_t> &shape, size_t elem, uint64_t *out) {
    int64_t n = 0;
    return ql_st_shape_count(shape, &n) && !__builtin_mul_overflow((uint64_t)n, (uint64_t)elem, out);
}

bool ql_safetensors_write(const char *path, const std::vector<ql_st_tensor> &tensors,
                          const std::vector<std::pair<std::string, std::string>> &metadata, std::string *err) {
    if (!path) return fail(err, "ql_safetensors_write: no path");
    // larger elements first (as the reference writer), so every tensor's data stays aligned to
    // its element size in the buffer; the given order is kept among equal sizes
    std::vector<size_t> order(tensors.size());
    for (size_t i = 0; i < order.size(); i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
        return ql_st_dtype_size(tensors[x].dtype) > ql_st_dtype_size(tensors[y].dtype);
    });
    std::string h = "{";
    if (!metadata.empty()) {
        h += "\"__metadata__\":{";
        for (size_t i = 0; i < metadata.size(); i++)
            h += (i ? "," : "") + ql_json_quote(metadata[i].first) + ":" + ql_json_quote(metadata[i].second);
        h += "}";
    }
    std::unordered_map<std::string, int> seen;
    std::vector<chunk> chunks(1);
    uint64_t offset = 0;
    for (size_t i : order) {
        const ql_st_tensor &t = tensors[i];
        const size_t es = ql_st_dtype_size(t.dtype);
        uint64_t n = 0;
        if (t.name.empty() || t.name == "__metadata__") return fail(err, "%s: bad tensor name '%s'", path, t.name.c_str());
        if (seen[t.name]++) return fail(err, "%s: tensor %s given twice", path, t.name.c_str());
        if (!es) return fail(err, "%s: tensor %s has dtype '%s' (F32, F16 or BF16 expected)", path, t.name.c_str(), t.dtype.c_str());
        if (!st_nbytes(t.shape, es, &n) || n > ((uint64_t)1 << 62))
            return fail(err, "%s: tensor %s has a bad shape", path, t.name.c_str());
        if (n && !t.data) return fail(err, "%s: tensor %s has no data", path, t.name.c_str());
        h += (h.size() > 1 ? "," : "") + ql_json_quote(t.name) + ":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
        for (size_t k = 0; k < t.shape.size(); k++) h += (k ? "," : "") + std::to_string(t.shape[k]);
        h += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) + "]}";
        offset += n;
        chunks.push_back({t.data, (size_t)n});
    }
    h += "}";
    while (h.size() % 8) h += ' ';
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)h.size() >> (8 * i));
    chunks[0] = {len, 8};
    chunks.insert(chunks.begin() + 1, chunk{h.data(), h.size()});
    return write_atomic(path, chunks, err);
}

bool ql_safetensors_read(const char *path, std::vector<ql_st_tensor> *tensors, std::vector<uint8_t> *storage,
                         std::string *err, std::vector<std::pair<std::string, std::string>> *metadata) {
    if (!path || !tensors || !storage) return fail(err, "ql_safetensors_read: bad arguments");
    tensors->clear();
    if (metadata) metadata->clear();
    std::string why;
    if (!read_whole_file(path, storage, &why)) return fail(err, "%s: %s", path, why.c_str());
    const uint8_t *f = storage->data();
    const uint64_t size = storage->size();
    if (size < 8) return fail(err, "%s: %llu bytes, too short for a safetensors header", path, (unsigned long long)size);
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)f[i] << (8 * i);
    if (n > k_st_max_header) return fail(err, "%s: header length %llu is over the %llu-byte limit", path, (unsigned long long)n,
                                         (unsigned long long)k_st_max_header);
    if (n > size - 8)
        return fail(err, "%s: header length %llu runs past the end of the file (%llu bytes)", path, (unsigned long long)n,
                    (unsigned long long)size);
    const char *h = (const char *)f + 8;
    if (n == 0 || h[0] != '{') return fail(err, "%s: the header does not start with '{'", path);
    const size_t bad_at = ql_utf8_invalid_at(std::string_view(h, (size_t)n));
    if (bad_at != std::string_view::npos) return fail(err, "%s: the header is not valid UTF-8 (byte %zu)", path, bad_at);
    ql_json root;
    if (!ql_json_parse(std::string_view(h, (size_t)n), QL_JSON_DOCUMENT, &root, &why))
        return fail(err, "%s: bad JSON header: %s", path, why.c_str());
    if (root.kind != ql_json::OBJ) return fail(err, "%s: the header is not a JSON object", path);
    const uint64_t data_size = size - 8 - n;
    struct span {
        uint64_t b, e;
        size_t i;
    };
    std::vector<span> spans;
    for (size_t k = 0; k < root.keys.size(); k++) {
        const std::string &name = root.keys[k];
        const ql_json &v = root.items[k];
        if (name == "__metadata__") {
            if (v.kind != ql_json::OBJ) return fail(err, "%s: __metadata__ is %s, not an object", path, ql_json_kind_name(v.kind));
            for (size_t i = 0; i < v.keys.size(); i++) {
                if (v.items[i].kind != ql_json::STR)
                    return fail(err, "%s: __metadata__ value of \"%s\" is %s, not a string", path, v.keys[i].c_str(),
                                ql_json_kind_name(v.items[i].kind));
                if (metadata) metadata->push_back({v.keys[i], v.items[i].str});
            }
            continue;
        }
        if (v.kind != ql_json::OBJ) return fail(err, "%s: tensor %s: entry is %s, not an object", path, name.c_str(), ql_json_kind_name(v.kind));
        const ql_json *dt = v.get("dtype"), *sh = v.get("shape"), *of = v.get("data_offsets");
        if (!dt || dt->kind != ql_json::STR) return fail(err, "%s: tensor %s: missing dtype string", path, name.c_str());
        if (!sh || sh->kind != ql_json::ARR) return fail(err, "%s: tensor %s: missing shape array", path, name.c_str());
        if (!of || of->kind != ql_json::ARR || of->items.size() != 2)
            return fail(err, "%s: tensor %s: data_offsets must be [begin, end]", path, name.c_str());
        const size_t es = ql_st_dtype_size(dt->str);
        if (!es)
            return fail(err, "%s: tensor %s has dtype %s; only F32, F16, BF16 and U8 are read", path, name.c_str(), dt->str.c_str());
        ql_st_tensor t;
        t.name = name;
        t.dtype = dt->str;
        for (const ql_json &d : sh->items) {
            uint64_t x = 0;
            if (!d.as_u64(&x) || x > (uint64_t)INT64_MAX)
                return fail(err, "%s: tensor %s: shape entries must be non-negative integers", path, name.c_str());
            t.shape.push_back((int64_t)x);
        }
        uint64_t b = 0, e = 0, want = 0;
        if (!of->items[0].as_u64(&b) || !of->items[1].as_u64(&e))
            return fail(err, "%s: tensor %s: data_offsets must be non-negative integers", path, name.c_str());
        if (e < b) return fail(err, "%s: tensor %s: data_offsets [%llu, %llu] end before they begin", path, name.c_str(),
                               (unsigned long long)b, (unsigned long long)e);
        if (e > data_size)
            return fail(err, "%s: tensor %s: data_offsets [%llu, %llu] run past the %llu data bytes", path, name.c_str(),
                        (unsigned long long)b, (unsigned long long)e, (unsigned long long)data_size);
        if (!st_nbytes(t.shape, es, &want))
            return fail(err, "%s: tensor %s: the element count of its shape overflows (data_offsets give %llu bytes)", path, name.c_str(),
                        (unsigned long long)(e - b));
        if (want != e - b)
            return fail(err, "%s: tensor %s: %s shape needs %llu bytes, data_offsets give %llu", path, name.c_str(),
                        t.dtype.c_str(), (unsigned long long)want, (unsigned long long)(e - b));
        t.data = f + 8 + n + b;
        spans.push_back({b, e, tensors->size()});
        tensors->push_back(t);
    }
    // the tensors must tile the buffer exactly: no overlaps (aliasing), no gaps (hidden bytes)
    std::sort(spans.begin(), spans.end(), [](const span &x, const span &y) { return x.b != y.b ? x.b < y.b : x.e < y.e; });
    uint64_t at = 0;
    for (const span &s : spans) {
        const char *name = (*tensors)[s.i].name.c_str();
        if (s.b < at) return fail(err, "%s: tensor %s (bytes %llu..%llu) overlaps another tensor", path, name,
                                  (unsigned long long)s.b, (unsigned long long)s.e);
        if (s.b > at) return fail(err, "%s: bytes %llu..%llu before tensor %s belong to no tensor", path,
                                  (unsigned long long)at, (unsigned long long)s.b, name);
        at = s.e;
    }
    if (at != data_size)
        return fail(err, "%s: %llu data bytes after the last tensor belong to no tensor", path, (unsigned long long)(data_size - at));
    return true;
}

// ============================================================================================
// module names and the q/k row order
// ============================================================================================

namespace {

// the seven linear weights of a block: GGUF name, PEFT module, PEFT parent module
struct module_name {
    const char *gguf, *peft, *group;
};
const module_name k_modules[] = {
    {"attn_q", "q_proj", "self_attn"},   {"attn_k", "k_proj", "self_attn"}, {"attn_v", "v_proj", "self_attn"},
    {"attn_output", "o_proj", "self_attn"}, {"ffn_gate", "gate_proj", "mlp"}, {"ffn_up", "up_proj", "mlp"},
    {"ffn_down", "down_proj", "mlp"},
};
const int k_n_modules = 7;
const int k_lm_head = 7;  // module index of the output projection (layer -1)
static_assert(sizeof(k_modules) / sizeof(k_modules[0]) == k_n_modules, "module table");

ql_tensor *slot_weight(const ql_llama &m, int layer, int mod) {
    if (mod == k_lm_head) return m.output;
    const ql_llama_layer &L = m.layers[(size_t)layer];
    ql_tensor *const w[k_n_modules] = {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down};
    return w[mod];
}

std::string peft_name(int layer, int mod, char which) {
    if (mod == k_lm_head) return ql_strf("base_model.model.lm_head.lora_%c.weight", which);
    return ql_strf("base_model.model.model.layers.%d.%s.%s.lora_%c.weight", layer, k_modules[mod].group, k_modules[mod].peft, which);
}

// "base_model.model.model.layers.N.<group>.<module>.lora_A.weight" or "...lm_head.lora_B.weight"
// -> layer (-1 for lm_head), module, 'A'/'B'. false when the name is not of that form.
bool parse_peft_name(const std::string &name, long long *layer, int *mod, char *which) {
    const std::string pre = "base_model.model.";
    if (name.compare(0, pre.size(), pre) != 0) return false;
    std::string rest = name.substr(pre.size());
    const std::string sa = ".lora_A.weight", sb = ".lora_B.weight";
    if (rest.size() <= sa.size()) return false;
    const std::string tail = rest.substr(rest.size() - sa.size());
    if (tail != sa && tail != sb) return false;
    *which = tail == sa ? 'A' : 'B';
    rest.resize(rest.size() - sa.size());
    if (rest == "lm_head") {
        *layer = -1;
        *mod = k_lm_head;
        return true;
    }
    const std::string lp = "model.layers.";
    if (rest.compare(0, lp.size(), lp) != 0) return false;
    size_t i = lp.size();
    long long n = 0;
    const size_t digits_at = i;
    while (i < rest.size() && rest[i] >= '0' && rest[i] <= '9' && i - digits_at < 9) n = n * 10 + (rest[i++] - '0');
    if (i == digits_at || i >= rest.size() || rest[i] != '.') return false;
    const std::string module = rest.substr(i + 1);
    for (int k = 0; k < k_n_modules; k++)
        if (module == std::string(k_modules[k].group) + "." + k_modules[k].peft) {
            *layer = n;
            *mod = k;
            return true;
        }
    return false;
}

// GGUF files of the llama family (normal rope) keep q/k rows in Meta's order; Hugging Face
// checkpoints (rotate_half rope) keep them per head as [first halves of the pairs, second
// halves]. llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) goes HF -> GGUF with
// w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2).reshape(w.shape) (k: n_head = n_head_kv), i.e.
// GGUF row h*hd + 2j + s = HF row h*hd + s*hd/2 + j  (j < hd/2, s in {0, 1}).
// qwen2 (neox rope) is converted without it.
bool arch_permutes_qk(const char *arch) {
    return !strcmp(arch, "llama") || !strcmp(arch, "mistral");  // the archs qlora runs with normal rope
}

// rows of row_len floats; to_hf: GGUF -> HF order, else HF -> GGUF
void permute_rows(const float *src, float *dst, int64_t n_rows, int64_t row_len, int n_head, bool to_hf) {
    const int64_t hd = n_rows / n_head, half = hd / 2;
    for (int64_t h = 0; h < n_head; h++)
        for (int64_t j = 0; j < half; j++)
            for (int64_t s = 0; s < 2; s++) {
                const int64_t g = h * hd + 2 * j + s, f = h * hd + s * half + j;
                const int64_t from = to_hf ? g : f, to = to_hf ? f : g;
                memcpy(dst + to * row_len, src + from * row_len, (size_t)row_len * sizeof(float));
            }
}

// heads whose rows a module's B carries in rope order (0: not a rope projection)
int rope_heads(const ql_llama &m, const char *arch, int mod) {
    if (!arch_permutes_qk(arch)) return 0;
    if (mod == 0) return m.hp.n_head;
    if (mod == 1) return m.hp.n_head_kv;
    return 0;
}

// any float tensor (contiguous) as f32
bool tensor_f32(const ql_tensor *t, std::vector<float> *out) {
    if (!t || !t->data || !ql_is_contiguous(t)) return false;
    out->resize((size_t)ql_nelements(t));
    if (t->type == QL_TYPE_F32) {
        memcpy(out->data(), t->data, out->size() * sizeof(float));
        return true;
    }
    return ql_dequantize(t->type, t->data, ql_nrows(t), t->ne[0], out->data()) == QL_OK;
}

// an adapter of m, found in model order
struct adapted {
    int layer, mod;           // layer -1 for lm_head
    const ql_tensor *w;
    const ql_lora_pair *p;
    int64_t r;
};

// m's adapters in model order (layers, then the output), each checked against its weight
bool collect_adapters(const ql_llama &m, std::vector<adapted> *out, std::string *why) {
    out->clear();
    auto visit = [&](int layer, int mod) -> bool {
        const ql_tensor *w = slot_weight(m, layer, mod);
        if (!w) return true;
        auto it = m.lora.find(w);
        if (it == m.lora.end()) return true;
        const ql_lora_pair &p = it->second;
        if (!p.a || !p.b) return fail(why, "the adapter of %s lacks its A or B tensor", w->name);
        if (ql_n_dims(p.a) > 2 || ql_n_dims(p.b) > 2 || p.a->ne[0] != w->ne[0] || p.b->ne[1] != w->ne[1] ||
            p.a->ne[1] != p.b->ne[0])
            return fail(why, "the adapter of %s [%lld, %lld] has A [%lld, %lld] and B [%lld, %lld]", w->name,
                        (long long)w->ne[0], (long long)w->ne[1], (long long)p.a->ne[0], (long long)p.a->ne[1],
                        (long long)p.b->ne[0], (long long)p.b->ne[1]);
        if (!p.a->data || !p.b->data) return fail(why, "the adapter of %s has no data", w->name);
        if (!std::isfinite(p.scale)) return fail(why, "the adapter of %s has scale %g", w->name, (double)p.scale);
        out->push_back({layer, mod, w, &p, p.a->ne[1]});
        return true;
    };
    for (int il = 0; il < (int)m.layers.size(); il++)
        for (int k = 0; k < k_n_modules; k++)
            if (!visit(il, k)) return false;
    if (!visit(-1, k_lm_head)) return false;
    if (out->size() != m.lora.size())
        return fail(why, "%zu of the model's adapters sit on tensors that are not linear weights of its blocks or output",
                    m.lora.size() - out->size());
    if (out->empty()) return fail(why, "the model carries no adapter");
    return true;
}

}  // namespace

// ============================================================================================
// LoRA configuration (adapter_config.json)
// ============================================================================================

float ql_lora_scale(const ql_lora_config &c) {
    if (c.r <= 0) return 0.0f;
    return (float)(c.rslora ? (double)c.alpha / std::sqrt((double)c.r) : (double)c.alpha / (double)c.r);
}

// the adapters must be what the configuration describes: rank r, scale alpha / r (or / sqrt r)
static bool check_against_config(const std::vector<adapted> &ads, const ql_lora_config &c, std::string *why) {
    if (c.r <= 0) return fail(why, "config r = %d must be positive", c.r);
    if (!std::isfinite(c.alpha)) return fail(why, "config alpha is not finite");
    const double want = ql_lora_scale(c);
    for (const adapted &a : ads) {
        if (a.r != c.r)
            return fail(why, "the adapter of %s has rank %lld, the config says r = %d", a.w->name, (long long)a.r, c.r);
        if (std::fabs(a.p->scale - want) > 1e-6 * std::fabs(want) + 1e-30)
            return fail(why, "the adapter of %s has scale %.9g, the config gives %s = %.9g", a.w->name, (double)a.p->scale,
                        c.rslora ? "alpha / sqrt(r)" : "alpha / r", want);
    }
    return true;
}

// Written as PEFT's save_pretrained writes it (sorted keys, two-space indent), with the keys
// every PEFT version since 0.9 reads; absent keys take PEFT's defaults on loading.
static std::string config_json(const ql_lora_config &c, const std::vector<std::string> &targets) {
    std::vector<std::pair<std::string, std::string>> kv = {
        {"alpha_pattern", "{}"},
        {"auto_mapping", "null"},
        {"base_model_name_or_path", c.base_model.empty() ? "null" : ql_json_quote(c.base_model)},
        {"bias", "\"none\""},
        {"fan_in_fan_out", "false"},
        {"inference_mode", "true"},
        {"init_lora_weights", "true"},
        {"layers_pattern", "null"},
        {"layers_to_transform", "null"},
        {"lora_alpha", float_text(c.alpha)},
        {"lora_dropout", float_text(c.dropout)},
        {"modules_to_save", "null"},
        {"peft_type", "\"LORA\""},
        {"r", std::to_string(c.r)},
        {"rank_pattern", "{}"},
        {"revision", "null"},
        {"target_modules", ""},
        {"task_type", "\"CAUSAL_LM\""},
        {"use_dora", "false"},
        {"use_rslora", c.rslora ? "true" : "false"},
    };
    std::string t = "[";
    for (size_t i = 0; i < targets.size(); i++) t += std::string(i ? ",\n    " : "\n    ") + ql_json_quote(targets[i]);
    t += targets.empty() ? "]" : "\n  ]";
    std::string o = "{\n";
    for (size_t i = 0; i < kv.size(); i++)
        o += "  " + ql_json_quote(kv[i].first) + ": " + (kv[i].first == "target_modules" ? t : kv[i].second) +
             (i + 1 < kv.size() ? ",\n" : "\n");
    return o + "}\n";
}

bool ql_peft_read_config(const char *dir, ql_lora_config *c, std::string *err) {
    if (!dir || !c) return fail(err, "ql_peft_read_config: bad arguments");
    const std::string path = std::string(dir) + "/adapter_config.json";
    std::vector<uint8_t> text;
    std::string why;
    if (!read_whole_file(path.c_str(), &text, &why)) return fail(err, "%s: %s", path.c_str(), why.c_str());
    const std::string_view doc((const char *)text.data(), text.size());
    const size_t bad_at = ql_utf8_invalid_at(doc);
    if (bad_at != std::string_view::npos) return fail(err, "%s: not valid UTF-8 (byte %zu)", path.c_str(), bad_at);
    ql_json root;
    if (!ql_json_parse(doc, QL_JSON_DOCUMENT, &root, &why)) return fail(err, "%s: bad JSON: %s", path.c_str(), why.c_str());
    if (root.kind != ql_json::OBJ) return fail(err, "%s: not a JSON object", path.c_str());
    const ql_json *pt = root.get("peft_type");
    if (!pt || pt->kind != ql_json::STR) return fail(err, "%s: no peft_type: not a PEFT adapter configuration", path.c_str());
    if (pt->str != "LORA") return fail(err, "%s: peft_type is \"%s\"; only LORA adapters are read", path.c_str(), pt->str.c_str());
    ql_lora_config out;  // PEFT's LoraConfig defaults where a key is absent
    out.r = 8;
    out.alpha = 8.0f;
    out.dropout = 0.0f;
    out.rslora = false;
    auto number = [&](const char *key, double *v) -> bool {
        const ql_json *j = root.get(key);
        if (!j || j->kind == ql_json::NUL) return true;
        if (j->kind != ql_json::NUM) return fail(err, "%s: %s is %s, not a number", path.c_str(), key, ql_json_kind_name(j->kind));
        *v = j->num();
        return true;
    };
    auto flag = [&](const char *key, bool *v) -> bool {
        const ql_json *j = root.get(key);
        if (!j || j->kind == ql_json::NUL) return true;
        if (j->kind != ql_json::BOOL) return fail(err, "%s: %s is %s, not true or false", path.c_str(), key, ql_json_kind_name(j->kind));
        *v = j->b;
        return true;
    };
    if (const ql_json *j = root.get("r")) {
        int64_t r = 0;
        if (!j->as_int(&r) || r <= 0 || r > (1 << 20)) return fail(err, "%s: r must be a positive integer", path.c_str());
        out.r = (int)r;
    }
    double alpha = out.alpha, dropout = out.dropout;
    bool dora = false;
    if (!number("lora_alpha", &alpha) || !number("lora_dropout", &dropout) || !flag("use_rslora", &out.rslora) ||
        !flag("use_dora", &dora))
        return false;
    if (!std::isfinite((float)alpha))  // 1e39 is a finite double but an infinite float
        return fail(err, "%s: lora_alpha %g is not a finite 32-bit number", path.c_str(), alpha);
    out.alpha = (float)alpha;
    out.dropout = (float)dropout;
    if (dora) return fail(err, "%s: use_dora is true; DoRA adapters are not supported", path.c_str());
    for (const char *key : {"rank_pattern", "alpha_pattern"}) {
        const ql_json *j = root.get(key);
        if (j && !(j->kind == ql_json::NUL || (j->kind == ql_json::OBJ && j->keys.empty())))
            return fail(err, "%s: a non-empty %s (per-module ranks or alphas) is not supported", path.c_str(), key);
    }
    if (const ql_json *j = root.get("target_modules")) {
        if (j->kind == ql_json::STR) {
            out.target_modules.push_back(j->str);  // a regular expression or "all-linear"
        } else if (j->kind == ql_json::ARR) {
            for (const ql_json &e : j->items) {
                if (e.kind != ql_json::STR) return fail(err, "%s: target_modules holds %s, not a string", path.c_str(), ql_json_kind_name(e.kind));
                out.target_modules.push_back(e.str);
            }
        } else if (j->kind != ql_json::NUL) {
            return fail(err, "%s: target_modules is %s", path.c_str(), ql_json_kind_name(j->kind));
        }
    }
    if (const ql_json *j = root.get("base_model_name_or_path")) {
        if (j->kind == ql_json::STR) out.base_model = j->str;
        else if (j->kind != ql_json::NUL) return fail(err, "%s: base_model_name_or_path is %s", path.c_str(), ql_json_kind_name(j->kind));
    }
    *c = out;
    return true;
}

// ============================================================================================
// llama.cpp adapter GGUF
// ============================================================================================

// llama.cpp applies scale = user_scale * adapter.lora.alpha / rank (rank = lora_b's ne[0];
// alpha 0 means "no scaling": scale = user_scale), and convert_lora_to_gguf.py stores PEFT's
// lora_alpha as is, ignoring use_rslora. To reproduce rsLoRA's alpha / sqrt(r) through
// alpha' / r, the file stores alpha' = alpha * sqrt(r).
bool ql_lora_save_gguf(const char *path, const ql_llama &m, const char *arch, const ql_lora_config &c, std::string *err) {
    if (!path || !arch) return fail(err, "ql_lora_save_gguf: bad arguments");
    std::vector<adapted> ads;
    std::string why;
    if (!collect_adapters(m, &ads, &why) || !check_against_config(ads, c, &why)) return fail(err, "%s: %s", path, why.c_str());
    if (c.alpha == 0.0f)
        return fail(err, "%s: alpha 0 cannot be written: llama.cpp reads adapter.lora.alpha = 0 as 'no scaling' (scale 1)", path);
    for (const adapted &a : ads)
        if (a.w == m.tok_embd)
            return fail(err, "%s: the output projection is tied to token_embd.weight; llama.cpp would apply its adapter to "
                             "the embedding lookup", path);
    const double alpha = c.rslora ? (double)c.alpha * std::sqrt((double)c.r) : (double)c.alpha;
    ql_gguf_writer *w = ql_gguf_writer_new();
    ql_gguf_set_str(w, "general.architecture", arch);
    ql_gguf_set_str(w, "general.type", "adapter");
    ql_gguf_set_str(w, "adapter.type", "lora");
    ql_gguf_set_f32(w, "adapter.lora.alpha", (float)alpha);
    std::vector<std::vector<float>> keep(ads.size() * 2);  // the writer references data until written
    bool ok = true;
    for (size_t i = 0; i < ads.size() && ok; i++) {
        const adapted &a = ads[i];
        if (!tensor_f32(a.p->a, &keep[2 * i]) || !tensor_f32(a.p->b, &keep[2 * i + 1])) {
            ok = fail(err, "%s: the adapter of %s is not a readable float tensor", path, a.w->name);
            break;
        }
        const int64_t na[4] = {a.w->ne[0], a.r, 1, 1}, nb[4] = {a.r, a.w->ne[1], 1, 1};
        const std::string base = a.w->name;
        if (ql_gguf_add_tensor(w, (base + ".lora_a").c_str(), QL_TYPE_F32, 2, na, keep[2 * i].data(), keep[2 * i].size() * 4) ||
            ql_gguf_add_tensor(w, (base + ".lora_b").c_str(), QL_TYPE_F32, 2, nb, keep[2 * i + 1].data(),
                               keep[2 * i + 1].size() * 4))
            ok = fail(err, "%s: cannot add the tensors of %s (a name of %zu bytes is too long for GGUF?)", path, a.w->name,
                      base.size() + 7);
    }
    char e[512];
    if (ok && ql_gguf_write(w, path, e, sizeof(e)) != QL_OK) ok = fail(err, "%s", e);
    ql_gguf_writer_free(w);
    return ok;
}

// ============================================================================================
// PEFT: adapter_config.json + adapter_model.safetensors
// ============================================================================================

bool ql_peft_save(const char *dir, const ql_llama &m, const char *arch, const ql_lora_config &c, std::string *err) {
    if (!dir || !arch) return fail(err, "ql_peft_save: bad arguments");
    std::vector<adapted> ads;
    std::string why;
    if (!collect_adapters(m, &ads, &why) || !check_against_config(ads, c, &why)) return fail(err, "%s: %s", dir, why.c_str());
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return fail(err, "%s: cannot create the folder: %s", dir, strerror(errno));
    if (!is_dir(dir)) return fail(err, "%s: exists and is not a folder", dir);

    std::vector<std::vector<float>> data(ads.size() * 2);
    std::vector<ql_st_tensor> ts;
    bool used[k_n_modules + 1] = {};
    for (size_t i = 0; i < ads.size(); i++) {
        const adapted &a = ads[i];
        std::vector<float> &A = data[2 * i], &B = data[2 * i + 1];
        if (!tensor_f32(a.p->a, &A) || !tensor_f32(a.p->b, &B))
            return fail(err, "%s: the adapter of %s is not a readable float tensor", dir, a.w->name);
        // A: ne [in, r] = lora_A [r, in] as it is. B: ne [r, out] = lora_B [out, r], rows of q/k
        // put back in Hugging Face's order
        const int heads = rope_heads(m, arch, a.mod);
        if (heads) {
            if (a.w->ne[1] % (2 * heads)) return fail(err, "%s: %s has %lld rows, not pairs per head", dir, a.w->name, (long long)a.w->ne[1]);
            std::vector<float> hf(B.size());
            permute_rows(B.data(), hf.data(), a.w->ne[1], a.r, heads, true);
            B.swap(hf);
        }
        ql_st_tensor ta, tb;
        ta.name = peft_name(a.layer, a.mod, 'A');
        ta.dtype = "F32";
        ta.shape = {a.r, a.w->ne[0]};
        ta.data = A.data();
        tb.name = peft_name(a.layer, a.mod, 'B');
        tb.dtype = "F32";
        tb.shape = {a.w->ne[1], a.r};
        tb.data = B.data();
        ts.push_back(ta);
        ts.push_back(tb);
        used[a.mod] = true;
    }
    std::vector<std::string> targets;  // the modules that carry tensors, in model order
    for (int k = 0; k <= k_n_modules; k++)
        if (used[k]) targets.push_back(k == k_lm_head ? "lm_head" : k_modules[k].peft);
    const std::string st = std::string(dir) + "/adapter_model.safetensors";
    if (!ql_safetensors_write(st.c_str(), ts, {{"format", "pt"}}, err)) return false;
    const std::string cfg = config_json(c, targets);
    return write_atomic(std::string(dir) + "/adapter_config.json", {{cfg.data(), cfg.size()}}, err);
}

// A whole weight PEFT saves beside the LoRA pairs: lm_head's base layer (a LoRA on lm_head saved
// with save_embedding_layers' default, "auto") and modules_to_save's copies of lm_head or
// embed_tokens. The model's tensor it stands for, or NULL for any other name.
static const ql_tensor *peft_full_weight(const ql_llama &m, const std::string &name) {
    for (const char *n : {"base_model.model.lm_head.weight", "base_model.model.lm_head.base_layer.weight"})
        if (name == n) return m.output;
    for (const char *n : {"base_model.model.model.embed_tokens.weight", "base_model.model.model.embed_tokens.base_layer.weight"})
        if (name == n) return m.tok_embd;
    return nullptr;
}

static void st_to_f32(const ql_st_tensor &t, std::vector<float> *o) {
    int64_t n = 0;
    if (!ql_st_shape_count(t.shape, &n)) n = 0;  // (cannot fail: the reader checked every shape)
    o->resize((size_t)n);
    const uint8_t *p = (const uint8_t *)t.data;
    for (size_t i = 0; i < o->size(); i++) {
        if (t.dtype == "F32") {
            memcpy(&(*o)[i], p + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            (*o)[i] = t.dtype == "F16" ? ql_fp16_to_fp32(h) : ql_bf16_to_fp32(h);
        }
    }
}

// The rounding of a float dtype: relative (half an ulp: 2^-p for p significand bits) and absolute
// (half the smallest subnormal, which bounds the rounding of values below the normal range)
struct rounding {
    double rel, abs;
};
static rounding dtype_rounding(const std::string &st_dtype) {
    if (st_dtype == "F16") return {std::ldexp(1.0, -11), std::ldexp(1.0, -25)};
    if (st_dtype == "BF16") return {std::ldexp(1.0, -8), std::ldexp(1.0, -134)};
    return {std::ldexp(1.0, -24), std::ldexp(1.0, -150)};  // F32
}

// a number as plain decimals with 4 significant digits ("0.0001234", "12.5"), no exponent
static std::string plain_number(double x) {
    if (!std::isfinite(x)) return std::isnan(x) ? "nan" : x > 0 ? "inf" : "-inf";
    const double ax = std::fabs(x);
    const int dec = ax == 0 ? 0 : std::max(0, std::min(40, 3 - (int)std::floor(std::log10(ax))));
    char b[96];
    snprintf(b, sizeof(b), "%.*f", dec, x);
    std::string s = b;
    if (s.find('.') != std::string::npos) {
        while (s.back() == '0') s.pop_back();
        if (s.back() == '.') s.pop_back();
    }
    return s;
}

// Whether a saved whole weight t is the model's w - the same base weight, each rounded its own
// way: PEFT saves it in the training dtype (f16 for fp16 training of a bf16 or f32 checkpoint),
// the model holds it converted or quantised into w->type. If both come from the same weight W,
// then by the triangle inequality |ours - saved| <= |ours - W| + |W - saved|, so each value may
// differ by the two roundings together:
//   - the saved dtype's: 2^-24 (f32), 2^-11 (f16), 2^-8 (bf16) of |x|, plus half its smallest
//     subnormal (|W - saved| <= u |W|, and |W| <= |saved| (1 + 2u): 2u |saved| covers it);
//   - w's, for f32/f16/bf16 the same rule with w's dtype (of |ours|);
//   - w's, for a quantized type, its quantisation step in that block. Measured, not tabled:
//     quantising the saved block into w's type (NF4: its fp32-absmax form) errs by at most E_b,
//     its largest error there. On the same grid (scale), an element whose code differs between
//     W and the saved values lies within the saved rounding of a boundary, so ours is within
//     E_b + 2 x that rounding of saved; the scale is computed from the values and moves with them
//     (k-quants' scale search, NF4's double-quantised absmax), which we allow up to another E_b:
//     2 E_b. A weight of another model, or trained away, differs by whole steps at many places.
// Compared in chunks of whole rows (whole blocks: a quantized type's rows are whole blocks; NF4's
// flat 64-blocks are made whole by the chunk's row count), so memory stays O(chunk) whatever the
// vocabulary. Refused: the largest excess and where, in *why.
static bool peft_same_weight(const ql_st_tensor &t, const ql_tensor *w, std::string *why) {
    if (!w || !w->data) return fail(why, "the model has no such weight in memory to compare with");
    if (t.shape.size() != 2 || t.shape[0] != w->ne[1] || t.shape[1] != w->ne[0])
        return fail(why, "its shape is not the model's %s [%lld, %lld]", w->name, (long long)w->ne[1], (long long)w->ne[0]);
    const ql_type_traits *tt = ql_type_traits_get(w->type);
    if (!tt || !tt->is_float) return fail(why, "the model's %s is %s, which it cannot be compared with", w->name, ql_type_name(w->type));
    const int64_t ne0 = w->ne[0], n_rows = w->ne[1];
    const bool nf4 = w->type == QL_TYPE_NF4 || w->type == QL_TYPE_NF4_NODQ;
    const bool quantized = nf4 || tt->blck_size > 1;
    const ql_type requant = nf4 ? QL_TYPE_NF4_NODQ : w->type;
    const int64_t blck = nf4 ? QL_NF4_BLOCK : tt->blck_size;
    const rounding rs = dtype_rounding(t.dtype);
    const rounding ro = w->type == QL_TYPE_F16 ? dtype_rounding("F16") : w->type == QL_TYPE_BF16 ? dtype_rounding("BF16")
                                                                          : dtype_rounding("F32");
    // rows a chunk: about 1M values; NF4: a row count whose values are whole 64-blocks
    int64_t step = 1;
    if (nf4)
        while ((step * ne0) % QL_NF4_BLOCK) step++;
    const int64_t rows = std::max<int64_t>(step, ((int64_t)1 << 20) / ne0 / step * step);
    const size_t esz = ql_st_dtype_size(t.dtype);
    std::vector<float> saved, ours, back;
    std::vector<uint8_t> q;
    double worst = -1, worst_d = 0, worst_tol = 0, worst_s = 0, worst_o = 0;
    int64_t worst_i = 0, n_bad = 0;
    char e[256];
    for (int64_t r0 = 0; r0 < n_rows; r0 += rows) {
        const int64_t nr = std::min(rows, n_rows - r0), n = nr * ne0;
        ql_st_tensor part = t;  // the chunk's rows of the saved tensor, as f32
        part.shape = {nr, ne0};
        part.data = (const uint8_t *)t.data + (size_t)(r0 * ne0) * esz;
        st_to_f32(part, &saved);
        ours.resize((size_t)n);
        for (int64_t r = 0; r < nr; r++)
            if (ql_tensor_row_to_float(w, r0 + r, ours.data() + r * ne0) != QL_OK)
                return fail(why, "the model's %s (%s) cannot be read to compare with", w->name, ql_type_name(w->type));
        bool finite = true;
        for (float v : saved) finite = finite && std::isfinite(v);
        if (quantized && finite) {  // E_b: the quantiser's own error on the saved block
            q.resize(ql_type_data_size(requant, nr, ne0));
            back.resize((size_t)n);
            if (ql_quantize(requant, saved.data(), nr, ne0, q.data(), e, sizeof(e)) != QL_OK ||
                ql_dequantize(requant, q.data(), nr, ne0, back.data()) != QL_OK)
                return fail(why, "the model's %s is %s, which it cannot be compared with (%s)", w->name, ql_type_name(w->type), e);
        }
        for (int64_t b0 = 0; b0 < n; b0 += blck) {
            const int64_t b1 = std::min(n, b0 + blck);
            double eb = 0, amax = 0;
            if (quantized)
                for (int64_t i = b0; i < b1; i++) {
                    amax = std::max(amax, std::fabs((double)saved[(size_t)i]));
                    if (finite) eb = std::max(eb, std::fabs((double)back[(size_t)i] - (double)saved[(size_t)i]));
                }
            for (int64_t i = b0; i < b1; i++) {
                const double s = saved[(size_t)i], o = ours[(size_t)i], d = std::fabs(o - s);
                const double tol = quantized ? 2 * eb + 2 * (rs.rel * amax + rs.abs)
                                             : 2 * rs.rel * std::fabs(s) + rs.abs + 2 * ro.rel * std::fabs(o) + ro.abs;
                if (d <= tol) continue;  // NaN or inf in either: not equal, counted below
                n_bad++;
                const double excess = std::isfinite(d) ? d - tol : HUGE_VAL;
                if (excess > worst) worst = excess, worst_d = d, worst_tol = tol, worst_s = s, worst_o = o, worst_i = r0 * ne0 + i;
            }
        }
    }
    if (n_bad == 0) return true;
    return fail(why, "%lld of its %lld values %s from the model's %s (%s) by more than the two roundings allow; the "
                "largest: %s at row %lld, column %lld (saved %s, the model's %s, allowed %s)", (long long)n_bad,
                (long long)(n_rows * ne0), n_bad == 1 ? "differs" : "differ", w->name, ql_type_name(w->type), plain_number(worst_d).c_str(),
                (long long)(worst_i / ne0), (long long)(worst_i % ne0), plain_number(worst_s).c_str(),
                plain_number(worst_o).c_str(), plain_number(worst_tol).c_str());
}

ql_lora_adapter *ql_peft_attach(ql_llama *m, const char *arch, const char *dir, float user_scale, std::string *err) {
    if (!m || !arch || !dir) {
        fail(err, "ql_peft_attach: bad arguments");
        return nullptr;
    }
    ql_lora_config c;
    if (!ql_peft_read_config(dir, &c, err)) return nullptr;
    const std::string path = std::string(dir) + "/adapter_model.safetensors";
    const char *file = path.c_str();
    std::vector<ql_st_tensor> ts;
    std::vector<uint8_t> storage;
    if (!ql_safetensors_read(file, &ts, &storage, err)) return nullptr;
    for (const ql_st_tensor &t : ts)
        if (t.dtype == "U8") {
            fail(err, "%s: tensor %s has dtype U8; a LoRA tensor is F32, F16 or BF16", file, t.name.c_str());
            return nullptr;
        }

    struct found {
        const ql_st_tensor *a = nullptr, *b = nullptr;
        int mod = 0;
    };
    std::unordered_map<const ql_tensor *, found> byw;
    std::vector<const ql_tensor *> order;  // weights in file order, for deterministic errors
    for (const ql_st_tensor &t : ts) {
        long long layer = 0;
        int mod = 0;
        char which = 0;
        if (!parse_peft_name(t.name, &layer, &mod, &which)) {
            if (const ql_tensor *w = peft_full_weight(*m, t.name)) {  // nothing to apply when it is ours; refused otherwise
                std::string why;
                if (!peft_same_weight(t, w, &why)) {
                    const bool copy = t.name.find("base_layer") == std::string::npos;
                    fail(err, "%s: %s: %s%s", file, t.name.c_str(), why.c_str(),
                         copy ? "; a trained copy (modules_to_save) replaces the weight, and qlora applies LoRA pairs only" : "");
                    return nullptr;
                }
                continue;
            }
            fail(err, "%s: tensor %s is not a LoRA tensor of a llama block or lm_head (expected "
                      "base_model.model.model.layers.N.{self_attn,mlp}.<module>.lora_{A,B}.weight)", file, t.name.c_str());
            return nullptr;
        }
        if (layer >= (long long)m->layers.size()) {
            fail(err, "%s: tensor %s adapts layer %lld; the model has %zu layers", file, t.name.c_str(), layer, m->layers.size());
            return nullptr;
        }
        const ql_tensor *w = slot_weight(*m, (int)layer, mod);
        found &f = byw[w];
        if (!f.a && !f.b) order.push_back(w);
        f.mod = mod;
        (which == 'A' ? f.a : f.b) = &t;
    }
    if (order.empty()) {
        fail(err, "%s: no LoRA tensors", file);
        return nullptr;
    }
    // check everything and convert to f32 (B's q/k rows into GGUF order) before binding anything
    struct ready {
        const ql_tensor *w;
        std::vector<float> a, b;
        int64_t r;
    };
    std::vector<ready> rs;
    for (const ql_tensor *w : order) {
        const found &f = byw[w];
        if (!f.a || !f.b) {
            fail(err, "%s: %s has no %s", file, (f.a ? f.a : f.b)->name.c_str(), f.a ? "lora_B" : "lora_A");
            return nullptr;
        }
        const std::vector<int64_t> &sa = f.a->shape, &sb = f.b->shape;
        if (sa.size() != 2 || sb.size() != 2) {
            fail(err, "%s: %s and its lora_B must be matrices", file, f.a->name.c_str());
            return nullptr;
        }
        if (sa[0] != c.r || sb[1] != c.r) {
            fail(err, "%s: %s has shape [%lld, %lld] and lora_B [%lld, %lld], but adapter_config.json says r = %d", file,
                 f.a->name.c_str(), (long long)sa[0], (long long)sa[1], (long long)sb[0], (long long)sb[1], c.r);
            return nullptr;
        }
        if (sa[1] != w->ne[0] || sb[0] != w->ne[1]) {
            fail(err, "%s: %s [%lld, %lld] and lora_B [%lld, %lld] do not fit %s (in %lld, out %lld)", file, f.a->name.c_str(),
                 (long long)sa[0], (long long)sa[1], (long long)sb[0], (long long)sb[1], w->name, (long long)w->ne[0],
                 (long long)w->ne[1]);
            return nullptr;
        }
        ready r{w, {}, {}, c.r};
        st_to_f32(*f.a, &r.a);
        st_to_f32(*f.b, &r.b);
        const int heads = rope_heads(*m, arch, f.mod);
        if (heads) {
            if (w->ne[1] % (2 * heads)) {
                fail(err, "%s: %s has %lld rows, not pairs per head", file, w->name, (long long)w->ne[1]);
                return nullptr;
            }
            std::vector<float> g(r.b.size());
            permute_rows(r.b.data(), g.data(), w->ne[1], r.r, heads, false);
            r.b.swap(g);
        }
        rs.push_back(std::move(r));
    }

    size_t bytes = 4096;
    for (const ready &r : rs) bytes += 2 * (ql_tensor_overhead() + 2 * QL_ALIGN) + (r.a.size() + r.b.size()) * sizeof(float);
    ql_lora_adapter *ad = new ql_lora_adapter();
    ql_init_params ip = {bytes, nullptr, false, false};
    ad->ctx = ql_init(ip);
    ad->alpha = c.alpha;
    const float scale = (float)((double)user_scale * (double)ql_lora_scale(c));
    std::vector<std::pair<const ql_tensor *, ql_lora_pair>> pairs;
    for (const ready &r : rs) {
        ql_lora_pair p;
        p.a = ql_new_tensor_2d(ad->ctx, QL_TYPE_F32, r.w->ne[0], r.r);
        p.b = ql_new_tensor_2d(ad->ctx, QL_TYPE_F32, r.r, r.w->ne[1]);
        if (!p.a || !p.b) {
            fail(err, "%s: %s", file, ad->ctx ? ql_ctx_error(ad->ctx) : "out of memory");
            ql_lora_adapter_free(ad);
            return nullptr;
        }
        ql_format_name(p.a, "%.55s.lora_a", r.w->name);
        ql_format_name(p.b, "%.55s.lora_b", r.w->name);
        memcpy(p.a->data, r.a.data(), r.a.size() * sizeof(float));
        memcpy(p.b->data, r.b.data(), r.b.size() * sizeof(float));
        p.scale = scale;
        pairs.push_back({r.w, p});
    }
    for (const auto &kv : pairs) m->lora[kv.first] = kv.second;  // only once everything checked out
    ad->n_pairs = (int)pairs.size();
    return ad;
}

ql_lora_adapter *ql_lora_attach_any(ql_llama *m, const char *arch, const char *path, float user_scale, std::string *err) {
    if (!path) {
        fail(err, "ql_lora_attach_any: no path");
        return nullptr;
    }
    if (is_dir(path)) return ql_peft_attach(m, arch, path, user_scale, err);
    char e[512] = "";
    ql_lora_adapter *ad = ql_llama_attach_lora(m, arch, path, user_scale, e, sizeof(e));
    if (!ad && err) *err = e;
    return ad;
}

// ============================================================================================
// merged model
// ============================================================================================

// types llama.cpp reads: ggml's ids (qlora's own, NF4 and NF4_NODQ, sit at 100 and above)
static bool llamacpp_reads(ql_type t) { return (int)t < (int)QL_TYPE_NF4; }

// f32 -> f16 for a whole tensor; false (with the first bad index) if a value leaves f16's range
static bool to_f16(const float *x, size_t n, uint16_t *out, size_t *bad) {
    for (size_t i = 0; i < n; i++) {
        out[i] = ql_fp32_to_fp16(x[i]);
        if ((out[i] & 0x7c00u) == 0x7c00u) {
            *bad = i;
            return false;
        }
    }
    return true;
}

// W [out rows of in] += scale * B A, with B [out rows of r], A [r rows of in]; each row's sum
// over the rank is taken in double, then added to W's f32 value in double and rounded once to f32
static void merge_rows(float *W, const float *A, const float *B, int64_t in, int64_t out, int64_t r, double scale) {
    unsigned nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    if (out * in * r < (int64_t)1 << 22) nt = 1;
    auto work = [&](int64_t o0, int64_t o1) {
        std::vector<double> acc((size_t)in);
        for (int64_t o = o0; o < o1; o++) {
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int64_t k = 0; k < r; k++) {
                const double bk = B[o * r + k];
                if (bk == 0.0) continue;
                const float *ak = A + k * in;
                for (int64_t i = 0; i < in; i++) acc[(size_t)i] += bk * ak[i];
            }
            float *wo = W + o * in;
            for (int64_t i = 0; i < in; i++) wo[i] = (float)((double)wo[i] + scale * acc[(size_t)i]);
        }
    };
    std::vector<std::thread> th;
    const int64_t per = (out + nt - 1) / nt;
    for (unsigned t = 1; t < nt; t++)
        if ((int64_t)t * per < out) th.emplace_back(work, (int64_t)t * per, std::min(out, (int64_t)(t + 1) * per));
    work(0, std::min(out, per));
    for (std::thread &t : th) t.join();
}

// limitation: every converted tensor is held in memory until the file is written (the GGUF
// writer references tensor data), so an NF4 base needs its whole f16 size in RAM.
bool ql_llama_save_merged(const char *path, const ql_llama_file &base, const ql_llama &m, std::string *err) {
    if (!path || !base.gguf) return fail(err, "ql_llama_save_merged: bad arguments");
    const ql_gguf *g = base.gguf;
    std::unordered_map<std::string, const ql_lora_pair *> by_name;  // adapters by weight name
    for (const auto &kv : m.lora) {
        if (kv.first == m.tok_embd && m.output == m.tok_embd)
            return fail(err, "%s: the output projection is tied to token_embd.weight; merging its adapter would change the "
                             "embeddings too", path);
        by_name[kv.first->name] = &kv.second;
    }
    for (const auto &kv : by_name)
        if (ql_gguf_find_tensor(g, kv.first.c_str()) < 0)
            return fail(err, "%s: the model has an adapter on %s, which the base file does not hold", path, kv.first.c_str());

    ql_gguf_writer *w = ql_gguf_writer_new();
    int64_t ift = -1;
    for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) {
        ql_gguf_copy_kv(w, g, i);
        if (!strcmp(ql_gguf_kv_key(g, i), "general.file_type")) ift = i;
    }
    std::vector<std::vector<uint16_t>> keep;  // converted tensors, alive until written
    keep.reserve((size_t)ql_gguf_n_tensors(g));
    bool widened = false, all_float = true, ok = true;
    for (int64_t i = 0; i < ql_gguf_n_tensors(g) && ok; i++) {
        const char *name = ql_gguf_tensor_name(g, i);
        const ql_type type = ql_gguf_tensor_type(g, i);
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(g, i, ne);
        auto it = by_name.find(name);
        const bool adapted = it != by_name.end();
        if (!adapted && llamacpp_reads(type)) {  // as it is, byte for byte
            if (nd >= 2 && type != QL_TYPE_F32 && type != QL_TYPE_F16) all_float = false;
            if (ql_gguf_add_tensor(w, name, type, nd, ne, ql_gguf_tensor_data(g, i), ql_gguf_tensor_size(g, i)) != QL_OK)
                ok = fail(err, "%s: cannot copy tensor %s", path, name);
            continue;
        }
        const int64_t n0 = ne[0], rows = ne[1] * ne[2] * ne[3];
        std::vector<float> x((size_t)(n0 * rows));
        if (!ql_type_traits_get(type) || !ql_type_traits_get(type)->is_float ||
            ql_dequantize(type, ql_gguf_tensor_data(g, i), rows, n0, x.data()) != QL_OK) {
            ok = fail(err, "%s: tensor %s of type %s cannot be converted to f16", path, name, ql_type_name(type));
            break;
        }
        if (adapted) {
            const ql_lora_pair &p = *it->second;
            std::vector<float> A, B;
            if (!p.a || !p.b || nd > 2 || p.a->ne[0] != n0 || p.b->ne[1] != rows || p.a->ne[1] != p.b->ne[0] ||
                !tensor_f32(p.a, &A) || !tensor_f32(p.b, &B)) {
                ok = fail(err, "%s: the adapter of %s does not fit its [%lld, %lld] weight in the base file", path, name,
                          (long long)n0, (long long)rows);
                break;
            }
            merge_rows(x.data(), A.data(), B.data(), n0, rows, p.a->ne[1], (double)p.scale);
        }
        keep.emplace_back(x.size());
        size_t bad = 0;
        if (!to_f16(x.data(), x.size(), keep.back().data(), &bad)) {
            ok = fail(err, "%s: tensor %s: element %zu = %g does not fit f16", path, name, bad, (double)x[bad]);
            break;
        }
        widened = true;
        if (ql_gguf_add_tensor(w, name, QL_TYPE_F16, nd, ne, keep.back().data(), keep.back().size() * 2) != QL_OK)
            ok = fail(err, "%s: cannot add tensor %s", path, name);
    }
    // general.file_type: mostly f16 (1) when converting left only f16/f32 matrices, dropped when
    // the file now mixes f16 with quantized types, kept when nothing was converted
    if (widened && all_float) ql_gguf_set_u32(w, "general.file_type", 1);
    else if (widened && ift >= 0) ql_gguf_remove_kv(w, "general.file_type");
    char e[512];
    if (ok && ql_gguf_write(w, path, e, sizeof(e)) != QL_OK) ok = fail(err, "%s", e);
    ql_gguf_writer_free(w);
    return ok;
}
