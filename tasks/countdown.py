"""Countdown: reach a target from given numbers with + - * / and parentheses.

Many different expressions are correct, so the verifier evaluates the completion
(with a small recursive-descent parser over exact fractions, never eval) instead of
comparing it to one reference. Each given number may be used at most once.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction
from typing import Annotated

import msgspec

from tasks.base import Problem, Verdict, is_held_out, register_task

_QUESTION = re.compile(r"target (\d+) numbers (\d+(?: \d+)*)")
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
MAX_EXPRESSION_CHARS = 200  # bounds parser work and recursion depth on hostile input


class CountdownConfig(msgspec.Struct, tag="countdown", tag_field="kind", forbid_unknown_fields=True, frozen=True):
    """Puzzles over `n_numbers` numbers in [1, max_number] with a reachable target."""

    n_numbers: Annotated[int, msgspec.Meta(ge=2, le=6)] = 3  # numbers given in a puzzle
    max_number: Annotated[int, msgspec.Meta(ge=2, le=1000)] = 9  # largest number given (drawn from 1..max_number)
    max_target: Annotated[int, msgspec.Meta(ge=2)] = 100  # largest target a puzzle asks for
    use_all: bool = False  # require every number in the answer (harder; fewer solutions)
    eval_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.1  # questions held out
    seed: int = 0  # seeds the puzzle drawn for each problem id (whether a puzzle is held out depends on it alone)


@register_task("countdown", CountdownConfig)
class CountdownTask:
    """Question "target T numbers a b c"; answer: an expression equal to T."""

    name = "countdown"

    def __init__(self, config: CountdownConfig) -> None:
        self.config = config

    def problem(self, prompt_id: int) -> Problem:
        return self._draw(prompt_id, held_out=False)

    def eval_problem(self, index: int) -> Problem:
        return self._draw(index, held_out=True)

    def _draw(self, index: int, held_out: bool) -> Problem:
        """Numbers, then a random expression over them; its value is the target."""
        cfg = self.config
        rng = random.Random(f"countdown:{cfg.seed}:{'eval' if held_out else 'train'}:{index}")
        while True:
            numbers = [rng.randint(1, cfg.max_number) for _ in range(cfg.n_numbers)]
            target = _random_value(rng, numbers, cfg.use_all)
            if target is None or target > cfg.max_target or target in numbers:
                continue
            question = f"target {target} numbers {' '.join(map(str, numbers))}"
            if is_held_out(question, cfg.eval_fraction) == held_out:
                return Problem(prompt_id=index, task=self.name, question=question, answer=str(target))

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        target, numbers = parse_question(problem.question)
        correct = check_expression(completion_text, target, numbers, self.config.use_all)
        return Verdict(reward=1.0 if correct else 0.0, verified=correct)

    def worked_solution(self, problem: Problem) -> str:
        target, numbers = parse_question(problem.question)
        solution = solve(target, numbers, self.config.use_all)
        if solution is None:  # cannot happen for problems this task drew
            raise ValueError(f"countdown problem {problem.question!r} has no solution")
        return solution


def parse_question(question: str) -> tuple[int, list[int]]:
    match = _QUESTION.fullmatch(question)
    if match is None:
        raise ValueError(f"not a countdown question: {question!r}")
    return int(match[1]), [int(n) for n in match[2].split()]


def _random_value(rng: random.Random, numbers: list[int], use_all: bool) -> int | None:
    """Combine a random subset of `numbers` pairwise with random ops; None if a step fails."""
    k = len(numbers) if use_all else rng.randint(2, len(numbers))
    values = rng.sample(numbers, k)
    while len(values) > 1:
        a, b = values.pop(), values.pop()
        result = _combine(a, b, rng.choice("+-*/"))
        if result is None:
            return None
        values.append(result)
    return values[0]


def _combine(a: int, b: int, op: str) -> int | None:
    """Countdown's rule for the generator and solver: intermediate values stay positive integers."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a > b else None
    if op == "*":
        return a * b
    return a // b if a % b == 0 else None


# --- verifier: tokens -> exact value, counting the literals used ---------------------


class _Invalid(Exception):
    pass


def check_expression(text: str, target: int, numbers: list[int], use_all: bool = False) -> bool:
    """Whether `text` is an arithmetic expression over a sub-multiset of `numbers` equal to `target`."""
    if len(text) > MAX_EXPRESSION_CHARS:
        return False
    try:
        value, used = _Parser(_tokenize(text)).parse()
    except (_Invalid, ZeroDivisionError):
        return False
    available = Counter(numbers)
    if any(count > available[n] for n, count in used.items()):
        return False
    if use_all and used != available:
        return False
    return value == target


def _tokenize(text: str) -> list[str]:
    tokens, pos, text = [], 0, text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise _Invalid
        tokens.append(match[1] or match[2])
        pos = match.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := int | '(' expr ')'"""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.used = tokens, 0, Counter()

    def parse(self) -> tuple[Fraction, Counter]:
        value = self._expr()
        if self.pos != len(self.tokens):
            raise _Invalid
        return value, self.used

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise _Invalid
        self.pos += 1
        return token

    def _expr(self) -> Fraction:
        value = self._term()
        while self._peek() in ("+", "-"):
            value = value + self._term() if self._take() == "+" else value - self._term()
        return value

    def _term(self) -> Fraction:
        value = self._factor()
        while self._peek() in ("*", "/"):
            value = value * self._factor() if self._take() == "*" else value / self._factor()
        return value

    def _factor(self) -> Fraction:
        token = self._take()
        if token == "(":
            value = self._expr()
            if self._take() != ")":
                raise _Invalid
            return value
        if not token.isdigit():
            raise _Invalid
        self.used[int(token)] += 1
        return Fraction(int(token))


# --- solver: the warm start's worked solutions ---------------------------------------

# Binding strength of an expression's top operator (atoms bind tightest), for minimal parentheses.
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_RIGHT_NEEDS = {"+": 1, "-": 2, "*": 2, "/": 3}  # a-(b+c) and a/(b*c) keep their parentheses


def solve(target: int, numbers: list[int], use_all: bool = False) -> str | None:
    """An expression reaching `target` using the fewest numbers (deterministic), or None.

    Subset dynamic programming: for each subset of positions, every value reachable
    under Countdown's rule, with the first expression found for it."""
    n = len(numbers)
    reach: dict[int, dict[int, tuple[str, int]]] = {1 << i: {v: (str(v), 3)} for i, v in enumerate(numbers)}
    for mask in sorted(range(1, 1 << n), key=lambda m: (bin(m).count("1"), m)):
        if mask not in reach:
            reach[mask] = _reachable(mask, reach)
        if target in reach[mask] and (not use_all or mask == (1 << n) - 1):
            return reach[mask][target][0]
    return None


def _reachable(mask: int, reach: dict[int, dict[int, tuple[str, int]]]) -> dict[int, tuple[str, int]]:
    found: dict[int, tuple[str, int]] = {}
    left = (mask - 1) & mask
    while left:
        right = mask ^ left
        for a, (ea, pa) in reach[left].items():
            for b, (eb, pb) in reach[right].items():
                for op in "+-*/":
                    value = _combine(a, b, op)
                    if value is None or value in found:
                        continue
                    la = ea if pa >= _PRECEDENCE[op] else f"({ea})"
                    rb = eb if pb >= _RIGHT_NEEDS[op] else f"({eb})"
                    found[value] = (f"{la}{op}{rb}", _PRECEDENCE[op])
        left = (left - 1) & mask
    return found
