import pytest

# _workers.disagreement asserts for the tests here: show its failures as pytest shows a test's own
pytest.register_assert_rewrite("_workers")
