"""Each policy's steady E as the report gives it (T_fast: the plain vanilla's no-straggler step)
and against the timed vanilla's (policy none) instead: T_ideal shifts by the difference of the
two T_fast. At TP=4 both are dilated and run the same layers, so their difference is the
baseline's noise, which E carries.

    python results/head-units-3-rounds/t_fast_timed.py COMPARE_OUT_DIR...
"""

import json
import sys

for d in sys.argv[1:]:
    r = json.load(open(f"{d}/report.json"))
    rows = {(x["scenario"], x["policy"]): x for x in r["rows"]}
    plain = r["baseline"]["t_fast_s"]
    timed = rows[("none", "none")]["step_s"]
    out = []
    for (s, p), x in rows.items():
        if s == "none" or p == "vanilla" or x.get("E") is None:
            continue
        alt = (x["t_ideal_s"] - plain + timed) / x["step_s"]
        out.append(f"{p} {x['E']:.3f}->{alt:.3f}")
    name = "/".join(d.rstrip("/").split("/")[-2:])
    print(
        f"{name}: T_fast plain {plain * 1e3:.1f} ms, timed {timed * 1e3:.1f} ms "
        f"({timed / plain:.3f}); " + ", ".join(out)
    )
