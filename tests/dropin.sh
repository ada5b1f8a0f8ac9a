#!/bin/sh
# tests/dropin.sh - the drop-in promise: qlora.h + qlora.cpp and plain compiler commands, nothing
# else (make test-dropin and CMake's dropin test run it).
#   CC=cc CXX=c++ sh tests/dropin.sh SOURCE_DIR OUT_DIR
# 1. examples/simple.cpp with qlora.cpp in one command, run;
# 2. qlora.h is C99, its implementer part too;
# 3. the implementer part is invisible without QL_INTERNALS (and visible when a file defines it
#    after a first include);
# 4. the example in qlora.h's top comment, compiled as C99 and as C++17 inside a main, linked
#    with qlora.cpp compiled as C++, run: it prints dl/dw[0] = 10.24.
set -e
src=$1
out=$2
CC=${CC:-cc}
CXX=${CXX:-c++}
mkdir -p "$out"

$CXX -std=c++17 -O2 -pthread "$src/examples/simple.cpp" "$src/qlora.cpp" -o "$out/simple"
"$out/simple"

$CC -std=c99 -Wall -Wextra -pedantic -fsyntax-only -x c "$src/qlora.h"
$CC -std=c99 -Wall -Wextra -pedantic -fsyntax-only -DQL_INTERNALS -x c "$src/qlora.h"

# one name of each kind in the implementer part: none compiles without QL_INTERNALS, all with it
n=0
for use in 'ql_block_q8_0 u;' 'ql_block_nf4 u;' 'ql_backend_i u;' 'ql_graph_exec u;' \
           'size_t u = sizeof(struct ql_backend);' 'int u = QL_CUDA_FA_NBUF;' 'int u = QL_QK_K;' \
           'int (*u)(int, int) = ql_cpu_threads_for;' 'bool (*u)(const ql_tensor *) = ql_cuda_fa_gemm;' \
           'uint64_t (*u)(void) = ql_backend_new_id;' 'float u[15] = QL_NF4_THRESHOLDS;' \
           'uint8_t (*u)(const float *, float) = ql_dynamic_quantize_inline;'; do
    n=$((n + 1))
    printf '#include "qlora.h"\n%s\n' "$use" > "$out/hidden$n.c"
    if $CC -std=c99 -pedantic -Werror -fsyntax-only -I"$src" "$out/hidden$n.c" 2>/dev/null; then
        echo "dropin: '$use' compiles without QL_INTERNALS: the implementer part is public"
        exit 1
    fi
    printf '#include "qlora.h"\n#define QL_INTERNALS\n#include "qlora.h"\n%s\n' "$use" > "$out/seen$n.c"
    $CC -std=c99 -pedantic -Wall -Werror -Wno-unused-variable -fsyntax-only -I"$src" "$out/seen$n.c"
done

# the top comment's example: the indented lines after the one naming test-dropin, up to the
# comment's first empty line
{
    printf '#include "qlora.h"\n\n#include <stdio.h>\n\nint main(void) {\n'
    awk '/test-dropin/ { on = 1; next }
         on && /^\/\/     / { print "    " substr($0, 8); seen = 1; next }
         on && seen && /^\/\/$/ { exit }' "$src/qlora.h"
    printf '    return 0;\n}\n'
} > "$out/example.c"
if ! grep -q ql_backend_graph_compute "$out/example.c"; then
    echo "dropin: no example found in qlora.h's top comment"
    exit 1
fi
$CXX -std=c++17 -O1 -pthread -c "$src/qlora.cpp" -o "$out/qlora.o"
$CC -std=c99 -pedantic -Wall -Wextra -Werror -I"$src" -c "$out/example.c" -o "$out/example-c.o"
$CXX -pthread "$out/example-c.o" "$out/qlora.o" -o "$out/example-c"
$CXX -std=c++17 -pedantic -Wall -Wextra -Werror -I"$src" -x c++ "$out/example.c" -x none "$out/qlora.o" -pthread \
    -o "$out/example-cpp"
for lang in c cpp; do
    got=$("$out/example-$lang")
    if [ "$got" != "dl/dw[0] = 10.24" ]; then
        echo "dropin: the header's example ($lang) printed '$got', not 'dl/dw[0] = 10.24'"
        exit 1
    fi
done
echo "dropin: simple, qlora.h as C99 (its implementer part only with QL_INTERNALS), the header's example as C and C++"
