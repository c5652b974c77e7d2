"""The table of scripts/bench-peers.sh, computed from what its runs recorded.

Reads every run folder under --runs (`seed<k>/<run>/`: meta.json from the
script, worker-<rank>.json of each of the --workers ranks from `ps-worker
train --report` or ddp_train.py, wire.json with the bytes each node's veth
sent and received during the run), prints one table, and writes it as
table.md and every measurement as results.json in --out.

The target is a test accuracy (reached at or above it) or, with
`--target-kind loss` (the GPT), a validation loss (reached at or below it).
Besides the target the table shows one milestone on the way: 95% accuracy,
or a loss of 1.1x the target.

Per run:
* step ms: training wall time (evaluation left out) / steps, mean of the
  workers; compute and comm ms per step likewise from each report.
* wire KB/step: (bytes sent + received on a worker node's link) / steps,
  mean over the worker nodes. Everything the node's processes put on the
  link counts: setup (TLS, the first parameters, DDP's broadcast), training,
  the small stop all-reduce of the DDP script; loopback traffic to a
  colocated server does not.
* steps and seconds to the milestone and to the target: the first
  evaluation (rank 0) reaching it; seconds are rank 0's training clock at
  that evaluation.
* start-up and steady state, from each step's wall time (Stratus: the
  `train_s` of its per-step JSONL records, worker-<rank>.jsonl; torch: the
  report's `step_train_s`; consecutive differences, evaluation left out):
  the start-up is the first step for DDP and Stratus and the dense
  all-reduce steps before start_powerSGD_iter for PowerSGD; start-up s is
  their wall time, its share is that over the time to the target, and the
  steady step is the mean step after them. Mean of the workers.
* density at the target: the density of rank 0's push at the step the
  target was reached (its step record), top-k modes only.
* ratios: Stratus over DDP dense and over DDP+PowerSGD of the same seed:
  time to the target, and steady-state step over steady-state step.
With several seeds a cell shows the mean over seeds and the spread (min-max).
"""
import argparse
import glob
import json
import os
import sys

SYSTEM_ORDER = [("ddp", "dense"), ("ddp", "powersgd"),
                ("stratus", "dense"), ("stratus", "densestream"), ("stratus", "dense16"),
                ("stratus", "dense16all"),
                ("stratus", "topk1"), ("stratus", "topk1stream"),
                ("stratus", "topk01"), ("stratus", "topk01stream")]
TOPOLOGY_ORDER = ["peer", "server", "colocated"]
SYSTEM_NAME = {"ddp": "DDP", "stratus": "Stratus"}
MODE_NAME = {("ddp", "dense"): "dense", ("ddp", "powersgd"): "PowerSGD r4",
             ("stratus", "dense"): "dense", ("stratus", "densestream"): "dense, pushed during backward",
             ("stratus", "dense16"): "dense, f16 push",
             ("stratus", "dense16all"): "dense, f16 push and pull",
             ("stratus", "topk1"): "top-k 1%",
             ("stratus", "topk01"): "top-k 0.1%",
             ("stratus", "topk1stream"): "top-k 1% per shard, pushed during backward",
             ("stratus", "topk01stream"): "top-k 0.1% per shard, pushed during backward"}
TOPOLOGY_NAME = {"peer": "peers (gloo)", "server": "1 server node", "colocated": "colocated"}


# The model each --model names, as the table's summary line says it.
MODELS = {
    "mlp": "MLP 256-1024-1024-10 (1.32M parameters)",
    "resnet20": "ResNet-20 on 3x32x32 (0.27M parameters)",
    "gpt": "GPT on byte tokens, context 64, d_model 128, 4 layers, 4 heads (0.83M parameters)",
}


def load_json(path):
    with open(path) as f:
        return json.load(f)


def reaches(e, goal):
    """Whether evaluation `e` reaches `goal`: an accuracy at or above it,
    or with --target-kind loss a test loss at or below it."""
    if ARGS.target_kind == "loss":
        return e["test_loss"] <= goal
    return e["test_accuracy"] >= goal


def first_reaching(evals, goal):
    for e in evals:
        if reaches(e, goal):
            return e
    return None


def milestone():
    """(label, value) of the milestone before the target."""
    if ARGS.target_kind == "loss":
        return f"loss {1.1 * ARGS.target:.3g}", 1.1 * ARGS.target
    return "95%", 0.95


def target_label():
    if ARGS.target_kind == "loss":
        return f"loss {ARGS.target:g}"
    return f"{100 * ARGS.target:g}%"


def step_clock(run_dir, rank, report):
    """Training clock at the end of each step, and the start-up steps."""
    if "step_train_s" in report:  # the torch side
        return report["step_train_s"], int(report.get("startup_steps", 1))
    records = {}
    path = os.path.join(run_dir, f"worker-{rank}.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("record") == "step" and "train_s" in rec:
                    records[rec["step"]] = rec
    ordered = [records[k] for k in sorted(records)]
    return [r["train_s"] for r in ordered], 1, ordered


def startup_and_steady(clock, startup_steps):
    """(start-up seconds, steady-state mean step seconds or None)."""
    walls = [b - a for a, b in zip([0.0] + clock[:-1], clock)]
    startup = sum(walls[:startup_steps])
    steady = walls[startup_steps:]
    return startup, (sum(steady) / len(steady) if steady else None)


def measure(run_dir):
    meta = load_json(os.path.join(run_dir, "meta.json"))
    out = dict(meta)
    out["dir"] = run_dir
    reports = []
    for r in range(ARGS.workers):
        p = os.path.join(run_dir, f"worker-{r}.json")
        if os.path.exists(p) and os.path.getsize(p) > 0:
            reports.append(load_json(p))
    if len(reports) != ARGS.workers:
        out["completed"] = False
        return out
    steps = reports[0]["steps"] - reports[0].get("start_step", 0)
    out["steps"] = steps
    if steps <= 0:
        out["completed"] = False
        return out

    def per_step_ms(field):
        return sum(1e3 * r[field] / max(r["steps"] - r.get("start_step", 0), 1)
                   for r in reports) / len(reports)

    out["step_ms"] = per_step_ms("train_s")
    startups, steadies, step_records = [], [], None
    for rank, r in enumerate(reports):
        got = step_clock(run_dir, rank, r)
        clock, startup_steps = got[0], got[1]
        if rank == 0 and len(got) > 2:
            step_records = got[2]
        if not clock:
            continue
        startup, steady = startup_and_steady(clock, startup_steps)
        out["startup_steps"] = startup_steps
        startups.append(startup)
        if steady is not None:
            steadies.append(steady)
    out["startup_s"] = sum(startups) / len(startups) if startups else None
    out["steady_ms"] = 1e3 * sum(steadies) / len(steadies) if len(steadies) == len(reports) else None
    out["compute_ms"] = per_step_ms("compute_s")
    out["comm_ms"] = per_step_ms("comm_s")
    out["data_wait_ms"] = per_step_ms("data_wait_s")
    out["app_bytes_per_step"] = sum(
        r["bytes_pushed_per_step"] + r["bytes_pulled_per_step"] for r in reports) / len(reports)
    wire = load_json(os.path.join(run_dir, "wire.json"))
    out["wire"] = wire
    nodes = [f"w{r}" for r in range(ARGS.workers)]
    out["wire_bytes_per_step"] = sum(
        wire[n]["tx_bytes"] + wire[n]["rx_bytes"] for n in nodes) / len(nodes) / steps
    out["wire_tx_bytes_per_step"] = sum(wire[n]["tx_bytes"] for n in nodes) / len(nodes) / steps
    out["wire_rx_bytes_per_step"] = sum(wire[n]["rx_bytes"] for n in nodes) / len(nodes) / steps
    evals = reports[0]["evals"]
    out["best_accuracy"] = max((e["test_accuracy"] for e in evals), default=None)
    out["best_loss"] = min((e["test_loss"] for e in evals), default=None)
    out["stop_reason"] = reports[0].get("stop_reason")
    out["evals"] = evals
    for key, acc in (("95", milestone()[1]), ("target", ARGS.target)):
        e = first_reaching(evals, acc)
        out[f"steps_to_{key}"] = e["step"] if e else None
        out[f"s_to_{key}"] = e["train_s"] if e else None
    out["startup_share"] = (out["startup_s"] / out["s_to_target"]
                            if out["startup_s"] is not None and out["s_to_target"] else None)
    out["density_at_target"] = None
    if step_records and out["steps_to_target"] is not None:
        at = [rec for rec in step_records if rec["step"] == out["steps_to_target"]]
        if at and "density" in at[0]:
            out["density_at_target"] = at[0]["density"]
    if "compute_ref_ms" in reports[0]:  # DDP: the compute-only reference per step
        out["compute_ref_ms"] = sum(r.get("compute_ref_ms", 0) for r in reports) / len(reports)
    return out


def spread(values, digits, seeds):
    """Mean over seeds, and (min-max) when there is more than one seed."""
    got = [v for v in values if v is not None]
    if not got:
        return "-" if not values else "miss"
    mean = sum(got) / len(got)
    cell = f"{mean:.{digits}f}"
    if seeds > 1:
        cell += f" ({min(got):.{digits}f}-{max(got):.{digits}f})"
    if len(got) < len(values):
        cell += f" [{len(values) - len(got)} miss]"
    return cell


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rate", required=True)
    ap.add_argument("--target", type=float, default=0.97)
    ap.add_argument("--target-kind", choices=["accuracy", "loss"], default="accuracy")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eval-every", type=int, required=True)
    ap.add_argument("--max-steps", type=int, required=True)
    ap.add_argument("--seeds", required=True, help="the seed list, for the summary")
    ap.add_argument("--torch", default="")
    ap.add_argument("--topk-warmup", type=int, default=0)
    ap.add_argument("--powersgd-start", type=int, default=2)
    ap.add_argument("--topk-recipe", default="")
    ap.add_argument("--topk-scope", default="model", choices=["model", "shard"])
    ap.add_argument("--data", default="")
    ap.add_argument("--model", default="mlp", choices=sorted(MODELS))
    ap.add_argument("--optimizer", default="SGD lr 0.05 momentum 0.9",
                    help="the optimizer the runs used, for the summary line")
    ap.add_argument("--quick", action="store_true")
    return ap.parse_args()


def main():
    runs = []
    for meta in sorted(glob.glob(os.path.join(ARGS.runs, "seed*", "*", "meta.json"))):
        runs.append(measure(os.path.dirname(meta)))
    if not runs:
        print("bench-peers: no runs to report", file=sys.stderr)
        return 1
    seeds = sorted({r["seed"] for r in runs})
    nseeds = len(seeds)
    by_key = {}
    for r in runs:
        by_key.setdefault((r["system"], r["mode"], r["topology"]), []).append(r)

    def run_of(system, mode, topology, seed):
        for r in by_key.get((system, mode, topology), []):
            if r["seed"] == seed and r.get("completed"):
                return r
        return None

    keys = sorted(by_key, key=lambda k: (SYSTEM_ORDER.index((k[0], k[1])) if k[0] == "ddp" else 2,
                                         TOPOLOGY_ORDER.index(k[2]),
                                         SYSTEM_ORDER.index((k[0], k[1]))))
    tgt = target_label()
    mile = milestone()[0]
    header = ["System", "Topology", "Mode", "Step ms", "Steady ms", "Start-up s", "Start-up share",
              "Compute ms", "Comm ms", "Wire KB/step",
              f"Steps {mile}", f"s {mile}", f"Steps {tgt}", f"s {tgt}", f"Density at {tgt}",
              f"t{tgt} /DDP", f"t{tgt} /PSGD", "steady /DDP", "steady /PSGD"]
    rows, table = [], []
    for key in keys:
        system, mode, topology = key
        done = [run_of(system, mode, topology, s) for s in seeds]
        done = [r for r in done if r is not None]
        agg = {"system": system, "mode": mode, "topology": topology,
               "seeds": len(by_key[key]), "completed": len(done)}
        cols = {}
        for field in ("step_ms", "steady_ms", "startup_s", "startup_share", "density_at_target",
                      "compute_ms", "comm_ms", "data_wait_ms", "wire_bytes_per_step",
                      "app_bytes_per_step", "steps_to_95", "s_to_95", "steps_to_target",
                      "s_to_target"):
            cols[field] = [r.get(field) for r in done]
        ratios = {"t_target_vs_ddp": [], "t_target_vs_powersgd": [],
                  "step_vs_ddp": [], "step_vs_powersgd": []}
        if system == "stratus":
            for r in done:
                for name, ref_mode in (("ddp", "dense"), ("powersgd", "powersgd")):
                    ref = run_of("ddp", ref_mode, "peer", r["seed"])
                    if ref is None:
                        continue
                    ratios[f"step_vs_{name}"].append(
                        r["steady_ms"] / ref["steady_ms"]
                        if r.get("steady_ms") and ref.get("steady_ms") else None)
                    if r["s_to_target"] is not None and ref["s_to_target"] is not None:
                        ratios[f"t_target_vs_{name}"].append(r["s_to_target"] / ref["s_to_target"])
                    else:
                        ratios[f"t_target_vs_{name}"].append(None)
        for field, values in list(cols.items()) + list(ratios.items()):
            got = [v for v in values if v is not None]
            agg[field] = {
                "mean": sum(got) / len(got) if got else None,
                "min": min(got) if got else None,
                "max": max(got) if got else None,
                "missing": len(values) - len(got),
                "values": values,
            }
        rows.append(agg)
        kb = [None if v is None else v / 1e3 for v in cols["wire_bytes_per_step"]]
        share = [None if v is None else 100 * v for v in cols["startup_share"]]
        dens = [None if v is None else 100 * v for v in cols["density_at_target"]]
        table.append([
            SYSTEM_NAME[system] + ("+PowerSGD" if mode == "powersgd" else ""),
            TOPOLOGY_NAME[topology], MODE_NAME[(system, mode)],
            spread(cols["step_ms"], 1, nseeds), spread(cols["steady_ms"], 1, nseeds),
            spread(cols["startup_s"], 3, nseeds), spread(share, 0, nseeds) + ("%" if any(
                v is not None for v in share) else ""),
            spread(cols["compute_ms"], 1, nseeds),
            spread(cols["comm_ms"], 1, nseeds), spread(kb, 0, nseeds),
            spread(cols["steps_to_95"], 0, nseeds), spread(cols["s_to_95"], 2, nseeds),
            spread(cols["steps_to_target"], 0, nseeds), spread(cols["s_to_target"], 2, nseeds),
            (spread(dens, 2, nseeds) + "%") if mode.startswith("topk") and any(
                v is not None for v in dens) else "",
            spread(ratios["t_target_vs_ddp"], 2, nseeds) if system == "stratus" else "",
            spread(ratios["t_target_vs_powersgd"], 2, nseeds) if system == "stratus" else "",
            spread(ratios["step_vs_ddp"], 2, nseeds) if system == "stratus" else "",
            spread(ratios["step_vs_powersgd"], 2, nseeds) if system == "stratus" else "",
        ])
        if len(done) < len(by_key[key]):
            table[-1][2] += f" ({len(by_key[key]) - len(done)} failed)"

    # Targets, from the means over seeds of this invocation.
    def row(system, mode, topology):
        for a in rows:
            if (a["system"], a["mode"], a["topology"]) == (system, mode, topology):
                return a
        return None

    # Issue 26's targets for this rate: the best mode's time to the target
    # over DDP+PowerSGD's (0.5x at 100 Mbit/s, 0.8x at other rates), at
    # 100 Mbit/s its steady-state step over PowerSGD's (0.6x), and the dense
    # colocated steady-state step over DDP's (1.0x).
    t_limit = 0.5 if ARGS.rate == "100mbit" else 0.8
    targets = []
    psgd = row("ddp", "powersgd", "peer")
    stratus_rows = [a for a in rows if a["system"] == "stratus"]
    reached = [a for a in stratus_rows
               if a["completed"] and a["s_to_target"]["missing"] == 0 and a["s_to_target"]["mean"] is not None]
    t_label = f"(1) Stratus best time to {tgt} <= {t_limit}x DDP+PowerSGD"
    s_label = "(2) that mode's steady-state step <= 0.6x DDP+PowerSGD's"
    best = None
    if psgd is None or not stratus_rows:
        targets.append(("SKIP", f"{t_label}: needs the powersgd mode and a Stratus mode"))
    else:
        psgd_t = psgd["s_to_target"]
        if not reached:
            targets.append(("MISS", f"{t_label}: no Stratus mode reached {tgt} in every seed"))
        elif psgd_t["missing"] or psgd_t["mean"] is None:
            targets.append(("MISS", f"{t_label}: DDP+PowerSGD did not reach {tgt} in every seed, no ratio"))
        else:
            best = min(reached, key=lambda a: a["s_to_target"]["mean"])
            ratio = best["s_to_target"]["mean"] / psgd_t["mean"]
            targets.append(("PASS" if ratio <= t_limit else "MISS",
                            f"{t_label}: "
                            f"{MODE_NAME[('stratus', best['mode'])]} {TOPOLOGY_NAME[best['topology']]} "
                            f"{best['s_to_target']['mean']:.2f} s vs {psgd_t['mean']:.2f} s = {ratio:.2f}x"))
    if ARGS.rate == "100mbit":
        if best is None or best["steady_ms"]["mean"] is None or psgd["steady_ms"]["mean"] is None:
            targets.append(("SKIP", f"{s_label}: needs a best mode and both steady-state steps"))
        else:
            ratio = best["steady_ms"]["mean"] / psgd["steady_ms"]["mean"]
            targets.append(("PASS" if ratio <= 0.6 else "MISS",
                            f"{s_label}: {best['steady_ms']['mean']:.1f} ms vs "
                            f"{psgd['steady_ms']['mean']:.1f} ms = {ratio:.2f}x"))
    ddp = row("ddp", "dense", "peer")
    for mode, label in (("dense", "(3) Stratus dense colocated steady-state step"),
                        ("dense16", "(3) Stratus dense colocated steady-state step, f16 push values,"),
                        ("dense16all", "(3) Stratus dense colocated steady-state step, f16 push and pull values,")):
        dense_col = row("stratus", mode, "colocated")
        if dense_col is None and mode != "dense":
            continue
        if (dense_col is None or ddp is None or dense_col["steady_ms"]["mean"] is None
                or ddp["steady_ms"]["mean"] is None):
            targets.append(("SKIP", f"{label} <= 1.0x DDP's: needs both runs to complete"))
        else:
            ratio = dense_col["steady_ms"]["mean"] / ddp["steady_ms"]["mean"]
            targets.append(("PASS" if ratio <= 1.0 else "MISS",
                            f"{label} <= 1.0x DDP's: "
                            f"{dense_col['steady_ms']['mean']:.1f} ms vs {ddp['steady_ms']['mean']:.1f} ms = {ratio:.2f}x"))
    # What pushing each shard during backward gains: the step against the
    # same mode pushing after the whole pass, per topology (for top-k an
    # A/B of the overlap alone when --topk-scope is shard).
    for whole_mode, streamed_mode, what in (("dense", "densestream", "dense"),
                                            ("topk1", "topk1stream", f"top-k 1% (whole push per {ARGS.topk_scope})"),
                                            ("topk01", "topk01stream", f"top-k 0.1% (whole push per {ARGS.topk_scope})")):
        for topology in ("server", "colocated"):
            whole = row("stratus", whole_mode, topology)
            streamed = row("stratus", streamed_mode, topology)
            if whole is None or streamed is None:
                continue
            w_ms, s_ms = whole["steady_ms"]["mean"], streamed["steady_ms"]["mean"]
            if w_ms is not None and s_ms is not None:
                targets.append(("INFO", f"overlap of the exchange with backward: {what} {TOPOLOGY_NAME[topology]} steady-state "
                                        f"step {s_ms:.1f} ms pushed during backward vs {w_ms:.1f} ms after it = {s_ms / w_ms:.2f}x"))
    settings = (f"link {ARGS.rate} each way per node (tc tbf), {ARGS.workers} workers x batch {ARGS.batch}, "
                f"{MODELS[ARGS.model]}, {ARGS.optimizer}, eval every {ARGS.eval_every} steps, "
                f"target {tgt}, "
                f"cap {ARGS.max_steps} steps, seeds {ARGS.seeds}, data {ARGS.data}, torch {ARGS.torch}, "
                f"PowerSGD rank 4 from step {ARGS.powersgd_start}"
                + (f", top-k warm-up {ARGS.topk_warmup} steps" if ARGS.topk_warmup else "")
                + (f", top-k {ARGS.topk_recipe}" if ARGS.topk_recipe else "")
                + (", QUICK smoke test (numbers mean nothing)" if ARGS.quick else ""))
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print()
    print(settings)
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in table:
        print(line(r))
    print()
    for verdict, text in targets:
        print(f"{verdict}: {text}")

    md = ["# Stratus vs PyTorch DDP (scripts/bench-peers.sh)", "", settings, "",
          "| " + " | ".join(header) + " |",
          "|" + "|".join("---" if i < 3 else "---:" for i in range(len(header))) + "|"]
    md += ["| " + " | ".join(r) + " |" for r in table]
    md += ["", "Step, compute and comm are ms per step (evaluation left out); wire is KB sent + "
           "received per step on each worker node's link; times to the milestone and the target are "
           "training seconds (rank 0's clock). Steady is the mean step after the start-up (DDP, Stratus: the first step; "
           "PowerSGD: its dense all-reduce steps); start-up share is the start-up's seconds over the "
           "time to the target. Density is the top-k density of the push at the step the target was "
           "reached. Ratios are Stratus over DDP dense (/DDP) and over DDP+PowerSGD (/PSGD) of the "
           "same seed: times to the target, and steady-state step over steady-state step. With "
           "several seeds: mean (min-max) over seeds; the PASS/MISS lines divide the means over seeds."]
    md += [""] + [f"- {v}: {t}" for v, t in targets]
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "table.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(ARGS.out, "results.json"), "w") as f:
        json.dump({"settings": vars(ARGS), "summary": settings, "runs": runs, "rows": rows,
                   "targets": [{"verdict": v, "text": t} for v, t in targets]}, f, indent=1)
    return 0


if __name__ == "__main__":
    ARGS = parse_args()
    sys.exit(main())
