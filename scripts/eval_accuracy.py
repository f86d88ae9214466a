#!/usr/bin/env python
"""Offline long-context accuracy: dense vs SnapKV, Quest, oracle top-k, RocketKV.

CLI of `rocketkv_eval.accuracy` (see its docstring for what it measures).
"""

import sys

from rocketkv_eval.accuracy import main

if __name__ == "__main__":
    sys.exit(main())
