// tools/cli.h - what the tools' command lines share: whole-number flags read strictly, and the
// checks a tool makes on its output file before doing any work (a conversion that runs for
// minutes and then cannot write its result has wasted them).
//
//   if (a == "--steps" && !arg_whole("train-tiny", argc, argv, &i, 1, 1000000, &steps)) return 2;
//   if (int rc = output_path_check("quantize", out, {in})) return rc;
#pragma once

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <initializer_list>
#include <string>

// s as a whole number in [lo, hi] ("", "abc", "1.9" and out of range are not)
inline bool parse_whole(const char *s, long long lo, long long hi, long long *v) {
    char *end = nullptr;
    errno = 0;
    const long long x = strtoll(s, &end, 10);
    if (end == s || *end || errno || x < lo || x > hi) return false;
    *v = x;
    return true;
}

// argv[*i]'s value (argv[*i + 1], *i moved onto it) as a whole number in [lo, hi]; else one
// line on stderr naming the tool, the flag and the value ("", "abc", "1.9", out of range, missing)
inline bool arg_whole(const char *tool, int argc, char **argv, int *i, long long lo, long long hi, long long *v) {
    const char *flag = argv[*i];
    if (*i + 1 >= argc) {
        fprintf(stderr, "%s: %s needs a value\n", tool, flag);
        return false;
    }
    const char *s = argv[++*i];
    if (!parse_whole(s, lo, hi, v)) {
        fprintf(stderr, "%s: %s: '%s' is not a whole number in [%lld, %lld]\n", tool, flag, s, lo, hi);
        return false;
    }
    return true;
}

// 0 when out may be written: a regular file or nothing yet, in a folder this process can write,
// and neither it nor the writers' temporary (out.tmp, renamed over out) is one of the inputs
// (compared as files: "./m.gguf" is "m.gguf", a hard link is its target, and so is a symbolic
// link - the writers remove a stale out.tmp and never follow one, but a link to an input is a
// mistake worth naming). Else the exit code -
// 2 for a wrong argument (a folder, an input), 1 for what the file system refuses - and why,
// in one line on stderr.
inline int output_path_why(const char *out, std::initializer_list<const char *> inputs, std::string *why) {
    const std::string s(out ? out : "");
    if (s.empty()) {
        *why = "the output path is empty";
        return 2;
    }
    struct stat st, in_st;
    if (lstat(s.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        *why = s + ": is a folder (give the output file's name)";
        return 2;
    }
    for (const std::string &p : {s, s + ".tmp"}) {
        if (stat(p.c_str(), &st) != 0) continue;  // (stat: a link is what it leads to - lstat let out.tmp -> input through)
        for (const char *in : inputs)
            if (in && stat(in, &in_st) == 0 && in_st.st_dev == st.st_dev && in_st.st_ino == st.st_ino) {
                *why = s + ": the output " + (p == s ? "" : "(through its temporary " + p + ") ") + "would overwrite the input " + in;
                return 2;
            }
    }
    if (lstat(s.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {  // the writers refuse these too, but only once the work is done
        *why = s + ": exists and is not a regular file (a " + (S_ISLNK(st.st_mode) ? "symbolic link" : "device, FIFO or socket") +
               "): not replaced";
        return 1;
    }
    const size_t slash = s.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : s.substr(0, slash);
    if (stat(dir.c_str(), &st) != 0) {
        *why = s + ": the folder " + dir + " does not exist";
        return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
        *why = s + ": " + dir + " is not a folder";
        return 1;
    }
    if (access(dir.c_str(), W_OK) != 0) {  // the writers make out.tmp beside out
        *why = s + ": cannot write in " + dir + ": " + strerror(errno);
        return 1;
    }
    return 0;
}
inline int output_path_check(const char *tool, const char *out, std::initializer_list<const char *> inputs) {
    std::string why;
    const int rc = output_path_why(out, inputs, &why);
    if (rc) fprintf(stderr, "%s: %s\n", tool, why.c_str());
    return rc;
}
