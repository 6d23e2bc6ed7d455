"""The z3 lemmas: every lemma proved for the profiles it claims, refuted for the others, every
false twin refuted with a counterexample; and the prover itself never calls a failure a proof."""

from __future__ import annotations

import json

import pytest
import z3

from kvspec.conformance.tools.cli import main
from kvspec.spec.lemmas import LEMMAS, Lemma, lemma_by_name
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation, decide_false, decide_true
from kvspec.spec.lemmas.report import DEFAULT_PROFILES, LemmaResult, ProofReport, prove
from kvspec.spec.ordering import profile_rule

# Proving every lemma for every profile takes about half a minute: the heavy stage of scripts/test.sh.
pytestmark = [pytest.mark.z3, pytest.mark.heavy, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def report() -> ProofReport:
    return prove()


def _results(report: ProofReport, number: int, kind: str) -> list[LemmaResult]:
    return [r for r in report.results if r.lemma.number == number and r.kind == kind]


def test_every_lemma_is_proved_for_every_profile_it_claims(report):
    assert report.profiles == DEFAULT_PROFILES
    for lemma in LEMMAS:
        for r in _results(report, lemma.number, "lemma"):
            rule = profile_rule(r.profile) if r.profile else None
            if rule is None or lemma.holds_for(rule):
                # Every lemma is proved for every size: none needed a bound.
                assert r.verdict.status == "proved", (lemma.name, r.profile, r.verdict)
                assert r.verdict.num_obligations >= 1
            else:
                assert r.verdict.status == "refuted", (lemma.name, r.profile, r.verdict)
                assert r.verdict.counterexample


def test_every_false_twin_is_refuted_with_a_readable_pool_state(report):
    twins = [r for r in report.results if r.kind == "twin"]
    assert {r.lemma.number for r in twins} == {lem.number for lem in LEMMAS}
    for r in twins:
        assert r.verdict.status == "refuted", (r.lemma.name, r.profile, r.verdict)
        text = r.verdict.counterexample or ""
        if r.lemma.number not in (5, 9):  # the hit cap's and the window's counterexamples are numbers, not a pool
            assert "num_gpu_blocks=" in text and "free_queue" in text and "ref_cnt" in text, text


def test_profiles_break_exactly_the_lemmas_they_declare(report):
    breaks = {p: [lem.number for lem in report.breaks(p)] for p in report.profiles}
    assert breaks == {
        "vllm-v1": [],
        "vllm-v1-tail": [3],
        "lru-timestamp": [8],  # recency only: the access count is never read
        "block-age": [1, 4, 8],  # the registration is the key: neither a free nor a hit moves a block
        "lfu": [1, 4],  # a deeper or older block with more accesses outlives the others
        "lru-lfu:0.5": [1, 4, 8],  # either way, given enough accesses or enough recency
    }
    assert report.ok


def test_every_lemma_is_checked_under_exactly_the_profiles_it_speaks_of(report):
    checked = {(r.lemma.number, r.profile) for r in report.results if r.kind == "lemma"}
    for lemma in LEMMAS:
        if not lemma.profile_sensitive:
            assert (lemma.number, None) in checked
            continue
        for profile in report.profiles:
            assert ((lemma.number, profile) in checked) == lemma.applies_to(profile_rule(profile)), (lemma, profile)
    assert [lem.number for lem in report.not_applicable("lfu")] == [2, 3]
    assert [lem.number for lem in report.not_applicable("vllm-v1")] == [8]


def test_lemma_7_holds_for_a_weight_too_fine_for_int64_too():
    # Every keyed policy's obligations take the free blocks in any order: the weight plays no part.
    assert prove(["lru-lfu:0.0000000000000000001"], [lemma_by_name("lemma_invariants_inductive")]).ok


def test_twin_counterexamples_show_the_broken_claim(report):
    (lemma3_tail,) = [r for r in _results(report, 3, "lemma") if r.profile == "vllm-v1-tail"]
    text = lemma3_tail.verdict.counterexample or ""
    assert "freed without a hash" in text and "[profile vllm-v1-tail]" in text
    (cap_twin,) = _results(report, 5, "twin")
    assert "num_tokens=" in (cap_twin.verdict.counterexample or "")
    (window_twin,) = _results(report, 9, "twin")
    assert "window=" in (window_twin.verdict.counterexample or "")
    double_free = _results(report, 7, "twin")
    assert all("no ref_cnt check" in (r.verdict.counterexample or "") for r in double_free)
    ignored = _results(report, 10, "twin")  # one per profile: the free that ignores evict_first
    assert {r.profile for r in ignored} == set(report.profiles)
    assert all("ignores evict_first" in (r.verdict.counterexample or "") for r in ignored)


def test_registry_lists_design_lemmas_one_module_each():
    import kvspec.spec.lemmas as package

    assert [lem.number for lem in LEMMAS] == list(range(1, 11))
    assert len({lem.name for lem in LEMMAS}) == len(LEMMAS)
    for lem in LEMMAS:
        assert lem.name.startswith("lemma_")
        assert lem.name in (package.__doc__ or ""), f"{lem.name} is missing from the package's claim table"
        assert lemma_by_name(lem.name) is lem
    with pytest.raises(KeyError, match=r"^\"no lemma named 'lemma_nope'"):
        lemma_by_name("lemma_nope")


def test_report_json_and_text_name_the_slowest_and_the_breaks(report):
    from kvspec.conformance.tools.commands.prove import render_text

    data = report.as_json()
    assert data["ok"] is True
    assert data["breaks"]["vllm-v1-tail"] == ["lemma_unhashed_free_evicted_first"]
    assert data["breaks"]["lru-timestamp"] == ["lemma_fewer_accesses_evicted_first"]
    assert data["not_applicable"]["vllm-v1"] == ["lemma_fewer_accesses_evicted_first"]
    assert data["slowest"]["lemma"] == report.slowest.lemma.name
    assert len(data["results"]) == len(report.results)
    json.dumps(data)  # plain JSON values only
    text = render_text(report)
    assert "slowest: lemma" in text
    assert "profile vllm-v1-tail breaks lemma 3 (lemma_unhashed_free_evicted_first)" in text
    assert "profile vllm-v1 breaks no lemma" in text
    assert "refuted, as it must be" in text and "FAILED" not in text
    print(text.splitlines()[-1])  # the timing line, for the log


def test_prove_cli_json_for_one_lemma(capsys):
    assert main(["prove", "--lemma", "lemma_hit_cap_within_prompt", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["lemma"], r["kind"], r["status"]) for r in data["results"]] == [
        ("lemma_hit_cap_within_prompt", "lemma", "proved"),
        ("lemma_hit_cap_within_prompt", "twin", "refuted"),
    ]


def test_prove_cli_profile_and_lemma_by_number(capsys):
    assert main(["prove", "--profile", "vllm-v1-tail", "--lemma", "3"]) == 0
    out = capsys.readouterr().out
    assert "refuted: the profile breaks it" in out
    assert "profile vllm-v1-tail breaks lemma 3" in out


def test_prove_cli_rejects_unknown_profile_and_lemma(capsys):
    assert main(["prove", "--profile", "lru-someday"]) == 2
    assert "unknown profile='lru-someday'" in capsys.readouterr().err
    assert main(["prove", "--lemma", "lemma_nope"]) == 2
    assert "unknown lemma='lemma_nope'" in capsys.readouterr().err


def test_prove_gives_no_verdict_when_no_lemma_speaks_of_the_profiles(capsys):
    assert main(["prove", "--profile", "vllm-v1", "--lemma", "8"]) == 2
    err = capsys.readouterr().err
    assert "nothing was checked" in err and "keyed profiles" in err and "Traceback" not in err


def test_prove_cli_names_what_each_keyed_profile_breaks(capsys):
    assert main(["prove", "--profile", "lfu", "--lemma", "1", "--lemma", "8"]) == 0
    out = capsys.readouterr().out
    assert "profile lfu breaks lemma 1 (lemma_tail_first_free_evicts_deeper_first)" in out
    assert "stamps after:" in out and "the deeper block" in out


# --- the prover never passes what is not a proof ---------------------------------------------------


def _obligation(name: str, hypotheses, claim, bound: int | None = None) -> Obligation:
    return Obligation(name, lambda u: Formula(hypotheses(u), claim(u), lambda m: f"model: {m}"), bound)


def test_unknown_is_a_failure_not_a_proof():
    # Fermat's n = 3 over the integers: nonlinear, and beyond z3 within a second.
    def hyp(u: Universe):
        x, y, w = z3.Ints("x y w")
        return [x > 0, y > 0, w > 0]

    def claim(u: Universe):
        x, y, w = z3.Ints("x y w")
        return x * x * x + y * y * y != w * w * w

    verdict = decide_true([_obligation("fermat 3", hyp, claim)], timeout_s=0.5, max_bound=1)
    assert verdict.status == "unknown"
    lemma = LEMMAS[0]
    assert not LemmaResult(lemma, None, "lemma", "holds", verdict).ok
    assert not LemmaResult(lemma, None, "twin", "fails", verdict).ok


def test_contradictory_hypotheses_are_vacuous_not_proved():
    def hyp(u: Universe):
        x = u.size("x")
        return [x > 3, x < 2]

    verdict = decide_true([_obligation("vacuous", hyp, lambda u: z3.BoolVal(False))])
    assert verdict.status == "vacuous"
    assert not LemmaResult(LEMMAS[0], None, "lemma", "holds", verdict).ok


def test_bounded_obligation_is_reported_bounded_never_proved():
    def hyp(u: Universe):
        return [u.size("n") >= 0]

    verdict = decide_true([_obligation("small", hyp, lambda u: z3.BoolVal(True), bound=3)])
    assert verdict.status == "bounded" and verdict.bound == 3
    r = LemmaResult(LEMMAS[0], None, "lemma", "holds", verdict)
    assert r.ok and r.status_text.startswith("bounded (n <= 3)") and "proved" not in r.status_text


def test_a_true_claim_posing_as_a_twin_fails():
    def hyp(u: Universe):
        return [u.size("n") >= 1]

    verdict = decide_false([_obligation("true", hyp, lambda u: z3.BoolVal(True))])
    assert verdict.status == "proved"
    assert not LemmaResult(LEMMAS[0], None, "twin", "fails", verdict).ok


def test_lemma_type_is_the_registry_entry():
    assert all(isinstance(lem, Lemma) for lem in LEMMAS)


def _fermat_unknown():
    """z3's own `unknown`: Fermat's n = 3 over the integers, beyond it within half a second."""

    def hyp(u: Universe):
        x, y, w = z3.Ints("x y w")
        return [x > 0, y > 0, w > 0]

    def claim(u: Universe):
        x, y, w = z3.Ints("x y w")
        return x * x * x + y * y * y != w * w * w

    verdict = decide_true([_obligation("fermat 3", hyp, claim)], timeout_s=0.5, max_bound=1)
    assert verdict.status == "unknown"
    return verdict


def test_prove_cli_exits_2_when_z3_gives_up_and_1_only_for_a_wrong_answer(monkeypatch, capsys):
    # z3 giving up is no verdict (exit 2, as `kvspec contracts` for a condition it could not search); it
    # exited 1, the code of a wrong answer. Which lemma z3 gives up on depends on the machine, so the run is
    # handed z3's real unknown on one that cannot be decided.
    import kvspec.spec.lemmas.report as lemma_report

    unknown = LemmaResult(LEMMAS[0], None, "lemma", "holds", _fermat_unknown())
    vacuous = LemmaResult(LEMMAS[0], None, "twin", "fails", decide_true([_obligation(
        "vacuous", lambda u: [u.size("x") > 3, u.size("x") < 2], lambda u: z3.BoolVal(False))]))  # fmt: skip
    assert vacuous.verdict.status == "vacuous"
    for results, code, says in [
        ((unknown,), 2, "NO ANSWER (z3 gave up; a larger --timeout may answer): lemma 1 lemma"),
        ((unknown, vacuous), 1, "FAILED: lemma 1 twin"),
    ]:
        ran = ProofReport(profiles=("vllm-v1",), results=results, seconds=0.5)
        monkeypatch.setattr(lemma_report, "prove", lambda *args, ran=ran, **kwargs: ran)
        assert main(["prove", "--lemma", "1"]) == code
        out = capsys.readouterr().out
        assert says in out and "unknown  NO ANSWER" in out, out
        assert main(["prove", "--lemma", "1", "--json"]) == code
        assert json.loads(capsys.readouterr().out)["ok"] is False
