set -u
G=/tmp/g; mkdir -p $G
ncu -i prof/decode_b191a70.ncu-rep --page source --csv --print-source sass > $G/b191_sass.csv 2>&1
ncu -i prof/decode_b191a70.ncu-rep --page raw --csv > $G/b191_raw.csv 2>&1
python3 -m cuda_ffi.build --archs 90a --out-dir /tmp/dsv41_neither --build-dir /tmp/dsv41_bn --define DSV41_EXP_NO_GATHER --define DSV41_EXP_NO_MMA > $G/build.log 2>&1 || tail -5 $G/build.log
DSV41_CUDA_LIB=/tmp/dsv41_neither/libdsv41_cuda.so timeout 300 ncu --clock-control none --set full --import-source yes -k regex:"dsv41_decode_kernel" --launch-skip 1 --launch-count 1 -f -o $G/neither python3 -m benchmarks.sparse_mla --cases decode_headline_h128 --impls cuda --sets 1 --iterations 2 --timer wall --out $G/nb > $G/ncu.log 2>&1; tail -3 $G/ncu.log
ncu -i $G/neither.ncu-rep --page source --csv --print-source sass > $G/neither_sass.csv 2>&1
ncu -i $G/neither.ncu-rep --page raw --csv > $G/neither_raw.csv 2>&1
cd $G && tar czf $OUT/ncu.tgz b191_sass.csv b191_raw.csv neither_sass.csv neither_raw.csv && cp neither.ncu-rep $OUT/ && ls -la $OUT
