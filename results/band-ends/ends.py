"""Per run: its decisions (iteration and reason), and with --readings each timing record from
--from on (per rank: work in millions, the loop's factor, the cost fit's own reading where the
record has it, the detector's slowdown, and where the factor was read from).

    python3 results/band-ends/ends.py results/band-ends/tp4-507d6a5/runs/*.jsonl [--readings]
"""

import argparse
import json
import os


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--readings", action="store_true")
    p.add_argument("--from", dest="start", type=int, default=13)
    a = p.parse_args()
    for path in a.runs:
        records = [json.loads(line) for line in open(path)]
        decided = [
            f"{r['iteration']}: {r['reason'][:48]}" for r in records if r["kind"] == "decision"
        ]
        print(f"{os.path.basename(path)}: {' | '.join(decided)}")
        if not a.readings:
            continue
        for r in records:
            if r["kind"] != "timing" or r["iteration"] < a.start:
                continue

            def row(key, scale=1.0, record=r):
                return [round(x / scale, 2) for x in (record.get(key) or [])]

            print(
                f"  {r['iteration']:>3} work {row('work', 1e6)} factor {row('factor')} "
                f"modelled {row('modelled')} slowdown {row('slowdown')} {r.get('reading')}"
            )


if __name__ == "__main__":
    main()
