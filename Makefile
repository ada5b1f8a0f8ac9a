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
#   make demo       QLoRA-fine-tunes a tiny NF4 llama on examples/demo.jsonl and shows what it learned
#   make fuzz       libFuzzer on the GGUF reader (clang; FUZZ_RUNS=1000000 by default)
#   make PORTABLE=1 ...  no -march=native (the portable SIMD fallback)

CXX      ?= g++
CC       ?= gcc
OPT      ?= -O3
ARCH     := $(if $(PORTABLE),,-march=native)
CXXFLAGS ?= $(OPT) $(ARCH) -g -std=c++17 -Wall -Wextra -Wshadow -pthread
SANFLAGS := -O1 -g $(ARCH) -std=c++17 -pthread -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDLIBS   := -pthread -ldl

BUILD    := build
LIB_SRC  := qlora.cpp $(wildcard models/*.cpp)
LIB_OBJ  := $(LIB_SRC:%.cpp=$(BUILD)/%.o)
TEST_SRC := $(wildcard tests/test_*.cpp)
TEST_OBJ := $(TEST_SRC:%.cpp=$(BUILD)/%.o)
# every tools/X.cpp is a binary ./X at the repository root, except the benchmark (tools/bench)
ROOT_TOOLS := $(filter-out bench,$(basename $(notdir $(wildcard tools/*.cpp))))
TOOLS    := tools/bench $(ROOT_TOOLS)
HEADERS  := qlora.h $(wildcard models/*.h models/*.inc)
TEST_HEADERS := $(wildcard tests/*.h)

.PHONY: all test test-unit test-dropin test-sanitize test-portable bench bench-finetune bench-checkpointing bench-optimizers demo clean cuda fuzz
all: $(TOOLS) $(BUILD)/test-qlora

$(BUILD)/%.o: %.cpp $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -I. -c $< -o $@

$(BUILD)/libqlora.a: $(LIB_OBJ)
	ar rcs $@ $^

tools/bench: $(BUILD)/tools/bench.o $(BUILD)/libqlora.a
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

$(ROOT_TOOLS): %: $(BUILD)/tools/%.o $(BUILD)/libqlora.a
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

$(TEST_OBJ): $(TEST_HEADERS)
$(TEST_SRC:%.cpp=$(BUILD)/san/%.o): $(TEST_HEADERS)

$(BUILD)/test-qlora: $(TEST_OBJ) $(BUILD)/libqlora.a
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

test: test-unit test-dropin

test-unit: $(BUILD)/test-qlora $(ROOT_TOOLS)
	./$(BUILD)/test-qlora

# The drop-in promise: qlora.h + qlora.cpp and one plain compiler command, nothing else.
test-dropin:
	@mkdir -p $(BUILD)
	$(CC) -std=c99 -Wall -Wextra -pedantic -fsyntax-only -x c qlora.h
	$(CXX) -std=c++17 -O2 -pthread examples/simple.cpp qlora.cpp -o $(BUILD)/simple
	./$(BUILD)/simple

# The portable SIMD fallback (no -march=native), in its own tree.
test-portable:
	$(MAKE) --no-print-directory BUILD=$(BUILD)/portable PORTABLE=1 $(BUILD)/portable/test-qlora
	./$(BUILD)/portable/test-qlora

# Sanitizer build in its own tree; same sources, same tests.
SAN := $(BUILD)/san
$(SAN)/%.o: %.cpp $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(SANFLAGS) -I. -c $< -o $@

$(SAN)/test-qlora: $(TEST_SRC:%.cpp=$(SAN)/%.o) $(LIB_SRC:%.cpp=$(SAN)/%.o)
	$(CXX) $(SANFLAGS) $^ -o $@ $(LDLIBS)

test-sanitize: $(SAN)/test-qlora $(ROOT_TOOLS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 ./$(SAN)/test-qlora

bench: tools/bench
	./tools/bench all

bench-finetune: $(TOOLS)
	./bench/finetune.sh

bench-checkpointing: $(TOOLS)
	./bench/checkpointing.sh

bench-optimizers: $(TOOLS)
	./bench/optimizers.sh

demo: $(TOOLS)
	./examples/demo.sh

# make fuzz: libFuzzer + ASan/UBSan on the GGUF reader and writer (needs clang).
# FUZZ_RUNS / FUZZ_MAXLEN adjust the run; seeds: small written files plus the fixtures' GGUFs.
FUZZ_CXX    ?= clang++
FUZZ_RUNS   ?= 1000000
FUZZ_MAXLEN ?= 4096
FUZZ        := $(BUILD)/fuzz
$(FUZZ)/fuzz_gguf: tests/fuzz_gguf.cpp $(LIB_SRC) $(HEADERS)
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz_gguf.cpp $(LIB_SRC) -o $@ -pthread
$(FUZZ)/fuzz_gguf_seeds: tests/fuzz_gguf_seeds.cpp $(LIB_SRC) $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O1 -I. tests/fuzz_gguf_seeds.cpp $(LIB_SRC) -o $@ -pthread
fuzz: $(FUZZ)/fuzz_gguf $(FUZZ)/fuzz_gguf_seeds
	@mkdir -p $(FUZZ)/seeds $(FUZZ)/corpus
	$(FUZZ)/fuzz_gguf_seeds $(FUZZ)/seeds
	-cp -f ../shared/fixtures/tokenizer-vectors/*.gguf $(FUZZ)/seeds/ 2>/dev/null
	$(FUZZ)/fuzz_gguf -runs=$(FUZZ_RUNS) -max_len=$(FUZZ_MAXLEN) -print_final_stats=1 $(FUZZ)/corpus $(FUZZ)/seeds

# CUDA: the backend file does not exist yet; say so instead of failing obscurely.
cuda:
	@if [ ! -f qlora-cuda.cu ]; then echo "make cuda: qlora-cuda.cu is not written yet (see README, status)"; exit 1; fi
	@command -v nvcc >/dev/null || { echo "make cuda: nvcc not found, skipping the CUDA backend"; exit 0; }

clean:
	rm -rf $(BUILD) $(TOOLS)
