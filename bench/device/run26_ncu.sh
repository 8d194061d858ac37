#!/usr/bin/env bash
# Device run 26 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): ncu profiles of the CuTeDSL
# forward, the two CuTeDSL backward kernels and the Triton forward at D=512, B=1, H=32, N=8192 bf16, non-causal
# (bench/profile_ncu.py): speed of light, memory / compute workload, warp stalls; then the same launches with the
# tensor-pipe, shared-memory and L2 counters this ncu knows (names looked up with --query-metrics).
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
ncu --version | tail -1
python3 bench/profile_ncu.py --d 512 --triton > "$OUT/warm.log" 2>&1; echo "warm rc=$? ($(( $(date +%s) - t0 )) s)"
timeout 200 ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section WarpStateStats \
  --section LaunchStats --section Occupancy python3 bench/profile_ncu.py --d 512 --triton > "$OUT/ncu_sections.txt" 2>&1
echo "sections rc=$? ($(( $(date +%s) - t0 )) s)"
ncu --query-metrics > "$OUT/metrics.txt" 2>&1
want=""
for m in sm__pipe_tensor_op_gmma_cycles_active sm__inst_executed_pipe_tensor_op_gmma sm__pipe_tensor_op_hmma_cycles_active \
         l1tex__data_pipe_lsu_wavefronts_mem_shared l1tex__data_bank_reads l1tex__data_bank_writes \
         smsp__l1tex_tmain_requests lts__t_bytes lts__t_sectors_srcunit_tex dram__bytes_read sm__cycles_active \
         l1tex__m_xbar2l1tex_read_bytes l1tex__throughput; do
  grep -q "^$m " "$OUT/metrics.txt" && want="$want,$m.avg.pct_of_peak_sustained_elapsed,$m.sum"
done
want=${want#,}; echo "metrics: $want"
[ -n "$want" ] && timeout 150 ncu --profile-from-start off --metrics "$want" python3 bench/profile_ncu.py --d 512 --triton \
  > "$OUT/ncu_metrics.txt" 2>&1
echo "metrics rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "^  [a-zA-Z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Shared Memory Config" "$OUT/ncu_sections.txt" | head -80
