// tools/plot.cpp - the loss plot (see plot.h): a small RGB canvas, a 5x7 bitmap font, PNG through
// stb_image_write, written atomically (ql_write_file_atomic, models/adapter.h).
//
// Reading order: errors -> the loss plot (canvas, font, ticks, ql_plot_losses).
#include "plot.h"

#include "../models/adapter.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>

// stb's PNG writer, private to this file (STB_IMAGE_WRITE_STATIC: no exported symbols)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wshadow"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif
#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

// ============================================================================================
// errors
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

// ============================================================================================
// loss plot: a small RGB canvas, a 5x7 bitmap font, PNG through stb_image_write
// ============================================================================================

namespace {

const int k_plot_w = 800, k_plot_h = 500;

struct rgb {
    uint8_t r, g, b;
};
const rgb k_white = {255, 255, 255}, k_black = {0, 0, 0}, k_grid = {228, 228, 228}, k_text = {40, 40, 40},
          k_train = {31, 119, 180}, k_eval = {230, 110, 10};

// 5x7 glyphs, rows top to bottom, '#' = ink
struct glyph {
    char c;
    const char *rows[7];
};
const glyph k_font[] = {
    {'0', {" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "}},
    {'1', {"  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'2', {" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"}},
    {'3', {"#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "}},
    {'4', {"   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "}},
    {'5', {"#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "}},
    {'6', {"  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "}},
    {'7', {"#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "}},
    {'8', {" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "}},
    {'9', {" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "}},
    {'.', {"     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "}},
    {'-', {"     ", "     ", "     ", " ### ", "     ", "     ", "     "}},
    {'+', {"     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "}},
    {'e', {"     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "}},
    {'t', {" #   ", " #   ", "#### ", " #   ", " #   ", " #  #", "  ## "}},
    {'r', {"     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "}},
    {'a', {"     ", "     ", " ### ", "    #", " ####", "#   #", " ####"}},
    {'i', {"  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'n', {"     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"}},
    {'v', {"     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  "}},
    {'l', {" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'s', {"     ", "     ", " ####", "#    ", " ### ", "    #", "#### "}},
    {'p', {"     ", "#### ", "#   #", "#   #", "#### ", "#    ", "#    "}},
    {'o', {"     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "}},
};

struct canvas {
    int w, h;
    std::vector<uint8_t> px;  // [h][w][3]
    canvas(int w_, int h_) : w(w_), h(h_), px((size_t)w_ * (size_t)h_ * 3, 255) {}

    void set(int x, int y, rgb c) {
        if (x < 0 || y < 0 || x >= w || y >= h) return;
        uint8_t *p = &px[((size_t)y * (size_t)w + (size_t)x) * 3];
        p[0] = c.r;
        p[1] = c.g;
        p[2] = c.b;
    }
    void fill(int x0, int y0, int x1, int y1, rgb c) {  // inclusive corners
        for (int y = std::max(0, y0); y <= std::min(h - 1, y1); y++)
            for (int x = std::max(0, x0); x <= std::min(w - 1, x1); x++) set(x, y, c);
    }
    // Bresenham, each point a thick x thick square
    void line(int x0, int y0, int x1, int y1, rgb c, int thick) {
        const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
        int e = dx + dy;
        for (int guard = 0; guard < 4 * (k_plot_w + k_plot_h); guard++) {
            fill(x0 - (thick - 1) / 2, y0 - (thick - 1) / 2, x0 + thick / 2, y0 + thick / 2, c);
            if (x0 == x1 && y0 == y1) break;
            const int e2 = 2 * e;
            if (e2 >= dy) { e += dy; x0 += sx; }
            if (e2 <= dx) { e += dx; y0 += sy; }
        }
    }
    void marker(int x, int y, rgb c) {  // a filled diamond with a dark rim
        for (int dy = -5; dy <= 5; dy++)
            for (int dx = -5; dx <= 5; dx++) {
                const int d = std::abs(dx) + std::abs(dy);
                if (d <= 5) set(x + dx, y + dy, d >= 5 ? k_black : c);
            }
    }
    static int text_width(const std::string &s, int scale) { return (int)s.size() * 6 * scale - scale; }
    void text(int x, int y, const std::string &s, rgb c, int scale) {  // (x, y): top left
        for (char ch : s) {
            for (const glyph &gl : k_font)
                if (gl.c == ch)
                    for (int r = 0; r < 7; r++)
                        for (int k = 0; k < 5; k++)
                            if (gl.rows[r][k] == '#') fill(x + k * scale, y + r * scale, x + k * scale + scale - 1, y + r * scale + scale - 1, c);
            x += 6 * scale;
        }
    }
};

// about `target` ticks at 1, 2 or 5 times a power of ten
double nice_step(double range, int target) {
    const double raw = range / target, mag = std::pow(10.0, std::floor(std::log10(raw))), f = raw / mag;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

std::string tick_label(double v, double step) {
    if (std::fabs(v) < step * 1e-6) v = 0;  // no "-0"
    char b[32];
    const double a = std::fabs(v);
    if (a != 0 && (a >= 1e6 || a < 1e-4 || step < 1e-4)) {
        snprintf(b, sizeof(b), "%.3g", v);
    } else {
        const int dec = std::max(0, (int)-std::floor(std::log10(step) + 1e-9));
        snprintf(b, sizeof(b), "%.*f", std::min(dec, 6), v);
    }
    return b;
}

void png_sink(void *ctx, void *data, int size) {
    std::vector<uint8_t> *o = (std::vector<uint8_t> *)ctx;
    o->insert(o->end(), (const uint8_t *)data, (const uint8_t *)data + size);
}

}  // namespace

bool ql_plot_losses(const char *path, const std::vector<std::pair<double, double>> &train,
                    const std::vector<std::pair<double, double>> &eval, std::string *err) {
    if (!path) return fail(err, "ql_plot_losses: no path");
    if (train.empty() && eval.empty()) return fail(err, "%s: no losses to plot", path);
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    for (int s = 0; s < 2; s++) {
        const auto &pts = s ? eval : train;
        for (size_t i = 0; i < pts.size(); i++) {
            if (!std::isfinite(pts[i].first) || !std::isfinite(pts[i].second))
                return fail(err, "%s: %s point %zu (step %g, loss %g) is not finite; nothing written", path, s ? "eval" : "train", i,
                            pts[i].first, pts[i].second);
            x0 = std::min(x0, pts[i].first);
            x1 = std::max(x1, pts[i].first);
            y0 = std::min(y0, pts[i].second);
            y1 = std::max(y1, pts[i].second);
        }
    }
    if (!std::isfinite(x1 - x0) || !std::isfinite(y1 - y0) || std::fabs(x0) > 1e300 || std::fabs(y0) > 1e300 ||
        std::fabs(x1) > 1e300 || std::fabs(y1) > 1e300)
        return fail(err, "%s: the values span too large a range to plot", path);
    // a single step or a constant loss still gets a visible range
    if (x1 - x0 <= 1e-9 * std::max(1.0, std::fabs(x0))) {
        x0 -= 1;
        x1 += 1;
    }
    if (y1 - y0 <= 1e-9 * std::max(1.0, std::fabs(y0))) {
        const double pad = y0 != 0 ? std::fabs(y0) * 0.1 : 1.0;
        y0 -= pad;
        y1 += pad;
    }
    const double ypad = (y1 - y0) * 0.05;
    y0 -= ypad;
    y1 += ypad;

    canvas cv(k_plot_w, k_plot_h);
    const int left = 100, right = k_plot_w - 24, top = 40, bottom = k_plot_h - 64;  // plot area corners
    auto X = [&](double x) { return left + (int)std::lround((x - x0) / (x1 - x0) * (right - left)); };
    auto Y = [&](double y) { return bottom - (int)std::lround((y - y0) / (y1 - y0) * (bottom - top)); };

    // grid, ticks and their labels
    const double sx = nice_step(x1 - x0, 6), sy = nice_step(y1 - y0, 5);
    for (double v = std::ceil(x0 / sx) * sx; v <= x1 + sx * 1e-9; v += sx) {
        const int x = X(v);
        cv.line(x, top, x, bottom, k_grid, 1);
        cv.line(x, bottom, x, bottom + 6, k_black, 1);
        const std::string s = tick_label(v, sx);
        cv.text(x - canvas::text_width(s, 2) / 2, bottom + 12, s, k_text, 2);
    }
    for (double v = std::ceil(y0 / sy) * sy; v <= y1 + sy * 1e-9; v += sy) {
        const int y = Y(v);
        cv.line(left, y, right, y, k_grid, 1);
        cv.line(left - 6, y, left, y, k_black, 1);
        const std::string s = tick_label(v, sy);
        cv.text(left - 12 - canvas::text_width(s, 2), y - 7, s, k_text, 2);
    }
    cv.line(left, top, left, bottom, k_black, 2);      // axes
    cv.line(left, bottom, right, bottom, k_black, 2);
    cv.text((left + right - canvas::text_width("step", 2)) / 2, k_plot_h - 26, "step", k_text, 2);
    cv.text(left - 60, top - 30, "loss", k_text, 2);

    // the curves: train as a line (one point: a dot), eval as markers joined by a thin line
    for (size_t i = 0; i + 1 < train.size(); i++)
        cv.line(X(train[i].first), Y(train[i].second), X(train[i + 1].first), Y(train[i + 1].second), k_train, 2);
    if (train.size() == 1) cv.fill(X(train[0].first) - 3, Y(train[0].second) - 3, X(train[0].first) + 3, Y(train[0].second) + 3, k_train);
    for (size_t i = 0; i + 1 < eval.size(); i++)
        cv.line(X(eval[i].first), Y(eval[i].second), X(eval[i + 1].first), Y(eval[i + 1].second), k_eval, 1);
    for (const auto &p : eval) cv.marker(X(p.first), Y(p.second), k_eval);

    // legend, top right inside the plot area
    const int n_items = (train.empty() ? 0 : 1) + (eval.empty() ? 0 : 1);
    const int lw = 130, lh = 12 + 24 * n_items, lx = right - lw - 10, ly = top + 10;
    cv.fill(lx, ly, lx + lw, ly + lh, k_white);
    cv.line(lx, ly, lx + lw, ly, k_black, 1);
    cv.line(lx, ly + lh, lx + lw, ly + lh, k_black, 1);
    cv.line(lx, ly, lx, ly + lh, k_black, 1);
    cv.line(lx + lw, ly, lx + lw, ly + lh, k_black, 1);
    int iy = ly + 12;
    if (!train.empty()) {
        cv.line(lx + 10, iy + 7, lx + 40, iy + 7, k_train, 2);
        cv.text(lx + 52, iy, "train", k_text, 2);
        iy += 24;
    }
    if (!eval.empty()) {
        cv.line(lx + 10, iy + 7, lx + 40, iy + 7, k_eval, 1);
        cv.marker(lx + 25, iy + 7, k_eval);
        cv.text(lx + 52, iy, "eval", k_text, 2);
    }

    std::vector<uint8_t> png;
    if (!stbi_write_png_to_func(png_sink, &png, cv.w, cv.h, 3, cv.px.data(), cv.w * 3) || png.empty())
        return fail(err, "%s: PNG encoding failed", path);
    return ql_write_file_atomic(path, png.data(), png.size(), err);
}
