"""The suite's skip policy (tests/helpers/skip_policy.py): a skip fails the run unless the test is opt-in or about a
platform, so a comparison whose reference is missing cannot pass CI unseen."""

from __future__ import annotations

TESTS = '''
import pytest

def test_reference_missing():
    pytest.skip("the reference library is not installed")

@pytest.mark.opt_in("TORCHLIKE_VLLM_PYTHON")
def test_opt_in():
    pytest.skip("not asked for")

@pytest.mark.platform("glibc")
@pytest.mark.skipif(True, reason="not glibc")
def test_platform():
    pass

@pytest.mark.skipif(True, reason="condition")
def test_unmarked_skipif():
    pass

@pytest.mark.xfail(strict=True)
def test_expected_failure():
    assert False
'''


def test_a_skip_fails_with_its_reason_unless_the_test_is_opt_in_or_about_a_platform(pytester):
    pytester.makepyfile(test_inner=TESTS)
    result = pytester.runpytest_inprocess("-p", "tests.helpers.skip_policy", "-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=0, failed=1, errors=1, skipped=2, xfailed=1)
    result.stdout.fnmatch_lines(["*the reference library is not installed*", "*The suite allows no skip*"])
    assert "FAILED test_inner.py::test_reference_missing" in result.stdout.str()
    assert "ERROR test_inner.py::test_unmarked_skipif" in result.stdout.str()


def test_a_module_skipped_at_import_fails_collection(pytester):
    pytester.makepyfile(test_inner="import pytest\npytest.importorskip('no_such_module_for_torchlike')\n")
    result = pytester.runpytest_inprocess("-p", "tests.helpers.skip_policy", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*could not import 'no_such_module_for_torchlike'*"])
