#!/usr/bin/env python
"""Where a decode step's time goes: one in-process engine, torch.profiler.

CLI of `rocketkv_eval.profile_decode` (see its docstring for what it measures).
"""

import sys

from rocketkv_eval.profile_decode import main

if __name__ == "__main__":
    sys.exit(main())
