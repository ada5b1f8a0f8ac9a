#!/bin/sh
# tools/deps.sh [stb] [doctest] - the headers the build needs beyond a C++ compiler and make:
# stb_image_write.h (Debian's libstb-dev: the loss plot's PNG) and doctest.h (doctest-dev: the
# test suite). With no argument, both. Run by make and CMake before they compile.
#
# A header counts as there when the compiler finds it (/usr/include, /usr/local/include, CPATH,
# ...), not only where Debian puts it. What is missing is installed as root on a machine with
# apt-get; otherwise the script stops at once and prints the one command that installs it.
# Exit 0: all there (or installed); 1: missing.
#
# CXX: the compiler asked (make and CMake pass theirs; default c++). QL_DEPS_UID: the user id
# (tests, with a CXX whose search path they control).
cxx=${CXX:-c++}
uid=${QL_DEPS_UID:-$(id -u)}
[ $# -eq 0 ] && set -- stb doctest

# found: the compiler's preprocessor finds the header
found() { printf '#include <%s>\n' "$1" | $cxx -E -x c++ - >/dev/null 2>&1; }

need=""
for what in "$@"; do
    case $what in
        stb) found stb/stb_image_write.h || need="$need libstb-dev" ;;
        doctest) found doctest/doctest.h || need="$need doctest-dev" ;;
        *) echo "deps: unknown dependency '$what' (stb, doctest)" >&2; exit 2 ;;
    esac
done
need=${need# }
[ -z "$need" ] && exit 0

if [ "$uid" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "deps: installing $need (Debian packages the build needs)"
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need; then
        exit 0
    fi
    echo "deps: apt-get could not install $need; install them, then run make again" >&2
    exit 1
fi
if command -v apt-get >/dev/null 2>&1; then
    echo "deps: missing $need; install with: sudo apt-get install $need" >&2
else
    echo "deps: missing $need: $cxx finds no $( [ "${need#*stb}" != "$need" ] && printf 'stb/stb_image_write.h ')$( [ "${need#*doctest}" != "$need" ] && printf 'doctest/doctest.h ')(the stb and doctest headers); install them with your package manager or add their folder to CPATH, then run make again" >&2
fi
exit 1
