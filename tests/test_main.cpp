// tests/test_main.cpp - doctest's main, and the skips counted by cause (tests/util.h's decorators):
//
//   [qlora] skipped 3 cases: 2 without ../shared/fixtures (or QLORA_FIXTURES); 1 without a CUDA device
//
// With QLORA_REQUIRE_FIXTURES=1 a case whose fixture or tool is missing runs anyway, is named, and
// the suite exits 1.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "util.h"

#include <cstdio>
#include <map>
#include <string>

namespace {

struct skip_tally {
    bool ran = false;                   // a run, not a listing
    int total = 0;                      // skipped cases among the selected ones
    std::map<std::string, int> causes;  // cause -> cases
    int ran_without = 0;                // cases QLORA_REQUIRE_FIXTURES=1 ran without what they need
};
skip_tally g_tally;

// limitation: doctest 2.4 reports a case outside -tc/-sf/--first.. and a case its skip decorator
// skips through the same call; this asks its filters (internal, in this file only: the one that
// holds doctest's implementation) whether the case was selected, as its run loop does
bool selected(const doctest::TestCaseData &tc) {
    const doctest::detail::ContextState *p = doctest::detail::g_cs;
    if (!doctest::matchesAny(tc.m_file.c_str(), p->filters[0], true, p->case_sensitive) ||
        doctest::matchesAny(tc.m_file.c_str(), p->filters[1], false, p->case_sensitive) ||
        !doctest::matchesAny(tc.m_test_suite, p->filters[2], true, p->case_sensitive) ||
        doctest::matchesAny(tc.m_test_suite, p->filters[3], false, p->case_sensitive) ||
        !doctest::matchesAny(tc.m_name, p->filters[4], true, p->case_sensitive) ||
        doctest::matchesAny(tc.m_name, p->filters[5], false, p->case_sensitive))
        return false;
    // --first/--last count the cases that run: a skipped one belongs to the range of the next
    const unsigned pos = p->numTestCasesPassingFilters + 1;
    return !((p->last < pos && p->first <= p->last) || p->first > pos);
}

struct skip_listener : doctest::IReporter {
    explicit skip_listener(const doctest::ContextOptions &) {}

    void test_case_skipped(const doctest::TestCaseData &tc) override {
        if (!tc.m_skip || !selected(tc)) return;
        std::string cause = "by a doctest::skip decorator that gives no cause";
        for (const skip_need &n : skip_needs())
            if (!n.have && n.line == tc.m_line && n.file == tc.m_file.c_str()) {
                cause = n.cause;
                break;
            }
        g_tally.total++;
        g_tally.causes[cause]++;
    }
    void test_case_start(const doctest::TestCaseData &tc) override {
        for (const skip_need &n : skip_needs())
            if (!n.have && n.required && n.line == tc.m_line && n.file == tc.m_file.c_str()) {
                printf("[qlora] QLORA_REQUIRE_FIXTURES=1: \"%s\" runs without %s (a skip otherwise)\n", tc.m_name,
                       n.what.c_str());
                g_tally.ran_without++;
                break;
            }
    }
    void test_run_end(const doctest::TestRunStats &) override { g_tally.ran = true; }

    void report_query(const doctest::QueryData &) override {}
    void test_run_start() override {}
    void test_case_reenter(const doctest::TestCaseData &) override {}
    void test_case_end(const doctest::CurrentTestCaseStats &) override {}
    void test_case_exception(const doctest::TestCaseException &) override {}
    void subcase_start(const doctest::SubcaseSignature &) override {}
    void subcase_end() override {}
    void log_assert(const doctest::AssertData &) override {}
    void log_message(const doctest::MessageData &) override {}
};

}  // namespace

REGISTER_LISTENER("qlora-skips", 1, skip_listener);

int main(int argc, char **argv) {
    int rc = doctest::Context(argc, argv).run();
    if (!g_tally.ran) return rc;
    std::string line = "[qlora] skipped " + std::to_string(g_tally.total) + (g_tally.total == 1 ? " case" : " cases");
    const char *sep = ": ";
    for (const auto &c : g_tally.causes) {
        line += sep + std::to_string(c.second) + " " + c.first;
        sep = "; ";
    }
    printf("%s\n", line.c_str());
    if (g_tally.ran_without > 0) {
        printf("[qlora] QLORA_REQUIRE_FIXTURES=1: %d case%s ran without what %s: a failure\n", g_tally.ran_without,
               g_tally.ran_without == 1 ? "" : "s", g_tally.ran_without == 1 ? "it needs" : "they need");
        if (rc == 0) rc = 1;
    }
    return rc;
}
