"""The loopback-only network namespace runner, shared with the benchmarks (see
``bench/_netns.py``): every libwebrtc scenario of the suite runs through it."""

from bench._netns import ROOT, run_isolated, unavailable

__all__ = ["ROOT", "run_isolated", "unavailable"]
