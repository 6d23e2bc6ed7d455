"""Long campaigns (KVSPEC_SLOW=1): the built-in implementations conform and every expected branch is reached."""

import pytest

from kvspec.conformance.runner.run import run_check


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["vllm-v1", "vllm-v1-tail"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching-on", "caching-off"])
@pytest.mark.parametrize("level", ["pool", "manager"])
@pytest.mark.parametrize("impl, examples", [("reference", 1000), ("spec", 400)])
def test_a_long_campaign_conforms_and_reaches_every_branch(impl, examples, level, caching, profile, tmp_path):
    r = run_check(impl, level=level, enable_caching=caching, profile=profile, max_examples=examples, trace_dir=tmp_path)
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    assert not r.unreached, r.unreached
    assert r.steps_run > 10 * examples
