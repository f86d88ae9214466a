"""RocketKV KV-cache compression as a vLLM attention backend (``ROCKETKV``)."""

__version__ = "0.1.0"
