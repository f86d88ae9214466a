"""Evaluation, demo and benchmark helpers for rocketkv-vllm.

Not part of the vLLM plugin: nothing in ``rocketkv_vllm`` imports this
package, so vLLM processes never load it. Scripts and tests import it.
"""
