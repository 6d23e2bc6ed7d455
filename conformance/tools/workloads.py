"""Built-in workload families for `kvspec simulate`, each seeded and described by its parameters.

Token ids are drawn from disjoint ranges per kind of text (system prompts,
documents, user turns, replies), so two requests share a prefix only where
the family says they do. Every family takes a seed and returns the same
requests for the same seed.

- `chat`: shared system prompts with multi-turn conversations; turn t's
  prompt is turn t-1's prompt, its reply and a new user message, so each turn
  can hit the whole previous turn (where it is still cached).
- `rag`: a shared document set; each query's prompt is a system prompt, a
  few documents, then the question.
- `few-shot`: a few long templates (instructions and examples), each request
  one template and a short question.
- `none`: independent prompts, no sharing: a hit rate of 0 is the floor.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvspec.conformance.tools.simulate import SimRequest

__all__ = ["WORKLOADS", "Family", "builtin_workload"]


class _Text:
    """Random token runs from one range of the vocabulary (one kind of text)."""

    def __init__(self, rng: random.Random, base: int) -> None:
        self.rng, self.base = rng, base

    def run(self, length: int) -> tuple[int, ...]:
        return tuple(self.base + self.rng.randrange(1_000_000) for _ in range(length))


def _chat(rng: random.Random) -> list[SimRequest]:
    """60 conversations of 1 to 5 turns over 3 system prompts of 300 tokens; user turns 20-100 tokens,
    replies 20-150; a conversation starts every 3 steps and its turns come 60 steps apart."""
    system, user, reply = _Text(rng, 0), _Text(rng, 10_000_000), _Text(rng, 20_000_000)
    prompts = [system.run(300) for _ in range(3)]
    out = []
    for c in range(60):
        history = rng.choice(prompts)
        for t in range(rng.randint(1, 5)):
            prompt = history + user.run(rng.randint(20, 100))
            answer = reply.run(rng.randint(20, 150))
            out.append(SimRequest(prompt, answer, arrival=3 * c + 60 * t))
            history = prompt + answer
    return out


def _rag(rng: random.Random) -> list[SimRequest]:
    """200 queries over 12 documents of 500 tokens, 2 documents each (in a random order), after a
    system prompt of 100 tokens; questions 10-50 tokens, answers 20-80; one query per step."""
    text, question, answer = _Text(rng, 0), _Text(rng, 10_000_000), _Text(rng, 20_000_000)
    system = text.run(100)
    documents = [text.run(500) for _ in range(12)]
    out = []
    for q in range(200):
        docs = rng.sample(documents, 2)
        prompt = system + docs[0] + docs[1] + question.run(rng.randint(10, 50))
        out.append(SimRequest(prompt, answer.run(rng.randint(20, 80)), arrival=q))
    return out


def _few_shot(rng: random.Random) -> list[SimRequest]:
    """250 requests over 4 templates of 400 tokens; questions 10-60 tokens, answers 5-40; one per step."""
    text, question, answer = _Text(rng, 0), _Text(rng, 10_000_000), _Text(rng, 20_000_000)
    templates = [text.run(400) for _ in range(4)]
    return [
        SimRequest(rng.choice(templates) + question.run(rng.randint(10, 60)), answer.run(rng.randint(5, 40)), arrival=i)
        for i in range(250)
    ]


def _no_sharing(rng: random.Random) -> list[SimRequest]:
    """200 independent prompts of 100-600 tokens, answers 20-100; one per step."""
    text, answer = _Text(rng, 0), _Text(rng, 20_000_000)
    return [
        SimRequest(text.run(rng.randint(100, 600)), answer.run(rng.randint(20, 100)), arrival=i) for i in range(200)
    ]


@dataclass(frozen=True, slots=True)
class Family:
    """A built-in workload family: its generator (its docstring gives the parameters)."""

    name: str
    build: Callable[[random.Random], list[SimRequest]]

    @property
    def description(self) -> str:
        """The parameters, in words."""
        return " ".join((self.build.__doc__ or "").split())


WORKLOADS: dict[str, Family] = {
    f.name: f
    for f in (Family("chat", _chat), Family("rag", _rag), Family("few-shot", _few_shot), Family("none", _no_sharing))
}


def builtin_workload(name: str, seed: int = 0) -> list[SimRequest]:
    """The requests of a built-in family for `seed`.

    Raises:
        KeyError: no such family (the message lists them).
    """
    if name not in WORKLOADS:
        raise KeyError(f"no built-in workload {name!r}; built in: {', '.join(WORKLOADS)}")
    return WORKLOADS[name].build(random.Random(seed))
