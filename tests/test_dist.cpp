// ql_dist_* in a build without MPI (qlora.cpp's weak definitions): one process, rank 0 of 1, every
// collective leaves the buffers as they are and succeeds, a device all-reduce is unsupported (the
// trainer then stages through the host). The MPI definitions run under mpirun in tests/mpi.sh.
#include "../qlora.h"

#include <doctest/doctest.h>

#include <cstring>
#include <string>

TEST_CASE("ql_dist without MPI: one process, collectives that leave the buffers as they are") {
    char err[64] = "x";
    int argc = 1;
    char arg0[] = "test", *args[] = {arg0, nullptr}, **argv = args;
    REQUIRE(ql_dist_init(&argc, &argv, err, sizeof(err)) == QL_OK);
    CHECK(err[0] == 0);
    CHECK(argc == 1);
    CHECK(ql_dist_rank() == 0);
    CHECK(ql_dist_size() == 1);
    CHECK(ql_dist_local_rank() == 0);
    CHECK(std::string(ql_dist_name()) == "one process");
    float f[3] = {1.5f, -2, 3};
    double d[2] = {0.25, 7};
    int64_t i[2] = {-5, (int64_t)1 << 40};
    CHECK(ql_dist_allreduce_f32(f, 3) == QL_OK);
    CHECK(ql_dist_allreduce_f64(d, 2) == QL_OK);
    CHECK(ql_dist_allreduce_i64(i, 2) == QL_OK);
    CHECK((f[0] == 1.5f && f[1] == -2 && f[2] == 3));
    CHECK((d[0] == 0.25 && d[1] == 7));
    CHECK((i[0] == -5 && i[1] == (int64_t)1 << 40));
    char b[4] = "abc";
    CHECK(ql_dist_broadcast(b, 4, 0) == QL_OK);
    CHECK(strcmp(b, "abc") == 0);
    CHECK(ql_dist_broadcast(b, 4, 1) == QL_ERR_INVALID);  // no rank 1
    CHECK(ql_dist_barrier() == QL_OK);
    ql_backend *cpu = ql_backend_cpu_init(1);
    REQUIRE(cpu);
    float *bufs[1] = {f};
    const size_t n[1] = {3};
    CHECK(ql_dist_allreduce_device_f32(cpu, bufs, n, 1) == QL_ERR_UNSUPPORTED);
    ql_backend_free(cpu);
    ql_dist_free();
}
