"""The calculator tool (run by rlx.agent.Sandbox): reads `A OP B` on stdin, digits possibly
space-separated ("4 2 7 + 9 3 1"), OP one of + - *; prints the integer result ("1358").
A malformed expression is the caller's mistake, not a crash: it prints "?" and exits 0."""

import sys

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def evaluate(text: str) -> str:
    for i, char in enumerate(text):
        if char in OPERATIONS:
            a, b = text[:i].replace(" ", ""), text[i + 1 :].replace(" ", "")
            if a.isdigit() and b.isdigit():
                return str(OPERATIONS[char](int(a), int(b)))
            break
    return "?"


if __name__ == "__main__":
    print(evaluate(sys.stdin.read().strip()))
