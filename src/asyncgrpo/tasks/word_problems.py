"""Word-problem task: seeded grade-school problems (GSM8K-shaped) of two or three arithmetic steps.

A row is ``{"prompt": [{"role": "user", "content": QUESTION}], "question": QUESTION, "answer": "19",
"solution": "5 * 3 = 15, 4 + 15 = 19. \\boxed{19}", "gsm8k_answer": "5 * 3 = 15\\n4 + 15 = 19\\n#### 19",
"kind": "buy_packs"}``. As in ``arithmetic``, ``prompt`` is conversational, ``answer`` is the exact
integer as a string (what a reward function compares against), ``solution`` is a reference chain in
the style of ``arithmetic.solve`` and ``kind`` names the entry of ``PROBLEM_KINDS`` it was drawn from.
``gsm8k_answer`` is the same chain in GSM8K's format, one step a line and the result after ``####``;
``to_gsm8k`` turns a row into GSM8K's two fields (``question``, ``answer``), what
``examples/one_gpu.py --data-files`` reads.

The question carries no answer-format instruction ("give the final answer as \\boxed{}"): the recipe
appends its own (``examples/one_gpu.py``'s ``to_prompt`` does); whoever trains on ``prompt`` as it is
appends one to its content first.

The problems are sized for a small model (~135M parameters) to get some right: every template
computes its answer in code from the numbers it drew, in 2 or 3 steps of ``+``, ``-``, ``*`` or an
exact ``/``; every number in a question is at most ``MAX_NUMBER_IN_QUESTION`` (most are under 50)
and every step's result, the answer included, is an integer in ``[0, MAX_RESULT]`` (most are under
100). Everything here is pure: the same
``(n, seed)`` always gives the same rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from asyncgrpo.tasks.arithmetic import extract_boxed, is_correct

__all__ = [
    "MAX_NUMBER_IN_QUESTION",
    "MAX_RESULT",
    "PROBLEM_KINDS",
    "extract_boxed",
    "is_correct",
    "make_dataset",
    "make_row",
    "to_gsm8k",
]

MAX_NUMBER_IN_QUESTION = 100
"""No number written in a question exceeds this."""

MAX_RESULT = 200
"""No step of a reference chain, the answer included, gives more than this (nor less than 0)."""

PROBLEM_KINDS: dict[str, tuple[float, int]] = {
    # name: (relative frequency, number of steps of the reference chain)
    "buy_change": (1.0, 2),
    "buy_two_items": (1.0, 3),
    "share_equally": (1.0, 2),
    "packs_shared": (1.0, 2),
    "age_in_years": (1.0, 2),
    "ages_sum_twice": (1.0, 3),
    "distance_then_more": (1.0, 2),
    "distance_two_speeds": (1.0, 3),
    "pages_left": (1.0, 2),
    "days_to_finish": (1.0, 2),
    "give_and_find": (1.0, 2),
    "buy_packs": (1.0, 2),
    "rows_minus": (1.0, 2),
    "hourly_wage": (1.0, 2),
    "weekly_practice": (1.0, 2),
    "more_than_twice": (1.0, 2),
    "more_than_twice_total": (1.0, 3),
    "fewer_than_total": (1.0, 2),
    "boxes_left": (1.0, 2),
    "split_bill": (1.0, 2),
    "bus_stops": (1.0, 3),
    "animal_legs": (1.0, 3),
    "savings_weeks": (1.0, 2),
    "bake_sell_eat": (1.0, 3),
    "line_up_teams": (1.0, 3),
}
"""Templates and how often each is drawn. Two-step kinds are about two thirds of the mix; changing
it changes how often a small model is right."""

_MAX_REJECTED_IN_A_ROW = 10_000
"""``make_dataset`` gives up when this many draws in a row fall in ``exclude``."""

# ------------------------------------------------------------------------------------------ vocabulary


class _Person(NamedTuple):
    name: str
    he: str  # subject pronoun
    him: str  # object pronoun
    his: str  # possessive


_SHE = ("she", "her", "her")
_HE = ("he", "him", "his")
_PEOPLE = tuple(
    _Person(name, *pronouns)
    for names, pronouns in (
        (("Ava", "Maya", "Lily", "Sofia", "Emma", "Nora", "Zoe", "Grace", "Priya", "Hana", "Rosa", "Chloe",
          "Amara", "Leah", "Mia"), _SHE),
        (("Ben", "Leo", "Omar", "Sam", "Jack", "Noah", "Ravi", "Theo", "Lucas", "Kenji", "Diego", "Finn",
          "Eli", "Max", "Tom"), _HE),
    )
    for name in names
)
_COLLECTIBLES = ("stickers", "marbles", "trading cards", "seashells", "stamps", "crayons", "beads",
                 "buttons", "postcards", "pencils", "toy cars", "rocks", "coins", "badges")
_PRICED_ITEMS = ("notebooks", "sandwiches", "pens", "comic books", "plants", "cupcakes", "bracelets",
                 "toy cars", "water bottles", "puzzles", "mugs", "kites")
_DISHES = ("pizzas", "salads", "burgers", "bowls of noodles", "plates of tacos", "sandwiches")
_GOALS = ("bike", "video game", "skateboard", "guitar", "tent", "pair of skates", "telescope")
_VEHICLES = ("bus", "train", "car", "truck", "boat", "tractor")
_ACTIVITIES = ("practices the piano", "practices the violin", "reads", "runs", "draws", "swims",
               "plays chess")
_TWO_LEGGED = ("chickens", "ducks", "geese", "turkeys")
_FOUR_LEGGED = ("cows", "goats", "sheep", "horses", "pigs")
_BAKED = ("cookies", "muffins", "cupcakes", "brownies")
_PLACES = ("classroom", "hall", "library", "gym")


def _people(rng: random.Random, k: int) -> list[_Person]:
    return rng.sample(_PEOPLE, k)


def _cap(word: str) -> str:
    return word[0].upper() + word[1:]


# -------------------------------------------------------------------------------------------- chains


class _Chain:
    """The steps of a reference solution, recorded while a template computes its answer."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, str, int, int]] = []

    def __call__(self, x: int, op: str, y: int) -> int:
        if op == "/":
            assert y > 0 and x % y == 0, f"{x} / {y} is not exact"
            z = x // y
        else:
            z = x + y if op == "+" else x - y if op == "-" else x * y
        assert 0 <= z <= MAX_RESULT, f"{x} {op} {y} = {z} is outside [0, {MAX_RESULT}]"
        self.steps.append((x, op, y, z))
        return z


# ------------------------------------------------------------------------------------------ templates
# Each template draws its numbers so that every step is a non-negative integer, writes the question
# and computes the answer through the chain (the answer is the chain's last result).


def _buy_change(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    item = rng.choice(_PRICED_ITEMS)
    count, price = rng.randint(2, 6), rng.randint(2, 15)
    cost = chain(count, "*", price)
    bill = rng.choice([b for b in (20, 50, 100) if b > cost])
    chain(bill, "-", cost)
    return (f"{p.name} buys {count} {item} that cost ${price} each. {_cap(p.he)} pays with a ${bill} bill. "
            f"How many dollars of change does {p.he} get back?")


def _buy_two_items(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    first, second = rng.sample(_PRICED_ITEMS, 2)
    a, price_a, b, price_b = rng.randint(2, 6), rng.randint(2, 12), rng.randint(2, 6), rng.randint(2, 12)
    cost_a = chain(a, "*", price_a)
    cost_b = chain(b, "*", price_b)
    chain(cost_a, "+", cost_b)
    return (f"{p.name} buys {a} {first} for ${price_a} each and {b} {second} for ${price_b} each. "
            f"How many dollars does {p.he} spend in all?")


def _share_equally(rng: random.Random, chain: _Chain) -> str:
    p, friend = _people(rng, 2)
    thing = rng.choice(_COLLECTIBLES)
    groups, each = rng.randint(2, 6), rng.randint(2, 10)
    had = rng.randint(2, groups * each - 2)
    got = groups * each - had
    total = chain(had, "+", got)
    chain(total, "/", groups)
    return (f"{p.name} has {had} {thing}. {friend.name} gives {p.him} {got} more. {_cap(p.he)} shares all "
            f"of the {thing} equally among {groups} friends. How many {thing} does each friend get?")


def _packs_shared(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    thing = rng.choice(_COLLECTIBLES)
    groups, per_pack = rng.randint(2, 5), rng.randint(2, 10)
    packs = groups * rng.randint(1, 4)
    total = chain(packs, "*", per_pack)
    chain(total, "/", groups)
    return (f"{p.name} has {packs} packs of {thing} with {per_pack} {thing} in each pack. {_cap(p.he)} "
            f"shares them equally among {groups} groups. How many {thing} does each group get?")


def _age_in_years(rng: random.Random, chain: _Chain) -> str:
    a, b = _people(rng, 2)
    age, older, years = rng.randint(4, 15), rng.randint(2, 30), rng.randint(2, 10)
    now = chain(age, "+", older)
    chain(now, "+", years)
    return (f"{a.name} is {age} years old. {b.name} is {older} years older than {a.name}. "
            f"How old will {b.name} be in {years} years?")


def _ages_sum_twice(rng: random.Random, chain: _Chain) -> str:
    a, b = _people(rng, 2)
    age = rng.randint(3, 15)
    less = rng.randint(2, min(10, 2 * age - 1))
    twice = chain(2, "*", age)
    other = chain(twice, "-", less)
    chain(age, "+", other)
    return (f"{a.name} is {age} years old. {b.name} is {less} years younger than twice {a.name}'s age. "
            f"What is the sum of their ages?")


def _distance_then_more(rng: random.Random, chain: _Chain) -> str:
    vehicle = rng.choice(_VEHICLES)
    speed, hours, more = rng.randint(5, 30), rng.randint(2, 5), rng.randint(2, 20)
    first = chain(speed, "*", hours)
    chain(first, "+", more)
    return (f"A {vehicle} travels at {speed} miles per hour for {hours} hours. Then it goes {more} more "
            f"miles. How many miles does the {vehicle} travel in all?")


def _distance_two_speeds(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    speed_a, hours_a = rng.randint(2, 20), rng.randint(2, 4)
    speed_b, hours_b = rng.randint(2, 20), rng.randint(2, 4)
    first = chain(speed_a, "*", hours_a)
    second = chain(speed_b, "*", hours_b)
    chain(first, "+", second)
    return (f"{p.name} rides {p.his} bike at {speed_a} miles per hour for {hours_a} hours and then at "
            f"{speed_b} miles per hour for {hours_b} hours. How many miles does {p.he} ride in total?")


def _pages_left(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    per_day, days = rng.randint(2, 12), rng.randint(2, 7)
    pages = per_day * days + rng.randint(1, min(40, MAX_NUMBER_IN_QUESTION - per_day * days))
    read = chain(per_day, "*", days)
    chain(pages, "-", read)
    return (f"{p.name}'s book has {pages} pages. {_cap(p.he)} reads {per_day} pages every day for {days} "
            f"days. How many pages does {p.he} still have to read?")


def _days_to_finish(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    per_day, days = rng.randint(2, 12), rng.randint(2, 8)
    done = rng.randint(2, min(40, MAX_NUMBER_IN_QUESTION - per_day * days))
    pages = per_day * days + done
    rest = chain(pages, "-", done)
    chain(rest, "/", per_day)
    return (f"A book has {pages} pages. {p.name} has already read {done} pages. If {p.he} reads {per_day} "
            f"pages a day, how many more days will {p.he} need to finish the book?")


def _give_and_find(rng: random.Random, chain: _Chain) -> str:
    p, friend = _people(rng, 2)
    thing = rng.choice(_COLLECTIBLES)
    had = rng.randint(10, 50)
    given, found = rng.randint(1, min(20, had - 1)), rng.randint(2, 30)
    left = chain(had, "-", given)
    chain(left, "+", found)
    return (f"{p.name} has {had} {thing}. {_cap(p.he)} gives {given} of them to {friend.name} and then "
            f"finds {found} more. How many {thing} does {p.name} have now?")


def _buy_packs(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    thing = rng.choice(_COLLECTIBLES)
    had, packs, per_pack = rng.randint(2, 40), rng.randint(2, 6), rng.randint(2, 12)
    bought = chain(packs, "*", per_pack)
    chain(had, "+", bought)
    return (f"{p.name} has {had} {thing}. {_cap(p.he)} buys {packs} packs with {per_pack} {thing} in each "
            f"pack. How many {thing} does {p.he} have now?")


def _rows_minus(rng: random.Random, chain: _Chain) -> str:
    rows, per_row = rng.randint(2, 9), rng.randint(2, 11)
    removed = rng.randint(2, min(20, rows * per_row - 1))
    total = chain(rows, "*", per_row)
    chain(total, "-", removed)
    if rng.random() < 0.5:
        place = rng.choice(_PLACES)
        return (f"A {place} has {rows} rows of chairs with {per_row} chairs in each row. {removed} of the "
                f"chairs are empty and there is one student on each of the others. How many students are "
                f"sitting?")
    plant = rng.choice(("tomato plants", "sunflowers", "apple trees", "rose bushes"))
    return (f"A garden has {rows} rows of {plant} with {per_row} in each row. A storm knocks down {removed} "
            f"of them. How many {plant} are still standing?")


def _hourly_wage(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    hours, days, wage = rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 8)
    worked = chain(hours, "*", days)
    chain(worked, "*", wage)
    return (f"{p.name} works {hours} hours a day for {days} days. {_cap(p.he)} earns ${wage} per hour. "
            f"How many dollars does {p.he} earn?")


def _weekly_practice(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    activity = rng.choice(_ACTIVITIES)
    minutes, days, extra = rng.randint(5, 30), rng.randint(2, 5), rng.randint(5, 40)
    weekdays = chain(minutes, "*", days)
    chain(weekdays, "+", extra)
    return (f"{p.name} {activity} for {minutes} minutes on each of {days} days, and for {extra} minutes on "
            f"Sunday. How many minutes does {p.he} spend in all?")


def _more_than_twice(rng: random.Random, chain: _Chain, total: bool) -> str:
    a, b = _people(rng, 2)
    thing = rng.choice(_COLLECTIBLES)
    count, more = rng.randint(2, 30), rng.randint(1, 20)
    twice = chain(2, "*", count)
    other = chain(twice, "+", more)
    question = (f"{a.name} has {count} {thing}. {b.name} has {more} more than twice as many {thing} as "
                f"{a.name}.")
    if total:
        chain(count, "+", other)
        return f"{question} How many {thing} do they have together?"
    return f"{question} How many {thing} does {b.name} have?"


def _fewer_than_total(rng: random.Random, chain: _Chain) -> str:
    a, b = _people(rng, 2)
    thing = rng.choice(_COLLECTIBLES)
    count = rng.randint(10, 60)
    fewer = rng.randint(2, min(20, count - 1))
    other = chain(count, "-", fewer)
    chain(count, "+", other)
    return (f"{a.name} has {count} {thing}. {b.name} has {fewer} fewer {thing} than {a.name}. "
            f"How many {thing} do they have together?")


def _boxes_left(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    thing = rng.choice(_COLLECTIBLES)
    per_box, boxes = rng.randint(2, 8), rng.randint(3, 12)
    given = rng.randint(1, boxes - 1)
    total = per_box * boxes
    packed = chain(total, "/", per_box)
    chain(packed, "-", given)
    return (f"{p.name} has {total} {thing} and puts them into boxes of {per_box}. {_cap(p.he)} gives away "
            f"{given} of the boxes. How many boxes does {p.he} have left?")


def _split_bill(rng: random.Random, chain: _Chain) -> str:
    dish = rng.choice(_DISHES)
    count, price = rng.randint(2, 6), rng.randint(2, 15)
    friends = rng.choice([k for k in range(2, 7) if count * price % k == 0])  # count itself is one
    bill = chain(count, "*", price)
    chain(bill, "/", friends)
    return (f"{friends} friends have lunch together. They order {count} {dish} that cost ${price} each and "
            f"split the bill equally. How many dollars does each friend pay?")


def _bus_stops(rng: random.Random, chain: _Chain) -> str:
    start = rng.randint(10, 40)
    off, on = rng.randint(2, min(15, start - 1)), rng.randint(2, 20)
    off_again = rng.randint(2, min(15, start - off + on))
    after_first = chain(start, "-", off)
    after_on = chain(after_first, "+", on)
    chain(after_on, "-", off_again)
    return (f"A bus leaves the station with {start} passengers. At the first stop, {off} passengers get off "
            f"and {on} get on. At the second stop, {off_again} passengers get off. How many passengers are "
            f"on the bus now?")


def _animal_legs(rng: random.Random, chain: _Chain) -> str:
    birds, beasts = rng.choice(_TWO_LEGGED), rng.choice(_FOUR_LEGGED)
    num_birds, num_beasts = rng.randint(2, 20), rng.randint(2, 20)
    bird_legs = chain(num_birds, "*", 2)
    beast_legs = chain(num_beasts, "*", 4)
    chain(bird_legs, "+", beast_legs)
    return (f"A farm has {num_birds} {birds} and {num_beasts} {beasts}. Each of the {birds} has 2 legs and "
            f"each of the {beasts} has 4 legs. How many legs are there in all?")


def _savings_weeks(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    goal = rng.choice(_GOALS)
    per_week, weeks = rng.randint(2, 10), rng.randint(2, 8)
    saved = rng.randint(1, min(40, MAX_NUMBER_IN_QUESTION - per_week * weeks))
    price = saved + per_week * weeks
    needed = chain(price, "-", saved)
    chain(needed, "/", per_week)
    return (f"{p.name} wants a {goal} that costs ${price}. {_cap(p.he)} has already saved ${saved} and saves "
            f"${per_week} more every week. How many weeks will it take {p.him} to have exactly enough?")


def _bake_sell_eat(rng: random.Random, chain: _Chain) -> str:
    (p,) = _people(rng, 1)
    baked = rng.choice(_BAKED)
    batches, per_batch = rng.randint(2, 6), rng.randint(6, 12)
    sold = rng.randint(1, batches * per_batch // 2)
    eaten = rng.randint(1, 5)
    total = chain(batches, "*", per_batch)
    left = chain(total, "-", sold)
    chain(left, "-", eaten)
    return (f"{p.name} bakes {batches} batches of {baked} with {per_batch} {baked} in each batch. "
            f"{_cap(p.he)} sells {sold} of them and eats {eaten}. How many {baked} are left?")


def _line_up_teams(rng: random.Random, chain: _Chain) -> str:
    teams, rows, per_row = rng.randint(2, 5), rng.randint(2, 6), rng.randint(2, 8)
    late = (-rows * per_row) % teams + teams * rng.randint(0, 3)
    late = late if late >= 2 else late + teams
    lined_up = chain(rows, "*", per_row)
    everyone = chain(lined_up, "+", late)
    chain(everyone, "/", teams)
    return (f"Students stand in {rows} rows with {per_row} students in each row. Then {late} more students "
            f"join them. The teacher splits all of the students into {teams} equal teams. How many students "
            f"are on each team?")


_TEMPLATES: dict[str, Callable[[random.Random, _Chain], str]] = {
    "buy_change": _buy_change,
    "buy_two_items": _buy_two_items,
    "share_equally": _share_equally,
    "packs_shared": _packs_shared,
    "age_in_years": _age_in_years,
    "ages_sum_twice": _ages_sum_twice,
    "distance_then_more": _distance_then_more,
    "distance_two_speeds": _distance_two_speeds,
    "pages_left": _pages_left,
    "days_to_finish": _days_to_finish,
    "give_and_find": _give_and_find,
    "buy_packs": _buy_packs,
    "rows_minus": _rows_minus,
    "hourly_wage": _hourly_wage,
    "weekly_practice": _weekly_practice,
    "more_than_twice": lambda rng, chain: _more_than_twice(rng, chain, total=False),
    "more_than_twice_total": lambda rng, chain: _more_than_twice(rng, chain, total=True),
    "fewer_than_total": _fewer_than_total,
    "boxes_left": _boxes_left,
    "split_bill": _split_bill,
    "bus_stops": _bus_stops,
    "animal_legs": _animal_legs,
    "savings_weeks": _savings_weeks,
    "bake_sell_eat": _bake_sell_eat,
    "line_up_teams": _line_up_teams,
}
assert _TEMPLATES.keys() == PROBLEM_KINDS.keys()

# ----------------------------------------------------------------------------------------------- rows


def make_row(kind: str, rng: random.Random) -> dict:
    """Draw one problem of template ``kind`` with ``rng`` and build its row.

    Returns:
        ``{"prompt", "question", "answer", "solution", "gsm8k_answer", "kind"}`` (see the module
        docstring); ``answer`` is the last result of the reference chain.
    """
    if kind not in _TEMPLATES:
        raise ValueError(f"unknown kind {kind!r}; use one of PROBLEM_KINDS: {', '.join(PROBLEM_KINDS)}")
    chain = _Chain()
    question = _TEMPLATES[kind](rng, chain)
    assert len(chain.steps) == PROBLEM_KINDS[kind][1], (kind, chain.steps)
    answer = chain.steps[-1][3]
    equations = [f"{x} {op} {y} = {z}" for x, op, y, z in chain.steps]
    return {
        "prompt": [{"role": "user", "content": question}],
        "question": question,
        "answer": str(answer),
        "solution": ", ".join(equations) + f". \\boxed{{{answer}}}",
        "gsm8k_answer": "\n".join(equations) + f"\n#### {answer}",
        "kind": kind,
    }


def make_dataset(n: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """Return ``n`` problems drawn with ``random.Random(seed)``, kinds weighted by ``PROBLEM_KINDS``.

    Args:
        n: Number of rows.
        seed: Seed of the generator; the same seed gives the same rows.
        exclude: Question texts (the user message, without any instruction) that must not appear,
            e.g. the questions of a held-out set.

    Returns:
        Rows as ``make_row`` builds them. Rows may repeat (rarely: the space of questions is large).

    Raises:
        ValueError: ``n`` is negative, or ``exclude`` rejected 10,000 draws in a row (it holds nearly
            every question there is).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    kinds = list(PROBLEM_KINDS)
    weights = [PROBLEM_KINDS[k][0] for k in kinds]
    rows: list[dict] = []
    rejected_in_a_row = 0
    while len(rows) < n:
        row = make_row(rng.choices(kinds, weights=weights)[0], rng)
        if exclude is not None and row["question"] in exclude:
            rejected_in_a_row += 1
            if rejected_in_a_row >= _MAX_REJECTED_IN_A_ROW:
                raise ValueError(f"exclude rejected {rejected_in_a_row} draws in a row: it holds nearly "
                                 f"every question there is, so nothing is left to draw; pass a smaller "
                                 f"exclude")
            continue
        rejected_in_a_row = 0
        rows.append(row)
    return rows


def to_gsm8k(row: dict) -> dict[str, str]:
    """A row -> GSM8K's two fields: ``{"question": ..., "answer": "<one step a line>\\n#### 19"}``."""
    return {"question": row["question"], "answer": row["gsm8k_answer"]}
