"""Regenerates prompts.jsonl (run from the repository root): python services/pipeline/data/make_prompts.py"""
import json
import random

rng = random.Random(20261202)
topics = ["photosynthesis","black holes","the water cycle","compound interest","vaccines","plate tectonics","the French Revolution","machine learning","blockchains","climate change","the immune system","electric cars","the printing press","volcanoes","honeybees","the internet","democracy","inflation","DNA","the Moon landing","coral reefs","sleep","coffee","recycling","the Roman Empire","quantum computing","solar panels","earthquakes","the stock market","meditation","rainbows","tides","antibiotics","the Great Wall of China","jazz music","chess","gravity","the Renaissance","cloud computing","nuclear fusion"]
audiences = ["a ten-year-old","a busy manager","a first-year university student","my grandmother","a software engineer"]
skills = ["learning a new language","public speaking","saving money","staying focused while working from home","running a first marathon","writing a clear email","cooking for a large group","keeping houseplants alive","preparing for a job interview","getting better sleep"]
things = ["a cat","autumn leaves","a lighthouse","the city at night","a rainy Monday","an old bicycle","the ocean","a cup of tea","a mountain trail","the first snow"]
code = ["reverses a string","checks whether a number is prime","counts the words in a text","merges two sorted lists","computes the factorial of n","removes duplicates from a list while keeping order","finds the largest element of a list","converts Celsius to Fahrenheit","checks whether a string is a palindrome","returns the n-th Fibonacci number"]
pairs = [("a virus","a bacterium"),("weather","climate"),("a list","a tuple in Python"),("RAM","storage"),("a comet","an asteroid"),("speed","velocity"),("TCP","UDP"),("a democracy","a republic"),("baking soda","baking powder"),("an alligator","a crocodile")]
out = []
for t in topics:
    out.append({"messages": [{"role": "user", "content": f"Explain {t} to {rng.choice(audiences)}."}]})
    out.append({"prompt": f"Give me three surprising facts about {t}."})
for s in skills:
    out.append({"instruction": f"List five practical tips for {s}."})
    out.append({"conversations": [{"from": "human", "value": f"I want to get better at {s}. Where should I start?"}]})
for th in things:
    out.append({"prompt": f"Write a short poem about {th}."})
    out.append({"instruction": "Write a haiku.", "input": th})
for c in code:
    out.append({"messages": [{"role": "system", "content": "You are a concise programming assistant."}, {"role": "user", "content": f"Write a Python function that {c}."}]})
    out.append({"prompt": f"In JavaScript, how would you write a function that {c}?"})
for a, b in pairs:
    out.append({"prompt": f"What is the difference between {a} and {b}?"})
names = ["Ana","Ben","Chen","Dara","Eli","Fatima","Goran","Hana","Ivo","Jun"]
items = ["apples","pencils","marbles","stickers","books","cookies"]
for _i in range(60):
    n, it = rng.choice(names), rng.choice(items)
    x, y, z = rng.randint(3, 40), rng.randint(2, 9), rng.randint(1, 12)
    out.append({"prompt": f"{n} has {x} {it}, buys {y} packs of {z} more, then gives away half. How many {it} does {n} have now? Show your reasoning."})
for _i in range(30):
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    out.append({"prompt": f"What is {a} times {b}? Explain how you computed it."})
for t in topics[:20]:
    out.append({"messages": [
        {"role": "user", "content": f"What is {t}?"},
        {"role": "assistant", "content": f"{t.capitalize()} is a broad subject; I can explain the basics."},
        {"role": "user", "content": "Please summarize it in two sentences."}]})
for s in skills:
    out.append({"prompt": f"Write a short motivational message for someone who is {s}."})
for t in topics:
    out.append({"prompt": f"Write a one-paragraph story in which {t} plays a key role."})
    out.append({"instruction": "Summarize the following topic in one sentence.", "input": t})
seen = set()
uniq = []
for o in out:
    k = json.dumps(o, sort_keys=True)
    if k not in seen:
        seen.add(k)
        uniq.append(o)
with open("services/pipeline/data/prompts.jsonl", "w") as f:
    for o in uniq:
        f.write(json.dumps(o, ensure_ascii=False) + "\n")
print(len(uniq))
