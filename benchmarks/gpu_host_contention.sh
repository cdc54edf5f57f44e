#!/usr/bin/env bash
# One call on a 2-GPU machine: where the extra host time of a 2-GPU update comes from.
# With LS_FAIRSEQ_STEP_TIMING=1 every run logs the host ms of its forward, backward and the parts of the step.
#   a: 1 GPU, --update-freq 2, alone                                  (the scaling baseline)
#   b: the same command on GPU 0 and GPU 1 at once, two processes     (host contention, no communication)
#   c: 2 GPUs, lightseq-train default                                 (overlapped reduce-scatter, hooks)
#   d: 2 GPUs, LS_FAIRSEQ_SYNC_ALL_REDUCE=1                           (no gradient hooks in the backward)
#   e: 2 GPUs, --bucket-cap-mb 100                                    (4x fewer buckets to fold and launch)
#   f: 2 GPUs, LS_FAIRSEQ_CPU_AFFINITY=1                              (each rank on its own half of the cores)
#   g: 2 GPUs, OMP_NUM_THREADS=1                                      (no CPU thread pool per rank)
# RUNS (default "a b c d") picks the runs, in that order. Logs and a summary (summary.txt) under $OUT;
# UPDATES (default 200) each.
cd "$(dirname "$0")/.."
export LS_FAIRSEQ_STEP_TIMING=1
source benchmarks/multi_gpu_common.sh
G=(--max-update "${UPDATES:-200}" --grouped-shuffling)
# the CPU layout the runs share (cores, threads per core, NUMA nodes; first CPUs' hyperthread siblings)
{ lscpu 2>/dev/null | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA)"
  for c in 0 1 16; do
    f=/sys/devices/system/cpu/cpu$c/topology/thread_siblings_list
    [[ -r $f ]] && echo "cpu$c siblings: $(cat $f)"
  done; } >> "$OUT/machine.txt"
pairs=()
for part in ${RUNS:-a b c d}; do
  case $part in
    a) run a_1gpu_alone env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2 ;;
    b) CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2 > "$OUT/b_1gpu_both_gpu0.log" 2>&1 &
       CUDA_VISIBLE_DEVICES=1 $T "${COMMON[@]}" "${G[@]}" --update-freq 2 > "$OUT/b_1gpu_both_gpu1.log" 2>&1
       wait ;;
    c) run c_2gpu_default $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
       pairs+=("$OUT/a_1gpu_alone.log" "$OUT/c_2gpu_default.log") ;;
    d) run d_2gpu_sync_all_reduce env LS_FAIRSEQ_SYNC_ALL_REDUCE=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
       pairs+=("$OUT/a_1gpu_alone.log" "$OUT/d_2gpu_sync_all_reduce.log") ;;
    e) run e_2gpu_bucket100 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2 --bucket-cap-mb 100
       pairs+=("$OUT/a_1gpu_alone.log" "$OUT/e_2gpu_bucket100.log") ;;
    f) run f_2gpu_affinity env LS_FAIRSEQ_CPU_AFFINITY=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
       pairs+=("$OUT/a_1gpu_alone.log" "$OUT/f_2gpu_affinity.log") ;;
    g) run g_2gpu_omp1 env OMP_NUM_THREADS=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
       pairs+=("$OUT/a_1gpu_alone.log" "$OUT/g_2gpu_omp1.log") ;;
    *) echo "unknown run '$part' (RUNS takes a b c d e f g)"; exit 2 ;;
  esac
done
python benchmarks/machine_check.py 2>&1 | tee -a "$OUT/machine.txt"
{
  cat "$OUT/machine.txt"
  [[ ${#pairs[@]} -gt 0 && -f "$OUT/a_1gpu_alone.log" ]] && python benchmarks/scaling_pairs.py "${AFTER:-60}" "${pairs[@]}"
  intervals "$OUT"/[a-g]_*.log
  timing_lines "$OUT"/[a-g]_*.log
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
