"""How well the cost fit predicts an unslowed rank's compute at the next report, by how far its
work changed since the last one (a move or resize changed it, or not), for the fit the loop
uses (hettp.costfit.ComputeFit: a robust line with a per-call part) and two alternatives:
no per-call part beyond the timed optimizer region (`proportional`), and the fitted per-call
part capped at the timed region plus 15% of a rank's median compute (`capped`, the prior the
fit's outliers are judged against). Each fit is replayed over a run's timing records, learning
from the reports before the one it predicts; an unslowed rank is one read within 10% of the
fastest. Runs with pipeline stages are shown apart: a stage's compute also changes with its
layers and micro-batch schedule, which no per-unit line covers.

    python results/cost-fit/predict.py 'results/**/runs/*.jsonl'
"""

import glob
import json
import math
import statistics
import sys

from hettp.costfit import ComputeFit, Line

CAP = 0.15  # of a rank's median compute, on top of the timed region


class Proportional(ComputeFit):
    def line(self, works=(), computes=(), fixed=None):
        if not self._points:
            return super().line(works, computes, fixed)
        base = statistics.median(x for _, _, x in self._points)
        return Line(base, statistics.median((c - base) / w for w, c, _ in self._points), base)


class Capped(ComputeFit):
    def line(self, works=(), computes=(), fixed=None):
        line = super().line(works, computes, fixed)
        if not self.fitted:
            return line
        base = statistics.median(x for _, _, x in self._points)
        work = statistics.median(w for w, _, _ in self._points)
        compute = statistics.median(c for _, c, _ in self._points)
        cap = base + CAP * compute
        if line.fixed <= cap:
            return line
        return Line(cap, (compute - cap) / work, min(cap, line.apart))  # through the median point


FITS = {"ComputeFit": ComputeFit, "proportional": Proportional, "capped": Capped}
CHANGES = [
    (0.0, 0.02, "unchanged"),
    (0.02, 0.3, "< 1.35x"),
    (0.3, 0.7, "1.35-2x"),
    (0.7, 99, "> 2x"),
]


def _change(old: float, new: float) -> str:
    d = abs(math.log(new / old))
    return next(name for low, high, name in CHANGES if low <= d < high)


def main(patterns):
    errors = {}  # (layers?, fit, change) -> relative errors
    paths = sorted({p for pattern in patterns for p in glob.glob(pattern, recursive=True)})
    for path in paths:
        if ".vanilla." in path or ".none." in path:
            continue
        records = [json.loads(line) for line in open(path)]
        timing = [r for r in records if r.get("kind") == "timing" and r.get("fixed_s")]
        layers = "-pp" in path.split("/runs/")[0]  # results/compare-pp2*/
        fits = {name: make() for name, make in FITS.items()}
        for before, report in zip(timing, timing[1:]):
            known = [f for f in report["factor"] if f]
            for name, fit in fits.items():
                fit.add(before["work"], before["compute_s"], before["factor"], before["fixed_s"])
                line = fit.line(report["work"], report["compute_s"], report["fixed_s"])
                if not known:
                    continue
                ranks = zip(before["work"], report["work"], report["compute_s"], report["factor"])
                for old, new, compute, factor in ranks:
                    if factor and factor < 1.1 * min(known) and old > 0 and new > 0:
                        key = (layers, name, _change(old, new))
                        predicted = line.fixed + line.per_unit * new
                        errors.setdefault(key, []).append(predicted / compute - 1.0)
    q = lambda v, p: sorted(v)[int(p * (len(v) - 1))]  # noqa: E731
    for layers in (False, True):
        print("runs with pipeline stages" if layers else "TP runs")
        print("| fit | " + " | ".join(name for _, _, name in CHANGES) + " |")
        print("|---|" + "---|" * len(CHANGES))
        for name in FITS:
            cells = []
            for _, _, change in CHANGES:
                e = errors.get((layers, name, change), [])
                size = [abs(x) for x in e]
                cells.append(f"{q(size, 0.5):.3f} / {q(size, 0.9):.3f} (n={len(e)})" if e else "-")
            print(f"| {name} | " + " | ".join(cells) + " |")
    print("cells: |predicted / measured - 1|, median / p90 over unslowed ranks' reports")


if __name__ == "__main__":
    main(sys.argv[1:])
