"""The vLLM environment check's findings (the ``vllm_env`` property each passing test records), repeated in the
terminal summary so they show without ``-s``: a release that passes only with relaxed pins says so there."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    lines = [value for report in terminalreporter.stats.get("passed", [])
             for name, value in getattr(report, "user_properties", ()) if name == "vllm_env"]
    if lines:
        terminalreporter.write_sep("-", "vllm environment")
        for line in lines:
            terminalreporter.write_line(line)
