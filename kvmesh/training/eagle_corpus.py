"""What an EAGLE head trains on: text the target itself wrote.

A head learns to predict the target's next token from the target's features,
so the text it trains on should be what the target says, not what some other
writer said: its greedy continuations of code, its answers to instructions.
This module builds those prompts and has the target answer them:

- ``code_prompts``: openings of code cut from the Python standard library
  (train split of ``kvmesh.training.corpus``): a ``def``/``class`` line and up to four
  lines after it, or a file's first lines. The target continues each.
- ``instruction_prompts``: chat questions from templates (tasks x phrasings,
  Python and general topics), chat-templated; the target answers each.

None of the benchmark's held-out prompts (``bench/speculation.py``) is built
here; ``tests/speculator/test_eagle_corpus.py`` checks it.
"""

from __future__ import annotations

import random
import re
import sys
import time

from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams

_OPENING = re.compile(r"^( {0,8})(def |class |async def )")

# Hand-written questions, the first the head trained on.
HANDWRITTEN_PROMPTS = [
    "How do I reverse a list in Python?",
    "What is a Python dictionary and how do I use it?",
    "Explain list comprehensions with an example.",
    "How do I read a file line by line in Python?",
    "What is the difference between a tuple and a list?",
    "Write a Python function that checks whether a string is a palindrome.",
    "How do I handle exceptions in Python?",
    "What does the 'with' statement do in Python?",
    "Write a function that returns the factorial of a number.",
    "How do I sort a list of dictionaries by a key?",
    "Explain what a Python decorator is.",
    "How can I remove duplicates from a list?",
    "What are *args and **kwargs?",
    "Write a Python class for a simple bank account.",
    "How do I merge two dictionaries?",
    "What is a generator in Python?",
    "How do I convert a string to an integer in Python?",
    "Write a function that counts the vowels in a string.",
    "How do I create a virtual environment?",
    "What is the difference between == and is in Python?",
    "Write a Python script that prints the numbers from 1 to 10.",
    "How do I split a string into words?",
    "Explain recursion with a short example.",
    "How do I format a string with f-strings?",
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Write a short poem about the ocean.",
    "Explain photosynthesis in simple terms.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a rainbow form?",
    "Write a short story about a robot learning to paint.",
    "What is machine learning?",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Give me a recipe for a simple pancake.",
    "What is the difference between weather and climate?",
    "Explain how a computer works to a child.",
    "Write an email asking a colleague for a meeting.",
    "What are some good habits for studying?",
]

PYTHON_TASKS = [
    "reverse a string",
    "sort a list of tuples by the second item",
    "read a CSV file",
    "write JSON to a file",
    "parse command-line arguments",
    "find the most common element in a list",
    "flatten a nested list",
    "count the words in a text file",
    "remove whitespace from a string",
    "check whether a number is even",
    "convert a list to a string",
    "make an HTTP request",
    "measure how long a function takes",
    "copy a file",
    "list the files in a directory",
    "create a directory if it does not exist",
    "generate a random number",
    "shuffle a list",
    "pick a random element from a list",
    "round a float to two decimals",
    "convert Celsius to Fahrenheit",
    "compute the average of a list",
    "find the index of an item in a list",
    "join two lists",
    "swap two variables",
    "check whether a string starts with a prefix",
    "replace text in a string",
    "capitalize every word",
    "read user input",
    "convert a string to lowercase",
    "sum the digits of a number",
    "find the maximum value in a dictionary",
    "invert a dictionary",
    "group items by a key",
    "zip two lists together",
    "enumerate a list with indexes",
    "filter a list with a condition",
    "square every number in a list",
    "compute a running total",
    "remove an item from a list",
    "get the length of a list",
    "slice a list",
    "repeat a string",
    "format a number with commas",
    "parse a date string",
    "add days to a date",
    "sleep for a second",
    "use a regular expression",
    "validate an email address",
    "write a unit test",
    "define a dataclass",
    "use a context manager",
    "open a file in binary mode",
    "compress a file with gzip",
    "hash a string with SHA-256",
    "encode text as base64",
    "run a shell command",
    "use a thread pool",
    "write an async function",
    "use a default dictionary",
    "count items with a Counter",
    "implement a queue",
    "implement binary search",
    "implement bubble sort",
    "compute the greatest common divisor",
    "check for prime numbers",
    "generate the Fibonacci sequence",
    "transpose a matrix",
    "multiply two matrices",
    "log messages",
    "raise a custom exception",
    "use type hints",
    "write a property",
    "implement __str__ for a class",
    "iterate over two lists at once",
    "read environment variables",
    "merge sorted lists",
    "deep copy an object",
    "serialize an object with pickle",
    "use enumerate and zip together",
]
PYTHON_PHRASINGS = [
    "How do I {task} in Python?",
    "Write a Python function to {task}.",
    "Show me how to {task} with Python.",
    "What is the best way to {task} in Python?",
]
PYTHON_CONCEPTS = [
    "a closure",
    "a class method",
    "a static method",
    "inheritance",
    "polymorphism",
    "the GIL",
    "a module",
    "a package",
    "a virtual environment",
    "pip",
    "a set comprehension",
    "slicing",
    "mutable defaults",
    "iterators",
    "the yield keyword",
    "async and await",
    "type hints",
    "duck typing",
    "exceptions",
    "the finally clause",
    "garbage collection",
    "the __init__ method",
    "self",
    "name mangling",
    "f-strings",
    "bytes and strings",
    "integer division",
    "None",
    "truthiness",
    "the walrus operator",
    "pattern matching",
    "dunder methods",
    "abstract base classes",
    "namedtuples",
    "the itertools module",
    "the functools module",
    "recursion limits",
    "global variables",
    "lambda expressions",
    "docstrings",
]
CONCEPT_PHRASINGS = [
    "Explain {topic} in Python.",
    "When should I use {topic} in Python?",
    "Give an example of {topic} in Python.",
]
GENERAL_TOPICS = [
    "the moon",
    "volcanoes",
    "the Roman Empire",
    "honey bees",
    "the internet",
    "electric cars",
    "coffee",
    "the human heart",
    "rain forests",
    "the solar system",
    "chess",
    "the printing press",
    "gravity",
    "the ocean tides",
    "dinosaurs",
    "vaccines",
    "recycling",
    "the Great Wall of China",
    "jazz music",
    "earthquakes",
    "the immune system",
    "democracy",
    "clouds",
    "penguins",
    "the Olympic Games",
    "solar panels",
    "bicycles",
    "libraries",
    "trees",
    "mountains",
    "deserts",
    "money",
    "languages",
    "the seasons",
    "music",
    "painting",
    "gardening",
    "cooking rice",
    "a healthy breakfast",
    "time zones",
]
GENERAL_PHRASINGS = [
    "Tell me about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Write a short paragraph about {topic}.",
    "What are three interesting facts about {topic}?",
    "Write a short poem about {topic}.",
]


def instruction_prompts() -> list[str]:
    """Every templated question, in a fixed order (tasks x phrasings)."""
    out = list(HANDWRITTEN_PROMPTS)
    out += [ph.format(task=t) for t in PYTHON_TASKS for ph in PYTHON_PHRASINGS]
    out += [ph.format(topic=t) for t in PYTHON_CONCEPTS for ph in CONCEPT_PHRASINGS]
    out += [ph.format(topic=t) for t in GENERAL_TOPICS for ph in GENERAL_PHRASINGS]
    return out


def code_prompts(n: int, seed: int) -> list[str]:
    """``n`` code openings from the stdlib's train split, files and cut points in a seeded order."""
    from kvmesh.training.corpus import split_files, stdlib_files

    rng = random.Random(seed)
    files = split_files(stdlib_files()).train
    rng.shuffle(files)
    out: list[str] = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if _OPENING.match(line)]
        picks = rng.sample(starts, min(3, len(starts)))
        if rng.random() < 0.2:
            picks.append(0)  # a file's opening: imports, a docstring
        for i in picks:
            text = "".join(lines[i : i + 1 + rng.randint(0, 4)])
            if 8 <= len(text) <= 600:
                out.append(text)
            if len(out) >= n:
                return out
    return out


def target_continuations(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (what the target itself says)."""
    t0 = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    new = sum(len(c.token_ids) for c in done)
    print(
        f"target wrote {new} tokens for {len(prompts)} prompts in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
        flush=True,
    )
    return [c.prompt_ids + c.token_ids for c in done]
