"""What a generic gather of a decode case's selected fp8_ds_mla records reaches on this GPU: the ceiling the
decode's producers are measured against (the copy bandwidth assumes streaming access, the decode reads
scattered 576-byte records).

    python -m benchmarks.gather_ceiling [--cases fm_decode_b128_h8_k128p256+512p64,...]

For each FlashMLA-style case (benchmarks/flashmla_cases.py; the same draw as the comparison) it takes every
attended record of both pools (each (request, query token) reads its own selection, as the decode does),
and times `torch.index_select` of their 576 data bytes (the pool viewed as rows of 576 bytes: fp8_ds_mla
pages are a whole number of such rows) into a contiguous buffer, in the indices' order and sorted, plus a
contiguous copy of the same byte count; CUPTI kernel time per call after an L2 flush. Needs a CUDA GPU and
PyTorch. Reported, not recorded by itself: quote it in benchmarks/RESULTS.md with the commit.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch's allocator needs room too

__all__ = ["record_rows", "main"]


def record_rows(indices, block_size: int, lengths=None):
    """int64 [n]: the 576-byte data row of every attended record of one pool (-1 entries and those past
    `lengths` [b] left out), in the order a decode reads them (request, query token, position)."""
    import numpy as np

    from dsv41_jax import kv_cache as kvc

    idx = np.asarray(indices).astype(np.int64)  # [b, s_q, topk]
    keep = idx >= 0
    if lengths is not None:
        keep &= np.arange(idx.shape[-1])[None, None, :] < np.asarray(lengths)[:, None, None]
    rows_per_page = kvc.page_bytes("fp8_ds_mla", block_size) // 576
    sel = idx[keep]
    return (sel // block_size) * rows_per_page + sel % block_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gather_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="fm_decode_b128_h8_k128p256+512p64,fm_decode_b256_h8_k128p256+512p64")
    ap.add_argument("--iterations", type=int, default=10)
    a = ap.parse_args(argv)

    import jax
    import numpy as np
    import torch

    from benchmarks import flashmla_cases as F
    from benchmarks.cupti import kernel_times
    from benchmarks.flashmla_compare import copy_gbps

    copy_bw = copy_gbps()
    print(f"# copy bandwidth {copy_bw:.0f} GB/s (read + write); device {jax.devices()[0].device_kind}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for case in F.select_cases(a.cases):
        x = F.decode_inputs(case)
        pools = [(x["kv_cache"], x["indices"], case.block_size, None)]
        if case.extra_topk:
            pools.append((x["extra_kv_cache"], x["extra_indices"], case.extra_block_size, x["extra_topk_length"]))
        srcs, idxs = [], []
        for cache, ind, bs, lens in pools:
            rows = record_rows(ind, bs, lens)
            flat = torch.from_dlpack(jax.block_until_ready(cache)).reshape(-1)
            srcs.append(flat.view(torch.int32).reshape(-1, 144))  # rows of 576 bytes
            idxs.append(rows)
        n = sum(len(r) for r in idxs)
        mb = n * 576 / 1e6
        dst = [torch.empty((len(r), 144), dtype=torch.int32, device="cuda") for r in idxs]
        stream = torch.empty(n * 144, dtype=torch.int32, device="cuda")
        stream_dst = torch.empty_like(stream)
        for label, order in (("selection order", lambda r: r), ("sorted", np.sort)):
            ti = [torch.as_tensor(order(r), device="cuda") for r in idxs]

            def run():
                for s, i, d in zip(srcs, ti, dst):
                    torch.index_select(s, 0, i, out=d)

            us, _ = kernel_times(run, sync=torch.cuda.synchronize, iterations=a.iterations, flush=flush.zero_)
            print(f"{case.name:44s} gather ({label:15s}) {n} records, {mb:.1f} MB read: {us:7.1f} us = "
                  f"{mb / us * 1e3:6.0f} GB/s read, {2 * mb / us * 1e3:6.0f} GB/s read + write "
                  f"({2 * mb / us * 1e3 / copy_bw:.2f} of copy)", flush=True)
        # (an elementwise kernel: copy_ is a memcpy, which CUPTI's kernel records do not hold)
        us, _ = kernel_times(lambda: torch.add(stream, 1, out=stream_dst), sync=torch.cuda.synchronize,
                             iterations=a.iterations, flush=flush.zero_)
        print(f"{case.name:44s} contiguous copy of the same bytes: {us:7.1f} us = {2 * mb / us * 1e3:6.0f} GB/s "
              f"read + write", flush=True)
        del x, srcs, dst, stream, stream_dst
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
