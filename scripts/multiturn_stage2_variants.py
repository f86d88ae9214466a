"""Issue 59's Stage 2 ablation: ROCKETKV with Stage 2's page selection
changed in the PyTorch path (``kernel`` torch), to find where the later turns
of the multi-turn chat are lost. A diagnostic, not a product setting: it
patches ``ops.pytorch.select_pages`` in this process.

Two ways to run it:

    # each fact asked as its turn of dense's chat (multiturn_single_turn --chat);
    # a method suffix changes Stage 2: _k2x (top-k pages doubled, any factor),
    # _dense0-2 (every page of the view attended in layers [0, 2))
    .venv/bin/python scripts/multiturn_stage2_variants.py chat --conversations 8 \\
        --doc-tokens 2000-6000 --methods dense,rocketkv,rocketkv_k2x,rocketkv_dense0-11

    # the multi-turn bench itself, top-k scaled for every ROCKETKV engine
    STAGE2_TOPK_SCALE=2 .venv/bin/python scripts/multiturn_stage2_variants.py bench \\
        --conversations 8 --turns 4 --doc-tokens 2000-6000 --fit-dense-conversations 3 \\
        --methods rocketkv+host --host-gib 3 --host-copies async \\
        --rocketkv '{"token_budget": 256, "kernel": "torch"}'

The page choice is otherwise the engine's own (``select_pages``: SPEC §1's
scores, the forced current page); a scaled top-k is capped at the view's pages.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))
sys.path.insert(0, str(ROOT))

# What the running engine's Stage 2 does: top-k scale, layers attending every page.
VARIANT = {"scale": int(os.environ.get("STAGE2_TOPK_SCALE", "1")), "dense": (0, 0), "layer": 0}


def patch_stage2() -> None:
    from vllm.model_executor.models.utils import extract_layer_index

    import rocketkv_vllm.ops.pytorch as ops
    from rocketkv_vllm.backend.impl import RocketKVImpl

    forward = RocketKVImpl.forward

    def forward_noting_layer(self, layer, *args, **kwargs):
        VARIANT["layer"] = extract_layer_index(layer.layer_name)
        return forward(self, layer, *args, **kwargs)

    select = ops.select_pages

    def select_pages(query, kt_cache, pages, topr, num_select, max_select, force_current_page):
        num_pages = pages.tokens.shape[1]
        lo, hi = VARIANT["dense"]
        if lo <= VARIANT["layer"] < hi:
            num_select, max_select = num_select.clone().fill_(num_pages), num_pages
        elif VARIANT["scale"] > 1:
            num_select = num_select * VARIANT["scale"]
            max_select = min(num_pages, max_select * VARIANT["scale"])
        return select(query, kt_cache, pages, topr, num_select, max_select, force_current_page)

    RocketKVImpl.forward = forward_noting_layer
    ops.select_pages = select_pages


def patch_methods() -> None:
    """Method names with a variant suffix: the base method's settings, the
    PyTorch kernel, the variant set for the engine about to start."""
    import rocketkv_eval.accuracy as accuracy

    settings_of = accuracy.method_settings

    def method_settings(method, *args, **kwargs):
        scale = re.fullmatch(r"(.*)_k(\d+)x", method)
        dense = re.fullmatch(r"(.*)_dense(\d+)-(\d+)", method)
        VARIANT["scale"] = int(scale.group(2)) if scale else 1
        VARIANT["dense"] = (int(dense.group(2)), int(dense.group(3))) if dense else (0, 0)
        base = scale.group(1) if scale else dense.group(1) if dense else method
        settings = settings_of(base, *args, **kwargs)
        return None if settings is None else {**settings, "kernel": "torch"}

    accuracy.method_settings = method_settings


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    patch_stage2()
    if mode == "chat":
        patch_methods()
        sys.argv = ["multiturn_single_turn.py", "--chat", *args]
        runpy.run_path(str(ROOT / "scripts/multiturn_single_turn.py"), run_name="__main__")
    elif mode == "bench":
        sys.argv = ["bench_multiturn.py", *args]
        runpy.run_path(str(ROOT / "scripts/bench_multiturn.py"), run_name="__main__")
    else:
        raise SystemExit(f"mode must be chat or bench, not {mode!r}")


if __name__ == "__main__":
    main()
