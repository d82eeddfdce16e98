"""Collectors tests: helper modules whose asserts pytest should explain on failure."""

import pytest

pytest.register_assert_rewrite("tests.collectors.agreement", "tests.helpers.prometheus")
