#!/usr/bin/env python3
# A list-scheduling model of the fused attention kernels' grids (qlora-cuda.cu, k_fa2_*): blocks
# start in order of their index (x fastest), each on the first free slot (an SM holds `per_sm`
# blocks); a block's time is its number of 64-row tiles (causal: the later query tiles see more
# keys). It ignores everything but the order and the imbalance - co-resident blocks sharing an SM
# at full speed, memory, latency - so it bounds what the grid's shape costs, no more. Stdlib only.
#   python3 bench/attn-sched.py [T] [H] [Hkv] [SMs]
import heapq
import sys

T = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
HKV = int(sys.argv[3]) if len(sys.argv) > 3 else 8
SMS = int(sys.argv[4]) if len(sys.argv) > 4 else 132
REP = H // HKV


def makespan(jobs, slots):
    free = [0.0] * slots
    end = 0.0
    for d in jobs:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def row(name, jobs, per_sm):
    slots = per_sm * SMS
    ms = makespan(jobs, slots)
    print(f"| {name} | {len(jobs)} | {per_sm} | {ms:.0f} | {sum(jobs) / slots:.1f} | {sum(jobs) / slots / ms:.2f} |")


print(f"seq {T}, {H}/{HKV} heads, {SMS} SMs; time in 64-row tiles (forward: 128-query blocks, 128-row units)")
print("| grid | blocks | blocks an SM | makespan | all slots busy | efficiency |")
print("|---|---:|---:|---:|---:|---:|")
nb = T // 128  # forward: blocks of 128 queries (8 warps); 1 an SM (254 registers at d 128)
row("forward, (query tile reversed, head): before", [nb - x for h in range(H) for x in range(nb)], 1)
row("forward, (head, query tile reversed): now", [nb - y for y in range(nb) for h in range(H)], 1)
nb = T // 64  # backward: blocks of 64 keys or queries (4 warps); 2 an SM (~200-240 registers)
row("dQ, (query tile reversed, head): before", [nb - x for h in range(H) for x in range(nb)], 2)
row("dQ, (head, query tile reversed): now", [nb - y for y in range(nb) for h in range(H)], 2)
row("dK/dV, (key tile, kv head), every head of the group: before", [REP * (nb - x) for h in range(HKV) for x in range(nb)], 2)
blocks = nb * HKV
split = 1
while split < REP and blocks * split < 1024:
    split += 1
    while REP % split:
        split += 1
row(f"dK/dV, (kv head x {split} slices, key tile): now",
    [(REP // split) * (nb - y) for y in range(nb) for h in range(HKV * split)], 2)
