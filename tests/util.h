// tests/util.h - helpers the test files share: a temporary folder, whole-file reads and writes,
// running a command, where the fixtures are, skips counted by cause, and comparing vectors.
//
//   tmpdir d;                                   // removed, with all it holds, at the end of the scope
//   write_file(d.file("a.txt"), "hi");          // REQUIREs that it worked
//   CHECK(read_file(d.file("a.txt")) == "hi");  // "" when the file cannot be read
//   std::string out;
//   CHECK(run("./tokenize -p hi", &out) == 0);  // exit code; stdout and stderr in out
#pragma once

#include <doctest/doctest.h>

#include <ftw.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// ---- files and folders ---------------------------------------------------------------------

inline bool exists(const std::string &path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0;
}

inline int tmpdir_remove_entry(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

// A fresh folder under $TMPDIR (or /tmp); it and everything below it go at the end of the scope.
struct tmpdir {
    std::string path;
    tmpdir() {
        const char *base = getenv("TMPDIR");
        std::string t = std::string(base && *base ? base : "/tmp") + "/qlora-test-XXXXXX";
        REQUIRE(mkdtemp(&t[0]));
        path = t;
    }
    ~tmpdir() { nftw(path.c_str(), tmpdir_remove_entry, 16, FTW_DEPTH | FTW_PHYS); }
    tmpdir(const tmpdir &) = delete;
    tmpdir &operator=(const tmpdir &) = delete;
    std::string file(const std::string &name) const { return path + "/" + name; }
};

// a whole file ("" when it cannot be read)
inline std::string read_file(const std::string &path) {
    std::string s;
    FILE *f = fopen(path.c_str(), "rb");
    if (!f) return s;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
    fclose(f);
    return s;
}
inline std::vector<uint8_t> read_file_bytes(const std::string &path) {
    const std::string s = read_file(path);
    return std::vector<uint8_t>(s.begin(), s.end());
}

inline void write_file(const std::string &path, const void *data, size_t n) {
    FILE *f = fopen(path.c_str(), "wb");
    REQUIRE(f);
    REQUIRE(fwrite(data, 1, n, f) == n);
    fclose(f);
}
inline void write_file(const std::string &path, const std::string &bytes) { write_file(path, bytes.data(), bytes.size()); }

// ---- where things are ----------------------------------------------------------------------

// this folder, tests/, with a trailing slash: "tests/" (make) or an absolute path (cmake)
inline std::string tests_dir() {
    const std::string f = __FILE__;
    return f.substr(0, f.find_last_of('/') + 1);
}

// ../shared/fixtures beside the checkout (tests run from the repo root), or found from this file;
// QLORA_FIXTURES, when set, is the only place looked at. "" when absent.
inline std::string fixtures_dir() {
    std::vector<std::string> cand = {"../shared/fixtures", tests_dir() + "../../shared/fixtures"};
    if (const char *env = getenv("QLORA_FIXTURES")) cand = {env};
    for (const std::string &c : cand)
        if (exists(c + "/tokenizer-vectors")) return c;
    return "";
}

// ---- skips ---------------------------------------------------------------------------------
//
// A case that cannot run here is skipped by a decorator, which doctest counts as skipped (an early
// return inside the case would count as a pass). test_main.cpp prints the skips by cause at the end:
//
//   TEST_CASE("..." * needs_fixture("stories260K/stories260K.bin")) {  // under ../shared/fixtures
//       const std::string bin = fixture("stories260K/stories260K.bin"); // the path; REQUIREs it
//   TEST_CASE("..." * needs_tools("make-model finetune"))              // ./NAME, built by make
//   TEST_CASE("..." * skip_unless(have_x, "without x"))                 // anything else, by cause
//
// Decorators are evaluated before main(): keep the probe cheap and safe (a stat()).
// QLORA_REQUIRE_FIXTURES=1 (CI sets it) runs the fixture and tool cases anyway: fixture() fails in
// the case, and the suite exits 1 when any case ran without what it needs.
// limitation: doctest has no skip from inside a running case; a condition that only the case can
// know is checked (CHECK), not returned from.

inline bool require_fixtures() {
    const char *e = getenv("QLORA_REQUIRE_FIXTURES");
    return e && *e && strcmp(e, "0") != 0;
}

// one decorator on one case: test_main.cpp's listener finds it by the case's file and line
struct skip_need {
    std::string file;
    unsigned line = 0;
    std::string cause;  // "without ../shared/fixtures": the summary groups by it
    std::string what;   // the missing thing, named when QLORA_REQUIRE_FIXTURES=1 runs the case anyway
    bool have = true;
    bool required = false;  // QLORA_REQUIRE_FIXTURES=1 turns this skip into a failure
};
inline std::vector<skip_need> &skip_needs() {
    static std::vector<skip_need> v;
    return v;
}

struct skip_decorator {
    skip_need need;
    void fill(doctest::detail::TestCase &tc) const {
        skip_need n = need;
        n.file = tc.m_file.c_str();
        n.line = tc.m_line;
        skip_needs().push_back(n);
        if (!n.have && !(n.required && require_fixtures())) tc.m_skip = true;
    }
};

inline skip_decorator skip_unless(bool have, const char *cause) {
    skip_decorator d;
    d.need.cause = d.need.what = cause;
    d.need.have = have;
    return d;
}

inline skip_decorator needs_fixture(const std::string &rel) {
    skip_decorator d;
    d.need.cause = "without ../shared/fixtures (or QLORA_FIXTURES)";
    d.need.what = "fixture " + rel;
    d.need.have = !fixtures_dir().empty() && exists(fixtures_dir() + "/" + rel);
    d.need.required = true;
    return d;
}

// the path of a fixture a case's needs_fixture named; fails the case when it is missing
inline std::string fixture(const std::string &rel) {
    const std::string fx = fixtures_dir(), p = fx + "/" + rel;
    REQUIRE_MESSAGE((!fx.empty() && exists(p)), "fixture " << rel << " not found under "
                    << (fx.empty() ? std::string("../shared/fixtures (or QLORA_FIXTURES)") : fx));
    return p;
}

// the tools, space-separated ("make-model finetune": a macro argument takes no braced list), run as
// ./NAME: from the repository root (make) or the build folder (ctest)
inline skip_decorator needs_tools(const char *names) {
    skip_decorator d;
    d.need.cause = "without the tools (run make)";
    const std::string s = names;
    for (size_t i = 0, j; i < s.size(); i = j + 1) {
        j = std::min(s.find(' ', i), s.size());
        const std::string n = s.substr(i, j - i);
        if (!n.empty() && !exists("./" + n)) {
            d.need.have = false;
            d.need.what += (d.need.what.empty() ? "./" : ", ./") + n;
        }
    }
    d.need.required = true;
    return d;
}

// ---- commands ------------------------------------------------------------------------------

// runs cmd in a shell; returns its exit code (-1 if it did not exit), its stdout and stderr in *out
inline int run(const std::string &cmd, std::string *out) {
    FILE *p = popen((cmd + " 2>&1").c_str(), "r");
    if (!p) return -1;
    char buf[4096];
    out->clear();
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Runs cmd with its stdout on a pipe; once a line starting with `when` appears, sends sig (times
// times, 5 ms apart: GNU timeout's TERM to the child and then to its group). Returns the exit
// status (-1 if signalled) and the output.
inline int run_interrupted(const std::string &cmd, const std::string &when, std::string *out, int sig = SIGINT, int times = 1) {
    int fd[2];
    if (pipe(fd) != 0) return -2;
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[0]);
        close(fd[1]);
        execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), (char *)nullptr);
        _exit(127);
    }
    close(fd[1]);
    out->clear();
    bool sent = false;
    char buf[4096];
    ssize_t n;
    while ((n = read(fd[0], buf, sizeof(buf))) > 0) {
        out->append(buf, (size_t)n);
        if (!sent && (out->rfind("\n" + when, std::string::npos) != std::string::npos)) {
            for (int i = 0; i < times; i++) {
                if (i) usleep(5000);
                kill(pid, sig);
            }
            sent = true;
        }
    }
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// ---- comparing -----------------------------------------------------------------------------

inline bool has(const std::string &s, const std::string &needle) { return s.find(needle) != std::string::npos; }

// "[1 2 3]"
inline std::string ids_str(const std::vector<int32_t> &ids) {
    std::string s = "[";
    for (size_t i = 0; i < ids.size(); i++) s += (i ? " " : "") + std::to_string(ids[i]);
    return s + "]";
}

// max |a - b| / max |b|; 1e30 when the sizes differ
inline double rel_err(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) return 1e30;
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        num = std::max(num, (double)std::fabs(a[i] - b[i]));
        den = std::max(den, (double)std::fabs(b[i]));
    }
    return num / std::max(den, 1e-30);
}
