// tools/own.h - what a tool's main holds, freed when main returns, on every path: its error
// exits too (make test-sanitize runs them under LeakSanitizer). Declared in the order made, so
// freed in reverse: what depends on a thing goes before it.
//
//   ql_llama_file *f = ql_llama_load(...);
//   owned<ql_llama_file> f_(f, ql_llama_file_free);
#pragma once

#include <memory>

template <class T> using owned = std::unique_ptr<T, void (*)(T *)>;
