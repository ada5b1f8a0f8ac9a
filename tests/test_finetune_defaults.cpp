// ./finetune's defaults and edges as a user meets them (issue 34, items 5 and 7): --precision auto
// by default, sizes with units, --cc as MAJOR.MINOR, a device plan without --vram, advice that
// combines changes, plain messages; --resume without a checkpoint, a changed --lr on resume, the
// steps a resumed run reports, --overwrite's snapshot, an empty text, the first Ctrl-C.
// (The binaries must be built: `make` does. Tiny models, a few steps each.)
#include "../models/trainer.h"
#include "../qlora.h"
#include "tiny.h"
#include "util.h"

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

// prompt/completion pairs (the answer spells the question backwards)
void write_qa(const std::string &path, int n) {
    std::string s;
    for (int i = 0; i < n; i++) {
        std::string w;
        for (int k = 0; k < 3 + i % 4; k++) w += (char)('a' + (i * 7 + k * 3) % 26);
        s += "{\"prompt\": \"Q: " + w + "\\nA:\", \"completion\": \" " + std::string(w.rbegin(), w.rend()) + ".\"}\n";
    }
    write_file(path, s);
}

// the "total" of the plan that cmd (a finetune --json run) prints
double plan_total(const std::string &cmd) {
    std::string out;
    REQUIRE_MESSAGE(run(cmd, &out) == 0, out);
    const size_t p = out.find("\"total\": ");
    REQUIRE(p != std::string::npos);
    return atof(out.c_str() + p + 9);
}

// a tiny model and data in d: ./finetune -m M -d D (without -o), on the CPU (a later --device wins)
std::string tiny_run(const tmpdir &d, const char *model_flags = "--dim 32 --layers 1 --heads 2 --ff 48") {
    const std::string m = d.file("m.gguf"), data = d.file("qa.jsonl");
    std::string log;
    REQUIRE_MESSAGE(run(std::string("./make-model -o ") + m + " " + model_flags, &log) == 0, log);
    write_qa(data, 8);
    return "./finetune -m " + m + " -d " + data + " -t 1 --seq-len 32 -b 2 --device cpu";
}


// the line of log that starts with prefix ("" when none)
std::string line_of(const std::string &log, const std::string &prefix) {
    const size_t p = log.find(prefix);
    if (p == std::string::npos) return "";
    return log.substr(p, log.find('\n', p) - p);
}

}  // namespace

// ---- item 5: defaults that fit ----

TEST_CASE("finetune defaults: --precision auto unless asked, said in one line, stored as chosen; an older run's fp32 kept" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = tiny_run(d);
    std::string log, log_auto;
    REQUIRE_MESSAGE(run(ft + " --max-steps 2 -o " + d.file("a"), &log) == 0, log);
    REQUIRE_MESSAGE(run(ft + " --max-steps 2 -o " + d.file("b") + " --precision auto", &log_auto) == 0, log_auto);
    // the same choice, with the reason, as an explicit --precision auto: bf16 on AMX/AVX512-BF16, else fp32
    const std::string line = line_of(log, "finetune: precision ");
    CHECK_MESSAGE(has(line, " (auto: this CPU "), log);
    CHECK(line == line_of(log_auto, "finetune: precision "));
    // (which one is the tool's build and CPU's: make test-portable runs a portable test binary
    // against natively built tools)
    const std::string chosen = line.rfind("finetune: precision bf16 (auto: ", 0) == 0 ? "bf16" : "fp32";
    CHECK_MESSAGE(line.rfind("finetune: precision " + chosen + " (auto: ", 0) == 0, line);
    // a dry run says it too
    REQUIRE_MESSAGE(run(ft + " --dry-run -o " + d.file("c"), &log) == 0, log);
    CHECK_MESSAGE(line_of(log, "finetune: precision ") == line, log);
    // the checkpoint stores what auto chose: a resume on another machine keeps it
    std::vector<std::string> cmd;
    int64_t step = 0, total = 0;
    std::string e;
    REQUIRE_MESSAGE(ql_checkpoint_info(d.file("a/checkpoint.gguf").c_str(), &cmd, &step, &total, &e), e);
    const auto p = std::find(cmd.begin(), cmd.end(), "--precision");
    REQUIRE(p != cmd.end());
    REQUIRE(p + 1 != cmd.end());
    CHECK(p[1] == chosen);
    CHECK(std::count(cmd.begin(), cmd.end(), "--precision") == 1);

    // a checkpoint from before auto was the default stored no --precision: it was fp32, and resumes so
    REQUIRE_MESSAGE(run(ft + " --max-steps 2 -o " + d.file("old") + " --precision fp32", &log) == 0, log);
    REQUIRE_MESSAGE(ql_checkpoint_info(d.file("old/checkpoint.gguf").c_str(), &cmd, &step, &total, &e), e);
    std::vector<std::string> old;
    for (size_t i = 0; i < cmd.size(); i++) {
        if (cmd[i] == "--precision") {
            i++;
            continue;
        }
        old.push_back(cmd[i]);
    }
    std::vector<const char *> ov;
    for (const std::string &x : old) ov.push_back(x.c_str());
    rewrite_gguf(d.file("old/checkpoint.gguf"), d.file("old/checkpoint.tmp"),
                 [&](ql_gguf_writer *w) { ql_gguf_set_arr_str(w, "qlora.run.command", ov.data(), ov.size()); });
    REQUIRE(rename(d.file("old/checkpoint.tmp").c_str(), d.file("old/checkpoint.gguf").c_str()) == 0);
    REQUIRE_MESSAGE(run("./finetune --resume " + d.file("old") + " --max-steps 3", &log) == 0, log);
    CHECK_MESSAGE(has(log, "finetune: precision fp32\n"), log);
}

TEST_CASE("finetune defaults: --vram and --mem-limit need a unit; --cc is MAJOR.MINOR, 7.5 to 12.0" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = tiny_run(d) + " --dry-run -o " + d.file("o");
    std::string log;
    struct bad_case {
        std::string args, says;
    };
    const std::vector<bad_case> bad = {
        {" --device cuda --vram 8", "--vram: '8' has no unit: K, M, G or T (powers of 1024), or B for bytes"},
        {" --mem-limit 6442450944", "--mem-limit: '6442450944' has no unit"},
        {" --mem-limit 6X", "--mem-limit: '6X' is not a size"},
        {" --device cuda --vram 8G --cc 8.65", "--cc: '8.65' is not a compute capability: MAJOR.MINOR with one digit after the point (7.5 to 12.0"},
        {" --device cuda --vram 8G --cc 8.", "--cc: '8.' is not a compute capability: MAJOR.MINOR"},
        {" --device cuda --vram 8G --cc 12.1", "--cc: '12.1' is not a compute capability qlora runs on (7.5 to 12.0"},
        {" --device cuda --vram 8G --cc 7.0", "--cc: '7.0' is not a compute capability qlora runs on"},
        {" --seq-len 1", "--seq-len: '1' is not a number in [2, 1048576]"},  // whole numbers in full, not 1.04858e+06
        {" --loss-chunk x", "--loss-chunk: 'x' is not a number in [-1, 1073741824]"},
    };
    for (const bad_case &c : bad) {
        CAPTURE(c.args);
        CHECK(run(ft + c.args, &log) == 2);
        CHECK_MESSAGE(has(log, c.says), log);
        CHECK_MESSAGE(std::count(log.begin(), log.end(), '\n') == 1, log);
        CHECK(!has(log, "e+0"));
    }
    REQUIRE_MESSAGE(run(ft + " --mem-limit 64M", &log) == 0, log);
    CHECK_MESSAGE(has(log, "limit 64.0: fits"), log);
    REQUIRE_MESSAGE(run(ft + " --mem-limit 67108864B", &log) == 0, log);  // bytes, said so
    CHECK_MESSAGE(has(log, "limit 64.0: fits"), log);
    if (ql_cuda_device_count() > 0) return;  // the rest plans for cards that are not here
    // Blackwell's 10.0 and 12.0 plan (with the newest rules known: Hopper's); "86" is 8.6
    for (const char *cc : {"10.0", "12.0", "86"}) {
        CAPTURE(cc);
        REQUIRE_MESSAGE(run(ft + " --device cuda --vram 8G --cc " + cc, &log) == 0, log);
        const std::string want = std::string(cc) == "86" ? "8.6" : cc;
        CHECK_MESSAGE(has(log, "compute capability " + want), log);
        CHECK(has(log, "total device memory"));
        CHECK(has(log, "of 8192.0: fits"));
    }
}

TEST_CASE("finetune defaults: a device plan without the GPU and without --vram: the plan, then why there is no verdict" * needs_tools("make-model finetune") *
          skip_unless(ql_cuda_device_count() == 0, "with a CUDA device (its free memory is the limit; the case is about a machine without one)")) {
    tmpdir d;
    const std::string ft = tiny_run(d) + " --dry-run --device cuda -o " + d.file("o");
    std::string log;
    REQUIRE_MESSAGE(run(ft, &log) == 0, log);
    CHECK_MESSAGE(has(log, "planning for one with memory unknown (no --vram), compute capability 8.0 (no --cc: assumed)"), log);
    CHECK(!has(log, "0.0 GiB"));
    CHECK(has(log, "total device memory"));
    CHECK(has(log, "finetune: no verdict: without the GPU the plan needs --vram SIZE"));
    CHECK(log.find("total device memory") < log.find("no verdict"));
    REQUIRE_MESSAGE(run(ft + " --cc 7.5", &log) == 0, log);
    CHECK(has(log, "no verdict"));
    // with --vram: a verdict, no such line
    REQUIRE_MESSAGE(run(ft + " --vram 4G", &log) == 0, log);
    CHECK(has(log, "of 4096.0: fits"));
    CHECK(!has(log, "no verdict"));
    // -b auto and --checkpointing auto have nothing to fit: refused with the hint, one line
    for (const char *f : {" -b auto", " --checkpointing auto"}) {
        CHECK(run(ft + f, &log) == 2);
        CHECK_MESSAGE(has(log, "needs --vram SIZE: without the GPU there is no memory to fit"), log);
        CHECK(std::count(log.begin(), log.end(), '\n') == 1);
    }
}

TEST_CASE("finetune defaults: when no single change fits, the advice gives the cheapest combination that does" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string m = d.file("m.gguf"), data = d.file("qa.jsonl");
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 192 --layers 4 --heads 4 --ff 512 --seed 1", &log) == 0);
    write_qa(data, 16);
    const std::string ft = "./finetune -m " + m + " -d " + data + " -o " + d.file("o") +
                           " --seq-len 256 -t 1 --no-dynamic-padding --precision fp32 --device cpu --dry-run --json";
    auto total = [&](const std::string &flags) { return plan_total(ft + flags); };
    // -b 4: each of block checkpointing and -b 1 alone is over a limit that both together meet
    const double both = total(" -b 1 --grad-accum 4 --checkpointing block"), block = total(" -b 4 --checkpointing block"),
                 b1 = total(" -b 1 --grad-accum 4"), b2 = total(" -b 2 --grad-accum 2 --checkpointing block");
    REQUIRE(both + 2 * 1048576.0 < std::min(block, b1));
    REQUIRE(both + 2 * 1048576.0 < b2);
    const std::string limit = std::to_string((long long)(both + 1048576.0)) + "B";
    const std::string plain = ft.substr(0, ft.size() - strlen(" --json"));
    CHECK(run(plain + " -b 4 --mem-limit " + limit, &log) == 1);
    CHECK_MESSAGE(has(log, "what would help most"), log);
    const std::string combo = line_of(log, "  --checkpointing block + -b 1 --grad-accum 4");
    CHECK_MESSAGE(has(combo, "fits (together; no single change does)"), log);
    CHECK(log.find("-b 1 --grad-accum 4 (the same effective batch)") < log.find(combo));
    // with room for -b 2: the largest micro-batch that fits with the rest
    const std::string roomy = std::to_string((long long)(b2 + 1048576.0)) + "B";
    if (b2 + 2 * 1048576.0 < std::min(block, b1)) {
        CHECK(run(plain + " -b 4 --mem-limit " + roomy, &log) == 1);
        CHECK_MESSAGE(has(line_of(log, "  --checkpointing block + -b 2 --grad-accum 2"), "fits (together"), log);
    }
    // nothing fits even together: said so, no combination claimed
    CHECK(run(plain + " -b 4 --mem-limit 4M", &log) == 1);
    CHECK_MESSAGE(has(log, "(all of them together: still over the limit)"), log);
    CHECK(!has(log, "fits (together"));
}

TEST_CASE("finetune defaults: library messages reach the user without the library's file:line" * needs_tools("make-model finetune")) {
    CHECK(ql_user_message("qlora.cpp:3284: backend cpu could not allocate 58474752 bytes") ==
          "backend cpu could not allocate 58474752 bytes");
    CHECK(ql_user_message("placing the model on cuda: qlora-cuda.cu:12: out of memory") == "placing the model on cuda: out of memory");
    CHECK(ql_user_message("data.jsonl:3: empty \"text\"") == "data.jsonl:3: empty \"text\"");  // a user's file, kept
    CHECK(ql_user_message("step 3: a.cpp is fine") == "step 3: a.cpp is fine");
    setenv("QLORA_DEBUG", "1", 1);
    CHECK(ql_user_message("qlora.cpp:3284: x") == "qlora.cpp:3284: x");  // kept for a bug report
    unsetenv("QLORA_DEBUG");
    // as the tool prints it: a planned buffer the process cannot get (address space capped)
    tmpdir d;
    const std::string m = d.file("m.gguf"), data = d.file("qa.jsonl");
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 192 --layers 4 --heads 4 --ff 512 --seed 1", &log) == 0);
    write_qa(data, 16);
    const int rc = run("ulimit -v 60000; ./finetune -m " + m + " -d " + data + " -o " + d.file("o") +
                           " --seq-len 256 -t 1 --no-dynamic-padding --precision fp32 --device cpu -b 4 --max-steps 1", &log);
    if (rc == 1 && has(log, "could not allocate")) {
        CHECK_MESSAGE(has(log, "finetune: backend cpu could not allocate "), log);
        CHECK(!has(log, ".cpp:"));
        CHECK(!has(log, "limit 0.0 MiB"));  // no limit was given: none printed
    } else {
        MESSAGE("the capped run did not fail on its buffer (rc ", rc, "): the tool's line unchecked here");
    }
}

// ---- item 7: finetune's edges ----

TEST_CASE("finetune edges: --resume where there is no checkpoint says what is there instead" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = tiny_run(d);
    std::string log;
    CHECK(run("./finetune --resume " + d.file("none"), &log) == 2);
    CHECK_MESSAGE(has(log, "finetune: --resume " + d.file("none") + ": no such directory"), log);
    REQUIRE(mkdir(d.file("empty").c_str(), 0755) == 0);
    CHECK(run("./finetune --resume " + d.file("empty"), &log) == 2);
    CHECK_MESSAGE(has(log, d.file("empty") + ": no checkpoint.gguf there: no finetune run has written to it"), log);
    CHECK(run(ft + " --resume " + d.file("empty"), &log) == 2);  // the run's flags given again: the same
    CHECK_MESSAGE(has(log, "no finetune run has written to it"), log);
    CHECK(!has(log, "cannot open"));
    // a run still going (its lock held: here by this process), before its first save
    REQUIRE(mkdir(d.file("running").c_str(), 0755) == 0);
    const int fd = open(d.file("running/.lock").c_str(), O_RDWR | O_CREAT, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(flock(fd, LOCK_EX | LOCK_NB) == 0);
    const std::string pid = std::to_string((long long)getpid());
    REQUIRE(write(fd, (pid + "\n").data(), pid.size() + 1) == (ssize_t)pid.size() + 1);
    CHECK(run("./finetune --resume " + d.file("running"), &log) == 2);
    CHECK_MESSAGE(has(log, "no checkpoint yet: the run there (pid " + pid + ") is still running and has not reached its first save"), log);
    close(fd);  // ... and one that ended before it
    CHECK(run("./finetune --resume " + d.file("running"), &log) == 2);
    CHECK_MESSAGE(has(log, "no checkpoint: the run there (pid " + pid + ") ended before its first save"), log);
    CHECK(std::count(log.begin(), log.end(), '\n') == 1);
}

TEST_CASE("finetune edges: a resumed run - a changed --lr named by its flag in plain numbers; the steps it ran" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = tiny_run(d), out = d.file("r");
    std::string log;
    REQUIRE_MESSAGE(run(ft + " --max-steps 2 -o " + out, &log) == 0, log);
    CHECK_MESSAGE(has(log, "finetune: done: 2 steps in "), log);  // a fresh run: as before
    // --lr was the default (not in the run's command): the checkpoint's setting, by the flag
    CHECK(run("./finetune --resume " + out + " --lr 3e-4 --max-steps 4", &log) == 1);
    CHECK_MESSAGE(has(log, "another run: --lr was 0.0002, now 0.0003"), log);
    CHECK(!has(log, "0.000199999995"));
    CHECK(!has(log, "learning rate was"));
    // 3 more steps: this run's 3, and where the run now is
    REQUIRE_MESSAGE(run("./finetune --resume " + out + " --max-steps 5", &log) == 0, log);
    CHECK_MESSAGE(has(log, "finetune: done: 3 steps this run (resumed after step 2; now step 5 of 5) in "), log);
}

TEST_CASE("finetune edges: --overwrite of a run whose plan does not fit writes no snapshot beside the old run" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = tiny_run(d, "--dim 64 --layers 2 --heads 2 --ff 96"), out = d.file("r");
    std::string log;
    REQUIRE_MESSAGE(run(ft + " --max-steps 1 -o " + out, &log) == 0, log);
    const std::string ck = read_file(out + "/checkpoint.gguf");
    CHECK(run(ft + " --max-steps 1 -o " + out + " --overwrite --mem-limit 2M", &log) == 1);
    CHECK_MESSAGE(has(log, "does not fit"), log);
    CHECK_MESSAGE(has(log, "finetune: no memory snapshot: " + out + " holds an earlier run's checkpoint.gguf"), log);
    CHECK(!exists(out + "/memory-snapshot.json"));
    CHECK(read_file(out + "/checkpoint.gguf") == ck);  // the earlier run untouched
    // a directory of its own gets it
    CHECK(run(ft + " --max-steps 1 -o " + d.file("fresh") + " --mem-limit 2M", &log) == 1);
    CHECK_MESSAGE(exists(d.file("fresh/memory-snapshot.json")), log);
}

TEST_CASE("finetune edges: an empty text is refused by file and line, as an empty completion is" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = tiny_run(d), bad = d.file("t.jsonl");
    write_file(bad, "{\"text\": \"a story\"}\n{\"text\": \"\"}\n");
    const std::string cmd = ft.substr(0, ft.find(" -d ")) + " -d " + bad + ft.substr(ft.find(" -t ")) + " --max-steps 1 -o " + d.file("o");
    std::string log;
    CHECK(run(cmd, &log) == 1);
    CHECK_MESSAGE(has(log, "finetune: " + bad + ":2: empty \"text\": nothing to learn"), log);
    CHECK(!exists(d.file("o")));
    REQUIRE_MESSAGE(run(cmd + " --skip-bad-lines", &log) == 0, log);
    CHECK_MESSAGE(has(log, "skipped 1 bad line of " + bad), log);
}

TEST_CASE("finetune edges: the first Ctrl-C says at once that the run stops after this step" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = tiny_run(d);
    std::string log;
    const int rc = run_interrupted(ft + " --max-steps 100000 -o " + d.file("r"), "step 1/", &log);
    CHECK_MESSAGE(rc == 130, log);
    const size_t said = log.find("finetune: stopping after this step; a checkpoint will be saved (Ctrl-C again kills)");
    REQUIRE_MESSAGE(said != std::string::npos, log);
    CHECK(said < log.find("interrupted (SIGINT) after step "));
    // SIGTERM: the same, without the Ctrl-C advice
    CHECK(run_interrupted(ft + " --max-steps 100000 -o " + d.file("t"), "step 1/", &log, SIGTERM) == 143);
    CHECK_MESSAGE(has(log, "finetune: stopping after this step; a checkpoint will be saved\n"), log);
}

// ---- issue 30 item 1: the tool decides the memory when it knows the limit ----

namespace {
// a model whose activations dominate (dim 192, 4 layers, 256 tokens, b 4: 70 MiB without
// recompute, under 40 with it) and its command on the CPU
std::string big_run(const tmpdir &d) {
    const std::string m = d.file("m.gguf"), data = d.file("qa.jsonl");
    std::string log;
    REQUIRE_MESSAGE(run("./make-model -o " + m + " --dim 192 --layers 4 --heads 4 --ff 512 --seed 1", &log) == 0, log);
    write_qa(data, 16);
    return "./finetune -m " + m + " -d " + data + " --seq-len 256 -t 1 --no-dynamic-padding --precision fp32 --device cpu -b 4";
}
}  // namespace

TEST_CASE("finetune memory auto: the default under --mem-limit - recompute only when nothing less fits, the flag wins" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string ft = big_run(d);
    std::string log;
    // no limit: none, as always, and no line
    REQUIRE_MESSAGE(run(ft + " --dry-run -o " + d.file("o"), &log) == 0, log);
    CHECK_MESSAGE(has(log, "  checkpointing: none\n"), log);
    CHECK(!has(log, "finetune: memory:"));
    // a generous limit: no recompute, said in one line; the dry run's table has the alternatives
    REQUIRE_MESSAGE(run(ft + " --dry-run --mem-limit 1G -o " + d.file("o"), &log) == 0, log);
    CHECK_MESSAGE(has(log, "finetune: memory: checkpointing auto -> no recompute: "), log);
    CHECK(has(log, " of the 1.0 GiB limit\n"));
    CHECK(has(log, "  checkpointing: none\n"));
    CHECK(has(log, "finetune: memory: the alternatives, in the order auto tries them"));
    CHECK(has(line_of(log, "  no recompute "), "fits           x1.00   <- chosen"));
    CHECK(has(line_of(log, "  recompute (none needed)"), "fits"));
    // a limit that no recompute does not meet: auto recomputes, the run fits and trains
    REQUIRE_MESSAGE(run(ft + " --max-steps 1 --mem-limit 45M -o " + d.file("r"), &log) == 0, log);
    const std::string line = line_of(log, "finetune: memory: checkpointing auto -> ");
    CHECK_MESSAGE(has(line, "-> recompute ("), log);
    CHECK(has(line, " of the 45.0 MiB limit (no recompute needs "));
    CHECK(has(line, "; step time about x1."));
    CHECK(has(log, "checkpointing: auto: "));
    CHECK(has(log, "finetune: done: 1 steps"));
    const size_t p = log.find("peak memory of training: ");
    REQUIRE(p != std::string::npos);
    CHECK(atof(log.c_str() + p + 25) <= 45.0);
    // the flag wins: --checkpointing none with that limit is refused as before, no ladder
    CHECK(run(ft + " --max-steps 1 --mem-limit 45M --checkpointing none -o " + d.file("n"), &log) == 1);
    CHECK_MESSAGE(has(log, "finetune: does not fit: needs "), log);
    CHECK(!has(log, "finetune: memory:"));
    // nothing fits: the steps tried, then the plan as asked and the advice
    CHECK(run(ft + " --dry-run --mem-limit 20M -o " + d.file("o"), &log) == 1);
    CHECK_MESSAGE(has(log, "finetune: memory: checkpointing auto: nothing fits the limit of 20.0 MiB (no recompute "), log);
    CHECK(has(log, "what would help most"));
}

TEST_CASE("finetune memory auto: a device plan - block recompute when none does not fit, checkpoint offload when block does not" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string m = d.file("g.gguf"), data = d.file("qa.jsonl");
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 256 --layers 4 --heads 4 --ff 512 --vocab 4000 --type nf4", &log) == 0);
    write_qa(data, 16);
    // (the loss's chunk pinned: auto's would change with the budget - the fused loss's 2^26 logits
    // where they fit - and move the thresholds this ladder is measured against)
    const std::string ft = "./finetune -m " + m + " -d " + data + " -o " + d.file("o") +
                           " --seq-len 512 -b 8 --no-dynamic-padding --device cuda --cc 8.6 --dry-run --loss-chunk 2048";
    // (without the weights' copies: auto adds them only where they fit, after the choices tested here)
    auto total = [&](const std::string &flags) { return (long long)plan_total(ft + " --vram 8G --json --cache-weights off" + flags); };
    const long long none = total(" --checkpointing none"), block = total(" --checkpointing block");
    REQUIRE(block + (4 << 20) < none);
    // the card holds block's plan, not none's: recompute
    REQUIRE_MESSAGE(run(ft + " --vram " + std::to_string(block) + "B", &log) == 0, log);
    std::string line = line_of(log, "finetune: memory: checkpointing auto -> ");
    CHECK_MESSAGE(has(line, "-> recompute ("), log);
    CHECK(has(line, " of device memory limit (no recompute needs "));
    CHECK(has(line_of(log, "  no recompute "), "does NOT fit"));
    // 1 MiB less: recompute alone does not fit, its checkpoints in pinned host memory do
    REQUIRE_MESSAGE(run(ft + " --vram " + std::to_string(block - (1 << 20)) + "B", &log) == 0, log);
    line = line_of(log, "finetune: memory: checkpointing auto -> ");
    CHECK_MESSAGE(has(line, "-> + checkpoint offload: "), log);
    CHECK(has(line, "(recompute (block) needs "));
    CHECK(has(line, "; pinned host "));
    CHECK(has(line, " available less a "));
    CHECK(has(line_of(log, "  + checkpoint offload "), "<- chosen"));
    CHECK(has(log, "offloaded: "));  // the plan printed is the chosen one
    // a flag pins its step: with --checkpointing block given, the ladder starts from block
    REQUIRE_MESSAGE(run(ft + " --vram " + std::to_string(block) + "B --checkpointing block", &log) == 0, log);
    CHECK_MESSAGE(has(log, "finetune: memory: checkpointing auto -> --checkpointing block: "), log);
}

TEST_CASE("finetune memory auto: on a device, checkpoint offload with the feed-forward whole before recompute with it in chunks" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string m = d.file("g.gguf"), data = d.file("qa.jsonl");
    std::string log;
    // (ffn 4096 at 4096 tokens: 2^24 elements an intermediate, over the 2^23 auto chunks at)
    REQUIRE(run("./make-model -o " + m + " --dim 256 --layers 4 --heads 4 --ff 4096 --vocab 4000 --type nf4 --ctx 8192", &log) == 0);
    write_qa(data, 4);
    const std::string ft = "./finetune -m " + m + " -d " + data + " -o " + d.file("o") +
                           " --seq-len 4096 -b 1 --no-dynamic-padding --device cuda --cc 8.6 --dry-run --loss-chunk 2048 --cache-weights off";
    auto total = [&](const std::string &flags) { return (long long)plan_total(ft + " --json" + flags); };
    // a limit under block recompute's plan with the feed-forward whole (8G: the first step fits)
    const std::string vram = " --vram " + std::to_string(total(" --vram 8G --checkpointing block --ffn-chunk -1") - (12 << 20)) + "B";
    // auto: the checkpoints offloaded, the feed-forward whole (chunks cost more than the copies)
    REQUIRE_MESSAGE(run(ft + vram + " --host-mem 64G", &log) == 0, log);
    std::string line = line_of(log, "finetune: memory: checkpointing auto -> ");
    CHECK_MESSAGE(has(line, "-> + checkpoint offload: "), log);
    CHECK(has(line, "(recompute (block) needs "));
    CHECK(!has(log, "\n  feed-forward: in chunks"));
    CHECK(has(line_of(log, "  recompute (block) "), "does NOT fit"));
    CHECK(has(line_of(log, ", feed-forward in chunks "), " fits "));  // (the second pass, planned for the table)
    // no pinned memory on the host: recompute with the feed-forward in chunks, as before
    REQUIRE_MESSAGE(run(ft + vram + " --host-mem 1G", &log) == 0, log);
    line = line_of(log, "finetune: memory: checkpointing auto -> ");
    CHECK_MESSAGE(has(line, "-> recompute ("), log);
    CHECK_MESSAGE(has(line, "), feed-forward in chunks: "), log);
    CHECK(has(line, "more with the feed-forward's chunks"));
    CHECK(has(log, "\n  feed-forward: in chunks of "));
    // --ffn-chunk given: one pass, the flag's
    REQUIRE_MESSAGE(run(ft + vram + " --host-mem 1G --ffn-chunk 1024", &log) == 0, log);
    CHECK_MESSAGE(has(log, "\n  feed-forward: in chunks of 1024 tokens"), log);
    CHECK(!has(log, ", feed-forward in chunks"));
}

TEST_CASE("finetune memory auto: the last step, adapter dropout inside A's multiply over 16-bit x; pinned by its flag" * needs_tools("make-model finetune")) {
    tmpdir d;
    const std::string m = d.file("g.gguf"), data = d.file("qa.jsonl");
    std::string log;
    REQUIRE(run("./make-model -o " + m + " --dim 256 --layers 4 --heads 4 --ff 512 --vocab 4000 --type nf4", &log) == 0);
    write_qa(data, 16);
    // (a small loss chunk: attention's backward, not the logits, is the peak this step lowers)
    const std::string ft = "./finetune -m " + m + " -d " + data + " -o " + d.file("o") +
                           " --seq-len 512 -b 8 --no-dynamic-padding --device cuda --cc 8.6 --dry-run --loss-chunk 128 --lora-targets all"
                           " --cache-weights off --checkpointing block";
    const std::string rest = " --offload-late --embd-on-host --optim paged_adamw8bit";
    auto total = [&](const std::string &flags) { return (long long)plan_total(ft + " --vram 8G --json" + flags); };
    const long long late = total(rest), x16 = total(rest + " --lora-dropout-fused 16");
    REQUIRE_MESSAGE(x16 + (4 << 20) < late, x16 << " " << late);
    const long long on = total(rest + " --lora-dropout-fused on");  // over f32 x: f32 x kept, not the copies
    CHECK(on <= late);
    CHECK(x16 + (2 << 20) < on);
    // a card that holds x16's plan and not late's: auto's last step (1 MiB over x16's total: under
    // this limit attention's chunks may be smaller, and the CUDA graph's executable, 86 B a launch,
    // a little larger than under 8G's)
    REQUIRE_MESSAGE(run(ft + " --vram " + std::to_string(x16 + (1 << 20)) + "B", &log) == 0, log);
    std::string line = line_of(log, "finetune: memory: checkpointing auto -> ");
    CHECK_MESSAGE(has(line, "-> + dropout inside A's multiply (16-bit x): "), log);
    CHECK(has(line, "(+ gradients parked on the host needs "));  // (the step before: at this shape no lower than late's)
    CHECK(has(line_of(log, "  + checkpoints back late "), "does NOT fit"));
    CHECK(has(line_of(log, "  + gradients parked on the host "), "does NOT fit"));
    CHECK(has(log, "\n  adapter dropout: in A's multiply, over x's 16-bit copy\n"));  // the plan printed is the chosen one
    std::string js;
    REQUIRE(run(ft + " --vram 8G --json", &js) == 0);
    CHECK_MESSAGE(has(js, "\"lora_dropout\": \"copies\""), js);  // a device's auto when memory allows
    // the flag pins it: off (or f32 compute) leaves the step out, and nothing fits; without
    // dropout there is no step either (nothing is dropped out)
    for (const char *pin : {" --lora-dropout-fused off", " --precision fp32"}) {
        CHECK(run(ft + " --vram " + std::to_string(x16) + "B" + pin, &log) == 1);
        CHECK_MESSAGE(has(log, "finetune: memory: checkpointing auto: nothing fits"), pin, log);
        CHECK(!has(log, "dropout inside A's multiply"));
    }
    run(ft + " --vram " + std::to_string(x16) + "B --lora-dropout 0", &log);
    CHECK_MESSAGE(has(log, "finetune: memory: "), log);
    CHECK(!has(log, "dropout inside A's multiply"));
    // a value it does not know: one line naming the flag and the choices
    CHECK(run(ft + " --lora-dropout-fused 8", &log) == 2);
    CHECK_MESSAGE(has(log, "finetune: --lora-dropout-fused: '8' is not one of auto, off, on, 16"), log);
}

// A grouped-heads model (4 layers, dim 256, 8/2 heads) and one text of 12,000 words, planned at 8k
// tokens: a block's attention backward is the backward's peak, with the residual gradient (f32
// [E, T]) waiting across it
static void long_gqa_model(tmpdir &d, std::string *m, std::string *data) {
    std::string log;
    *m = d.file("g.gguf");
    *data = d.file("long.jsonl");
    REQUIRE(run("./make-model -o " + *m + " --dim 256 --layers 4 --heads 8 --kv-heads 2 --ff 768 --vocab 4000 --type nf4 --zero", &log) == 0);
    std::ofstream f(*data);
    f << "{\"text\": \"";
    for (int i = 0; i < 12000; i++) f << "word" << i % 500 << ' ';
    f << "\"}\n";
}

TEST_CASE("finetune memory auto: gradients parked on the host across attention's backward (--offload-grads)" * needs_tools("make-model finetune")) {
    tmpdir d;
    std::string m, data, log;
    long_gqa_model(d, &m, &data);
    const std::string ft = "./finetune -m " + m + " -d " + data + " -o " + d.file("o") +
                           " --seq-len 8192 -b 1 --device cuda --cc 8.6 --dry-run --lora-targets all --cache-weights off --checkpointing block"
                           " --embd-on-host --optim paged_adamw8bit --ffn-chunk 512 --loss-chunk 256 --lora-dropout-fused 16"
                           " --attn-score-mib 32";  // (pinned: auto's budget grows with the card's room and moves the totals)
    auto plan = [&](const std::string &flags, long long *parked) {
        std::string out;
        REQUIRE_MESSAGE(run(ft + " --vram 8G --json" + flags, &out) == 0, out);
        const size_t p = out.find("\"total\": "), q = out.find("\"parked\": ");
        REQUIRE(p != std::string::npos);
        REQUIRE(q != std::string::npos);
        *parked = (long long)atof(out.c_str() + q + 10);
        return (long long)atof(out.c_str() + p + 9);
    };
    long long parked_late = -1, parked = -1;
    const long long late = plan(" --offload-late", &parked_late), grads = plan(" --offload-grads", &parked);
    CHECK(parked_late == 0);
    CHECK(parked >= 8192LL * 256 * 4);  // the residual gradient at least
    REQUIRE_MESSAGE(grads + (4 << 20) < late, grads << " " << late);
    // a card that holds it and not late's: the step after late
    REQUIRE_MESSAGE(run(ft + " --vram " + std::to_string(grads) + "B", &log) == 0, log);
    const std::string line = line_of(log, "finetune: memory: checkpointing auto -> ");
    CHECK_MESSAGE(has(line, "-> + gradients parked on the host: "), log);
    CHECK(has(line, "(+ checkpoints back late needs "));
    CHECK(has(log, "of backward's gradients parked there across each attention's backward"));  // the plan printed is the chosen one
}

TEST_CASE("finetune memory auto: short of pinned host memory, a step offloads one checkpoint a block instead of auto's two" * needs_tools("make-model finetune")) {
    tmpdir d;
    std::string m, data, log;
    long_gqa_model(d, &m, &data);
    const std::string ft = "./finetune -m " + m + " -d " + data + " -o " + d.file("o") +
                           " --seq-len 8192 -b 1 --device cuda --cc 8.6 --dry-run --lora-targets all --cache-weights off"
                           " --ffn-chunk 512 --loss-chunk 256 --attn-score-mib 32 --vram 784M";
    auto pinned = [&](const std::string &flags, std::string *checkpointing) {
        std::string out;
        REQUIRE_MESSAGE(run(ft + " --json" + flags, &out) == 0, out);
        const size_t p = out.find("\"pinned\": "), c = out.find("\"checkpointing\": \"");
        REQUIRE(p != std::string::npos);
        REQUIRE(c != std::string::npos);
        const size_t c0 = c + strlen("\"checkpointing\": \"");
        if (checkpointing) *checkpointing = out.substr(c0, out.find('"', c0) - c0);
        return (long long)atoll(out.c_str() + p + 10);
    };
    // with room on the host: auto's offload step, its policy keeping each half-block's input
    std::string policy;
    const long long two = pinned(" --host-mem 64G", &policy), one = pinned(" --checkpointing block --offload-activations", nullptr);
    REQUIRE_MESSAGE(policy.find("of 8 segments 8 keep only their input") != std::string::npos, policy);  // (the shape this case needs)
    REQUIRE(one > 0);
    REQUIRE(one < two);
    // a host whose room (less the 2 GiB margin) lies between the two: block's offload, not nothing
    const long long host = (2LL << 30) + (one + two) / 2;
    REQUIRE_MESSAGE(run(ft + " --host-mem " + std::to_string(host) + "B", &log) == 0, log);
    CHECK_MESSAGE(has(line_of(log, "finetune: memory: checkpointing auto -> "), "-> + checkpoint offload (one checkpoint a block: less host memory): "), log);
    CHECK(has(log, "\n  checkpointing: block;"));
    CHECK(pinned(" --host-mem " + std::to_string(host) + "B", nullptr) == one);
}
