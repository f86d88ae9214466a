#!/usr/bin/env python
"""Paired comparison of accuracy cells (McNemar), pooled over seeds.

CLI of `rocketkv_eval.compare` (see its docstring).
"""

import sys

from rocketkv_eval.compare import main

if __name__ == "__main__":
    sys.exit(main())
