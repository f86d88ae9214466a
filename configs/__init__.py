"""Preset YAML files for `{"rocketkv": {"preset": NAME}}` (shipped as package data)."""
