"""Three cuda decodes (fp8 main + extra cache, split plan; h 64, and h 128 and 100 as 2-CTA pairs), the V4.1 decodes,
four mega decodes, two prefills (bf16 rows: prefill_cta, h 40; f16 rows: the seesaw CTA, h 100: two head groups,
the last partial; varying lengths) and two mega prefills of the same kinds, for
`compute-sanitizer --tool memcheck python -m tests.cuda_emulator.sanitize_case` (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import sys
from unittest import mock

import jax
import numpy as np

import dsv41_jax as d
from tests.attention_cases import make_decode_case, make_prefill_case


def main() -> int:
    extra = dict(topk=128, block_size=2, fmt="fp8_ds_mla")
    decodes = [
        ("sanitizer decode", make_decode_case(5, b=6, s_q=2, h_q=64, topk=256, block_size=61, s_kv=600,
                                              fmt="fp8_ds_mla", extra=extra)),
        # h_q = 128: two head groups run as 2-CTA clusters (bulk copies into the peer, cluster mbarriers)
        ("sanitizer decode (pair)", make_decode_case(7, b=3, s_q=2, h_q=128, topk=200, block_size=61, s_kv=400,
                                                     fmt="fp8_ds_mla", extra=extra)),
        # h_q = 100: the same pair, its second group of 36 heads (q and the results unpadded)
        ("sanitizer decode (pair, 100 heads)", make_decode_case(9, b=3, s_q=2, h_q=100, topk=200, block_size=61,
                                                                s_kv=400, fmt="fp8_ds_mla", extra=extra)),
        # the V4.1 kernels (mxfp8_ds_mla main, nvfp4_ds_mla extra): one CTA, a pair, the narrow CTA
    ] + [(f"sanitizer decode (V4.1, {h} heads)",
          make_decode_case(11 + h, b=3, s_q=2, h_q=h, topk=200, block_size=61, s_kv=400, fmt="mxfp8_ds_mla",
                           extra=dict(topk=128, block_size=2, fmt="nvfp4_ds_mla"))) for h in (64, 128, 8)]
    for what, dec in decodes:
        out, lse = jax.block_until_ready(d.sparse_mla_decode(*dec.args(), **dec.kwargs(), impl="cuda"))
        dec.check(out, lse, what)
    from cuda_ffi import ops as _ops

    # head counts that leave a partial last group (40; 64 + 36): q and the results as they are, the missing
    # heads neither read nor written
    prefills = [("bf16", make_prefill_case(6, s_q=9, h_q=40, topk=256, s_kv=300)),
                ("f16", make_prefill_case(8, s_q=5, h_q=100, topk=320, s_kv=300, sink="inf"))]
    for rows, pre in prefills:
        with mock.patch.object(_ops, "prefill_kv_f16", lambda *a, f16=rows == "f16": f16):
            res = jax.block_until_ready(d.sparse_mla_prefill(*pre.args(), **pre.kwargs(), impl="cuda"))
        pre.check(res, f"sanitizer prefill ({rows} rows)")
    # the mega decode: its staged epilogue (300 one-token requests, most unsplit: h 64, and h 128 as pairs) and the
    # combine's output stage (the narrow CTA, h 8; split requests)
    from tests.attention_cases import assert_mega_close, make_mega_case

    for h, b in ((64, 300), (128, 300), (8, 40), (64, 4)):
        mega = make_mega_case(20 + h, b=b, h_q=h, topk=128, block_size=61, s_kv=400, fmt="mxfp8_ds_mla",
                              extra=dict(topk=128, block_size=2, fmt="nvfp4_ds_mla"))
        res = jax.block_until_ready(d.sparse_mla_mega_decode(*mega.args(), **mega.kwargs(), impl="cuda"))
        assert_mega_close(*res, mega.expected(), f"sanitizer mega decode ({h} heads, {b} tokens)")
    # the mega prefill over both prefill kernels, partial last groups (its staged epilogue writes rows < h only)
    from tests.attention_cases import make_mega_prefill_case

    for rows, h in (("bf16", 40), ("f16", 100)):
        mp = make_mega_prefill_case(30 + h, s_q=7, h_q=h, topk=256, s_kv=300)
        with mock.patch.object(_ops, "prefill_kv_f16", lambda *a, f16=rows == "f16": f16):
            res = jax.block_until_ready(d.sparse_mla_mega_prefill(*mp.args(), **mp.kwargs(), impl="cuda"))
        assert_mega_close(*res, mp.expected(), f"sanitizer mega prefill ({rows} rows, {h} heads)", kind="prefill")
    print("sanitize_case: decodes, mega decodes, prefills and mega prefills ran and matched the oracle",
          np.asarray(out).shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
