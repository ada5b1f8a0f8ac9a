// ./convert hf on checkpoints that are hostile, broken or merely unusual: it must never write over
// what it reads, never open files outside the checkpoint folder, never size anything by a number
// no data stands behind, and say in one line what is wrong. The checkpoints are copies of
// tests/golden/hf/ (real save_pretrained output), changed one thing at a time.
// QL_TOOLS=DIR runs DIR/convert instead of ./convert (to try an older build).
#include "../models/adapter.h"
#include "../models/json.h"
#include "../models/llama.h"
#include "../qlora.h"
#include "util.h"

#include <doctest/doctest.h>

#include <dirent.h>
#include <limits.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

std::string convert_bin() {  // absolute, so that a test may run it from another folder
    const char *d = getenv("QL_TOOLS");
    const std::string p = d && *d ? std::string(d) + "/convert" : "./convert";
    char real[PATH_MAX];
    return realpath(p.c_str(), real) ? std::string(real) : std::string();
}

skip_decorator needs_convert() {  // ./convert, or $QL_TOOLS/convert
    skip_decorator d = needs_tools("");
    if (convert_bin().empty()) {
        d.need.have = false;
        d.need.what = "convert";
    }
    return d;
}

// ./convert hf DIR -o OUT, its exit code; stdout and stderr in *log. Memory and time bounded:
// a converter that sizes a buffer by a forged number fails here instead of taking the machine.
int convert_hf(const std::string &dir, const std::string &out, std::string *log, const std::string &cd = "") {
    return run((cd.empty() ? "" : "cd " + cd + " && ") + "ulimit -v 3000000; timeout 60 " + convert_bin() + " hf " + dir + " -o " + out, log);
}

// a copy of tests/golden/hf/NAME in dst (created)
void copy_golden(const std::string &name, const std::string &dst) {
    const std::string src = tests_dir() + "golden/hf/" + name;
    mkdir(dst.c_str(), 0755);
    DIR *d = opendir(src.c_str());
    REQUIRE(d);
    while (struct dirent *e = readdir(d))
        if (e->d_name[0] != '.') write_file(dst + "/" + e->d_name, read_file(src + "/" + e->d_name));
    closedir(d);
}

// the first `from` in the file replaced by `to` (REQUIREs that it is there)
void edit_file(const std::string &path, const std::string &from, const std::string &to) {
    std::string s = read_file(path);
    const size_t at = s.find(from);
    REQUIRE_MESSAGE(at != std::string::npos, path, " has no '", from, "'");
    s.replace(at, from.size(), to);
    write_file(path, s);
}

// safetensors written by hand, so that any shape, dtype or size can be tried (the library's
// writer refuses what is inconsistent)
struct st_item {
    std::string name, dtype;
    std::vector<int64_t> shape;
    std::string bytes;
};
std::vector<st_item> read_st(const std::string &path) {
    std::vector<ql_st_tensor> ts;
    std::vector<uint8_t> storage;
    std::string why;
    REQUIRE_MESSAGE(ql_safetensors_read(path.c_str(), &ts, &storage, &why), why);
    std::vector<st_item> out;
    for (const ql_st_tensor &t : ts) {
        size_t n = t.dtype == "F32" ? 4 : t.dtype == "U8" ? 1 : 2;
        for (int64_t d : t.shape) n *= (size_t)d;
        out.push_back({t.name, t.dtype, t.shape, std::string((const char *)t.data, n)});
    }
    return out;
}
void write_st(const std::string &path, const std::vector<st_item> &items) {
    std::string h = "{", data;
    for (const st_item &t : items) {
        h += (h.size() > 1 ? "," : "") + ql_json_quote(t.name) + ":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
        for (size_t i = 0; i < t.shape.size(); i++) h += (i ? "," : "") + std::to_string(t.shape[i]);
        h += "],\"data_offsets\":[" + std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) + "]}";
        data += t.bytes;
    }
    h += "}";
    while (h.size() % 8) h += ' ';
    std::string f(8, '\0');
    const uint64_t n = h.size();
    memcpy(&f[0], &n, 8);
    write_file(path, f + h + data);
}
st_item *find_item(std::vector<st_item> &items, const std::string &name) {
    for (st_item &t : items)
        if (t.name == name) return &t;
    return nullptr;
}

int lines(const std::string &s) { return (int)std::count(s.begin(), s.end(), '\n'); }

}  // namespace

TEST_CASE("convert hf: an output that is a file it reads is refused, and that file is kept" * needs_convert()) {
    tmpdir d;
    const std::string q = d.path + "/qwen2", l = d.path + "/llama";
    copy_golden("qwen2", q);  // sharded: the index names three shards
    copy_golden("llama", l);
    std::string log;
    const std::string outs[] = {q + "/model-00002-of-00003.safetensors", q + "/./model-00003-of-00003.safetensors",
                                q + "/model.safetensors.index.json", q + "/config.json", q + "/tokenizer.json",
                                q + "/tokenizer_config.json", l + "/model.safetensors"};
    for (const std::string &out : outs) {
        CAPTURE(out);
        const std::string before = read_file(out);
        REQUIRE(!before.empty());
        CHECK(convert_hf(out.find("/llama/") != std::string::npos ? l : q, out, &log) == 2);
        CHECK_MESSAGE(has(log, "would overwrite the input"), log);
        CHECK(lines(log) == 1);
        CHECK(read_file(out) == before);
    }
    {  // a hard link to a shard under another name is the same file
        const std::string link = d.path + "/other-name.gguf";
        REQUIRE(::link((q + "/model-00001-of-00003.safetensors").c_str(), link.c_str()) == 0);
        CHECK(convert_hf(q, link, &log) == 2);
        CHECK_MESSAGE(has(log, "would overwrite the input " + q + "/model-00001-of-00003.safetensors"), log);
    }
    CHECK(convert_hf(q, d.path + "/fine.gguf", &log) == 0);  // and the folder still converts
}

TEST_CASE("convert hf: a weight_map path that leaves the folder is refused by name, never opened" * needs_convert()) {
    tmpdir d;
    const std::string q = d.path + "/qwen2";
    copy_golden("qwen2", q);
    const std::string idx = q + "/model.safetensors.index.json", orig = read_file(idx);
    const std::string entry = "\"model.embed_tokens.weight\": \"model-00001-of-00003.safetensors\"";
    const std::pair<std::string, std::string> cases[] = {
        {"../../../../../../etc/passwd", "which leads out of the folder ('..')"},
        {"sub/../../x.safetensors", "which leads out of the folder ('..')"},
        {"/etc/passwd", "which is an absolute path"},
        {"to-a-folder.safetensors", "which is a symbolic link to something that is not a file"},
        {"dangling.safetensors", "which is a symbolic link that leads nowhere (No such file or directory)"},
    };
    REQUIRE(symlink(d.path.c_str(), (q + "/to-a-folder.safetensors").c_str()) == 0);
    REQUIRE(symlink((d.path + "/not-there.safetensors").c_str(), (q + "/dangling.safetensors").c_str()) == 0);
    std::string log;
    for (const auto &c : cases) {
        CAPTURE(c.first);
        write_file(idx, orig);
        edit_file(idx, entry, "\"model.embed_tokens.weight\": \"" + c.first + "\"");
        CHECK(convert_hf(q, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(has(log, "weight_map puts model.embed_tokens.weight in '" + c.first + "', " + c.second), log);
        CHECK_MESSAGE(has(log, "shards must be files in " + q), log);
        CHECK(lines(log) == 1);
        CHECK_FALSE(exists(d.path + "/x.gguf"));
    }
    write_file(idx, orig);
    edit_file(idx, entry, "\"model.embed_tokens.weight\": 7");
    CHECK(convert_hf(q, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(has(log, "which is not a file name"), log);
}

TEST_CASE("convert hf: an index that does not say where a tensor is gives one clause (was shards[-1])" * needs_convert()) {
    tmpdir d;
    const std::string q = d.path + "/qwen2", idx = q + "/model.safetensors.index.json";
    copy_golden("qwen2", q);
    const std::string orig = read_file(idx);
    const std::string entry = "\"model.layers.0.self_attn.q_proj.weight\": \"model-00001-of-00003.safetensors\",";
    std::string log;
    edit_file(idx, entry, "");  // in shard 1, missing from the weight_map
    CHECK(convert_hf(q, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log == "convert: " + idx + ": weight_map does not name model.layers.0.self_attn.q_proj.weight, but it is in "
                         "model-00001-of-00003.safetensors\n", log);
    write_file(idx, orig);
    edit_file(idx, entry, "\"model.layers.0.self_attn.q_proj.weight\": \"model-00003-of-00003.safetensors\",");  // the wrong shard
    CHECK(convert_hf(q, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log == "convert: " + idx + ": weight_map puts model.layers.0.self_attn.q_proj.weight in model-00003-of-00003.safetensors, "
                         "but it is in model-00001-of-00003.safetensors\n", log);
    CHECK_FALSE(exists(d.path + "/x.gguf"));
}

TEST_CASE("convert hf: num_hidden_layers beyond the weights is refused at once (was 9 names a layer, then bad_alloc)" * needs_convert()) {
    tmpdir d;
    const std::string l = d.path + "/llama";
    copy_golden("llama", l);
    edit_file(l + "/config.json", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1000000000");
    std::string log;
    CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log == "convert: " + l + "/config.json: num_hidden_layers is 1000000000, but the weights have no layer 2 "
                         "(no model.layers.2.input_layernorm.weight)\n", log);
    edit_file(l + "/config.json", "\"num_hidden_layers\": 1000000000", "\"num_hidden_layers\": 3");
    CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(has(log, "num_hidden_layers is 3, but the weights have no layer 2"), log);
}

TEST_CASE("convert hf: the layers are counted, not taken from the largest index (a tensor model.layers.999999999.x made 9e9 names)" * needs_convert()) {
    tmpdir d;
    const std::string l = d.path + "/llama", st = l + "/model.safetensors";
    copy_golden("llama", l);
    const std::vector<st_item> orig = read_st(st);
    edit_file(l + "/config.json", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1000000000");
    std::string log;
    for (const char *far : {"model.layers.999999999.x", "model.layers.999999999.input_layernorm.weight"}) {
        CAPTURE(far);
        std::vector<st_item> items = orig;
        items.push_back({far, "F32", {0}, ""});  // no data behind it
        write_st(st, items);
        CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);  // (memory bounded: bad_alloc was exit 134)
        CHECK_MESSAGE(log == "convert: " + l + "/config.json: num_hidden_layers is 1000000000, but the weights have no layer 2 "
                             "(no model.layers.2.input_layernorm.weight)\n", log);
    }
    {  // a gap: layer 1's norm gone, layer 0 and a far one there - the first missing is named
        std::vector<st_item> items = orig;
        items.erase(std::find_if(items.begin(), items.end(), [](const st_item &t) { return t.name == "model.layers.1.input_layernorm.weight"; }));
        items.push_back({"model.layers.7.input_layernorm.weight", "F32", {0}, ""});
        write_st(st, items);
        edit_file(l + "/config.json", "\"num_hidden_layers\": 1000000000", "\"num_hidden_layers\": 8");
        CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(has(log, "num_hidden_layers is 8, but the weights have no layer 1 (no model.layers.1.input_layernorm.weight)"), log);
    }
    CHECK_FALSE(exists(d.path + "/x.gguf"));
}

TEST_CASE("convert hf: config.json's sizes are whole numbers in range, the file an object" * needs_convert()) {
    tmpdir d;
    const std::string l = d.path + "/llama", cfg = l + "/config.json";
    copy_golden("llama", l);
    const std::string orig = read_file(cfg);
    const std::pair<std::string, std::string> cases[] = {
        {"\"hidden_size\": 32.5", "config.json: hidden_size is 32.5 (a whole number)"},
        {"\"hidden_size\": 1e30", "config.json: hidden_size is 1e30 (a size from 1 to 2^30)"},
        {"\"hidden_size\": -1e300", "config.json: hidden_size is -1e300 (a size from 1 to 2^30)"},
        {"\"num_hidden_layers\": 2.0000001", "config.json: num_hidden_layers is 2.0000001 (a whole number)"},
        {"\"head_dim\": 1e30", "config.json: head_dim is 1e30 (a size from 1 to 2^30)"},
        {"\"head_dim\": 16.5", "config.json: head_dim is 16.5 (a whole number)"},
        {"\"vocab_size\": 9223372036854775808", "config.json: vocab_size is 9223372036854775808 (a size from 1 to 2^30)"},
    };
    std::string log;
    for (const auto &c : cases) {
        CAPTURE(c.first);
        write_file(cfg, orig);
        const std::string key = c.first.substr(0, c.first.find(':') + 1);
        const size_t at = orig.find(key);
        REQUIRE(at != std::string::npos);
        std::string s = orig;
        s.replace(at, orig.find_first_of(",\n", at) - at, c.first);
        write_file(cfg, s);
        CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(has(log, c.second), log);
        CHECK(lines(log) == 1);
    }
    write_file(cfg, "[" + orig + "]");
    CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log == "convert: " + cfg + ": is an array, not a JSON object of the model's settings\n", log);
    CHECK_FALSE(exists(d.path + "/x.gguf"));
}

TEST_CASE("convert hf: bitsandbytes arrays are checked against their quant_state before anything is sized by it" * needs_convert()) {
    tmpdir d;
    const std::string b = d.path + "/bnb", st = b + "/model.safetensors";
    copy_golden("llama-bnb4", b);
    const std::vector<st_item> orig = read_st(st);
    const std::string v = "model.layers.0.self_attn.v_proj.weight";
    auto with_state = [&](const std::string &shape_json) {  // v_proj's quant_state with another "shape"
        std::vector<st_item> items = orig;
        st_item *qs = find_item(items, v + ".quant_state.bitsandbytes__nf4");
        REQUIRE(qs);
        const size_t at = qs->bytes.find("\"shape\": [");
        REQUIRE(at != std::string::npos);
        qs->bytes.replace(at, qs->bytes.find(']', at) + 1 - at, "\"shape\": " + shape_json);
        qs->shape = {(int64_t)qs->bytes.size()};
        return items;
    };
    std::string log;
    // a shape 2^16 x 2^16 behind 1 KiB of codes (the writer zero-filled 2 GiB for it)
    write_st(st, with_state("[65536, 65536]"));
    CHECK(convert_hf(b, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(has(log, v + ": its bitsandbytes arrays do not fit its quant_state shape [65536, 65536]: " + v +
                               " holds 1024 bytes, the shape needs 2147483648"), log);
    CHECK(lines(log) == 1);
    // numbers that cast to int64 were undefined
    write_st(st, with_state("[1e300, 64]"));
    CHECK(convert_hf(b, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(has(log, v + ": quant_state shape [1e300, 64] is not two sizes from 1 to 2^31"), log);
    write_st(st, with_state("[32.5, 64]"));
    CHECK(convert_hf(b, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(has(log, "quant_state shape [32.5, 64] is not two sizes"), log);
    {  // an absmax whose shape's product overflows on the way to 0 (was a signed overflow; now the reader's rule)
        std::vector<st_item> items = orig;
        st_item *am = find_item(items, v + ".absmax");
        REQUIRE(am);
        am->shape = {(int64_t)1 << 32, ((int64_t)1 << 32) - 1, 0};
        am->bytes.clear();
        write_st(st, items);
        CHECK(convert_hf(b, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(has(log, "tensor " + v + ".absmax: the element count of its shape overflows"), log);
    }
    {  // an empty absmax (a 0 and no overflow) is still the wrong size
        std::vector<st_item> items = orig;
        st_item *am = find_item(items, v + ".absmax");
        REQUIRE(am);
        am->shape = {(int64_t)1 << 32, 0};
        am->bytes.clear();
        write_st(st, items);
        CHECK(convert_hf(b, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(has(log, v + ".absmax holds 0 values, the shape needs 32"), log);
    }
    {  // a side array missing
        std::vector<st_item> items = orig;
        items.erase(std::find_if(items.begin(), items.end(), [&](const st_item &t) { return t.name == v + ".quant_map"; }));
        write_st(st, items);
        CHECK(convert_hf(b, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(has(log, "no tensor " + v + ".quant_map beside it"), log);
    }
    CHECK_FALSE(exists(d.path + "/x.gguf"));
}

TEST_CASE("convert hf: bnb_4bit_quant_storage=bfloat16 converts to the same file; fp4 is refused by name" * needs_convert()) {
    tmpdir d;
    const std::string a = d.path + "/u8", b = d.path + "/bf16";
    mkdir(a.c_str(), 0755);
    mkdir(b.c_str(), 0755);
    copy_golden("llama-bnb4", a + "/m");
    copy_golden("llama-bnb4", b + "/m");
    edit_file(b + "/m/config.json", "\"bnb_4bit_quant_storage\": \"uint8\"", "\"bnb_4bit_quant_storage\": \"bfloat16\"");
    std::vector<st_item> items = read_st(b + "/m/model.safetensors");
    int moved = 0;
    for (st_item &t : items)  // the packed codes as bitsandbytes stores them then: BF16 elements, [bytes / 2, 1]
        if (t.dtype == "U8" && find_item(items, t.name + ".quant_map")) {
            REQUIRE(t.bytes.size() % 2 == 0);
            t.dtype = "BF16";
            t.shape = {(int64_t)t.bytes.size() / 2, 1};
            moved++;
        }
    CHECK(moved == 14);
    write_st(b + "/m/model.safetensors", items);
    std::string log;
    REQUIRE_MESSAGE(convert_hf("m", "out.gguf", &log, a) == 0, log);
    REQUIRE_MESSAGE(convert_hf("m", "out.gguf", &log, b) == 0, log);  // (the same relative names: the same general.name)
    const std::string ga = read_file(a + "/out.gguf");
    CHECK(ga.size() > 10000);
    CHECK(read_file(b + "/out.gguf") == ga);

    // fp4: refused by name from config.json, and from the tensors' own quant_state
    const std::string f = d.path + "/fp4";
    copy_golden("llama-bnb4-real", f);
    edit_file(f + "/config.json", "\"bnb_4bit_quant_type\": \"nf4\"", "\"bnb_4bit_quant_type\": \"fp4\"");
    CHECK(convert_hf(f, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(log == "convert: " + f + "/config.json: bitsandbytes 4-bit type 'fp4' is not supported: only nf4\n", log);
    edit_file(f + "/config.json", "\"bnb_4bit_quant_type\": \"fp4\"", "\"bnb_4bit_quant_type\": \"nf4\"");
    items = read_st(f + "/model.safetensors");
    for (st_item &t : items) {
        const size_t at = t.name.find("bitsandbytes__nf4");
        if (at == std::string::npos) continue;
        t.name.replace(at, 17, "bitsandbytes__fp4");
        const size_t q = t.bytes.find("\"nf4\"");
        if (q != std::string::npos) t.bytes.replace(q, 5, "\"fp4\"");
    }
    write_st(f + "/model.safetensors", items);
    CHECK(convert_hf(f, d.path + "/x.gguf", &log) == 1);
    CHECK_MESSAGE(has(log, "bitsandbytes fp4 4-bit weights are not supported: only nf4"), log);
    CHECK(lines(log) == 1);
}

TEST_CASE("convert hf: malformed merges are refused at convert, naming the entry; an NFC normalizer warns" * needs_convert()) {
    tmpdir d;
    const std::string l = d.path + "/llama", tj = l + "/tokenizer.json";
    copy_golden("llama", l);
    const std::string orig = read_file(tj);  // each case's list replaces the merges whole
    const size_t at = orig.find("\"merges\": [");
    REQUIRE(at != std::string::npos);
    auto with_merges = [&](const std::string &list) {
        std::string s = orig;
        s.replace(at, s.find(']', at) + 1 - at, "\"merges\": [" + list + "]");
        write_file(tj, s);
    };
    const std::pair<std::string, std::string> cases[] = {
        {"\"h e\", \"he x y\"", "merges entry 2 'he x y' is not two tokens separated by one space"},
        {"\"h e\", \"he\"", "merges entry 2 'he' is not two tokens separated by one space"},
        {"\"h  e\"", "merges entry 1 'h  e' is not two tokens separated by one space"},
        {"\"h e\", \"q z\"", "merges entry 2 'q z' makes 'qz', which is not in the vocabulary"},
        {"\"h e\", \"Q zz\"", "merges entry 2 'Q zz' has 'zz', which is not in the vocabulary"},
        {"[\"h\", \"e\"], [\"i\"]", "merges entry 2 is a list that is not two tokens, not \"a b\" or [\"a\", \"b\"]"},
        {"\"h e\", 7", "merges entry 2 is a number, not \"a b\" or [\"a\", \"b\"]"},
    };
    std::string log;
    for (const auto &c : cases) {
        CAPTURE(c.first);
        with_merges(c.first);
        CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(log == "convert: " + tj + ": " + c.second + "\n", log);
    }
    with_merges("[\"h\", \"e\"], \"i n\"");  // both forms, well made: converts
    CHECK_MESSAGE(convert_hf(l, d.path + "/x.gguf", &log) == 0, log);
    // Qwen2's NFC normalizer, alone and in a Sequence: converted, with one warning line
    for (const std::string &nz : {std::string("{\"type\": \"NFC\"}"), std::string("{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}]}")}) {
        CAPTURE(nz);
        std::string s = orig;
        const size_t n = s.find("\"normalizer\": null");
        REQUIRE(n != std::string::npos);
        s.replace(n, strlen("\"normalizer\": null"), "\"normalizer\": " + nz);
        write_file(tj, s);
        CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 0);
        CHECK_MESSAGE(has(log, "convert: warning: " + tj + ": its NFC normalizer is not applied"), log);
    }
    write_file(tj, orig);
    CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 0);
    CHECK_MESSAGE(!has(log, "warning"), log);
}

// a PEFT folder d/peft with cfg and items, attached to d/model: its pair count (-1: refused, *why)
static int peft_attach_pairs(const tmpdir &d, const std::string &model, const std::string &cfg, const std::vector<st_item> &items,
                             std::string *why) {
    const std::string p = d.path + "/peft";
    mkdir(p.c_str(), 0755);
    write_file(p + "/adapter_config.json", cfg);
    write_st(p + "/adapter_model.safetensors", items);
    char err[256];
    ql_llama_file *f = ql_llama_load((d.path + "/" + model).c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    ql_lora_adapter *ad = ql_lora_attach_any(&f->model, f->arch.c_str(), p.c_str(), 1.0f, why);
    const int n = ad ? ad->n_pairs : -1;
    ql_lora_adapter_free(ad);
    ql_llama_file_free(f);
    return n;
}

// PEFT saves whole weights beside the LoRA pairs: lm_head's base layer when lm_head is a target
// (save_embedding_layers="auto"), and modules_to_save's copies. Each is loaded (there is nothing
// to apply) when it is the model's own weight, and refused, saying why, when it is not.
TEST_CASE("PEFT adapter: lm_head's saved base layer and modules_to_save copies load when they are the model's weights" * needs_convert()) {
    tmpdir d;
    std::string log;
    REQUIRE_MESSAGE(convert_hf(tests_dir() + "golden/hf/llama", d.path + "/m.gguf", &log) == 0, log);
    REQUIRE_MESSAGE(convert_hf(tests_dir() + "golden/hf/llama", d.path + "/m16.gguf --outtype f16", &log) == 0, log);
    std::vector<st_item> base = read_st(tests_dir() + "golden/hf/llama/model.safetensors");
    const st_item *head = find_item(base, "lm_head.weight"), *emb = find_item(base, "model.embed_tokens.weight");
    REQUIRE(head);
    REQUIRE(emb);
    const std::vector<st_item> lora = read_st(tests_dir() + "golden/hf/llama-peft/adapter_model.safetensors");
    const std::string cfg = read_file(tests_dir() + "golden/hf/llama-peft/adapter_config.json");
    const int64_t V = head->shape[0], E = head->shape[1], r = 4;
    std::vector<float> a((size_t)(r * E)), b((size_t)(V * r));
    for (size_t i = 0; i < a.size(); i++) a[i] = 0.01f * (float)((i * 7) % 13) - 0.06f;
    for (size_t i = 0; i < b.size(); i++) b[i] = 0.01f * (float)((i * 5) % 11) - 0.05f;
    const st_item head_a{"base_model.model.lm_head.lora_A.weight", "F32", {r, E}, std::string((const char *)a.data(), a.size() * 4)};
    const st_item head_b{"base_model.model.lm_head.lora_B.weight", "F32", {V, r}, std::string((const char *)b.data(), b.size() * 4)};
    auto attach = [&](const std::string &model, std::vector<st_item> extra, std::string *why) -> int {
        std::vector<st_item> items = lora;
        items.insert(items.end(), extra.begin(), extra.end());
        return peft_attach_pairs(d, model, cfg, items, why);
    };
    st_item saved_base = *head, copy = *head, emb_copy = *emb;
    saved_base.name = "base_model.model.lm_head.base_layer.weight";
    copy.name = "base_model.model.lm_head.weight";
    emb_copy.name = "base_model.model.model.embed_tokens.weight";
    std::string why;
    // a LoRA on lm_head saved with PEFT's defaults: the pair and lm_head's base layer
    CHECK_MESSAGE(attach("m.gguf", {head_a, head_b, saved_base}, &why) == 15, why);
    CHECK_MESSAGE(attach("m16.gguf", {head_a, head_b, saved_base}, &why) == 15, why);  // f16 head: the saved f32 rounds to it
    // modules_to_save copies that were not trained away from the model's
    CHECK_MESSAGE(attach("m.gguf", {copy, emb_copy}, &why) == 14, why);
    // ones that were: refused, saying why
    std::string changed = copy.bytes;
    changed[4 * 17 + 2] ^= 0x10;
    copy.bytes = changed;
    CHECK(attach("m.gguf", {copy}, &why) == -1);
    CHECK_MESSAGE(has(why, "base_model.model.lm_head.weight: 1 of its " + std::to_string(V * E) + " values differs from the model's "
                           "output.weight (f32)"), why);
    CHECK_MESSAGE(has(why, "; a trained copy (modules_to_save) replaces the weight, and qlora applies LoRA pairs only"), why);
    saved_base.bytes = changed;
    CHECK(attach("m.gguf", {head_a, head_b, saved_base}, &why) == -1);
    CHECK_MESSAGE(has(why, "lm_head.base_layer.weight: 1 of its " + std::to_string(V * E) + " values differs from the model's "
                           "output.weight (f32) by more than the two roundings allow; the largest: 0.003906 at row 0, column 17"), why);
    CHECK_MESSAGE(!has(why, "another base model"), why);
    saved_base.shape = {E, V};
    CHECK(attach("m.gguf", {head_a, head_b, saved_base}, &why) == -1);
    CHECK_MESSAGE(has(why, "its shape is not the model's output.weight"), why);
}

// A base layer saved in another dtype than the model's (fp16 training on an f32 or bf16
// checkpoint) is the same weight, rounded: it loads, on float and quantized models; a layer that
// differs by more than the two roundings is refused with the largest difference and where.
TEST_CASE("PEFT adapter: lm_head's base layer saved in f16 or bf16 loads on an f32, q8_0 or nf4 model; more than rounding is refused with the number" *
          needs_convert() * needs_tools("quantize")) {
    tmpdir d;
    std::string log;
    const std::string m = d.path + "/m.gguf";
    REQUIRE_MESSAGE(convert_hf(tests_dir() + "golden/hf/llama", m, &log) == 0, log);
    REQUIRE_MESSAGE(run("./quantize " + m + " " + d.path + "/q8.gguf q8_0", &log) == 0, log);  // the head q8_0 too
    REQUIRE_MESSAGE(run("./quantize " + m + " " + d.path + "/nf4.gguf nf4 --include-output", &log) == 0, log);
    std::vector<st_item> base = read_st(tests_dir() + "golden/hf/llama/model.safetensors");
    const st_item *head = find_item(base, "lm_head.weight");
    REQUIRE(head);
    REQUIRE(head->dtype == "F32");
    const int64_t V = head->shape[0], E = head->shape[1], r = 4;
    std::vector<float> h((size_t)(V * E)), a((size_t)(r * E), 0.01f), b((size_t)(V * r), 0.02f);
    memcpy(h.data(), head->bytes.data(), h.size() * 4);
    const st_item head_a{"base_model.model.lm_head.lora_A.weight", "F32", {r, E}, std::string((const char *)a.data(), a.size() * 4)};
    const st_item head_b{"base_model.model.lm_head.lora_B.weight", "F32", {V, r}, std::string((const char *)b.data(), b.size() * 4)};
    // the head rounded to f16 or bf16, as PEFT saves it after fp16/bf16 training (x scaled by 1 + bump first)
    auto saved = [&](const char *dtype, float bump) {
        std::string bytes(h.size() * 2, '\0');
        for (size_t i = 0; i < h.size(); i++) {
            const float x = h[i] * (1.0f + bump);
            const uint16_t v = !strcmp(dtype, "F16") ? ql_fp32_to_fp16(x) : ql_fp32_to_bf16(x);
            memcpy(&bytes[2 * i], &v, 2);
        }
        return st_item{"base_model.model.lm_head.base_layer.weight", dtype, {V, E}, bytes};
    };
    const std::vector<st_item> lora = read_st(tests_dir() + "golden/hf/llama-peft/adapter_model.safetensors");
    const std::string cfg = read_file(tests_dir() + "golden/hf/llama-peft/adapter_config.json");
    auto attach = [&](const std::string &model, const st_item &layer, std::string *why) -> int {
        std::vector<st_item> items = lora;
        items.push_back(head_a);
        items.push_back(head_b);
        items.push_back(layer);
        return peft_attach_pairs(d, model, cfg, items, why);
    };
    std::string why;
    for (const char *model : {"m.gguf", "q8.gguf", "nf4.gguf"})
        for (const char *dtype : {"F16", "BF16"}) {
            const std::string on = model, as = dtype;
            CAPTURE(on);
            CAPTURE(as);
            CHECK_MESSAGE(attach(model, saved(dtype, 0.0f), &why) == 15, why);
        }
    // another weight: every value 1% larger (f16 rounds by 0.05%, bf16 by 0.4%) - not rounding
    CHECK(attach("m.gguf", saved("F16", 0.01f), &why) == -1);
    CHECK_MESSAGE(has(why, "base_model.model.lm_head.base_layer.weight: "), why);
    CHECK_MESSAGE(has(why, "differ from the model's output.weight (f32) by more than the two roundings allow; the largest: "), why);
    CHECK_MESSAGE(has(why, " at row "), why);
    // one value 10% off in a q8_0 head: more than a q8_0 step (1/127 of its block's largest value)
    std::vector<float> keep = h;
    size_t big = 0;
    auto mag = [](float x) { return x < 0 ? -x : x; };
    for (size_t i = 0; i < h.size(); i++)
        if (mag(h[i]) > mag(h[big])) big = i;
    h[big] *= 1.1f;
    CHECK(attach("q8.gguf", saved("F16", 0.0f), &why) == -1);
    CHECK_MESSAGE(has(why, "1 of its " + std::to_string(V * E) + " values differs from the model's output.weight (q8_0)"), why);
    CHECK_MESSAGE(has(why, "at row " + std::to_string(big / (size_t)E) + ", column " + std::to_string(big % (size_t)E) + " "), why);
    h = keep;
    // saved as U8 (bitsandbytes' codes, not values): refused by its dtype before any comparison
    st_item codes{"base_model.model.lm_head.base_layer.weight", "U8", {V, E}, std::string((size_t)(V * E), '\x11')};
    CHECK(attach("m.gguf", codes, &why) == -1);
    CHECK_MESSAGE(has(why, "lm_head.base_layer.weight has dtype U8; a LoRA tensor is F32, F16 or BF16"), why);
}

TEST_CASE("convert hf: an output whose temporary (OUT.tmp) is a symbolic link to an input is refused; the input kept" * needs_convert()) {
    tmpdir d;
    const std::string l = d.path + "/llama", shard = l + "/model.safetensors", out = d.path + "/o.gguf";
    copy_golden("llama", l);
    const std::string before = read_file(shard);
    REQUIRE(symlink(shard.c_str(), (out + ".tmp").c_str()) == 0);  // the link's own inode is not the shard's
    std::string log;
    CHECK(convert_hf(l, out, &log) == 2);
    CHECK_MESSAGE(log == "convert: " + out + ": the output (through its temporary " + out + ".tmp) would overwrite the input " + shard + "\n", log);
    CHECK(read_file(shard) == before);
    CHECK_FALSE(exists(out));
    {  // a link at OUT itself is not replaced either
        REQUIRE(unlink((out + ".tmp").c_str()) == 0);
        REQUIRE(symlink(shard.c_str(), out.c_str()) == 0);
        CHECK(convert_hf(l, out, &log) == 1);
        CHECK_MESSAGE(has(log, "exists and is not a regular file (a symbolic link): not replaced"), log);
        CHECK(read_file(shard) == before);
    }
}

TEST_CASE("writers: a stale PATH.tmp is replaced, never followed (a link there truncated the file behind it)") {
    tmpdir d;
    const std::string victim = d.file("victim.bin"), keep = "what the link points to must survive";
    const float v[4] = {1, 2, 3, 4};
    SUBCASE("GGUF") {
        const std::string out = d.file("o.gguf");
        write_file(victim, keep);
        REQUIRE(symlink(victim.c_str(), (out + ".tmp").c_str()) == 0);
        ql_gguf_writer *w = ql_gguf_writer_new();
        const int64_t ne[1] = {4};
        REQUIRE(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 1, ne, v, sizeof(v)) == QL_OK);
        char err[256] = "";
        CHECK_MESSAGE(ql_gguf_write(w, out.c_str(), err, sizeof(err)) == QL_OK, err);
        CHECK(read_file(victim) == keep);
        struct stat st;
        CHECK((lstat(out.c_str(), &st) == 0 && S_ISREG(st.st_mode)));
        CHECK_FALSE(lstat((out + ".tmp").c_str(), &st) == 0);
        write_file(out + ".tmp", "a stale temporary from a run that died");  // a plain stale one: replaced as well
        CHECK_MESSAGE(ql_gguf_write(w, out.c_str(), err, sizeof(err)) == QL_OK, err);
        ql_gguf_writer_free(w);
        ql_gguf *g = ql_gguf_open(out.c_str(), err, sizeof(err));
        CHECK_MESSAGE(g, err);
        if (g) ql_gguf_close(g);
    }
    SUBCASE("safetensors") {
        const std::string out = d.file("o.safetensors");
        write_file(victim, keep);
        REQUIRE(symlink(victim.c_str(), (out + ".tmp").c_str()) == 0);
        ql_st_tensor t;
        t.name = "t";
        t.dtype = "F32";
        t.shape = {4};
        t.data = v;
        std::string why;
        CHECK_MESSAGE(ql_safetensors_write(out.c_str(), {t}, {}, &why), why);
        CHECK(read_file(victim) == keep);
        struct stat st;
        CHECK((lstat(out.c_str(), &st) == 0 && S_ISREG(st.st_mode)));
        CHECK(read_st(out).size() == 1);
    }
}

TEST_CASE("convert hf: a sharded checkpoint laid out as Hugging Face's download cache (snapshots/REV/* links to ../../blobs/SHA) converts" * needs_convert()) {
    tmpdir d;
    const std::string q = d.path + "/plain", cache = d.path + "/models--tiny--qwen2", snap = cache + "/snapshots/0123abc";
    copy_golden("qwen2", q);
    REQUIRE(mkdir(cache.c_str(), 0755) == 0);
    REQUIRE(mkdir((cache + "/blobs").c_str(), 0755) == 0);
    REQUIRE(mkdir((cache + "/snapshots").c_str(), 0755) == 0);
    REQUIRE(mkdir(snap.c_str(), 0755) == 0);
    DIR *dd = opendir(q.c_str());
    REQUIRE(dd);
    int n = 0;
    while (struct dirent *e = readdir(dd)) {
        if (e->d_name[0] == '.') continue;
        const std::string blob = "blob" + std::to_string(n++);  // (the cache names them by their hash)
        write_file(cache + "/blobs/" + blob, read_file(q + "/" + e->d_name));
        REQUIRE(symlink(("../../blobs/" + blob).c_str(), (snap + "/" + e->d_name).c_str()) == 0);
    }
    closedir(dd);
    std::string log;
    REQUIRE_MESSAGE(convert_hf(q, d.path + "/plain.gguf", &log) == 0, log);
    CHECK_MESSAGE(convert_hf(snap, d.path + "/cache.gguf", &log) == 0, log);  // was 'leads out of the folder (to .../blobs/...)'
    {  // the same tensors, byte for byte (general.name says the folder: it differs)
        char err[256];
        ql_gguf *a = ql_gguf_open((d.path + "/cache.gguf").c_str(), err, sizeof(err)), *b = ql_gguf_open((d.path + "/plain.gguf").c_str(), err, sizeof(err));
        REQUIRE((a && b));
        REQUIRE(ql_gguf_n_tensors(a) == ql_gguf_n_tensors(b));
        for (int64_t i = 0; i < ql_gguf_n_tensors(a); i++) {
            CAPTURE(ql_gguf_tensor_name(b, i));
            CHECK(std::string(ql_gguf_tensor_name(a, i)) == ql_gguf_tensor_name(b, i));
            REQUIRE(ql_gguf_tensor_size(a, i) == ql_gguf_tensor_size(b, i));
            CHECK(memcmp(ql_gguf_tensor_data(a, i), ql_gguf_tensor_data(b, i), ql_gguf_tensor_size(a, i)) == 0);
        }
        ql_gguf_close(a);
        ql_gguf_close(b);
    }
    // and an output over one of the blobs, through the link or by its own name, is still refused
    CHECK(convert_hf(snap, cache + "/blobs/blob0", &log) == 2);
    CHECK_MESSAGE(has(log, "would overwrite the input"), log);
}

TEST_CASE("convert hf: hidden_size that the heads do not divide, without head_dim, is named (was 'head_dim is 0')" * needs_convert()) {
    tmpdir d;
    const std::string l = d.path + "/llama", cfg = l + "/config.json";
    copy_golden("llama", l);
    edit_file(cfg, "\"head_dim\": 8,", "");
    const std::string orig = read_file(cfg);
    const std::pair<std::string, std::string> cases[] = {
        {"\"hidden_size\": 2,", "config.json: hidden_size 2 is smaller than num_attention_heads 4 (and no head_dim gives the heads' size)"},
        {"\"hidden_size\": 30,", "config.json: hidden_size 30 is not a multiple of num_attention_heads 4 (and no head_dim gives the heads' size)"},
    };
    std::string log;
    for (const auto &c : cases) {
        CAPTURE(c.first);
        write_file(cfg, orig);
        edit_file(cfg, "\"hidden_size\": 32,", c.first);
        CHECK(convert_hf(l, d.path + "/x.gguf", &log) == 1);
        CHECK_MESSAGE(has(log, c.second), log);
        CHECK(lines(log) == 1);
    }
    write_file(cfg, orig);  // hidden_size / heads without head_dim still converts
    CHECK_MESSAGE(convert_hf(l, d.path + "/x.gguf", &log) == 0, log);
}

TEST_CASE("safetensors shapes: one element count (ql_st_shape_count), a 0 never hiding an overflow, whatever the order") {
    int64_t n = -1;
    const int64_t big = (int64_t)1 << 40;
    CHECK((ql_st_shape_count({}, &n) && n == 1));
    CHECK((ql_st_shape_count({3, 0, 5}, &n) && n == 0));
    CHECK((ql_st_shape_count({3, 4}, &n) && n == 12));
    CHECK_FALSE(ql_st_shape_count({-1, 0}, &n));
    CHECK_FALSE(ql_st_shape_count({big, big, 0}, &n));
    CHECK_FALSE(ql_st_shape_count({0, big, big}, &n));  // (the reader took this one: 0 bytes first, then 0 * anything)
    CHECK_FALSE(ql_st_shape_count({big, 0, big}, &n));
    tmpdir d;
    for (const std::vector<int64_t> &shape : {std::vector<int64_t>{big, big, 0}, {0, big, big}}) {
        CAPTURE(shape[0]);
        write_st(d.file("s.safetensors"), {{"t", "F32", shape, ""}});
        std::vector<ql_st_tensor> ts;
        std::vector<uint8_t> storage;
        std::string why;
        CHECK_FALSE(ql_safetensors_read(d.file("s.safetensors").c_str(), &ts, &storage, &why));
        CHECK_MESSAGE(has(why, "tensor t: the element count of its shape overflows"), why);
    }
}
