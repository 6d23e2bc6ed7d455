"""An adapter's `not_applicable` declaration: the machine leaves the feature out and says so.

The implementation here is the reference KVCacheManager with its cache_salt
taken away: it refuses a salted request, as a vLLM release before 0.9.0 must
(its Request takes no cache_salt). Declared, the harness sends it no salted
request and lists the feature as not applicable; undeclared, the same
implementation is caught at the first salted request, so the declaration is
what makes the difference.

The same holds for a trailing parameter at the pool level: a pool whose
free_blocks predates vLLM 0.34.0's evict_first is never sent it and is told
so, and one that takes it is sent it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.branches import EVICT_FIRST_OUTCOME
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.builtin import ReferenceManagerAdapter, ReferencePoolAdapter
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockId

# Enough examples that a salted prompt is drawn many times over (salts are one
# draw in three of a prompt's keys, and more in the "other keys" rule).
N = 25


class _RefusingManager(ReferenceManagerAdapter):
    """The reference manager refusing, before any change, requests with a feature it lacks (`_refuse`)."""

    def _refuse(self, request: Request) -> None:
        """Raise the refusal for a request that uses the feature; each subclass defines it (the base is never built)."""
        raise NotImplementedError(f"{type(self).__name__} must define _refuse")

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        self._refuse(request)
        return super().get_computed_blocks(request)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        self._refuse(request)
        return super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens
        )


class NoSaltManager(_RefusingManager):
    """The reference manager without cache_salt: a salted request is refused before any change."""

    def _refuse(self, request: Request) -> None:
        if request.cache_salt is not None:
            raise InvalidRequest(
                f"request_id={request.request_id!r} has cache_salt={request.cache_salt!r}; this manager takes none"
            )


class DeclaredNoSaltManager(NoSaltManager):
    """The same, declaring it (as the vLLM adapter does for releases before 0.9.0)."""

    not_applicable = {"cache_salt": "this manager's requests take no cache_salt"}


def make_undeclared(config: AdapterConfig) -> NoSaltManager:
    return NoSaltManager(config)


def make_declared(config: AdapterConfig) -> DeclaredNoSaltManager:
    return DeclaredNoSaltManager(config)


def test_an_undeclared_missing_cache_salt_is_caught(tmp_path: Path) -> None:
    r = run_check(make_undeclared, level="manager", max_examples=N, trace_dir=tmp_path, impl="no-salt")
    assert r.verdict == "diverges", r.message
    assert r.failure is not None and "cache_salt" in r.failure.message


def test_a_declared_missing_cache_salt_is_left_out_and_listed(tmp_path: Path) -> None:
    r = run_check(make_declared, level="manager", max_examples=N, trace_dir=tmp_path, impl="no-salt", cover_rounds=10)
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    assert "cache_salt: not applicable, this manager's requests take no cache_salt" in r.not_exercised
    # Everything else still ran: LoRA and multimodal keys, prefix hits, preemption.
    assert r.coverage.get("allocate_slots: admitted with a prefix hit"), r.coverage


class TextOnlyManager(_RefusingManager):
    """The reference manager for a text-only engine: a request with images is refused before any change."""

    not_applicable = {"multimodal inputs": "this manager serves text only"}
    seen_images = 0  # requests with multimodal inputs that reached it (the declaration must make it 0)

    def _refuse(self, request: Request) -> None:
        if request.mm_inputs:
            type(self).seen_images += 1
            raise InvalidRequest(f"request_id={request.request_id!r} has multimodal inputs; this manager takes none")


def test_declared_missing_multimodal_inputs_send_no_image_and_no_misplaced_image(tmp_path: Path) -> None:
    TextOnlyManager.seen_images = 0
    # More rounds while a branch is unreached (they stop once every branch is reached).
    r = run_check(
        TextOnlyManager, level="manager", max_examples=N, trace_dir=tmp_path, impl="text-only", cover_rounds=10
    )
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    assert TextOnlyManager.seen_images == 0
    assert "multimodal inputs: not applicable, this manager serves text only" in r.not_exercised
    assert not any("misplaced images" in m for m in r.mistakes_checked), r.mistakes_checked
    assert r.coverage.get("allocate_slots: admitted with a prefix hit"), r.coverage


class PoolBeforeEvictFirst(ReferencePoolAdapter):
    """The reference pool with the free_blocks of a vLLM before 0.34.0: no evict_first parameter."""

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        super().free_blocks(ordered_block_ids)


def test_a_pool_whose_free_blocks_takes_no_evict_first_is_told_so_and_still_covered(tmp_path: Path) -> None:
    r = run_check(PoolBeforeEvictFirst, level="pool", max_examples=100, trace_dir=tmp_path, impl="old-pool")
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    assert "evict first: not applicable, the adapter's free_blocks takes no evict_first" in r.not_exercised
    assert f"free_blocks: {EVICT_FIRST_OUTCOME}" not in r.unreached  # only a call with it reaches it
    assert not r.coverage.get(f"free_blocks: {EVICT_FIRST_OUTCOME}")


@pytest.mark.heavy
def test_a_pool_whose_free_blocks_takes_evict_first_is_sent_it(tmp_path: Path) -> None:
    # Sent it, and compared: the reference conforms only if every such free reaches it.
    r = run_check(ReferencePoolAdapter, level="pool", max_examples=100, trace_dir=tmp_path, impl="new-pool")
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    assert not any(n.startswith("evict first") for n in r.not_exercised), r.not_exercised
    assert r.coverage.get(f"free_blocks: {EVICT_FIRST_OUTCOME}"), r.coverage
