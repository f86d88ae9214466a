"""Wrappers of vLLM's NIXL connector (disaggregated prefill and decode,
``rocketkv_vllm.pd``), with their rows of ``PATCHES``."""

from __future__ import annotations

from rocketkv_vllm.vllm_patches.check import Patch


def _register_kv_caches(original):
    def register_kv_caches(self, kv_caches):
        from rocketkv_vllm.engine import is_rocketkv_engine

        if is_rocketkv_engine(self.vllm_config):
            from rocketkv_vllm.pd import whole_block_rows

            kv_caches = whole_block_rows(kv_caches)
        return original(self, kv_caches)

    return register_kv_caches


PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
        "NixlBaseConnectorWorker",
        "register_kv_caches",
        ("self", "kv_caches"),
        _register_kv_caches,
        "a ROCKETKV engine registers each layer's whole block rows (K/V and the KT "
        "pages in their padding) with NIXL: its K/V views skip the padding, which "
        "vLLM's region check cannot partition (pd.whole_block_rows)",
    ),
)
