"""Twenty small Python files with one function body cut out: (prefix, suffix) pairs for
fill-in-the-middle on a real code model (tests/test_infill.py). The prefix ends where the body
starts (after the indentation of its first line); the suffix is the rest of the file."""
from __future__ import annotations

_FILES = [
    ("def add(a, b):\n    ", "\n\n\nprint(add(2, 3))\n"),
    ("def is_even(n):\n    ", "\n\n\ndef is_odd(n):\n    return not is_even(n)\n"),
    ("def factorial(n):\n    ", "\n\n\nassert factorial(5) == 120\n"),
    ("def reverse_string(s):\n    ", "\n\n\nprint(reverse_string('hello'))\n"),
    ("def maximum(values):\n    ", "\n\n\nprint(maximum([3, 1, 4, 1, 5]))\n"),
    ("def count_vowels(text):\n    ", "\n\n\nprint(count_vowels('banana'))\n"),
    ("import math\n\n\ndef circle_area(radius):\n    ", "\n\n\nprint(circle_area(2.0))\n"),
    ("def fibonacci(n):\n    ", "\n\n\nprint([fibonacci(i) for i in range(10)])\n"),
    ("def is_palindrome(word):\n    ", "\n\n\nprint(is_palindrome('level'))\n"),
    ("def mean(numbers):\n    ", "\n\n\nprint(mean([1, 2, 3, 4]))\n"),
    ("def celsius_to_fahrenheit(c):\n    ", "\n\n\nprint(celsius_to_fahrenheit(100))\n"),
    ("def square_all(values):\n    ", "\n\n\nprint(square_all([1, 2, 3]))\n"),
    ("def word_count(sentence):\n    ", "\n\n\nprint(word_count('a b c'))\n"),
    ("class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n        ",
     "\n\n\ncounter = Counter()\ncounter.increment()\nprint(counter.count)\n"),
    ("def gcd(a, b):\n    ", "\n\n\nprint(gcd(12, 18))\n"),
    ("def flatten(nested):\n    ", "\n\n\nprint(flatten([[1, 2], [3]]))\n"),
    ("def unique(items):\n    ", "\n\n\nprint(unique([1, 1, 2, 3, 3]))\n"),
    ("def clamp(x, low, high):\n    ", "\n\n\nprint(clamp(15, 0, 10))\n"),
    ("def read_lines(path):\n    ", "\n\n\nfor line in read_lines('data.txt'):\n    print(line)\n"),
    ("def sum_of_digits(n):\n    ", "\n\n\nprint(sum_of_digits(1234))\n"),
]
CASES: list[tuple[str, str]] = list(_FILES)
