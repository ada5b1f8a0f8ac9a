#!/bin/sh
# tools/deps.sh - what the build needs beyond a C++ compiler and make: Debian's libstb-dev (the loss
# plot's PNG writer) and doctest-dev (the test suite). Run by make and CMake before they compile.
# As root on a machine with apt-get, it installs what is missing; otherwise it stops at once and
# prints the one command that installs it. Exit 0: all there (or installed); 1: missing.
#
# QL_DEPS_INCLUDE: where the headers are looked for (default /usr/include; the tests point it at
# an empty folder to see what a fresh machine sees). QL_DEPS_UID: the user id (tests).
inc=${QL_DEPS_INCLUDE:-/usr/include}
uid=${QL_DEPS_UID:-$(id -u)}

need=""
[ -f "$inc/stb/stb_image_write.h" ] || need="$need libstb-dev"
[ -f "$inc/doctest/doctest.h" ] || need="$need doctest-dev"
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
    echo "deps: missing $need (the stb single-file headers and doctest, under $inc/stb and $inc/doctest); install them with your package manager, then run make again" >&2
fi
exit 1
