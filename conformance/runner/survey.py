"""What an implementation does with each caller mistake, measured: the source of an adapter's declared reactions.

`survey_reactions` runs the conformance machine with every mistake sent to a
replica (so that whatever the implementation does, the example goes on) and
counts, per mistake, the reactions seen (kvspec.conformance.core.reactions). One
reaction per mistake is what an adapter can declare; a mistake seen with two
shows that it must be split, or that the implementation reacts by state.
vLLM's declared reactions (kvspec.conformance.targets.vllm.reactions: `pool_reactions`,
`manager_reactions`) were measured this way, and tests survey the releases
again and compare.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.core.lockstep import Factory, Observer
from kvspec.conformance.core.machine import conformance_machine

__all__ = ["survey_reactions"]


def survey_reactions(
    factory: Factory,
    level: str = "pool",
    enable_caching: bool = True,
    max_examples: int = 200,
    seed: int = 0,
    profile: str = "vllm-v1",
    groups: str = "full",
) -> dict[str, Counter[str]]:
    """Mistake -> reaction seen (in `Reaction.describe` words) -> times, over one campaign.

    ``groups`` is the managers' KV cache group layout (a reaction may depend on it: see
    `kvspec.conformance.targets.vllm.reactions.manager_reactions`).

    Raises:
        kvspec.conformance.core.lockstep.ConformanceFailure: a valid call diverged (no survey of a wrong
            implementation).
    """
    observer = Observer(survey={})
    machine = conformance_machine(factory, level, enable_caching, profile, observer=observer, groups=groups)
    run_state_machine_as_test(
        machine,
        settings=settings(
            # No targeting: its hill-climb on cached-block reuse spends the examples on valid
            # calls (a 200-example survey of the reference then saw most allocate_slots mistakes
            # never); a survey wants every mistake, in as many states as it can.
            phases=[Phase.explicit, Phase.generate],
            max_examples=max_examples,
            deadline=None,
            database=None,
            derandomize=seed == 0,
            suppress_health_check=list(HealthCheck),
            stateful_step_count=30,
        ),
    )
    assert observer.survey is not None, "the survey was dropped"
    return observer.survey
