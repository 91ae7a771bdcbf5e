#!/usr/bin/env python3
"""A multiple-choice task for lm-evaluation-harness from a local JSONL file
(no dataset hub here): sums and country capitals, four choices each, seeded.

    python3 make_task.py OUT_DIR [N]    -> OUT_DIR/mc.jsonl, OUT_DIR/tandem_mc.yaml

The YAML reads OUT_DIR/mc.jsonl through datasets' json builder; run lm_eval
with --include_path OUT_DIR --tasks tandem_mc."""
import json
import os
import random
import sys

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
            ("Russia", "Moscow"), ("China", "Beijing"), ("India", "New Delhi"), ("Brazil", "Brasilia"),
            ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
            ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Mexico", "Mexico City"), ("Peru", "Lima"),
            ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Turkey", "Ankara"), ("Thailand", "Bangkok"),
            ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Cuba", "Havana"), ("Finland", "Helsinki"),
            ("Hungary", "Budapest"), ("Vietnam", "Hanoi")]


def items(n, rng):
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(2, 60), rng.randint(2, 60)
            right = a + b
            wrong = rng.sample(sorted({right + d for d in (-10, -2, -1, 1, 2, 10)} - {right}), 3)
            q, choices = "Question: What is %d + %d?" % (a, b), [str(v) for v in [right] + wrong]
        else:
            country, right = CAPITALS[(i // 2) % len(CAPITALS)]
            wrong = rng.sample([c for _, c in CAPITALS if c != right], 3)
            q, choices = "Question: What is the capital of %s?" % country, [right] + wrong
        rng.shuffle(choices)
        out.append({"question": q, "choices": choices, "answer": choices.index(str(right))})
    return out


def main():
    out = os.path.abspath(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "mc.jsonl"), "w") as f:
        for it in items(n, random.Random(52)):
            f.write(json.dumps(it) + "\n")
    with open(os.path.join(out, "tandem_mc.yaml"), "w") as f:
        f.write("""task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: %s
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""" % os.path.join(out, "mc.jsonl"))


if __name__ == "__main__":
    main()
