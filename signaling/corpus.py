"""Small built-in English corpus served by /data when FineWeb is unavailable."""

import random

PARAGRAPHS = [
    "Water boils at a lower temperature on a mountain than at sea level, because the "
    "air pressure pressing on the surface of the water is lower at high altitude.",
    "Plants make their own food through photosynthesis. Using energy from sunlight, "
    "they turn water and carbon dioxide into sugar and release oxygen into the air.",
    "The heart is a muscle that pumps blood through the body. Arteries carry blood away "
    "from the heart, and veins bring it back again.",
    "A fraction names a part of a whole. In the fraction three quarters, the whole has "
    "been split into four equal parts, and three of those parts are being counted.",
    "Earthquakes happen when large plates of rock beneath the surface of the Earth slip "
    "past one another and release energy that travels outward as waves.",
    "Reading every day helps children build vocabulary. When a new word appears in a "
    "story, the sentences around it often give clues to its meaning.",
    "The Moon does not make its own light. We see it because it reflects light from the "
    "Sun, and its shape in the sky changes as it travels around the Earth.",
    "Bees carry pollen from flower to flower while they collect nectar, which helps "
    "many plants produce fruit and seeds.",
]


def builtin_slice(n: int = 4, rng: random.Random | None = None) -> str:
    rng = rng or random.Random()
    start = rng.randrange(len(PARAGRAPHS))
    return "\n\n".join(PARAGRAPHS[(start + i) % len(PARAGRAPHS)] for i in range(n)) + "\n"
