#!/usr/bin/env python
"""What a new vLLM's source tree breaks or changes of ROCKETKV's vLLM tables.

CLI of `rocketkv_vllm.vllm_patches.bump_report` (see its docstring for what it
reads and reports): `python scripts/vllm_bump_report.py PATH/TO/vllm`.
"""

import sys

from rocketkv_vllm.vllm_patches.bump_report import main

if __name__ == "__main__":
    sys.exit(main())
