// The suite's skips (tests/util.h's decorators, counted by tests/test_main.cpp): a case whose
// fixture is missing is skipped - not run, not counted as passed - and named by cause; with
// QLORA_REQUIRE_FIXTURES=1 (CI) it runs and fails instead. The suite runs itself on one case
// (-tc); QL_SKIPS_INNER keeps that inner run from running these cases again.
#include "util.h"

#include <doctest/doctest.h>

#include <climits>
#include <string>

namespace {

const char *const k_case = "gguf: the real vocab files open and copy back byte for byte";  // needs two fixtures

std::string self_exe() {
    char p[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", p, sizeof(p) - 1);
    REQUIRE(n > 0);
    return std::string(p, (size_t)n);
}

// the suite on k_case alone, with `env` in front; its exit code, its output in *out (runs of
// spaces made one: doctest pads its counts to the widest)
int run_inner(const std::string &env, std::string *out) {
    const int rc = run("QL_SKIPS_INNER=1 " + env + " " + self_exe() + " -nc -tc='" + k_case + "'", out);
    std::string s;
    for (char c : *out)
        if (c != ' ' || s.empty() || s.back() != ' ') s += c;
    *out = s;
    return rc;
}

const char *const k_inner = "inside the skip cases' own run of the suite (QL_SKIPS_INNER)";

}  // namespace

TEST_CASE("skips: a missing fixture is a skip counted by cause; QLORA_REQUIRE_FIXTURES=1 makes it a failure" *
          skip_unless(!getenv("QL_SKIPS_INNER"), k_inner)) {
    tmpdir empty;  // QLORA_FIXTURES, when set, is the only place looked at
    std::string out;
    CHECK_MESSAGE(run_inner("QLORA_REQUIRE_FIXTURES=0 QLORA_FIXTURES=" + empty.path, &out) == 0, out);
    CHECK_MESSAGE(has(out, "test cases: 0 | 0 passed | 0 failed"), out);  // not run, so not a pass
    CHECK_MESSAGE(has(out, "[qlora] skipped 1 case: 1 without ../shared/fixtures (or QLORA_FIXTURES)\n"), out);

    // CI's setting: the case runs, fails on the fixture it names, and the suite exits 1
    CHECK(run_inner("QLORA_REQUIRE_FIXTURES=1 QLORA_FIXTURES=" + empty.path, &out) == 1);
    CHECK_MESSAGE(has(out, "test cases: 1 | 0 passed | 1 failed"), out);
    CHECK_MESSAGE(has(out, "fixture tokenizer-vectors/ggml-vocab-llama-spm.gguf not found under ../shared/fixtures"), out);
    CHECK_MESSAGE(has(out, "[qlora] QLORA_REQUIRE_FIXTURES=1: \"" + std::string(k_case) + "\" runs without fixture "), out);
    CHECK_MESSAGE(has(out, "[qlora] skipped 0 cases\n"), out);
}

TEST_CASE("skips: with the fixtures the same case runs and passes, with or without QLORA_REQUIRE_FIXTURES" *
          needs_fixture("tokenizer-vectors/ggml-vocab-llama-spm.gguf") * skip_unless(!getenv("QL_SKIPS_INNER"), k_inner)) {
    const std::string fx = "QLORA_FIXTURES=" + fixtures_dir();
    std::string out;
    for (const char *req : {"0", "1"}) {
        CHECK_MESSAGE(run_inner(fx + " QLORA_REQUIRE_FIXTURES=" + req, &out) == 0, out);
        CHECK_MESSAGE(has(out, "test cases: 1 | 1 passed | 0 failed"), out);
        CHECK_MESSAGE(has(out, "[qlora] skipped 0 cases\n"), out);
    }
}
