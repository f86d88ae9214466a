#!/usr/bin/env python
"""CLI of `rocketkv_eval.capacity` (see its docstring for what it measures)."""

import sys

from rocketkv_eval.capacity import main

if __name__ == "__main__":
    sys.exit(main())
