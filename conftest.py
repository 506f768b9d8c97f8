"""Root conftest: every test in the repo gets the shared fixtures and markers of miles.common.testing."""

pytest_plugins = ["miles.common.testing.pytest_plugin"]
