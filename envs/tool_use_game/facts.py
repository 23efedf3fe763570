"""The facts of the tool-use game: a fixed catalog of what a fact can be, and one episode's fact book.

A task draws a few facts from :data:`FACT_CATALOG` and gives each a fresh value, so the values
live in ``task.metadata["facts"]`` and can never be memorised across tasks; only the tools reveal
them. The catalog comes in *families* of look-alike facts (apples in the orchard, apples in the
basket): a task that needs one of them also shows its sibling as a distractor, so a question in
words has to be matched to the right key by reading the descriptions, not guessed from one noun.
Key names follow several styles on purpose (``apple_count``, ``basket_apples``, ``n_pears``), so
a key cannot always be derived from the words of a question either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FactSpec:
    """One kind of fact. ``question`` asks for it in words, for single-fact questions of tier 3."""

    key: str
    description: str  # shown by list_fact_keys; "the " + description names it inside a question
    question: str
    family: str


def _family(name: str, *facts: tuple[str, str, str]) -> list[FactSpec]:
    return [FactSpec(key, description, question, name) for key, description, question in facts]


FACT_CATALOG: tuple[FactSpec, ...] = tuple(
    _family(
        "apples",
        ("apple_count", "number of apples in the orchard", "How many apples are in the orchard?"),
        ("basket_apples", "number of apples in the basket", "How many apples are in the basket?"),
    )
    + _family(
        "pears",
        ("n_pears", "number of pears in the basket", "How many pears are in the basket?"),
        ("orchard_pears", "number of pears in the orchard", "How many pears are in the orchard?"),
    )
    + _family(
        "books",
        ("book_count", "number of books on the shelf", "How many books are on the shelf?"),
        ("desk_books", "number of books on the desk", "How many books are on the desk?"),
    )
    + _family(
        "chairs",
        ("kitchen_chairs", "number of chairs in the kitchen", "How many chairs are in the kitchen?"),
        ("chair_total", "number of chairs in the office", "How many chairs are in the office?"),
    )
    + _family(
        "pets",
        ("cat_count", "number of cats in the house", "How many cats live in the house?"),
        ("dogs_park", "number of dogs in the park", "How many dogs are in the park?"),
        ("park_cats", "number of cats in the park", "How many cats are in the park?"),
    )
    + _family(
        "cars",
        ("red_cars", "number of red cars in the parking lot", "How many red cars are in the parking lot?"),
        ("blue_cars", "number of blue cars in the parking lot", "How many blue cars are in the parking lot?"),
    )
    + _family(
        "coins",
        ("jar_coins", "number of coins in the jar", "How many coins are in the jar?"),
        ("wallet_total", "number of coins in the wallet", "How many coins are in the wallet?"),
    )
    + _family(
        "visitors",
        (
            "visitors_mon",
            "number of museum visitors on Monday",
            "How many people visited the museum on Monday?",
        ),
        (
            "visitors_tue",
            "number of museum visitors on Tuesday",
            "How many people visited the museum on Tuesday?",
        ),
    )
    + _family(
        "prices",
        (
            "ticket_price",
            "price of one concert ticket in dollars",
            "How many dollars does one concert ticket cost?",
        ),
        ("bus_fare", "price of one bus ride in dollars", "How many dollars does one bus ride cost?"),
    )
    + _family(
        "teams",
        ("team_size", "number of players on each team", "How many players are on each team?"),
        ("league_teams", "number of teams in the league", "How many teams are in the league?"),
    )
    + _family(
        "boxes",
        ("box_weight", "weight of one box in kilograms", "How many kilograms does one box weigh?"),
        ("truck_boxes", "number of boxes in the truck", "How many boxes are in the truck?"),
    )
    + _family(
        "eggs",
        ("eggs_per_tray", "number of eggs in one tray", "How many eggs fit in one tray?"),
        ("fridge_trays", "number of egg trays in the fridge", "How many egg trays are in the fridge?"),
    )
    + _family(
        "classes",
        ("class_a", "number of students in class A", "How many students are in class A?"),
        ("class_b", "number of students in class B", "How many students are in class B?"),
    )
    + _family(
        "weather",
        ("rain_days", "number of rainy days in April", "How many days did it rain in April?"),
        ("sunny_days", "number of sunny days in April", "How many sunny days were there in April?"),
    )
    + _family(
        "farm",
        ("sheep", "number of sheep on the farm", "How many sheep are on the farm?"),
        ("cow_count", "number of cows on the farm", "How many cows are on the farm?"),
        ("farm_hens", "number of hens on the farm", "How many hens are on the farm?"),
    )
    + _family(
        "stationery",
        ("pencils", "number of pencils in the cup", "How many pencils are in the cup?"),
        ("drawer_pens", "number of pens in the drawer", "How many pens are in the drawer?"),
    )
    + _family(
        "reading",
        ("pages_read", "number of pages Maya read today", "How many pages did Maya read today?"),
        ("novel_pages", "number of pages left in the novel", "How many pages are left in the novel?"),
    )
    + _family(
        "street",
        ("tree_count", "number of trees along the road", "How many trees stand along the road?"),
        ("lamp_posts", "number of lamp posts along the road", "How many lamp posts stand along the road?"),
    )
    + _family(
        "birds",
        ("roof_birds", "number of birds on the roof", "How many birds are on the roof?"),
        ("bird_count", "number of birds in the garden", "How many birds are in the garden?"),
    )
    + _family(
        "bikes",
        ("bike_rack", "number of bikes in the rack", "How many bikes are in the rack?"),
        ("bikes_shop", "number of bikes in the shop", "How many bikes are in the shop?"),
    )
)

FACTS_BY_KEY: dict[str, FactSpec] = {spec.key: spec for spec in FACT_CATALOG}
assert len(FACTS_BY_KEY) == len(FACT_CATALOG), "fact keys must be unique"


@dataclass(frozen=True)
class Fact:
    """One fact of an episode: what ``lookup`` returns, and what ``list_fact_keys`` says about it."""

    value: int | float
    description: str


class FactBook:
    """The facts of the current episode. The env loads it on ``reset``; the tools read it.

    It is shared by reference so that the tools can be built once, in the env's constructor, as
    :class:`~cookbook_lib.envs.ToolEnv` wants, while the facts change with every task.
    """

    def __init__(self) -> None:
        self._facts: dict[str, Fact] = {}

    def load(self, raw_facts: Mapping[str, Any]) -> None:
        """Replace the facts with ``task.metadata["facts"]``: key -> {"value", "description"}."""
        facts: dict[str, Fact] = {}
        for key, entry in raw_facts.items():
            value = entry.get("value") if isinstance(entry, Mapping) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"fact {key!r} needs a numeric 'value', got {entry!r}")
            facts[str(key)] = Fact(value=value, description=str(entry.get("description", "")))
        self._facts = facts

    def all_keys(self) -> list[str]:
        """The keys in the task's own order (shuffled at generation, so position tells nothing)."""
        return list(self._facts)

    def get(self, key: str) -> Fact | None:
        return self._facts.get(key)
