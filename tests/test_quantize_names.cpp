// ./quantize's type names as llama-quantize reads them: any case, one meaning each (the name is
// llama.cpp's ftype, i.e. its mix), a near miss answered with "did you mean", the mixes that need
// an importance matrix refused with that reason, no output that converted nothing, requantising
// only with --allow-requantize, and general.file_type in every output. Run as a user would.
#include "../qlora.h"
#include "util.h"

#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

namespace {

// a quantize output: its general.file_type (-1: none) and each tensor's type name
struct qfile {
    long long file_type = -1;
    std::map<std::string, std::string> type;
};
qfile read_qfile(const std::string &path) {
    qfile q;
    char err[256];
    ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    uint64_t ft = 0;
    const int64_t k = ql_gguf_find_kv(g, "general.file_type");
    if (k >= 0 && ql_gguf_get_u64(g, k, &ft)) q.file_type = (long long)ft;
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) q.type[ql_gguf_tensor_name(g, i)] = ql_type_name(ql_gguf_tensor_type(g, i));
    ql_gguf_close(g);
    return q;
}

}  // namespace

TEST_CASE("quantize names: any case, llama-quantize's aliases and numbers, one meaning each (llama.cpp's mix), general.file_type always" * needs_tools("make-model quantize")) {
    tmpdir d;
    std::string log;
    const std::string m = d.file("m.gguf");
    REQUIRE_MESSAGE(run("./make-model -o " + m + " --dim 256 --layers 2 --heads 4 --ff 512 --seed 5", &log) == 0, log);
    auto quantize = [&](const std::string &type, const std::string &out) {
        CAPTURE(type);
        REQUIRE_MESSAGE(run("./quantize " + m + " " + d.file(out) + " " + type, &log) == 0, log);
        return read_qfile(d.file(out));
    };
    // every spelling of one mix writes the same bytes: the name's case, llama-quantize's alias, its ftype number
    const qfile km = quantize("Q4_K_M", "km.gguf");
    CHECK(km.file_type == 15);
    CHECK(km.type.at("output.weight") == "q6_K");
    CHECK(km.type.at("blk.0.attn_q.weight") == "q4_K");
    for (const std::string t : {"q4_k_m", "Q4_k_M", "Q4_K", "q4_K", "15"}) {
        CAPTURE(t);
        quantize(t, "x.gguf");
        CHECK(read_file(d.file("x.gguf")) == read_file(d.file("km.gguf")));
    }
    // q4_0 is Q4_0, the mix (it quantised only the block weights: output and embedding stayed f32)
    const qfile q40 = quantize("Q4_0", "q40.gguf");
    quantize("q4_0", "q40b.gguf");
    CHECK(read_file(d.file("q40b.gguf")) == read_file(d.file("q40.gguf")));
    CHECK(q40.file_type == 2);
    CHECK(q40.type.at("output.weight") == "q6_K");
    CHECK(q40.type.at("token_embd.weight") == "q4_0");
    CHECK(q40.type.at("blk.1.ffn_down.weight") == "q4_0");
    CHECK(q40.type.at("blk.1.attn_norm.weight") == "f32");
    // the single k-quant names are their mixes: q2_K, the aliases q3_K/q4_K/q5_K (_M), q6_K - each with its llama_ftype
    const std::map<std::string, long long> ftype = {{"q2_K", 10}, {"q3_K", 12}, {"Q3_K_S", 11}, {"q5_K", 17}, {"q6_k", 18},
                                                    {"iq4_nl", 25}, {"IQ4_xs", 30}, {"q8_0", 7}, {"q5_1", 9}};
    for (const auto &f : ftype) {
        CAPTURE(f.first);
        CHECK(quantize(f.first, "k.gguf").file_type == f.second);
    }
    CHECK(quantize("q5_1", "k.gguf").type.at("output.weight") == "q6_K");  // Q5_1's head
    // the float types: every weight matrix, the head and embedding too; norms stay f32
    for (const auto &f : std::vector<std::pair<std::string, long long>>{{"F16", 1}, {"f16", 1}, {"BF16", 32}, {"bf16", 32}}) {
        CAPTURE(f.first);
        const qfile q = quantize(f.first, "f.gguf");
        CHECK(q.file_type == f.second);
        const std::string t = f.second == 1 ? "f16" : "bf16";
        CHECK(q.type.at("output.weight") == t);
        CHECK(q.type.at("token_embd.weight") == t);
        CHECK(q.type.at("blk.0.ffn_up.weight") == t);
        CHECK(q.type.at("output_norm.weight") == "f32");
    }
    REQUIRE_MESSAGE(run("./quantize " + d.file("f.gguf") + " " + d.file("f32.gguf") + " F32", &log) == 0, log);
    CHECK(read_qfile(d.file("f32.gguf")).file_type == 0);
    CHECK(read_qfile(d.file("f32.gguf")).type.at("output.weight") == "f32");
    // NF4 (llama.cpp has none: qlora's meaning, the block weights): any case; file_type its type id
    const qfile n4 = quantize("NF4", "n4.gguf");
    quantize("nf4", "n4b.gguf");
    CHECK(read_file(d.file("n4b.gguf")) == read_file(d.file("n4.gguf")));
    CHECK(n4.file_type == QL_TYPE_NF4);
    CHECK(n4.type.at("blk.0.attn_q.weight") == "nf4");
    CHECK(n4.type.at("output.weight") == "f32");
    CHECK(quantize("Nf4 --no-double-quant", "n4n.gguf").file_type == QL_TYPE_NF4_NODQ);
    // the mixes decide every tensor: nf4's flags are refused with them
    CHECK(run("./quantize " + m + " " + d.file("y.gguf") + " q8_0 --include-output", &log) == 2);
    CHECK_MESSAGE(has(log, "decides every tensor itself"), log);
    CHECK(run("./quantize " + m + " " + d.file("y.gguf") + " f16 --no-double-quant", &log) == 2);
    CHECK_MESSAGE(has(log, "--no-double-quant applies to nf4 only"), log);
    CHECK(!exists(d.file("y.gguf")));
}

TEST_CASE("quantize names: an unknown name lists the mixes and answers a near miss; the importance-matrix mixes are refused by reason" * needs_tools("make-model quantize")) {
    tmpdir d;
    std::string log;
    const std::string m = d.file("m.gguf"), out = d.file("out.gguf");
    REQUIRE_MESSAGE(run("./make-model -o " + m + " --dim 64 --layers 1 --heads 2 --ff 128", &log) == 0, log);
    struct bad {
        std::string type, says, not_says;
    };
    const std::vector<bad> cases = {
        {"nf5", "unknown target type 'nf5': did you mean NF4?", ""},
        {"q4_k_n", "did you mean Q4_K_S or Q4_K_M?", ""},
        {"Q4KM", "did you mean Q4_K_M?", ""},
        {"q8", "did you mean Q8_0?", ""},
        {"Q5_K_X", "did you mean Q5_K_S or Q5_K_M?", ""},
        {"zzz", "unknown target type 'zzz' (llama-quantize's Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M "
                "Q5_K_S Q5_K_M Q6_K IQ4_NL IQ4_XS F16 BF16 F32 Q3_K Q4_K Q5_K or NF4; any case)", "did you mean"},
        {"q4_K_M_extra_long", "unknown target type", "did you mean"},
        {"", "unknown target type ''", "did you mean"},
        {"999", "unknown target type '999'", ""},
    };
    for (const bad &c : cases) {
        CAPTURE(c.type);
        CHECK(run("./quantize " + m + " " + out + " '" + c.type + "'", &log) == 2);
        CHECK_MESSAGE(has(log, c.says), log);
        if (!c.not_says.empty()) CHECK_MESSAGE(!has(log, c.not_says), log);
        CHECK(!exists(out));
    }
    // llama-quantize makes these only with an importance matrix; the IQ3 mixes are of types qlora has not
    for (const std::string t : {"Q2_K_S", "q2_k_s", "IQ1_S", "iq1_m", "IQ2_XXS", "IQ2_XS", "iq2_s", "IQ2_M", "21", "19"}) {
        CAPTURE(t);
        CHECK(run("./quantize " + m + " " + out + " " + t, &log) == 2);
        CHECK_MESSAGE(has(log, "needs an importance matrix (llama-quantize --imatrix FILE), which this quantize does not take"), log);
        CHECK(!has(log, "unknown"));
        CHECK(!exists(out));
    }
    CHECK(run("./quantize " + m + " " + out + " 21", &log) == 2);
    CHECK_MESSAGE(has(log, "Q2_K_S (ftype 21) needs an importance matrix"), log);
    for (const std::string t : {"IQ3_XXS", "iq3_xs", "IQ3_S", "IQ3_M"}) {
        CAPTURE(t);
        CHECK(run("./quantize " + m + " " + out + " " + t, &log) == 2);
        CHECK_MESSAGE(has(log, "is made of llama.cpp's iq3 types, which qlora neither writes nor reads"), log);
        CHECK(!exists(out));
    }
    CHECK(run("./quantize " + m + " " + out + " q4_0 --imatrix imatrix.dat", &log) == 2);
    CHECK_MESSAGE(has(log, "--imatrix: this quantize takes no importance matrix"), log);
    CHECK(!exists(out));
}

TEST_CASE("quantize names: a run that would quantise nothing writes nothing and exits 1; llama-quantize's fallbacks are written, with a warning" * needs_tools("make-model quantize")) {
    tmpdir d;
    std::string log;
    const std::string m64 = d.file("m64.gguf"), m16 = d.file("m16.gguf"), out = d.file("out.gguf");
    REQUIRE_MESSAGE(run("./make-model -o " + m64 + " --dim 64 --layers 2 --heads 2 --ff 128", &log) == 0, log);
    REQUIRE_MESSAGE(run("./make-model -o " + m16 + " --dim 16 --layers 1 --heads 1 --ff 48", &log) == 0, log);
    // rows of 64 are not whole 256-blocks: q4_K -> q5_0, q6_K -> q8_0, as llama-quantize writes
    // it (a real quantisation, so written), but said
    REQUIRE_MESSAGE(run("./quantize " + m64 + " " + out + " q4_K", &log) == 0, log);
    CHECK_MESSAGE(has(log, "warning: 15 of 16 weight matrices have rows (64 and 128 wide) that are not whole blocks of their "
                           "type in Q4_K_M, so they fell back: 13 q4_K -> q5_0 and 2 q6_K -> q8_0"), log);
    qfile q = read_qfile(out);
    CHECK(q.type.at("blk.0.attn_q.weight") == "q5_0");
    CHECK(q.type.at("blk.1.ffn_down.weight") == "q8_0");
    CHECK(q.file_type == 15);
    REQUIRE(remove(out.c_str()) == 0);
    // rows of 16: not even the fallbacks fit, f16 is all that is left - no quantised tensor, no file
    CHECK(run("./quantize " + m16 + " " + out + " Q4_K_M", &log) == 1);
    CHECK_MESSAGE(has(log, "m16.gguf: no tensor would be quantised: the rows of its weight matrices (16 and 48 wide) are not "
                           "whole blocks of Q4_K_M's types"), log);
    CHECK(!exists(out));
    CHECK(run("./quantize " + m16 + " " + out + " q8_0", &log) == 1);
    CHECK(!exists(out));
    // a file already of the target's types: nothing to convert
    REQUIRE_MESSAGE(run("./quantize " + m64 + " " + d.file("f16.gguf") + " F16", &log) == 0, log);
    CHECK(run("./quantize " + d.file("f16.gguf") + " " + out + " f16", &log) == 1);
    CHECK_MESSAGE(has(log, "f16.gguf: nothing to convert: its 16 weight matrices are of F16's types already: nothing written"), log);
    CHECK(!exists(out));
    CHECK(run("./quantize " + m64 + " " + out + " F32", &log) == 1);
    CHECK(!exists(out));
}

TEST_CASE("quantize names: re-quantising a quantised file needs --allow-requantize, as in llama.cpp" * needs_tools("make-model quantize")) {
    tmpdir d;
    std::string log;
    const std::string q8 = d.file("q8.gguf"), f = d.file("f.gguf"), out = d.file("out.gguf");
    REQUIRE_MESSAGE(run("./make-model -o " + q8 + " --dim 256 --layers 1 --heads 4 --ff 512 --type q8_0", &log) == 0, log);
    for (const std::string t : {"Q4_K_M", "nf4", "f16", "q4_0"}) {
        CAPTURE(t);
        CHECK(run("./quantize " + q8 + " " + out + " " + t, &log) == 2);
        CHECK_MESSAGE(has(log, "q8.gguf: 7 of the tensors to convert are quantised already (blk.0.attn_"), log);
        CHECK_MESSAGE(has(log, ".weight is q8_0): quantising again loses more than quantising the f16/f32 model"), log);
        CHECK_MESSAGE(has(log, "--allow-requantize does it anyway"), log);
        CHECK(!exists(out));
    }
    REQUIRE_MESSAGE(run("./quantize " + q8 + " " + out + " Q4_K_M --allow-requantize", &log) == 0, log);
    CHECK(has(log, "q8_0 -> q4_K"));
    CHECK(read_qfile(out).type.at("blk.0.attn_q.weight") == "q4_K");
    // only tensors that change count: Q8_0 of the q8_0 file converts its f32 head and embedding alone
    REQUIRE_MESSAGE(run("./quantize " + q8 + " " + d.file("q8b.gguf") + " Q8_0", &log) == 0, log);
    CHECK(has(log, "2 tensors to Q8_0"));
    // f16 and bf16 inputs are not quantised: no flag needed
    REQUIRE_MESSAGE(run("./make-model -o " + f + " --dim 256 --layers 1 --heads 4 --ff 512 --type f16", &log) == 0, log);
    REQUIRE_MESSAGE(run("./quantize " + f + " " + out + " q4_k_s", &log) == 0, log);
    CHECK(has(log, "f16 -> q4_K"));
}

TEST_CASE("quantize: an output whose temporary (OUT.tmp) is a symbolic link to the input is refused; the input kept" * needs_tools("make-model quantize")) {
    tmpdir d;
    std::string log;
    const std::string in = d.file("in.gguf"), out = d.file("o.gguf");
    REQUIRE_MESSAGE(run("./make-model -o " + in + " --dim 256 --layers 1 --heads 4 --ff 512", &log) == 0, log);
    const std::string before = read_file(in);
    REQUIRE(symlink(in.c_str(), (out + ".tmp").c_str()) == 0);  // (the writer truncated the mapped input through it)
    CHECK(run("./quantize " + in + " " + out + " Q4_K_M", &log) == 2);
    CHECK_MESSAGE(log == "quantize: " + out + ": the output (through its temporary " + out + ".tmp) would overwrite the input " + in + "\n", log);
    CHECK(read_file(in) == before);
    CHECK(!exists(out));
}
