"""Test oracles: plain-PyTorch references the product is checked against,
kept out of the wheel (``test_packaging`` proves it). Imported by the tests
as ``from reference import paged`` (pytest puts ``tests/`` on ``sys.path``)."""
