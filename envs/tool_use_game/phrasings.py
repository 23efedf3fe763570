"""Question templates of the tool-use game, by tier and operation.

Many phrasings per case on purpose: a warm-start on a single phrasing overfits (a 135M model
trained only on "What is the value of the fact 'k'?" then looked up the key "lookup" for any other
question), so every tier asks in several ways. Placeholders: ``{a}``/``{b}`` are fact keys (tiers
1 and 2), ``{A}``/``{B}`` are facts described in words (tier 3), ``{c}`` is a constant.
"""

from __future__ import annotations

TIER1 = (
    "What is the value of the fact '{a}'?",
    "Look up '{a}' and tell me its value.",
    "What number is stored under the key {a}?",
    "Please find {a}. Reply with its value.",
    "What is {a}?",
    "I need the value of {a}.",
    "Use the lookup tool to get '{a}'. What is it?",
    "Report the value recorded for {a}.",
)

# Two facts named by key.
TIER2_PAIR = {
    "+": (
        "What is {a} plus {b}?",
        "What is the sum of '{a}' and '{b}'?",
        "Look up {a} and {b} and add them together.",
        "Add the facts {a} and {b}. What do you get?",
        "What is {a} + {b}?",
    ),
    "-": (
        "What is {a} minus {b}?",
        "Subtract {b} from {a}. What is the result?",
        "By how much does {a} exceed {b}?",
        "What is {a} - {b}?",
        "How much larger is '{a}' than '{b}'?",
    ),
    "*": (
        "What is {a} times {b}?",
        "Multiply {a} by {b}. What is the product?",
        "What is the product of '{a}' and '{b}'?",
        "What is {a} * {b}?",
    ),
}

# One fact named by key, and a constant.
TIER2_CONST = {
    "+": (
        "What is {a} plus {c}?",
        "Add {c} to {a}. What is the result?",
        "What is the value of '{a}' increased by {c}?",
    ),
    "-": (
        "What is {a} minus {c}?",
        "Subtract {c} from {a}. What do you get?",
        "What is '{a}' decreased by {c}?",
    ),
    "*": (
        "What is {a} times {c}?",
        "Multiply {a} by {c}.",
        "What is {c} times the value of '{a}'?",
    ),
}

# Two facts described in words ("the number of apples in the orchard").
TIER3_PAIR = {
    "+": (
        "What is {A} plus {B}?",
        "What do you get if you add {A} and {B}?",
        "What is the total of {A} and {B}?",
        "Add {A} to {B}. What is the result?",
    ),
    "-": (
        "What is {A} minus {B}?",
        "How much greater is {A} than {B}?",
        "What is the difference between {A} and {B}?",
        "Take {A} and subtract {B}. What is left?",
    ),
    "*": (
        "What is {A} times {B}?",
        "What do you get when you multiply {A} by {B}?",
        "What is the product of {A} and {B}?",
    ),
}

# One fact described in words, and a constant. (A single fact with no arithmetic is asked with
# the fact's own question, FactSpec.question.)
TIER3_CONST = {
    "+": (
        "What is {A} plus {c}?",
        "If you add {c} to {A}, what do you get?",
    ),
    "-": (
        "What is {A} minus {c}?",
        "What is left when you take {c} away from {A}?",
    ),
    "*": (
        "What is {c} times {A}?",
        "What is {A} multiplied by {c}?",
    ),
}
