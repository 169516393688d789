"""Tests that run ranks on several test hosts; the library they use is
tests/support/cluster.py."""
