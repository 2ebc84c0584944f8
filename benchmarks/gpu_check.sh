#!/usr/bin/env bash
# One device call does it all: build the CUDA library, run the GPU tests, benchmark.
#
#   benchmarks/gpu_check.sh [stage ...]
#
# stages (default: env build cuda-tests pallas-tests bench):
#   env           GPU, driver, jax / flax versions
#   build         python -m cuda_ffi.build (sm_90a; SM100 is compiled on CPU CI, never run here)
#   cuda-tests    tests/gpu/test_cuda_gpu.py       pallas-tests  tests/gpu/test_pallas_gpu.py
#   install-tests tests/gpu/test_install_gpu.py (the first-use CUDA build, explain_impl, the fallback warning, info)
#   pallas-ablation  benchmarks.pallas_kernels_bench on the two target cases with kernel variants
#                 ($PALLAS_VARIANTS, default "default,f16,bf16_ops,splits=1", or e.g. default,persistent;
#                 $ABL_CASES of decode, prefill, v4, v41, default decode,prefill); not recorded (comparisons)
#   pallas-mega-ablation  benchmarks.pallas_mega_ablation: the pallas mega ops with parts of their in-kernel stages
#                 removed ($MEGA_ABL_CASES, default mega_v41_h64_t512,mega_v41_h64_t128, mega prefill names too;
#                 $MEGA_ABL_VARIANTS, default all; one split); not recorded
#   pallas-ncu    Nsight Compute over one pallas kernel call per case ($NCU_CASES): report, details page,
#                 per-instruction SASS page, log and a bench folder per case: point OUT elsewhere and
#                 copy what you need (the device tool returns at most 8 files)
#   model-tests   tests/model/test_engine.py with impl=auto on the GPU
#   bench         python -m benchmarks.sparse_mla --quick (every available impl, or $BENCH_IMPLS; $BENCH_FLAGS
#                 adds flags, e.g. --breakdown: each kernel's CUPTI time, or --pallas-ctas sms: persistent pallas
#                 CTAs; bench-flashmla, bench-mega and compare take $BENCH_FLAGS too)
#   bench-full    python -m benchmarks.sparse_mla (all cases)
#   bench-flashmla  python -m benchmarks.sparse_mla --suite flashmla ($FM_CASES, default decode,prefill; $BENCH_IMPLS)
#   bench-step    python -m benchmarks.sparse_mla --suite step ($STEP_BATCHES, default 64,128)
#   bench-mega    python -m benchmarks.sparse_mla --suite mega ($MEGA_CASES, default all; $BENCH_IMPLS, default cuda)
#   flashmla      FlashMLA for measurement only, from the source tarball $FLASHMLA_TGZ (default
#                 .flashmla/flashmla_src.tgz: FlashMLA + cutlass headers, git-ignored, passed with the device
#                 tool's `carry`) into /tmp/FlashMLA, SM90 only; a prebuilt extension $FLASHMLA_SO (default
#                 .flashmla/flash_mla_cuda.so, in pieces .part00, .part01, ...) skips the build; a fresh build goes to
#                 $OUT in such pieces for the next call
#   compare       python -m benchmarks.flashmla_compare (after `flashmla`): FlashMLA and ours on the same inputs
#   bench-rows    the cuda prefill with kv rows forced to bf16 (producers convert) and to f16 (the wrapper
#                 converts; seesaw.cuh), $ROWS_CASES (default prefill_h128_topk2048); not recorded
#   sanitizer     compute-sanitizer memcheck over one cuda decode and one prefill
#   narrow-trace  python -m benchmarks.narrow_trace: the narrow CTA's per-tile timeline for the ablation variants
#                 $TRACE_VARIANTS (default "default,no_gather") on $TRACE_CASE (default the b128 h8 V4.1-Flash decode)
#   pallas-compile  python -m benchmarks.pallas_lowering --compile (each pallas kernel's device compile, timed),
#                 --engine --compile (one tiny-model engine step: its kernels and compile), then the engine's
#                 warm-up with impl="pallas" (examples/generate.py; $GEN_TIMEOUT s, 300)
#   sharded       python -m benchmarks.sharded_decode --devices 1,2 (needs 2 GPUs)
#   cuda-ablation the quick cuda benchmark for the ablation builds of benchmarks/cuda_ablations.py (patched
#                 copies of cuda_ffi/csrc/: no_gather no cache reads, no_mma no tensor-core work, neither,
#                 no_pair decode without head-group pairs, mma_sync the mma.sync consumers on sm_90a);
#                 not recorded (experiments); $ABLATION picks variants (default: "default no_gather no_mma
#                 neither mma_sync"), $ABL_CASES the cases (default: decode,prefill), or $ABL_FM_CASES FlashMLA's
#                 (benchmarks/flashmla_cases.py names, or decode / prefill / few_heads); $ABL_PREBUILT/<variant>/
#                 libdsv41_cuda.so, where present (built on the CPU machine, passed with `carry`), skips that build
#   ncu           Nsight Compute (--clock-control none) over one call of the attention kernel per case
#                 ($NCU_CASES, default decode_headline_h128; prefill_h128_topk2048 can crash Python with
#                 signal 11 under ncu): a report per case, its details page and its
#                 per-instruction source page (SASS + CUDA lines). Five files per case: the device
#                 tool returns at most 8 from $OUT, so point OUT elsewhere and pack what you need.
#   ncu-export    per-instruction (SASS) and raw CSVs of stored reports $NCU_REPORTS (space-separated paths; pass
#                 git-ignored ones such as prof/*.ncu-rep through the device tool's `carry`): there is no ncu on
#                 the CPU machines; read the CSVs there with benchmarks.ncu_summary
# DSV41_COMMIT: give the commit as a literal; on the device machine `git rev-parse` may answer another commit than the tree's.
# Logs, JSON, the roofline PNG and benchmark rows for benchmarks/RESULTS.md go to $OUT (default gpu_out/).
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# never use NVLink multicast on shared hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env build cuda-tests pallas-tests bench)
status=0
run() { "$@" || { echo "!!! failed ($?): $*"; status=1; }; }
# ncu_cases IMPL KERNEL_REGEX PREFIX PRINT_SOURCE SOURCE_SUFFIX EXTRA_GREP [NCU_FLAGS...]: one Nsight
# Compute report per case of $NCU_CASES for one impl, its details page and its per-instruction source page.
ncu_cases() {
  local impl=$1 kre=$2 pre=$3 psrc=$4 ssuf=$5 xgrep=$6; shift 6
  for c in $(echo "${NCU_CASES:-decode_headline_h128}" | tr , ' '); do
    run timeout 400 ncu --clock-control none --set full "$@" -k regex:"$kre" \
      --launch-skip 1 --launch-count 1 -f -o "$OUT/${pre}_$c" $PY -m benchmarks.sparse_mla --cases "$c" --impls "$impl" \
      --sets 1 --iterations 2 --timer wall --out "$OUT/${pre}_bench_$c" > "$OUT/${pre}_$c.log" 2>&1
    tail -3 "$OUT/${pre}_$c.log"
    ncu -i "$OUT/${pre}_$c.ncu-rep" --page details > "$OUT/${pre}_${c}_details.txt" 2>&1
    ncu -i "$OUT/${pre}_$c.ncu-rep" --page source --csv --print-source "$psrc" > "$OUT/${pre}_${c}_${ssuf}.csv" 2>&1
    grep -E "Duration|Throughput|Pipe|Stall|Warp Cycles|Issued|Eligible|Registers|Bank$xgrep" \
      "$OUT/${pre}_${c}_details.txt" | head -60
  done
}
for s in "${stages[@]}"; do
  echo "=== $s $(date +%T)"
  case "$s" in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
      $PY -c "import jax, numpy; print('jax', jax.__version__, 'numpy', numpy.__version__, jax.devices())"
      $PY -c "import flax; print('flax', flax.__version__)" 2>&1 | tail -1 ;;
    build) run $PY -m cuda_ffi.build --archs 90a 2>&1 | tail -3 ;;
    cuda-tests) run timeout 420 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cuda_gpu.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -30 ;;
    pallas-ablation) run timeout 500 $PY -m benchmarks.pallas_kernels_bench --iters 5 --variants "${PALLAS_VARIANTS:-default,f16,bf16_ops,splits=1}" \
        --cases "${ABL_CASES:-decode,prefill}" 2>&1 | tee "$OUT/pallas_ablation.log" | grep -v "^  (CUPTI" ;;
    pallas-mega-ablation) run timeout 500 $PY -m benchmarks.pallas_mega_ablation \
        --cases "${MEGA_ABL_CASES:-mega_v41_h64_t512,mega_v41_h64_t128}" ${MEGA_ABL_VARIANTS:+--variants $MEGA_ABL_VARIANTS} \
        2>&1 | tee "$OUT/pallas_mega_ablation.log" ;;
    pallas-ncu) ncu_cases pallas sparse_mla_kernel pncu sass sass "|Shared Memory" ;;
    install-tests) run timeout 560 $PY -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_install_gpu.py 2>&1 | tee "$OUT/install_tests.log" | tail -40 ;;
    pallas-tests) run timeout 420 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_pallas_gpu.py 2>&1 | tee "$OUT/pallas_tests.log" | tail -30 ;;
    model-tests) run timeout 420 $PY -m pytest -q -p no:cacheprovider tests/model/test_engine.py 2>&1 | tee "$OUT/model_tests.log" | tail -15 ;;
    bench) run timeout 420 $PY -m benchmarks.sparse_mla --quick ${BENCH_IMPLS:+--impls $BENCH_IMPLS} ${BENCH_FLAGS:-} --out "$OUT" --record "$OUT/results_rows.md" 2>&1 | tee "$OUT/bench.log" ;;
    bench-rows) for rows in bf16 f16; do echo "--- prefill kv rows: $rows"
        DSV41_CUDA_PREFILL_ROWS=$rows run timeout 300 $PY -m benchmarks.sparse_mla --impls cuda --cases "${ROWS_CASES:-prefill_h128_topk2048}" \
          --out "$OUT/rows_$rows" 2>&1 | grep -E "^(prefill|!!!)"; done ;;
    bench-flashmla) run timeout 560 $PY -m benchmarks.sparse_mla --suite flashmla --cases "${FM_CASES:-decode,prefill}" \
        ${BENCH_IMPLS:+--impls $BENCH_IMPLS} ${BENCH_FLAGS:-} --out "$OUT/fm" --record "$OUT/results_rows.md" 2>&1 | tee "$OUT/bench_flashmla.log" ;;
    bench-step) run timeout 560 $PY -m benchmarks.sparse_mla --suite step --step-batches "${STEP_BATCHES:-64,128}" \
        ${BENCH_IMPLS:+--impls $BENCH_IMPLS} --out "$OUT/step" --record "$OUT/results_rows.md" 2>&1 | tee "$OUT/bench_step.log" ;;
    bench-mega) run timeout 560 $PY -m benchmarks.sparse_mla --suite mega ${MEGA_CASES:+--cases $MEGA_CASES} \
        --impls "${BENCH_IMPLS:-cuda}" ${BENCH_FLAGS:-} --out "$OUT/mega" --record "$OUT/results_rows.md" 2>&1 | tee "$OUT/bench_mega.log" ;;
    flashmla)
      rm -rf /tmp/FlashMLA && tar xzf "${FLASHMLA_TGZ:-.flashmla/flashmla_src.tgz}" -C /tmp
      so="/tmp/FlashMLA/flash_mla/cuda$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
      pre="${FLASHMLA_SO:-.flashmla/flash_mla_cuda.so}"
      if [ -f "$pre.part00" ]; then cat "$pre".part* > "$so"
      else
        cuda_home="$(dirname "$(dirname "$(readlink -f "$(which nvcc)")")")"
        (cd /tmp/FlashMLA && CUDA_HOME="$cuda_home" CPATH="$cuda_home/include/cccl" NVCC_APPEND_FLAGS="-I$cuda_home/include/cccl" \
          FLASH_MLA_DISABLE_SM100=1 MAX_JOBS=16 NVCC_THREADS=2 timeout 500 $PY setup.py build_ext --inplace > "$OUT/flashmla_build.log" 2>&1) \
          || { echo "!!! FlashMLA build failed"; tail -20 "$OUT/flashmla_build.log"; status=1; }
        [ -f "$so" ] && split -b 15m -d "$so" "$OUT/flash_mla_cuda.so.part"  # (the device tool returns files of 16 MiB)
      fi
      export PYTHONPATH="/tmp/FlashMLA:$PYTHONPATH"
      $PY -c "import flash_mla; print('flash_mla', flash_mla.__file__)" ;;
    compare) run timeout 560 $PY -m benchmarks.flashmla_compare --cases "${FM_CASES:-decode,prefill}" ${BENCH_IMPLS:+--impls $BENCH_IMPLS} \
        ${BENCH_FLAGS:-} --out "$OUT/cmp" --record "$OUT/results_rows.md" 2>&1 | tee "$OUT/compare.log" ;;
    bench-full) run timeout 560 $PY -m benchmarks.sparse_mla --out "$OUT" --record "$OUT/results_rows.md" 2>&1 | tee "$OUT/bench.log" ;;
    narrow-trace) run timeout 500 $PY -m benchmarks.narrow_trace --variants "${TRACE_VARIANTS:-default,no_gather}" \
        --case "${TRACE_CASE:-fm_decode_b128_h8_k128p256+512p64}" 2>&1 | tee "$OUT/narrow_trace.log" ;;
    pallas-compile)
      run timeout 400 $PY -m benchmarks.pallas_lowering --compile 2>&1 | tee "$OUT/pallas_compile.log"
      run timeout 300 $PY -m benchmarks.pallas_lowering --engine --compile 2>&1 | tee -a "$OUT/pallas_compile.log"
      run timeout "${GEN_TIMEOUT:-300}" $PY examples/generate.py --platform gpu --impl pallas --kv-format fp8_ds_mla \
        --max-new-tokens 4 2>&1 | tee "$OUT/generate_pallas.log" | grep -vE "^\s*$" | tail -12 ;;
    sanitizer) run timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m tests.cuda_emulator.sanitize_case 2>&1 | tee "$OUT/sanitizer.log" | tail -15 ;;
    sharded) run timeout 300 $PY -m benchmarks.sharded_decode --devices 1,2 --record "$OUT/results_rows.md" 2>&1 | tee "$OUT/sharded.log" ;;
    cuda-ablation)
      for name in ${ABLATION:-default no_gather no_mma neither mma_sync}; do
        echo "--- variant $name"
        lib="/tmp/dsv41_$name/libdsv41_cuda.so"
        if [ -n "${ABL_PREBUILT:-}" ] && [ -f "$ABL_PREBUILT/$name/libdsv41_cuda.so" ]; then lib="$ABL_PREBUILT/$name/libdsv41_cuda.so"
        else $PY -m benchmarks.cuda_ablations "$name" --out-dir "/tmp/dsv41_$name" --build-dir "/tmp/dsv41_build_$name" \
          > "$OUT/build_$name.log" 2>&1 || { echo "build failed"; tail -5 "$OUT/build_$name.log"; continue; }; fi
        if [ -n "${ABL_FM_CASES:-}" ]; then  # FlashMLA's cases (benchmarks.flashmla_cases names or groups)
          DSV41_CUDA_LIB="$lib" run timeout 300 $PY -m benchmarks.sparse_mla --suite flashmla \
            --impls cuda --cases "$ABL_FM_CASES" --out "$OUT/ablation_$name" 2>&1 | grep -E "^(fm_|!!!)" | tee -a "$OUT/ablation.log"
        else
          DSV41_CUDA_LIB="$lib" run timeout 300 $PY -m benchmarks.sparse_mla --quick --impls cuda \
            --cases "${ABL_CASES:-decode,prefill}" --out "$OUT/ablation_$name" 2>&1 | grep -E "^(decode|prefill|!!!)" | tee -a "$OUT/ablation.log"
        fi
      done ;;
    ncu) ncu_cases cuda "dsv41_(decode|prefill|prefill_f16)_kernel" ncu sass,cuda source "" --import-source yes ;;
    ncu-export)
      for r in ${NCU_REPORTS:-}; do
        b="$(basename "$r" .ncu-rep)"
        run ncu -i "$r" --page source --csv --print-source sass > "$OUT/${b}_sass.csv"
        run ncu -i "$r" --page raw --csv > "$OUT/${b}_raw.csv"
      done ;;
    *) echo "unknown stage $s"; status=2 ;;
  esac
done
exit $status
