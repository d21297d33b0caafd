"""Short pairing codes that a person can read out and type: ``<number>-<word>-<word>``.

Contract
--------
``new_code()`` draws a fresh code such as ``7-crossover-clockwork`` from the operating system's
random source (``secrets``): a number 1..999 and two words of the 338 in ``WORDS``: about 26.8 bits.
That is enough only because the code is used as the password of a PAKE (``sfchat.link.pairing``):
a capture gives nothing to test guesses against offline, each pairing attempt tests one guess
online, and a tail that made its code replaces it after a few failed attempts.
``normalize(text)`` is what both sides feed to the PAKE: case folded, surrounding space dropped,
runs of spaces, hyphens and underscores made one hyphen, so ``"7 Crossover  clockwork"`` pairs
with ``7-crossover-clockwork``. The word list is this project's own: common, distinct English
words of 3 to 8 letters, no two alike. No I/O; torch-free.
"""

from __future__ import annotations

import re
import secrets

MAX_NUMBER = 999
WORDS = (
    "acorn", "actor", "adult", "agent", "alarm", "album", "alley", "amber", "anchor", "angle",
    "ankle", "anvil", "apple", "apron", "arena", "armor", "arrow", "artist", "atlas", "attic",
    "autumn", "avenue", "badge", "bakery", "balcony", "ballot", "bamboo", "banana", "banjo",
    "barley", "barrel", "basket", "beacon", "beaver", "beetle", "bench", "berry", "bicycle",
    "biscuit", "blanket", "blossom", "border", "bottle", "boulder", "bracket", "branch", "breeze",
    "brick", "bridge", "bronze", "bubble", "bucket", "buffalo", "button", "cabin", "cable",
    "cactus", "camera", "candle", "candy", "canoe", "canyon", "carpet", "carrot", "castle",
    "cattle", "cedar", "cellar", "cement", "chapter", "cherry", "chimney", "cinema", "circle",
    "citizen", "clock", "cloud", "clover", "coast", "cobalt", "coffee", "collar", "comet",
    "compass", "copper", "coral", "cotton", "cousin", "crater", "crayon", "credit", "cricket",
    "crystal", "cushion", "custom", "daisy", "dancer", "dawn", "desert", "desk", "diamond",
    "dinner", "doctor", "dolphin", "donkey", "dragon", "drawer", "dream", "drum", "dune", "eagle",
    "earth", "echo", "elbow", "ember", "engine", "envelope", "escape", "fabric", "falcon", "family",
    "farmer", "feast", "feather", "fence", "ferry", "festival", "fiddle", "field", "finger", "flag",
    "flame", "flute", "forest", "fossil", "fountain", "fox", "frame", "garden", "garlic", "gate",
    "giant", "ginger", "glacier", "globe", "glove", "goose", "grape", "gravel", "gravy", "guitar",
    "habit", "hammer", "harbor", "harvest", "hazel", "helmet", "hermit", "hiker", "hollow", "honey",
    "horizon", "hotel", "igloo", "island", "ivory", "jacket", "jaguar", "jelly", "jewel", "jigsaw",
    "jungle", "kayak", "kettle", "kitchen", "kitten", "koala", "ladder", "lagoon", "lantern",
    "laptop", "lemon", "lemur", "letter", "lily", "lizard", "llama", "lobster", "locket", "magnet",
    "mammal", "mango", "maple", "marble", "market", "meadow", "melody", "metal", "meteor", "mirror",
    "mitten", "monkey", "morning", "mosaic", "mountain", "muffin", "mural", "museum", "napkin",
    "nectar", "needle", "nephew", "noble", "noodle", "nugget", "number", "oak", "oasis", "ocean",
    "olive", "onion", "orange", "orbit", "orchard", "otter", "oven", "oyster", "paddle", "palace",
    "panda", "pantry", "paper", "parade", "parrot", "pasta", "pearl", "pebble", "pencil", "pepper",
    "piano", "pickle", "pigeon", "pillow", "pilot", "planet", "plum", "pocket", "poem", "pony",
    "potato", "prism", "puzzle", "pyramid", "quarry", "quilt", "rabbit", "radar", "radio",
    "rainbow", "raven", "rhythm", "ribbon", "river", "robin", "rocket", "saddle", "salad", "salmon",
    "sandal", "satchel", "saucer", "scarf", "school", "season", "shadow", "shelter", "shrub",
    "signal", "silver", "siren", "sketch", "sleeve", "socket", "spider", "sponge", "spring",
    "square", "squirrel", "stable", "statue", "steam", "stone", "studio", "sugar", "summer",
    "sunset", "survey", "sweater", "table", "tablet", "tango", "teapot", "temple", "tennis",
    "thunder", "ticket", "tiger", "timber", "toast", "tomato", "toucan", "tower", "tractor",
    "trophy", "truck", "trumpet", "tulip", "tunnel", "turtle", "umbrella", "unicorn", "valley",
    "velvet", "violin", "volcano", "voyage", "waffle", "wagon", "walnut", "walrus", "willow",
    "window", "winter", "wizard", "yacht", "yogurt", "zebra", "zipper",
)
_SEPARATORS = re.compile(r"[\s_-]+")


def new_code() -> str:
    """A fresh random code, ``<1..MAX_NUMBER>-<word>-<word>``."""
    return f"{1 + secrets.randbelow(MAX_NUMBER)}-{secrets.choice(WORDS)}-{secrets.choice(WORDS)}"


def normalize(text: str) -> str:
    """The canonical form of a typed code (or of any other shared secret)."""
    return _SEPARATORS.sub("-", text.strip().casefold()).strip("-")

