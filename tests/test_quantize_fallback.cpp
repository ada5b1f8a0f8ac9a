// ./quantize's fallbacks for rows that are not whole blocks of the type a mix chose, as llama.cpp
// b8495 and later (tensor_type_fallback in src/llama-quant.cpp, since ggml-org/llama.cpp#19770)
// write them: q2_K and q3_K -> q4_0 (builds before it wrote iq4_nl there), q4_K -> q5_0, q5_K ->
// q5_1, q6_K -> q8_0, iq4_xs -> iq4_nl; the head q8_0 when its rows are not whole blocks.
// The goldens (tests/golden/quants_llama.bin, 256-wide rows) have no fallback in them.
#include "../qlora.h"
#include "util.h"

#include <doctest/doctest.h>

#include <map>
#include <string>

namespace {

// each tensor's type name in a GGUF
std::map<std::string, std::string> tensor_types(const std::string &path) {
    std::map<std::string, std::string> t;
    char err[256];
    ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) t[ql_gguf_tensor_name(g, i)] = ql_type_name(ql_gguf_tensor_type(g, i));
    ql_gguf_close(g);
    return t;
}

}  // namespace

TEST_CASE("quantize fallback: Q3_K_M, Q2_K and IQ4_XS on 96- and 160-wide rows fall back as llama-quantize b8495+" * needs_tools("make-model quantize")) {
    tmpdir d;
    std::string log;
    const std::string m = d.file("m.gguf");
    // 16 layers: Q3_K_M's ffn_down is q5_K in the first n_layer/16 layers, q4_K after; attn_v q5_K
    // in the first two; 96 and 160 are whole 32-blocks, not whole 256-blocks
    REQUIRE_MESSAGE(run("./make-model -o " + m + " --dim 96 --layers 16 --heads 2 --ff 160 --vocab 512", &log) == 0, log);
    auto quantize = [&](const std::string &type) {
        CAPTURE(type);
        const std::string out = d.file(type + ".gguf");
        REQUIRE_MESSAGE(run("./quantize " + m + " " + out + " " + type, &log) == 0, log);
        return tensor_types(out);
    };
    std::map<std::string, std::string> t = quantize("Q3_K_M");
    CHECK(t.at("output.weight") == "q8_0");                // q6_K's rows do not fit: the head's own rule
    CHECK(t.at("token_embd.weight") == "q4_0");            // q3_K -> q4_0 (iq4_nl before #19770)
    CHECK(t.at("blk.0.attn_q.weight") == "q4_0");          // q3_K
    CHECK(t.at("blk.0.attn_k.weight") == "q4_0");          // q3_K
    CHECK(t.at("blk.0.ffn_gate.weight") == "q4_0");        // q3_K
    CHECK(t.at("blk.0.attn_v.weight") == "q5_1");          // q5_K (first two attn_v)
    CHECK(t.at("blk.2.attn_v.weight") == "q5_0");          // q4_K
    CHECK(t.at("blk.0.attn_output.weight") == "q5_0");     // q4_K
    CHECK(t.at("blk.0.ffn_down.weight") == "q5_1");        // q5_K (160-wide rows)
    CHECK(t.at("blk.1.ffn_down.weight") == "q5_0");        // q4_K
    CHECK(t.at("blk.0.attn_norm.weight") == "f32");
    CHECK_MESSAGE(has(log, "65 q3_K -> q4_0, 45 q4_K -> q5_0 and 3 q5_K -> q5_1"), log);

    t = quantize("Q2_K");
    CHECK(t.at("blk.0.attn_q.weight") == "q4_0");      // q2_K -> q4_0
    CHECK(t.at("blk.0.attn_v.weight") == "q4_0");      // q3_K (n_gqa 1) -> q4_0
    CHECK(t.at("blk.0.ffn_down.weight") == "q4_0");    // q3_K -> q4_0

    t = quantize("IQ4_XS");
    CHECK(t.at("blk.0.attn_q.weight") == "iq4_nl");    // iq4_xs -> iq4_nl
    CHECK(t.at("blk.0.ffn_down.weight") == "q5_1");    // q5_K in the first n_layer/8 layers
}
