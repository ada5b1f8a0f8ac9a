// A fresh machine: what the README's two commands do when the headers the build needs
// (libstb-dev, doctest-dev) are missing. tools/deps.sh asks the compiler whether it finds them; the
// tests give it a compiler whose only include folder is one of theirs (c++ -nostdinc -isystem
// DIR: an empty DIR is what a fresh machine's compiler finds) and QL_DEPS_UID as a user or as
// root, with a stand-in apt-get on PATH that records what it was asked.
#include "util.h"

#include <doctest/doctest.h>

#include <string>

namespace {

std::string deps_script() { return tests_dir() + "../tools/deps.sh"; }

// make on PATH, and the repository's Makefile and tools/deps.sh: a stat() each, before main
bool have_make_and_makefile() {
    if (!exists(tests_dir() + "../Makefile") || !exists(deps_script())) return false;
    const char *env = getenv("PATH");
    const std::string path = env ? env : "";
    for (size_t i = 0, j; i <= path.size(); i = j + 1) {
        j = std::min(path.find(':', i), path.size());
        if (access(((j > i ? path.substr(i, j - i) : std::string(".")) + "/make").c_str(), X_OK) == 0) return true;
    }
    return false;
}

// a folder with the two headers, as libstb-dev and doctest-dev install them
void make_headers(const std::string &inc) {
    REQUIRE(system(("mkdir -p " + inc + "/stb " + inc + "/doctest").c_str()) == 0);
    write_file(inc + "/stb/stb_image_write.h", "/* stand-in */\n");
    write_file(inc + "/doctest/doctest.h", "/* stand-in */\n");
}

// a stand-in apt-get: logs its arguments; `install` creates the headers (or fails with fail=1)
void make_apt(const tmpdir &d, const std::string &inc, bool fail) {
    REQUIRE(system(("mkdir -p " + d.file("bin")).c_str()) == 0);
    const std::string script = "#!/bin/sh\necho \"$@\" >> " + d.file("apt.log") + "\n" +
                               (fail ? std::string("[ \"$1\" = install ] && exit 100\n")
                                     : "if [ \"$1\" = install ]; then mkdir -p " + inc + "/stb " + inc + "/doctest; : > " + inc +
                                           "/stb/stb_image_write.h; : > " + inc + "/doctest/doctest.h; fi\n") +
                               "exit 0\n";
    write_file(d.file("bin/apt-get"), script);
    REQUIRE(chmod(d.file("bin/apt-get").c_str(), 0755) == 0);
}

}  // namespace

TEST_CASE("fresh machine: tools/deps.sh installs the headers as root, else names the one command") {
    tmpdir d;
    const std::string inc = d.file("include");
    REQUIRE(system(("mkdir -p " + inc).c_str()) == 0);
    std::string out;

    // the compiler deps.sh asks: it finds only what is under inc
    const std::string cxx = "CXX='c++ -nostdinc -isystem " + inc + "' ";
    SUBCASE("a user without root: stops at once with the one command, and the exit code says so") {
        make_apt(d, inc, false);
        const std::string env = "PATH=" + d.file("bin") + ":/usr/bin:/bin " + cxx + "QL_DEPS_UID=1000 ";
        CHECK(run(env + "sh " + deps_script(), &out) == 1);
        CHECK(has(out, "deps: missing libstb-dev doctest-dev; install with: sudo apt-get install libstb-dev doctest-dev\n"));
        CHECK(std::count(out.begin(), out.end(), '\n') == 1);
        CHECK_FALSE(exists(d.file("apt.log")));  // nothing was asked of apt
    }
    SUBCASE("only doctest missing: only doctest named") {
        make_headers(inc);
        REQUIRE(remove((inc + "/doctest/doctest.h").c_str()) == 0);
        CHECK(run(cxx + "QL_DEPS_UID=1000 sh " + deps_script(), &out) == 1);
        CHECK(has(out, "install with: sudo apt-get install doctest-dev\n"));
        CHECK_FALSE(has(out, "libstb-dev"));
    }
    SUBCASE("root with apt-get: updates, installs what is missing, exits 0") {
        make_apt(d, inc, false);
        const std::string env = "PATH=" + d.file("bin") + ":/usr/bin:/bin " + cxx + "QL_DEPS_UID=0 ";
        CHECK(run(env + "sh " + deps_script(), &out) == 0);
        CHECK(has(out, "deps: installing libstb-dev doctest-dev"));
        const std::string log = read_file(d.file("apt.log"));
        CHECK(has(log, "update"));
        CHECK(has(log, "install -y -qq --no-install-recommends libstb-dev doctest-dev"));
        CHECK(exists(inc + "/stb/stb_image_write.h"));
        // a second run finds them and is silent
        CHECK(run(env + "sh " + deps_script(), &out) == 0);
        CHECK(out.empty());
    }
    SUBCASE("root, but apt-get fails: exit 1 with the reason") {
        make_apt(d, inc, true);
        const std::string env = "PATH=" + d.file("bin") + ":/usr/bin:/bin " + cxx + "QL_DEPS_UID=0 ";
        CHECK(run(env + "sh " + deps_script(), &out) == 1);
        CHECK(has(out, "deps: apt-get could not install libstb-dev doctest-dev"));
    }
    SUBCASE("headers the compiler finds elsewhere (CPATH, /usr/local/include) count as there") {
        make_headers(inc);
        CHECK(run("CXX='c++ -nostdinc' CPATH=" + inc + " QL_DEPS_UID=1000 sh " + deps_script(), &out) == 0);
        CHECK(out.empty());
        CHECK(run("CXX='c++ -nostdinc' QL_DEPS_UID=1000 sh " + deps_script(), &out) == 1);  // not without it
    }
    SUBCASE("no apt-get: names the headers and CPATH, not apt") {
        REQUIRE(system(("mkdir -p " + d.file("noapt") + " && ln -s \"$(command -v c++)\" " + d.file("noapt/c++")).c_str()) == 0);
        CHECK(run("PATH=" + d.file("noapt") + " " + cxx + "QL_DEPS_UID=0 /bin/sh " + deps_script() + " doctest", &out) == 1);
        CHECK_MESSAGE(has(out, "finds no doctest/doctest.h (the stb and doctest headers); install them with your package manager or add "
                               "their folder to CPATH"), out);
        CHECK_FALSE(has(out, "apt-get"));
    }
    SUBCASE("everything there: silent, exit 0") {
        make_headers(inc);
        CHECK(run(cxx + "QL_DEPS_UID=1000 sh " + deps_script(), &out) == 0);
        CHECK(out.empty());
    }
}

TEST_CASE("fresh machine: make demo and make test stop before compiling anything, with the one command" *
          skip_unless(have_make_and_makefile(), "without make or the repository's Makefile") *
          skip_unless(!getenv("QL_FRESH_TEST"), "inside the fresh-machine case's own make (QL_FRESH_TEST)")) {
    // make in a build tree of its own, as a user on a machine without the headers: the first
    // thing make runs is tools/deps.sh, and nothing is compiled after its refusal. The repository's
    // own Makefile by path (under ctest the working folder holds CMake's Makefile, whose `make
    // test` runs this suite again); QL_FRESH_TEST guards against running inside itself all the same.
    const std::string root = tests_dir() + "..";
    tmpdir d;
    REQUIRE(system(("mkdir -p " + d.file("include")).c_str()) == 0);
    // make demo needs only stb (the tools); make test needs doctest too: one line names both
    const std::pair<const char *, const char *> goals[] = {{"demo", "libstb-dev"}, {"test", "libstb-dev doctest-dev"}};
    for (const auto &g : goals) {
        std::string out;
        const std::string cmd = "MAKEFLAGS= QL_FRESH_TEST=1 QL_DEPS_UID=1000 timeout 600 make --no-print-directory -C " + root +
                                " BUILD=" + d.file("build") + " CXX='c++ -nostdinc -isystem " + d.file("include") + "' " + g.first;
        CHECK(run(cmd, &out) != 0);
        CHECK_MESSAGE(has(out, std::string("install with: sudo apt-get install ") + g.second + "\n"), out);
        CHECK_MESSAGE(!has(out, "-c "), out);  // no compile started
        CHECK_FALSE(exists(d.file("build/qlora.o")));
    }
}
