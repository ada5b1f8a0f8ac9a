// The loss plot (tools/plot.cpp, finetune's loss.png): a decodable 800 x 500 RGB PNG with both
// curves in their colours; single points, constant and tiny or large values; non-finite values
// refused with nothing written. The one atomic write it goes through (ql_write_file_atomic).
#include "../models/adapter.h"
#include "../tools/plot.h"
#include "util.h"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wshadow"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#endif
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#include <stb/stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace {

uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

// checks the PNG signature and IHDR, decodes it, counts pixels of two colours
void check_png(const std::string &path, int *n_train, int *n_eval) {
    const std::vector<uint8_t> b = read_file_bytes(path);
    REQUIRE(b.size() > 33);
    const uint8_t sig[8] = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
    CHECK(memcmp(b.data(), sig, 8) == 0);
    CHECK(be32(&b[8]) == 13);
    CHECK(memcmp(&b[12], "IHDR", 4) == 0);
    CHECK(be32(&b[16]) == 800);
    CHECK(be32(&b[20]) == 500);
    CHECK(b[24] == 8);  // bit depth
    CHECK(b[25] == 2);  // colour type: RGB
    int w = 0, h = 0, comp = 0;
    uint8_t *px = stbi_load_from_memory(b.data(), (int)b.size(), &w, &h, &comp, 3);
    REQUIRE(px);
    CHECK(w == 800);
    CHECK(h == 500);
    *n_train = *n_eval = 0;
    for (int i = 0; i < w * h; i++) {
        const uint8_t *p = px + 3 * i;
        *n_train += p[0] == 31 && p[1] == 119 && p[2] == 180;
        *n_eval += p[0] == 230 && p[1] == 110 && p[2] == 10;
    }
    stbi_image_free(px);
}

}  // namespace

TEST_CASE("plot: loss.png is an 800x500 PNG with both curves; single points, constants and NaN") {
    tmpdir d;
    const std::string path = d.path + "/loss.png";
    std::vector<std::pair<double, double>> train, eval;
    for (int s = 1; s <= 60; s++) train.push_back({(double)s, 3.0 * std::exp(-s / 20.0) + 0.5 + 0.05 * std::sin(s)});
    for (int s = 10; s <= 60; s += 10) eval.push_back({(double)s, 3.0 * std::exp(-s / 20.0) + 0.7});
    std::string err;
    int nt = 0, ne = 0;
    REQUIRE_MESSAGE(ql_plot_losses(path.c_str(), train, eval, &err), err);
    CHECK_FALSE(exists(path + ".tmp"));
    check_png(path, &nt, &ne);
    CHECK(nt > 300);
    CHECK(ne > 100);

    const std::vector<std::pair<double, double>> none;
    REQUIRE_MESSAGE(ql_plot_losses(path.c_str(), {{0.0, 2.5}}, none, &err), err);  // one point, no eval
    check_png(path, &nt, &ne);
    CHECK(nt > 10);
    CHECK(ne == 0);
    REQUIRE_MESSAGE(ql_plot_losses(path.c_str(), {{1, 2.0}, {2, 2.0}, {3, 2.0}}, {{3, 2.0}}, &err), err);  // constant
    check_png(path, &nt, &ne);
    CHECK(nt > 10);
    CHECK(ne > 10);
    REQUIRE_MESSAGE(ql_plot_losses(path.c_str(), none, {{100, 1e-5}, {200, 3e-6}}, &err), err);  // eval only, tiny values
    REQUIRE_MESSAGE(ql_plot_losses(path.c_str(), {{0, 1e7}, {1e6, -3e7}}, none, &err), err);       // large values

    const std::string nan_path = d.path + "/nan.png";
    CHECK_FALSE(ql_plot_losses(nan_path.c_str(), {{1, 2.0}, {2, NAN}}, none, &err));
    CHECK(has(err, "nan.png"));
    CHECK(has(err, "not finite"));
    CHECK_FALSE(exists(nan_path));
    CHECK_FALSE(ql_plot_losses(nan_path.c_str(), {{1, 2.0}}, {{INFINITY, 1.0}}, &err));
    CHECK(has(err, "eval point 0"));
    CHECK_FALSE(ql_plot_losses(nan_path.c_str(), none, none, &err));
    CHECK(has(err, "no losses"));
}

TEST_CASE("plot: loss.png goes through ql_write_file_atomic: a stale link at PATH.tmp is never followed, a link at PATH never replaced") {
    tmpdir d;
    const std::string path = d.file("out.bin"), victim = d.file("victim.bin"), keep = "what the link points to must survive";
    std::string err;
    REQUIRE_MESSAGE(ql_write_file_atomic(path.c_str(), "abc", 3, &err), err);
    CHECK(read_file(path) == "abc");
    write_file(path + ".tmp", "a stale temporary from a run that died");
    REQUIRE_MESSAGE(ql_write_file_atomic(path.c_str(), "", 0, &err), err);  // replaced, empty
    CHECK(exists(path));
    CHECK(read_file(path).empty());
    CHECK_FALSE(exists(path + ".tmp"));

    write_file(victim, keep);  // a link at PATH.tmp: a new file is made, the one behind the link kept
    REQUIRE(symlink(victim.c_str(), (path + ".tmp").c_str()) == 0);
    REQUIRE_MESSAGE(ql_write_file_atomic(path.c_str(), "new", 3, &err), err);
    CHECK(read_file(path) == "new");
    CHECK(read_file(victim) == keep);
    struct stat st;
    CHECK_FALSE(lstat((path + ".tmp").c_str(), &st) == 0);

    const std::string png = d.file("loss.png");  // a link at PATH itself: refused, by name, for the plot too
    REQUIRE(symlink(victim.c_str(), png.c_str()) == 0);
    CHECK_FALSE(ql_plot_losses(png.c_str(), {{1, 2.0}, {2, 1.5}}, {}, &err));
    CHECK_MESSAGE(err == png + ": exists and is not a regular file (a symbolic link): not replaced", err);
    CHECK(read_file(victim) == keep);
    CHECK_FALSE(exists(png + ".tmp"));

    CHECK_FALSE(ql_write_file_atomic(d.file("no/such/dir/f").c_str(), "x", 1, &err));
    CHECK_MESSAGE(has(err, "/no/such/dir/f: cannot create"), err);
}
