#!/usr/bin/env python
"""CLI of `rocketkv_eval.fault_campaign` (see its docstring for what it checks)."""

from rocketkv_eval.fault_campaign import main

if __name__ == "__main__":
    main()
