"""The host emulator of the CUDA kernels (CPU tests only): emu_runtime.h runs every CUDA thread as a fiber,
emu_main.cc compiles the product's kernels (cuda_ffi/csrc/) against it, build.py builds it, emulate.py
runs decodes, prefills and plans through it; sanitize_case.py is the GPU memcheck case of
benchmarks/gpu_check.sh."""
