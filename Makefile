# qlora - build the library, the tools and the tests. CUDA is opt-in (CUDA=1) and off by default.
#
#   make            library, tools (tools/bench; ./X for every other tools/X.cpp), test binary
#   make test       the test suite + the drop-in build check (a few minutes on 2 cores)
#   make test-sanitize   the suite under AddressSanitizer + UndefinedBehaviorSanitizer
#   make test-portable   the suite built without -march=native (portable SIMD fallback)
#   make bench      benchmarks (numbers go to bench/RESULTS.md by hand, with the command)
#   make bench-finetune  finetune tokens/s and peak RSS, with PyTorch's as the yardstick (bench/finetune.sh)
#   make bench-checkpointing  step time and peak memory for each --checkpointing policy (bench/checkpointing.sh)
#   make bench-optimizers  finetune tokens/s and state memory for each --precision and --optim (bench/optimizers.sh)
#   make bench-infer  generate's decode tokens/s against llama.cpp's, 110M and 1B, Q4_0/Q8_0/Q4_K_M/nf4 (bench/infer.sh)
#   make demo       QLoRA-fine-tunes a tiny NF4 llama on examples/demo.jsonl and shows what it learned
#   make fuzz       libFuzzer on the GGUF reader (clang; FUZZ_RUNS=1000000 by default)
#   make PORTABLE=1 ...  no -march=native (the portable SIMD fallback)
#   make CUDA=1 ...      with the CUDA backend (qlora-cuda.cu, nvcc, cuBLAS) for sm_75..sm_90 (+ PTX)
#   make test-amx-shim   the AMX kernel runs on any CPU through tests/amx_shim.h (part of make test)
#   make test-cuda-shim  the CUDA backend's kernels run on the CPU through tests/cuda_shim.h
#                        (needs only CUDA's headers; part of make test when they are there)
#   make CUDA=1 test-gpu the checks that need a real GPU (tests/gpu-check.sh)
#   make MPI=1 ...       ./finetune with data parallel over MPI (qlora-mpi.cpp, mpicxx): mpirun -np N ./finetune ...
#   make test-mpi        mpirun -np 2 against one process (tests/mpi.sh; part of make test where OpenMPI is),
#                        on the CPU and, through the CUDA shim and NCCL on MPI, on two shim devices
#   make cuda-check      compile qlora-cuda.cu for every architecture, warnings as errors, and
#                        fail on register spills or local memory (ptxas -v)

CXX      ?= g++
CC       ?= gcc
OPT      ?= -O3
ARCH     := $(if $(PORTABLE),,-march=native)
CXXFLAGS ?= $(OPT) $(ARCH) -g -std=c++17 -Wall -Wextra -Wshadow -pthread
# the tests' own sources: -O1 with line tables (the library they test is built with CXXFLAGS). Four
# times quicker to compile than -O3 -g (doctest's expansions), and the suite runs as fast.
TEST_OPT ?= -O1
TESTFLAGS = $(filter-out -O% -g,$(CXXFLAGS)) $(TEST_OPT) -g1
# (float-cast-overflow: GCC's -fsanitize=undefined leaves it out; a float-to-int cast out of range is UB)
SANFLAGS := -O1 -g1 $(ARCH) -std=c++17 -pthread -fsanitize=address,undefined,float-cast-overflow -fno-omit-frame-pointer -fno-sanitize-recover=undefined,float-cast-overflow
LDLIBS   := -pthread -ldl

BUILD    := build

# CUDA: the toolkit's headers (the shim suite needs only cuda_fp16.h / cuda_bf16.h) and nvcc
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc
CUDA_HEADERS := $(wildcard $(CUDA_HOME)/include/cuda_bf16.h)
CUDA_ARCHS   := -gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=sm_80 \
                -gencode arch=compute_86,code=sm_86 -gencode arch=compute_89,code=sm_89 \
                -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCCFLAGS ?= -std=c++17 -O3 -g -lineinfo $(CUDA_ARCHS) -Xcompiler -Wall,-Wextra -Werror all-warnings
# nvcc compiles the six targets in parallel: cuda-check 367 s -> 194 s on 2 cores
NVCC_THREADS ?= $(shell nproc 2>/dev/null || echo 1)
CUDA_SRC  := qlora-cuda.cu
CUDA_OBJ  := $(if $(CUDA),$(BUILD)/qlora-cuda.o)
comma := ,
LDLIBS    += $(if $(CUDA),-L$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart -Wl$(comma)-rpath$(comma)$(CUDA_HOME)/lib64)

# MPI: opt-in (MPI=1): qlora-mpi.cpp, compiled and linked with mpicxx into ./finetune, whose
# ql_dist_* replace the library's one-process weak ones. The library itself never includes mpi.h.
MPICXX    ?= mpicxx
# with CUDA=1 too: its NCCL part (gradients summed in device memory; NCCL is in the CUDA toolkit's lib64)
MPI_OBJ   := $(if $(MPI),$(BUILD)/qlora-mpi$(if $(CUDA),-nccl).o)

LIB_SRC  := qlora.cpp $(wildcard models/*.cpp)
LIB_OBJ  := $(LIB_SRC:%.cpp=$(BUILD)/%.o)
TEST_SRC := $(wildcard tests/test_*.cpp)
TEST_OBJ := $(TEST_SRC:%.cpp=$(BUILD)/%.o)
# code the tools share, without a main (tools/plot.cpp: finetune's loss.png), archived so that
# a tool or the test binary links what it calls; stb's PNG writer is its dependency
TOOL_LIB_SRC := tools/plot.cpp
TOOL_LIB_OBJ := $(TOOL_LIB_SRC:%.cpp=$(BUILD)/%.o)
# every other tools/X.cpp is a binary ./X at the repository root, except the benchmark (tools/bench)
ROOT_TOOLS := $(filter-out bench $(basename $(notdir $(TOOL_LIB_SRC))),$(basename $(notdir $(wildcard tools/*.cpp))))
TOOLS    := tools/bench $(ROOT_TOOLS)
HEADERS  := qlora.h $(wildcard models/*.h models/*.inc tools/*.h)
TEST_HEADERS := $(wildcard tests/*.h)

.PHONY: deps all test test-unit test-mpi test-dropin test-cuda-shim test-amx-shim test-gpu cuda-check test-sanitize test-portable bench bench-finetune bench-checkpointing bench-optimizers bench-infer demo clean cuda fuzz
all: $(TOOLS) $(BUILD)/test-qlora

# tools/deps.sh: the headers the build needs - stb for the tools' loss plot, doctest for the tests -
# installed as root with apt or named with the one command that installs them, before anything
# compiles (order-only: no rebuilds). One check for what the goals need (the tools alone, as in
# make demo, need no doctest), so that one apt-get runs and one line names all that is missing.
LIB_ONLY_GOALS := demo cuda fuzz deps $(TOOLS) $(ROOT_TOOLS) bench bench-%
DEPS_NEED := $(if $(filter-out $(LIB_ONLY_GOALS),$(or $(MAKECMDGOALS),all)),stb doctest,stb)
deps:
	@CXX="$(CXX)" sh tools/deps.sh $(DEPS_NEED)

$(BUILD)/%.o: %.cpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -I. -c $< -o $@

$(BUILD)/tests/%.o: tests/%.cpp $(HEADERS) $(TEST_HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(TESTFLAGS) -I. -c $< -o $@

$(BUILD)/libqlora.a: $(LIB_OBJ)
	ar rcs $@ $^

$(BUILD)/libtools.a: $(TOOL_LIB_OBJ)
	ar rcs $@ $^

# the CUDA object is linked explicitly (not archived): its definitions replace the library's weak
# no-CUDA ones
$(BUILD)/qlora-cuda.o: $(CUDA_SRC) qlora.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) --threads $(NVCC_THREADS) -I. -c qlora-cuda.cu -o $@

tools/bench: $(BUILD)/tools/bench.o $(BUILD)/libqlora.a $(CUDA_OBJ)
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

$(ROOT_TOOLS): %: $(BUILD)/tools/%.o $(BUILD)/libtools.a $(BUILD)/libqlora.a $(CUDA_OBJ)
	$(LINK_CXX) $(CXXFLAGS) $(filter %.o %.a,$^) -o $@ $(LDLIBS)
LINK_CXX = $(CXX)

# the MPI object, like the CUDA one, linked explicitly: its definitions replace the weak ones
$(BUILD)/qlora-mpi.o: qlora-mpi.cpp qlora.h
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) -I. -c qlora-mpi.cpp -o $@
$(BUILD)/qlora-mpi-nccl.o: qlora-mpi.cpp qlora.h
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) -DQL_DIST_NCCL -I$(CUDA_HOME)/include -I. -c qlora-mpi.cpp -o $@
ifneq ($(MPI),)
finetune: $(MPI_OBJ)
finetune: LINK_CXX = $(MPICXX)
finetune: LDLIBS += $(if $(CUDA),-lnccl)
endif
# ./finetune is linked again when MPI= changes: a stamp of the setting, remade when it differs
MPI_STAMP := $(BUILD)/.mpi-$(if $(MPI),on,off)
$(BUILD)/.mpi-on $(BUILD)/.mpi-off:
	@mkdir -p $(BUILD) && rm -f $(BUILD)/.mpi-on $(BUILD)/.mpi-off && touch $@
finetune: $(MPI_STAMP)
# the data-parallel finetune for the tests, whatever MPI= says (./finetune stays as built)
$(BUILD)/mpi/finetune: $(BUILD)/tools/finetune.o $(BUILD)/libtools.a $(BUILD)/libqlora.a $(BUILD)/qlora-mpi.o
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

# the data-parallel GPU path without a GPU (tests/mpi.sh, part 5): finetune with the CUDA backend through
# the shim and qlora-mpi.cpp's NCCL part on tests/nccl_shim.h (NCCL on MPI over the shim's memory);
# built and tested where CUDA's headers and nccl.h are
NCCL_HEADER := $(wildcard $(CUDA_HOME)/include/nccl.h)
MPI_SHIM := $(if $(CUDA_HEADERS),$(if $(NCCL_HEADER),$(BUILD)/mpi/finetune-shim $(BUILD)/mpi/nccl-shim-selftest))
$(BUILD)/mpi/nccl_shim_mpi.o: tests/nccl_shim_mpi.cpp tests/nccl_shim.h tests/cuda_shim.h qlora-mpi.cpp qlora.h
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) $(SHIM_FLAGS) -I. -c $< -o $@
$(BUILD)/mpi/nccl-shim-selftest: tests/nccl_shim_selftest.cpp tests/nccl_shim.h tests/cuda_shim.h
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) $(SHIM_FLAGS) -I. $< -o $@ $(LDLIBS)
$(BUILD)/mpi/finetune-shim: $(BUILD)/tools/finetune.o $(BUILD)/shim/cuda_shim_backend.o $(BUILD)/mpi/nccl_shim_mpi.o $(BUILD)/libtools.a $(BUILD)/libqlora.a
	$(MPICXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

$(TEST_OBJ): $(TEST_HEADERS)
$(TEST_SRC:%.cpp=$(BUILD)/san/%.o): $(TEST_HEADERS)

$(BUILD)/test-qlora: $(TEST_OBJ) $(BUILD)/libtools.a $(BUILD)/libqlora.a $(CUDA_OBJ)
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

# The CUDA backend through the shim: qlora-cuda.cu compiled as host C++ (tests/cuda_shim_backend.cpp)
# with the same op suite (tests/test_backend_ops.cpp), CUDA graphs' (tests/test_cuda_graphs.cpp),
# the optimizer's (tests/test_optim.cpp: its multi-tensor cases on the device) and the shim's own tests.
# (test_main, test_backend_ops and test_optim are the suite's own objects: nothing in them sees the
# shim; test_optim reads its counters through weak symbols). The backend's object first: the
# linker keeps the first copy of each inline function, and shim_selftest's, built at the tests'
# lower -O, made the shim's scheduler 2.3x slower under the sanitizers (trainer_cache_weights
# 262 -> 116 s)
SHIM_OBJ := shim/cuda_shim_backend.o tests/test_main.o tests/test_backend_ops.o tests/test_cuda_graphs.o tests/test_optim.o shim/shim_selftest.o
SHIM_FLAGS := -I$(CUDA_HOME)/include
$(BUILD)/shim/cuda_shim_backend.o: tests/cuda_shim_backend.cpp tests/cuda_shim.h $(CUDA_SRC) $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $(SHIM_FLAGS) -I. -c $< -o $@
$(BUILD)/shim/%.o: tests/%.cpp tests/cuda_shim.h $(HEADERS) $(TEST_HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(TESTFLAGS) $(SHIM_FLAGS) -I. -c $< -o $@
$(BUILD)/test-cuda-shim: $(SHIM_OBJ:%=$(BUILD)/%) $(BUILD)/libqlora.a
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

# The AMX kernel through tests/amx_shim.h: qlora.cpp compiled with the tiles emulated, with the
# cases whose bf16 multiplies take the AMX path (bf16 x, K a multiple of 32, N >= 16) where the
# processor has the tiles - so that kernel is tested on every machine, not only on Sapphire Rapids.
AMX_SHIM_TESTS := tests/test_main.cpp tests/amx_selftest.cpp tests/test_ops.cpp tests/test_trainer.cpp
AMX_SHIM_CASES := -tc="amx shim*,mul_mat*,trainer: bf16*"
$(BUILD)/tests/amx_selftest.o: tests/amx_shim.h
$(BUILD)/amx/qlora.o: qlora.cpp tests/amx_shim.h $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -DQL_AMX_SHIM -include tests/amx_shim.h -I. -c qlora.cpp -o $@
$(BUILD)/test-amx-shim: $(BUILD)/amx/qlora.o $(filter-out $(BUILD)/qlora.o,$(LIB_OBJ)) $(AMX_SHIM_TESTS:%.cpp=$(BUILD)/%.o)
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)
test-amx-shim: $(BUILD)/test-amx-shim
	./$(BUILD)/test-amx-shim $(AMX_SHIM_CASES)

test: test-unit test-dropin test-cuda-shim test-amx-shim test-mpi

# data parallel: mpirun -np 2 against one process with twice the accumulation, a killed rank
# (tests/mpi.sh); skipped with its reason where OpenMPI is not installed
HAVE_MPI := $(and $(shell command -v $(MPICXX) 2>/dev/null),$(shell command -v mpirun 2>/dev/null))
ifneq ($(HAVE_MPI),)
test-mpi: $(BUILD)/mpi/finetune make-model finetune $(MPI_SHIM)
	sh tests/mpi.sh $(BUILD)/mpi/finetune $(BUILD)/mpi-test $(MPI_SHIM)
else
test-mpi:
	@echo "test-mpi: skipped: mpicxx or mpirun not found (Debian: openmpi-bin libopenmpi-dev); data parallel is untested in this run"
endif

# The suite linked with the CUDA backend from the objects make already built (the CPU objects do
# not depend on CUDA=1) and cuda-check's object: what CI runs to see the CUDA build link and its
# GPU suite skip (or run) without compiling everything a second time.
$(BUILD)/test-qlora-cuda: $(TEST_OBJ) $(BUILD)/libtools.a $(BUILD)/libqlora.a $(BUILD)/cuda/qlora-cuda.o
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS) -L$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart -Wl,-rpath,$(CUDA_HOME)/lib64

# session 11's kernels (LoRA dropout in A's multiply, decode on 8-bit activations) and the layer
# split's peer copies again with each block's threads in a seeded random order (tests/cuda_shim.h:
# a missing barrier gives a wrong answer in some order; forward, reverse, random:2 and :3 pass
# them all): ~10 s of CPU
SHIM_RANDOM_CASES := -tc="backend ops cuda: mul_mat_dropout,backend ops cuda: mul_mat_decode_q8,cuda decode*,census: a decode*,backend ops cuda: trainer_split_layers"
ifneq ($(CUDA_HEADERS),)
test-cuda-shim: $(BUILD)/test-cuda-shim
	./$(BUILD)/test-cuda-shim
	QL_SHIM_ORDER=random:1 ./$(BUILD)/test-cuda-shim $(SHIM_RANDOM_CASES)
else
test-cuda-shim:
	@echo "test-cuda-shim: skipped: CUDA's headers not found under $(CUDA_HOME)/include (set CUDA_HOME); the CUDA backend is untested in this run"
endif

# every architecture, warnings as errors, and the ptxas gate: no spill stores and no stack frame
$(BUILD)/cuda/qlora-cuda.o: $(CUDA_SRC) qlora.h
	@mkdir -p $(BUILD)/cuda
	$(NVCC) $(NVCCFLAGS) --threads $(NVCC_THREADS) -Xptxas -v -I. -c qlora-cuda.cu -o $@ 2> $(BUILD)/ptxas.log || { cat $(BUILD)/ptxas.log; exit 1; }
cuda-check: $(BUILD)/cuda/qlora-cuda.o
	@if grep -E "[1-9][0-9]* bytes (spill stores|stack frame)" $(BUILD)/ptxas.log >/dev/null; then \
	    echo "cuda-check: spills or local memory:"; grep -B3 -E "[1-9][0-9]* bytes (spill stores|stack frame)" $(BUILD)/ptxas.log; exit 1; fi
	@echo "cuda-check: $$(grep -c 'Compiling entry' $(BUILD)/ptxas.log) kernel builds, no spills, no stack frames"

test-unit: $(BUILD)/test-qlora $(ROOT_TOOLS)
	./$(BUILD)/test-qlora

# The drop-in promise: qlora.h + qlora.cpp and one plain compiler command, nothing else; qlora.h
# is C99, its implementer part hidden without QL_INTERNALS; its top comment's example builds as C
# and C++ and runs (tests/dropin.sh).
test-dropin:
	CC="$(CC)" CXX="$(CXX)" sh tests/dropin.sh . $(BUILD)/dropin

# The portable SIMD fallback (no -march=native), in its own tree; with clang there, under UBSan
# with float-cast-overflow (GCC's -fsanitize=undefined leaves it out, and the portable path
# converts floats to int). -fno-sanitize=enum: the API-edge tests pass out-of-range ql_type values.
CLANGXX := $(shell command -v clang++ 2>/dev/null)
PORTABLE_SAN   := -O1 -g1 -std=c++17 -pthread -fsanitize=undefined$(comma)float-cast-overflow -fno-sanitize=enum -fno-sanitize-recover=all
PORTABLE_FLAGS := $(if $(CLANGXX),CXX=clang++ CXXFLAGS="$(PORTABLE_SAN)") TEST_OPT=-O0
# (test_ops.cpp's double references: -O1 everywhere; at -O0 they cost more time than it saves)
$(BUILD)/tests/test_ops.o: override TEST_OPT = -O1
# the suite in two halves, run at once under make -j (doctest's --first/--last count the cases
# that run, in file order; the second half has no end, so a new test is always in one). The
# split points halve each build's time as measured with doctest's -d (the slow cases differ; the
# sanitizers' in session 27: 64 and 71 s).
SAN_HALF_1  := --last=181
SAN_HALF_2  := --first=182
PORT_HALF_1 := --last=178
PORT_HALF_2 := --first=179
.PHONY: portable-build portable-half-1 portable-half-2
test-portable: portable-half-1 portable-half-2
portable-build:
	$(if $(CLANGXX),,@echo "test-portable: clang++ not found: the portable build with g++, without float-cast-overflow checks")
	$(MAKE) --no-print-directory BUILD=$(BUILD)/portable PORTABLE=1 $(PORTABLE_FLAGS) $(BUILD)/portable/test-qlora
portable-half-1 portable-half-2: portable-half-%: portable-build $(ROOT_TOOLS)
	UBSAN_OPTIONS=print_stacktrace=1 ./$(BUILD)/portable/test-qlora $(PORT_HALF_$*)

# Sanitizer build in its own tree; same sources, same tests (the shim suite too). -g1: line
# tables only (file:line in every report) - a third less compile time than -g.
SAN := $(BUILD)/san
$(SAN)/%.o: %.cpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(SANFLAGS) -I. -c $< -o $@

# the tests' own sources at -O0 (a quarter of -O1's compile time under the sanitizers), but for
# test_ops.cpp: its double references run 3-4x slower at -O0 than the compile saves
SAN_TESTFLAGS = $(subst -O1,-O0,$(SANFLAGS))
$(SAN)/tests/test_ops.o: SAN_TESTFLAGS = $(SANFLAGS)
$(SAN)/tests/%.o: tests/%.cpp $(HEADERS) $(TEST_HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(SAN_TESTFLAGS) -I. -c $< -o $@

$(SAN)/test-qlora: $(TEST_SRC:%.cpp=$(SAN)/%.o) $(TOOL_LIB_SRC:%.cpp=$(SAN)/%.o) $(LIB_SRC:%.cpp=$(SAN)/%.o)
	$(CXX) $(SANFLAGS) $^ -o $@ $(LDLIBS)

# the tools under the sanitizers too: their error exits must be leak-free (tests/test_tools.cpp's
# "error exits" case runs them, QL_TOOLS=$(SAN)/tools)
$(SAN)/tools/%: $(SAN)/tools/%.o $(TOOL_LIB_SRC:%.cpp=$(SAN)/%.o) $(LIB_SRC:%.cpp=$(SAN)/%.o)
	$(CXX) $(SANFLAGS) $^ -o $@ $(LDLIBS)
SAN_TOOLS := $(ROOT_TOOLS:%=$(SAN)/tools/%)

$(SAN)/shim/cuda_shim_backend.o: tests/cuda_shim_backend.cpp tests/cuda_shim.h $(CUDA_SRC) $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(SANFLAGS) $(SHIM_FLAGS) -I. -c $< -o $@
$(SAN)/shim/%.o: tests/%.cpp tests/cuda_shim.h $(HEADERS) $(TEST_HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(SAN_TESTFLAGS) $(SHIM_FLAGS) -I. -c $< -o $@
$(SAN)/test-cuda-shim: $(SHIM_OBJ:%=$(SAN)/%) $(LIB_SRC:%.cpp=$(SAN)/%.o)
	$(CXX) $(SANFLAGS) $^ -o $@ $(LDLIBS)

# the AMX kernel under the sanitizers: its multiplies only (the emulated tiles are slow there)
$(SAN)/tests/amx_selftest.o: tests/amx_shim.h
$(SAN)/amx/qlora.o: qlora.cpp tests/amx_shim.h $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(SANFLAGS) -DQL_AMX_SHIM -include tests/amx_shim.h -I. -c qlora.cpp -o $@
$(SAN)/test-amx-shim: $(SAN)/amx/qlora.o $(filter-out $(SAN)/qlora.o,$(LIB_SRC:%.cpp=$(SAN)/%.o)) $(AMX_SHIM_TESTS:%.cpp=$(SAN)/%.o)
	$(CXX) $(SANFLAGS) $^ -o $@ $(LDLIBS)

# the suite in two halves, the tools' error exits and the shim suite in four (its cases under
# ASan, measured with doctest's -d, session 16: 1,208 s in all, 223 s the longest): separate
# targets, so that make -j runs them at once; the longest first. The fourth part is every case
# the first three do not name, so a new case always runs.
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
SAN_SHIM_1 := *trainer_cache_weights*,*trainer_chunked_loss*
SAN_SHIM_2 := *flash_attn_fused*,*trainer_fused_loss*,*llama_qlora_step*
SAN_SHIM_3 := cuda graphs:*,census:*,*: flash_attn,*trainer_split_layers*,*trainer_device*
.PHONY: san-half-1 san-half-2 san-tools san-shim-1 san-shim-2 san-shim-3 san-shim-4 san-amx
test-sanitize: $(if $(CUDA_HEADERS),san-shim-1 san-shim-2 san-shim-3 san-shim-4) san-half-1 san-half-2 san-amx san-tools
san-half-1 san-half-2: san-half-%: $(SAN)/test-qlora $(ROOT_TOOLS)
	$(SAN_ENV) ./$(SAN)/test-qlora $(SAN_HALF_$*)
san-tools: $(SAN)/test-qlora $(ROOT_TOOLS) $(SAN_TOOLS)
	QL_TOOLS=$(SAN)/tools ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ./$(SAN)/test-qlora -tc="tools: error exits*"
san-shim-1 san-shim-2 san-shim-3: san-shim-%: $(SAN)/test-cuda-shim
	$(SAN_ENV) ./$(SAN)/test-cuda-shim -tc="$(SAN_SHIM_$*)"
san-shim-4: $(SAN)/test-cuda-shim
	$(SAN_ENV) ./$(SAN)/test-cuda-shim -tce="$(SAN_SHIM_1),$(SAN_SHIM_2),$(SAN_SHIM_3)"
san-amx: $(SAN)/test-amx-shim
	$(SAN_ENV) ./$(SAN)/test-amx-shim -tc="amx shim*,mul_mat*"  # (the training case: too slow under ASan)

bench: tools/bench
	./tools/bench all

bench-finetune: $(TOOLS)
	./bench/finetune.sh

bench-checkpointing: $(TOOLS)
	./bench/checkpointing.sh

bench-gpu: $(TOOLS)
	./bench/gpu.sh

# the checks that need a real GPU (make CUDA=1 test-gpu): the op suite on the device, the demo on
# it, CPU and GPU losses side by side; an error without a device
test-gpu: $(TOOLS) $(BUILD)/test-qlora
	BUILD=$(BUILD) ./tests/gpu-check.sh

bench-optimizers: $(TOOLS)
	./bench/optimizers.sh

bench-infer: $(TOOLS)
	./bench/infer.sh

demo: $(TOOLS)
	./examples/demo.sh

# make fuzz: libFuzzer + ASan/UBSan on the GGUF reader and writer (needs clang).
# FUZZ_RUNS / FUZZ_MAXLEN adjust the run; seeds: small written files plus the fixtures' GGUFs.
FUZZ_CXX    ?= clang++
FUZZ_RUNS   ?= 1000000
FUZZ_MAXLEN ?= 4096
FUZZ        := $(BUILD)/fuzz
$(FUZZ)/fuzz_gguf: tests/fuzz_gguf.cpp $(LIB_SRC) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I. tests/fuzz_gguf.cpp $(LIB_SRC) -o $@ -pthread
$(FUZZ)/fuzz_gguf_seeds: tests/fuzz_gguf_seeds.cpp $(LIB_SRC) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O1 -I. tests/fuzz_gguf_seeds.cpp $(LIB_SRC) -o $@ -pthread
fuzz: $(FUZZ)/fuzz_gguf $(FUZZ)/fuzz_gguf_seeds
	@mkdir -p $(FUZZ)/seeds $(FUZZ)/corpus
	$(FUZZ)/fuzz_gguf_seeds $(FUZZ)/seeds
	-cp -f ../shared/fixtures/tokenizer-vectors/*.gguf $(FUZZ)/seeds/ 2>/dev/null
	$(FUZZ)/fuzz_gguf -runs=$(FUZZ_RUNS) -max_len=$(FUZZ_MAXLEN) -print_final_stats=1 $(FUZZ)/corpus $(FUZZ)/seeds

# make cuda: everything with the CUDA backend (the same as make CUDA=1), or a message without nvcc
cuda:
	@if [ -x "$(NVCC)" ]; then $(MAKE) --no-print-directory CUDA=1 all; \
	 else echo "make cuda: nvcc not found at $(NVCC) (set CUDA_HOME): the CUDA backend is not built"; fi

clean:
	rm -rf $(BUILD) $(TOOLS)
