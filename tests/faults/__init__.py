"""Fault tests: shard kills, SIGTERM under load, a faulty network, adversarial requests, connection churn.

Each test runs short in a plain run and long under ``pytest -m slow`` (``tests.profiles.long_run``).
"""
