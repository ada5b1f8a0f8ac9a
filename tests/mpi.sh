#!/bin/sh
# tests/mpi.sh - data parallel over MPI (make test-mpi, part of make test where OpenMPI is):
#   sh tests/mpi.sh MPI_FINETUNE OUT_DIR        (run from the repository root: ./make-model, ./finetune)
# 1. mpirun -np 2 with --grad-accum 1 against one process with --grad-accum 2: every step's loss
#    and every evaluation loss equal within 1e-6 relative; the ranks' adapters and optimizer state
#    the same (finetune compares their checksums and says so); one metrics file, rank 0's;
#    --dry-run prints one plan, each process's; one process with QLORA_DIST_ALWAYS=1 (the
#    all-reduce made anyway) the same losses;
# 2. a rank killed (SIGKILL) as step 5 begins: mpirun exits non-zero naming rank 1 and the signal,
#    the checkpoint of step 4 is there and resumes in ONE process (the effective accumulation 2
#    it stored) to the uninterrupted run's losses;
# 3. a SIGTERM to one rank: every rank stops after that step, with rank 0's checkpoint, which
#    resumes in 2 processes to the uninterrupted run's losses (not in 3: 2 micro-batches a step);
# 4. a rank that fails with an error: mpirun exits non-zero, the line names the rank and the cause.
# 5. with SHIM_FINETUNE (build/mpi/finetune-shim: the CUDA backend through tests/cuda_shim.h, NCCL on
#    MPI through tests/nccl_shim.h), the GPU path on the CPU: --device cuda, mpirun -np 2 with two
#    shim devices against one process with twice the accumulation (losses within 1e-6, the ranks'
#    adapters the same, one NCCL launch a step on each rank, each on its own device); with one
#    device the two ranks share it and NCCL's init refuses; QLORA_DIST_ALWAYS=1 -np 1 the same losses;
#    before them NCCL_SHIM_SELFTEST (tests/nccl_shim_selftest.cpp), the NCCL shim's own checks;
#    and --profile's census per run equal to the plan's, with the weights' copies on.
#   sh tests/mpi.sh MPI_FINETUNE OUT_DIR [SHIM_FINETUNE NCCL_SHIM_SELFTEST]
set -e
ft=$1
out=$2
shim=$3
shim_selftest=$4
rm -rf "$out"
mkdir -p "$out"
# CI runs as root, which OpenMPI refuses unless told; two processes on however many cores; no
# single-copy shared memory (containers often forbid the ptrace it needs)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
# (a timeout: a rank waiting for one that went away must fail the test, not hang it)
mpirun="timeout 120 mpirun --oversubscribe --bind-to none -np 2"
fail() {
    echo "test-mpi: $*"
    exit 1
}

./make-model -o "$out/m.gguf" --dim 32 --layers 2 --heads 2 --ff 64 --seed 4 > /dev/null
i=0
while [ $i -lt 20 ]; do  # question/answer pairs: the answer spells the question backwards
    w=$(printf 'abcdefghijklmnopqrstuvwxyz' | cut -c$((i % 20 + 1))-$((i % 20 + 3 + i % 4)))
    r=$(printf '%s' "$w" | rev)
    printf '{"prompt": "Q: %s\\nA:", "completion": " %s."}\n' "$w" "$r" >> "$out/qa.jsonl"
    i=$((i + 1))
done
args="-m $out/m.gguf -d $out/qa.jsonl --max-steps 8 -b 2 --seq-len 24 --lora-dropout 0.1 --lr 1e-3 --precision fp32 -t 1 \
--val-split 0.2 --eval-every 4 --save-every 2"

# KEY's value in each metrics line that has one, as "step value"
values() {
    awk -v k="\"$2\": " '{ p = index($0, k); if (p) { split(substr($0, p + length(k)), v, /[,}]/); sub(/^\{"step": /, ""); sub(/,.*/, ""); print $0, v[1] } }' "$1"
}
# the two files' KEY values, step by step, within 1e-6 relative (and the same steps)
same_values() {
    values "$1" "$3" > "$out/a.txt"
    values "$2" "$3" > "$out/b.txt"
    [ -s "$out/a.txt" ] || fail "no $3 in $1"
    cut -d' ' -f1 "$out/a.txt" > "$out/a.steps"
    cut -d' ' -f1 "$out/b.txt" > "$out/b.steps"
    cmp -s "$out/a.steps" "$out/b.steps" || fail "$3: steps differ: $(tr '\n' ' ' < "$out/a.steps") vs $(tr '\n' ' ' < "$out/b.steps")"
    paste -d' ' "$out/a.txt" "$out/b.txt" | awk -v k="$3" '{ d = $2 - $4; if (d < 0) d = -d; if (d > 1e-6 * ($2 < 0 ? -$2 : $2)) {
        printf "test-mpi: step %s: %s %s (one process) vs %s (2 processes)\n", $1, k, $2, $4; bad = 1 } } END { exit bad }' ||
        fail "$3 differs"
}

# 1. two processes equal one with twice the accumulation
./finetune $args --grad-accum 2 -o "$out/one" > "$out/one.log" 2>&1 || { cat "$out/one.log"; fail "one process failed"; }
$mpirun "$ft" $args --grad-accum 1 -o "$out/two" > "$out/two.log" 2>&1 || { cat "$out/two.log"; fail "mpirun -np 2 failed"; }
same_values "$out/one/metrics.jsonl" "$out/two/metrics.jsonl" loss
same_values "$out/one/metrics.jsonl" "$out/two/metrics.jsonl" eval_loss
grep -q "x accumulation 1 x 2 processes = effective batch 4 sequences" "$out/two.log" || fail "no data-parallel batch line in $out/two.log"
grep -q "the same on all 2 processes" "$out/two.log" || fail "the ranks' adapters were not compared ($out/two.log)"
[ "$(grep -c '"step": 8,' "$out/two/metrics.jsonl")" = 1 ] || fail "metrics.jsonl: not one writer"
[ "$(grep -c '^finetune: done' "$out/two.log")" = 1 ] || fail "more than one rank printed"
$mpirun "$ft" $args --grad-accum 1 --dry-run > "$out/dry.log" 2>&1 || { cat "$out/dry.log"; fail "--dry-run failed"; }
[ "$(grep -c 'memory plan (MiB)' "$out/dry.log")" = 1 ] && grep -q "2 processes .*the plan is each process's" "$out/dry.log" &&
    grep -q "gradients packed for the all-reduce" "$out/dry.log" || { cat "$out/dry.log"; fail "--dry-run: not one plan, each process's"; }

# one process making the all-reduce anyway (QLORA_DIST_ALWAYS: the collectives' path on one GPU)
QLORA_DIST_ALWAYS=1 timeout 60 mpirun --bind-to none -np 1 "$ft" $args --grad-accum 2 -o "$out/always" > "$out/always.log" 2>&1 ||
    { cat "$out/always.log"; fail "QLORA_DIST_ALWAYS=1 mpirun -np 1 failed"; }
grep -q "gradients packed for the all-reduce" "$out/always.log" || fail "QLORA_DIST_ALWAYS: no all-reduce planned"
same_values "$out/one/metrics.jsonl" "$out/always/metrics.jsonl" loss

# 2. rank 1 killed as step 5 begins: the job stops, naming it; step 4's checkpoint resumes in one process
if QLORA_DIST_FAIL=1:5:kill $mpirun "$ft" $args --grad-accum 1 -o "$out/killed" > "$out/killed.log" 2>&1; then
    fail "mpirun exited 0 with rank 1 killed"
fi
grep -q "rank 1 .*signal 9" "$out/killed.log" || { cat "$out/killed.log"; fail "the killed rank is not named"; }
[ -f "$out/killed/checkpoint.gguf" ] && [ ! -f "$out/killed/adapter.gguf" ] || fail "killed: not the checkpoint alone"
./finetune --resume "$out/killed" > "$out/resumed.log" 2>&1 || { cat "$out/resumed.log"; fail "the checkpoint did not resume"; }
grep -q "resuming after step 4" "$out/resumed.log" || fail "not resumed after step 4 ($out/resumed.log)"
same_values "$out/one/metrics.jsonl" "$out/killed/metrics.jsonl" loss

# 3. SIGTERM to rank 1 alone as step 3 begins: every rank stops after that step, rank 0 saving its
#    checkpoint (exit 128 + 15); it resumes in two processes
QLORA_DIST_FAIL=1:3:term $mpirun "$ft" $args --grad-accum 1 -o "$out/term" > "$out/term.log" 2>&1 && fail "mpirun exited 0 after a SIGTERM"
grep -q "interrupted (SIGTERM) after step 3: checkpoint saved" "$out/term.log" && [ -f "$out/term/checkpoint.gguf" ] ||
    { cat "$out/term.log"; fail "a SIGTERM to rank 1 did not stop the job after the step with a checkpoint"; }
$mpirun "$ft" --resume "$out/term" > "$out/term-resumed.log" 2>&1 || { cat "$out/term-resumed.log"; fail "no resume in 2 processes"; }
same_values "$out/one/metrics.jsonl" "$out/term/metrics.jsonl" loss
timeout 60 mpirun --oversubscribe --bind-to none -np 3 "$ft" --resume "$out/term" > "$out/three.log" 2>&1 && fail "3 processes resumed a run of 2"
grep -q "effective accumulation 2 (micro-batches per step) does not divide among 3 processes" "$out/three.log" ||
    { cat "$out/three.log"; fail "3 processes: not the reason"; }

# 4. rank 1 fails with an error: the job stops, the line names the rank and the cause
if QLORA_DIST_FAIL=1:3 $mpirun "$ft" $args --grad-accum 1 -o "$out/failed" > "$out/failed.log" 2>&1; then
    fail "mpirun exited 0 with rank 1 failed"
fi
grep -q "rank 1 of 2: finetune stopped (exit code 1): step 3: a failure made on purpose" "$out/failed.log" ||
    { cat "$out/failed.log"; fail "the failed rank and its cause are not named"; }
# 5. the GPU path (the device all-reduce, NCCL's) through the shims
if [ -n "$shim" ]; then
    QL_SHIM_DEVICES=2 $mpirun "$shim_selftest" > "$out/nccl-shim-selftest.log" 2>&1 ||
        { cat "$out/nccl-shim-selftest.log"; fail "the NCCL shim's self-test failed"; }
    "$shim" $args --device cuda --grad-accum 2 -o "$out/shim-one" > "$out/shim-one.log" 2>&1 ||
        { cat "$out/shim-one.log"; fail "the shim: one process failed"; }
    QL_SHIM_DEVICES=2 $mpirun "$shim" $args --device cuda --grad-accum 1 -o "$out/shim-two" > "$out/shim-two.log" 2>&1 ||
        { cat "$out/shim-two.log"; fail "the shim: mpirun -np 2 failed"; }
    grep -q "^finetune: cuda: qlshim" "$out/shim-two.log" || fail "the shim: not on the CUDA backend ($out/shim-two.log)"
    same_values "$out/shim-one/metrics.jsonl" "$out/shim-two/metrics.jsonl" loss
    same_values "$out/shim-one/metrics.jsonl" "$out/shim-two/metrics.jsonl" eval_loss
    grep -q "the same on all 2 processes" "$out/shim-two.log" || fail "the shim: the ranks' adapters were not compared ($out/shim-two.log)"
    for r in 0 1; do  # one grouped all-reduce a step, on each rank's own device
        grep -q "qlshim nccl: rank $r of 2 on device $r: 8 launches, [1-9][0-9]* all-reduces run" "$out/shim-two.log" ||
            { grep "qlshim nccl" "$out/shim-two.log"; fail "the shim: rank $r did not make 8 NCCL launches on device $r"; }
    done
    # --profile's census per run is the plan's, the weights' copies counted (they are dropped when
    # the trainer moves to the host at the end, before the profile is printed; a census made then
    # counted every product's dequantisation tiles)
    "$shim" $args --device cuda --precision bf16 --cache-weights on --profile --max-steps 3 -o "$out/shim-profile" \
        > "$out/shim-profile.log" 2>&1 || { cat "$out/shim-profile.log"; fail "the shim: --profile failed"; }
    planned=$(sed -n 's/^  census, one micro-batch: \([0-9]*\) launches.*/\1/p' "$out/shim-profile.log")
    profiled=$(sed -n 's/^  census per run: \([0-9]*\) launches.*/\1/p' "$out/shim-profile.log")
    grep -q "cache-weights on" "$out/shim-profile.log" && [ -n "$planned" ] && [ "$planned" = "$profiled" ] ||
        { grep -E "census|cache-weights" "$out/shim-profile.log"; fail "the shim: --profile's census ($profiled launches) is not the plan's ($planned)"; }
    # one device: both ranks on it, which NCCL refuses (the device is the local rank's)
    QL_SHIM_DEVICES=1 $mpirun "$shim" $args --device cuda --grad-accum 1 -o "$out/shim-dup" > "$out/shim-dup.log" 2>&1 &&
        fail "the shim: two ranks on one device ran"
    grep -q "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0" "$out/shim-dup.log" &&
        grep -q "rank [01] of 2: finetune stopped (exit code 1): step 1: the all-reduce of the gradients" "$out/shim-dup.log" ||
        { cat "$out/shim-dup.log"; fail "the shim: two ranks on one device did not fail as NCCL does"; }
    # NCCL with one rank (QLORA_DIST_ALWAYS: what a machine with one GPU can check)
    QLORA_DIST_ALWAYS=1 timeout 60 mpirun --bind-to none -np 1 "$shim" $args --device cuda --grad-accum 2 -o "$out/shim-always" > "$out/shim-always.log" 2>&1 ||
        { cat "$out/shim-always.log"; fail "the shim: QLORA_DIST_ALWAYS=1 mpirun -np 1 failed"; }
    grep -q "qlshim nccl: rank 0 of 1 on device 0: 8 launches" "$out/shim-always.log" || fail "the shim: QLORA_DIST_ALWAYS: no NCCL launches"
    same_values "$out/shim-one/metrics.jsonl" "$out/shim-always/metrics.jsonl" loss
    echo "test-mpi: the NCCL shim's self-test; the GPU path through the CUDA shim and NCCL on MPI: 2 processes on 2 shim devices = 1 with twice the accumulation" \
         "(8 steps, 3 evaluations, within 1e-6), one NCCL launch a step; 2 ranks on 1 device refused; QLORA_DIST_ALWAYS=1 -np 1 the same; --profile's census the plan's"
else
    echo "test-mpi: the GPU path through the shim skipped (no SHIM_FINETUNE: nccl.h or CUDA's headers missing)"
fi

echo "test-mpi: 2 processes = 1 with twice the accumulation (8 steps' losses, 3 evaluations, within 1e-6), adapters the same on both;" \
     "a killed rank and a failed one stop the job by name; a SIGTERM to one stops all after the step; checkpoints resume in 1 and 2 processes, not 3"
