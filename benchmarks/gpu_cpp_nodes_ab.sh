#!/usr/bin/env bash
# One call on a 2-GPU machine: what the C++ autograd nodes (csrc/torch/autograd.cpp) save in host time,
# then the 2-GPU scaling of the current default.
#   1. PROBES (default 2) alternations of benchmarks/host_probe.py on GPU 0 (t2t, 8192 tokens, 16 batches)
#      over the LS_FAIRSEQ_CPP_AUTOGRAD values in SETTINGS (default "1 0"; "1 ops 0" adds the op nodes with
#      F.linear): 1 = every C++ node (the default), 0 = the Python autograd.Functions and F.linear. Host and
#      GPU ms of the forward, backward and optimizer step, each started on an idle GPU, so the host ms are
#      the host's own work. Lines "cpp=1 PHASE ..." / "cpp=0 PHASE ..." in probes.txt.
#      AB_VAR=LS_FAIRSEQ_CPP_LAYERS SETTINGS="1 0" compares whole layers in one C++ call (1, the default)
#      with the Python layers over the same nodes (0) instead; the lines then read "LS_FAIRSEQ_CPP_LAYERS=1 ...".
#   2. ROUNDS (default 2) rounds of benchmarks/gpu_scaling_rounds.sh with VARIANTS (default "default=-").
# Everything under $OUT; summary.txt collects both.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
for k in $(seq 1 "${PROBES:-2}"); do
  for v in ${SETTINGS:-1 0}; do
    var=${AB_VAR:-LS_FAIRSEQ_CPP_AUTOGRAD}
    label=$([[ "$var" == LS_FAIRSEQ_CPP_AUTOGRAD ]] && echo cpp || echo "$var")
    env "$var=$v" CUDA_VISIBLE_DEVICES=0 python benchmarks/host_probe.py "${COMMON[@]}" --batches 16 \
      --skip-cprofile ${PROBE_FLAGS:-} > "$OUT/probe${k}_${label}$v.log" 2>&1
    grep -E "^(STEP|PHASE)" "$OUT/probe${k}_${label}$v.log" | sed "s/^/$label=$v /" | tee -a "$OUT/probes.txt"
  done
done
if [[ "${ROUNDS:-2}" -gt 0 ]]; then
  MACHINE_CHECK=0 OUT="$OUT/rounds" ROUNDS=${ROUNDS:-2} VARIANTS="${VARIANTS:-default=-}" \
    bash benchmarks/gpu_scaling_rounds.sh > "$OUT/rounds_stdout.txt" 2>&1
fi
{ cat "$OUT/machine.txt" "$OUT/probes.txt"; [[ -f "$OUT/rounds/pairs.txt" ]] && cat "$OUT/rounds/pairs.txt"; } \
  > "$OUT/summary.txt"
cat "$OUT/summary.txt"
