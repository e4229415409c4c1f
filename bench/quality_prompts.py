"""The quality bench's prompt set: the bundled 350 prompts plus more of the same kinds, deterministic.

A drafter learns the target's own way of answering; 350 prompts give it ~30k supervised tokens,
which a 30-minute CPU run already overfits (training-set τ runs well ahead of held-out τ). This
writes the bundled prompts followed by template prompts over a wider set of topics (explanations,
facts, tips, comparisons, poems, code, word problems, stories, summaries, multi-turn follow-ups),
all written for this project (CC0, like the bundled set). Held-out prompts are chosen by the
trainer (`trainer.holdout_mod`, by prompt id) from the whole file, so the eval never sees a
training prompt.

usage: python bench/quality_prompts.py OUT.jsonl [COUNT]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "services" / "pipeline" / "data" / "prompts.jsonl"

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "compound interest", "vaccines", "plate tectonics",
    "the French Revolution", "machine learning", "blockchains", "climate change", "the immune system",
    "electric cars", "the printing press", "volcanoes", "honeybees", "the internet", "democracy", "inflation",
    "DNA", "the Moon landing", "coral reefs", "sleep", "coffee", "recycling", "the Roman Empire",
    "quantum computing", "solar panels", "earthquakes", "the stock market", "meditation", "rainbows", "tides",
    "antibiotics", "the Great Wall of China", "jazz music", "chess", "gravity", "the Renaissance",
    "cloud computing", "nuclear fusion", "the human heart", "bread baking", "wind turbines", "the Silk Road",
    "glaciers", "octopuses", "the theory of evolution", "supply and demand", "the Olympic Games",
    "public libraries", "hurricanes", "the periodic table", "bicycles", "the Amazon rainforest",
    "ancient Egypt", "the printing of money", "batteries", "the human brain", "migratory birds",
    "the Industrial Revolution", "tea ceremonies", "deserts", "the speed of light", "volunteering",
    "open-source software", "the metric system", "dinosaurs", "submarines", "the placebo effect", "mushrooms",
    "the Pythagorean theorem", "lightning", "the Eiffel Tower", "composting", "neural networks", "tornadoes",
    "the Cold War", "pollination", "credit scores", "satellites", "the Mediterranean diet", "wolves",
    "encryption", "the Byzantine Empire", "rain forests", "3D printing", "the Northern Lights", "salt",
    "the violin", "photography", "bees and wasps", "the moon's phases", "microplastics", "origami",
    "the human skeleton", "trade unions", "the Big Bang", "penguins", "railways", "the Great Barrier Reef",
    "carbon dioxide", "elections", "ocean currents", "whales", "paper making", "sundials", "the Vikings",
    "rockets", "the English language", "yoga", "the Sahara", "bridges", "musical scales", "spices",
    "telescopes", "the Aztecs", "memory", "GPS", "hydroelectric power", "cheese making", "the Milky Way",
    "ants", "time zones", "the Ice Age", "vitamins", "the piano", "skyscrapers", "forest fires",
]
AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year university student", "my grandmother",
             "a software engineer", "a high-school student", "someone who has never heard of it", "a journalist"]
SKILLS = [
    "learning a new language", "public speaking", "saving money", "staying focused while working from home",
    "running a first marathon", "writing a clear email", "cooking for a large group", "keeping houseplants alive",
    "preparing for a job interview", "getting better sleep", "learning to draw", "playing the guitar",
    "managing a small team", "studying for exams", "reading more books", "starting a vegetable garden",
    "taking better photos", "learning to swim", "negotiating a salary", "organizing a small apartment",
    "learning to code", "making new friends in a new city", "writing a novel", "training a puppy",
]
THINGS = ["a cat", "autumn leaves", "a lighthouse", "the city at night", "a rainy Monday", "an old bicycle",
          "the ocean", "a cup of tea", "a mountain trail", "the first snow", "a quiet library", "a train station",
          "a summer storm", "a garden at dawn", "an empty beach", "a candle", "the desert at noon", "an old map",
          "a busy market", "the stars", "a river", "a forgotten letter", "a grandfather clock", "spring rain"]
CODE = ["reverses a string", "checks whether a number is prime", "counts the words in a text",
        "merges two sorted lists", "computes the factorial of n", "removes duplicates from a list while keeping order",
        "finds the largest element of a list", "converts Celsius to Fahrenheit", "checks whether a string is a palindrome",
        "returns the n-th Fibonacci number", "sorts a list of dictionaries by a key", "counts the vowels in a string",
        "computes the average of a list of numbers", "finds the second largest number in a list",
        "checks whether two strings are anagrams", "flattens a nested list", "returns the greatest common divisor of two numbers",
        "converts a number to binary", "capitalizes the first letter of every word", "sums the digits of an integer"]
LANGS = ["Python", "JavaScript", "Go", "Rust", "Java", "C"]
PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("a list", "a tuple in Python"), ("RAM", "storage"),
         ("a comet", "an asteroid"), ("speed", "velocity"), ("TCP", "UDP"), ("a democracy", "a republic"),
         ("baking soda", "baking powder"), ("an alligator", "a crocodile"), ("a frog", "a toad"),
         ("a hurricane", "a typhoon"), ("debit", "credit"), ("a lake", "a pond"), ("mass", "weight"),
         ("a rabbit", "a hare"), ("HTTP", "HTTPS"), ("a simile", "a metaphor"), ("a star", "a planet"),
         ("an ape", "a monkey"), ("a CPU", "a GPU"), ("a stock", "a bond"), ("a moth", "a butterfly"),
         ("a violin", "a viola")]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Mia", "Nora"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "stamps", "cards", "shells", "coins"]

TEMPLATES = [
    lambda r: {"messages": [{"role": "user", "content": f"Explain {r.choice(TOPICS)} to {r.choice(AUDIENCES)}."}]},
    lambda r: {"prompt": f"Give me three surprising facts about {r.choice(TOPICS)}."},
    lambda r: {"prompt": f"Why does {r.choice(TOPICS)} matter? Answer in a short paragraph."},
    lambda r: {"prompt": f"What are the most common misconceptions about {r.choice(TOPICS)}?"},
    lambda r: {"instruction": f"List five practical tips for {r.choice(SKILLS)}."},
    lambda r: {"conversations": [{"from": "human", "value": f"I want to get better at {r.choice(SKILLS)}. Where should I start?"}]},
    lambda r: {"prompt": f"What mistakes do beginners make when {r.choice(SKILLS)}?"},
    lambda r: {"prompt": f"Write a short poem about {r.choice(THINGS)}."},
    lambda r: {"instruction": "Write a haiku.", "input": r.choice(THINGS)},
    lambda r: {"prompt": f"Describe {r.choice(THINGS)} in three vivid sentences."},
    lambda r: {"messages": [{"role": "system", "content": "You are a concise programming assistant."},
                            {"role": "user", "content": f"Write a {r.choice(LANGS)} function that {r.choice(CODE)}."}]},
    lambda r: {"prompt": f"In {r.choice(LANGS)}, how would you write a function that {r.choice(CODE)}?"},
    lambda r: {"prompt": "What is the difference between {} and {}?".format(*r.choice(PAIRS))},
    lambda r: {"prompt": f"Write a one-paragraph story in which {r.choice(TOPICS)} plays a key role."},
    lambda r: {"instruction": "Summarize the following topic in one sentence.", "input": r.choice(TOPICS)},
    lambda r: {"prompt": f"Write a short motivational message for someone who is {r.choice(SKILLS)}."},
    lambda r: {"prompt": f"How would you teach {r.choice(TOPICS)} in a ten-minute lesson?"},
    lambda r: {"prompt": f"Write a short dialogue between a teacher and a student about {r.choice(TOPICS)}."},
    lambda r: {"messages": [{"role": "user", "content": f"What is {r.choice(TOPICS)}?"},
                            {"role": "assistant", "content": "It is a broad subject; I can explain the basics."},
                            {"role": "user", "content": "Please summarize it in two sentences."}]},
    lambda r: {"prompt": (lambda n, it, x, y, z: f"{n} has {x} {it}, buys {y} packs of {z} more, then gives away "
                          f"half. How many {it} does {n} have now? Show your reasoning.")(
        r.choice(NAMES), r.choice(ITEMS), r.randint(3, 40), r.randint(2, 9), r.randint(1, 12))},
    lambda r: {"prompt": f"What is {r.randint(12, 99)} times {r.randint(12, 99)}? Explain how you computed it."},
    lambda r: {"prompt": (lambda n, it, x, p: f"{n} had {x} {it} and sold {p} percent of them. How many are left? "
                          "Explain step by step.")(r.choice(NAMES), r.choice(ITEMS), r.randint(2, 20) * 10,
                                                   r.choice([10, 20, 25, 50]))},
]


def quality_prompts(count: int, seed: int = 20261204) -> list[dict]:
    """The bundled prompts, then unique template prompts until `count` in all."""
    out = [json.loads(line) for line in BUNDLED.read_text().splitlines() if line.strip()]
    seen = {json.dumps(o, sort_keys=True) for o in out}
    rng = random.Random(seed)
    while len(out) < count:
        o = rng.choice(TEMPLATES)(rng)
        k = json.dumps(o, sort_keys=True)
        if k not in seen:
            seen.add(k)
            out.append(o)
    return out


def main() -> int:
    path, count = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    prompts = quality_prompts(count)
    path.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in prompts))
    print(f"wrote {len(prompts)} prompts to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
