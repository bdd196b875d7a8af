"""Pick the int4 kernel defaults from one device call's sweeps (session 12): the batch-1 GEMV config best
summed over the Llama-3.1-8B shapes (benchmarks/h200/lowbit_gemv.py), the tensor-core GEMM config best summed
over the shapes at 4-32 rows (benchmarks/h200/int4_rows_gemm.py), and up to how many rows the GEMV stays
faster than that GEMM; configs whose output is off the reference anywhere are never picked. Writes kernel_config.json for `benchmarks/h200_quant.py --kernel-config`, so the
decode rows of the same call run with them (and the committed defaults are then set to the same values).

    python benchmarks/h200/pick_int4_configs.py DIR     (DIR holds lowbit_gemv.json and int4_rows_gemm.json)
"""

from __future__ import annotations

import json
import os
import sys

MAX_REL_ERR = 0.01  # every correct config measures 2-4e-3 (bf16 rounding) on these shapes

def main() -> int:
    d = sys.argv[1]
    gemv = json.load(open(os.path.join(d, "lowbit_gemv.json")))
    rows = json.load(open(os.path.join(d, "int4_rows_gemm.json")))
    shapes = [s for s in ("qkv", "o", "gate_up", "down") if s in gemv]
    totals: dict[str, float] = {}
    for s in shapes:
        for e in gemv[s]["int4_gemv"]["all"]:
            key = json.dumps(e["cfg"], sort_keys=True)
            # a config off the bf16-stored reference by more than bf16 rounding is wrong, whatever its speed
            totals[key] = totals.get(key, 0.0) + (e["us"] if e["rel_err"] < MAX_REL_ERR else 1e9)
    totals = {k: v for k, v in totals.items() if v < 1e9}
    gemv_key = min(totals, key=totals.get)
    ms = sorted({int(k.split("/M")[1]) for k in rows["points"]})
    rows_tot: dict[str, float] = {}
    for m in [m for m in ms if 4 <= m <= 32]:
        for s in shapes:
            for i, v in rows["points"][f"{s}/M{m}"]["rows_gemm"].items():
                rows_tot[i] = rows_tot.get(i, 0.0) + (v["us"] if v["rel_err"] < MAX_REL_ERR else 1e9)
    rows_tot = {i: v for i, v in rows_tot.items() if v < 1e9}
    best_i = min(rows_tot, key=rows_tot.get)
    # the GEMV (each shape's best config, as lowbit_gemv.py times 2 and 4 rows) against the chosen GEMM
    gemv_max_rows = 1
    for m in (2, 4):
        if m not in ms:
            continue
        g = sum(gemv[s].get(f"int4_gemv_M{m}", {"us": 1e9})["us"] for s in shapes)
        r = sum(rows["points"][f"{s}/M{m}"]["rows_gemm"][best_i]["us"] for s in shapes)
        print(f"M{m}: GEMV {g:.1f} us vs GEMM {r:.1f} us (summed over the shapes)")
        if g < r and gemv_max_rows == m // 2:
            gemv_max_rows = m
    out = {"gemv": json.loads(gemv_key), "gemv_sum_us": totals[gemv_key],
           "rows_gemm": rows["configs"][int(best_i)], "rows_gemm_sum_us_4_to_32": rows_tot[best_i],
           "gemv_max_rows": gemv_max_rows}
    print(json.dumps(out))
    with open(os.path.join(d, "kernel_config.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
