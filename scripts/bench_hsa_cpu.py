#!/usr/bin/env python
"""Decode attention of one layer on CPU: vLLM's CPU_ATTN kernel over the whole
context against ROCKETKV's Stage 2 over a compressed one (batched PyTorch and
the C++ kernel), with KT pages in the model dtype and in fp8
(``rocketkv.kt_dtype = "fp8_e4m3"``).

CLI of `rocketkv_eval.bench_hsa_cpu` (see its docstring for what it measures).
"""

import sys

from rocketkv_eval.bench_hsa_cpu import main

if __name__ == "__main__":
    sys.exit(main())
