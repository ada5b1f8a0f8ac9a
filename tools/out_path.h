// tools/out_path.h - the checks a tool makes on its output file before doing any work: a
// conversion that runs for minutes and then cannot write its result has wasted them.
//
//   std::string why;
//   if (!output_path_ok(out, {in}, &why)) { fprintf(stderr, "quantize: %s\n", why.c_str()); return 1; }
#pragma once

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <initializer_list>
#include <string>

// out may be replaced (a regular file, or nothing yet) in a folder this process can write, and
// is none of the inputs (compared as files: "./m.gguf" is "m.gguf", a hard link is its target)
inline bool output_path_ok(const char *out, std::initializer_list<const char *> inputs, std::string *why) {
    struct stat st, in_st;
    if (lstat(out, &st) == 0) {
        if (S_ISDIR(st.st_mode)) {
            *why = std::string(out) + ": is a folder (give the output file's name)";
            return false;
        }
        if (!S_ISREG(st.st_mode)) {  // the writers refuse these too, but only once the work is done
            *why = std::string(out) + ": exists and is not a regular file (a " +
                   (S_ISLNK(st.st_mode) ? "symbolic link" : "device, FIFO or socket") + "): not replaced";
            return false;
        }
        for (const char *in : inputs)
            if (in && stat(in, &in_st) == 0 && in_st.st_dev == st.st_dev && in_st.st_ino == st.st_ino) {
                *why = std::string(out) + ": the output would overwrite the input " + in;
                return false;
            }
    }
    const std::string s(out);
    const size_t slash = s.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : s.substr(0, slash);
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        *why = s + ": the folder " + dir + " does not exist";
        return false;
    }
    if (access(dir.c_str(), W_OK) != 0) {  // the writers make out.tmp beside out
        *why = s + ": cannot write in " + dir + ": " + strerror(errno);
        return false;
    }
    return true;
}
