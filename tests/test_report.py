"""`mhc report`: runs grouped by their tags, mean +- std over seeds, tables, plots and the markdown report."""
import json
import math
import time

import mlflow
import pytest
from mlflow.entities import Metric, Param

from mhc_lightning.cli import main


def make_runs(uri: str):
    """Two variants x two depths x two seeds with known metrics; one FAILED run that must be ignored."""
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("grid")
    for variant, gain in (("hc", 10.0), ("mhc", 1.0)):
        for depth in (2, 4):
            for seed in (1, 2):
                run = client.create_run(exp, run_name=f"{variant}-L{depth}-s{seed}",
                                        tags={"variant": variant, "model.arch.n_layers": str(depth), "seed_everything": str(seed)})
                rid, now = run.info.run_id, int(time.time() * 1000)
                metrics = [Metric("val/bpb", 2.0 + 0.1 * seed, now, 50)]
                for step in range(0, 50, 10):
                    metrics += [
                        Metric("train/grad_norm", 1.0 + (9.0 if step == 30 and variant == "hc" else 0.0), now, step),
                        Metric("amax/composite_fwd_max", 1.0 + (gain - 1) * depth * step / 40 if variant == "hc" else 1.0,
                               now, step),
                        Metric("amax/composite_bwd_max", 1.0 + (gain - 1) * depth * step / 50 if variant == "hc" else 1.0,
                               now, step),
                        Metric("train/tokens_per_sec", 1000.0 * seed, now, step)]
                client.log_batch(rid, metrics=metrics, params=[Param("optim/warmup_steps", "0")])
                with open("per_layer.json", "w") as f:
                    json.dump({"composite_fwd_max": [gain, 1.0], "composite_bwd_max": [gain, 1.0]}, f)
                client.log_artifact(rid, "per_layer.json", "diagnostics")  # not per_layer_step*: ignored
                # the loader looks for per_layer_stepNNNNNNN.json
                client.log_dict(rid, {"composite_fwd_max": [gain, 1.0], "composite_bwd_max": [gain, 1.0]},
                                "diagnostics/per_layer_step0000040.json")
                client.set_terminated(rid, "FINISHED")
    broken = client.create_run(exp, run_name="hc-L2-s3", tags={"variant": "hc", "model.arch.n_layers": "2"})
    client.log_metric(broken.info.run_id, "val/bpb", 99.0)
    client.set_terminated(broken.info.run_id, "FAILED")


def test_report_groups_over_seeds(mlflow_uri, tmp_path, capsys):
    make_runs(mlflow_uri)
    notes = tmp_path / "notes.md"
    notes.write_text("## Reading\nhand-written text\n")
    out, rep = tmp_path / "results", tmp_path / "results.md"
    with pytest.raises(SystemExit) as exc:
        main(["report", "--experiment", "grid", "--group-by", "variant,model.arch.n_layers",
              "--tracking-uri", mlflow_uri, "--out", str(out), "--report", str(rep), "--notes", str(notes)])
    assert exc.value.code == 0
    table = (out / "groups.md").read_text().splitlines()
    assert len(table) == 2 + 4  # header, rule, 4 groups; the FAILED run is not counted
    hc4 = next(l for l in table if l.startswith("| hc | 4 |"))
    cells = [c.strip() for c in hc4.strip("|").split("|")]
    assert cells[2] == "2"  # runs
    assert cells[3] == f"2.1500 ± {math.sqrt(0.005):.4f}"  # val bpb 2.1 and 2.2: mean, sample std
    assert cells[4].startswith("37 ± 0")  # peak Amax 1 + 9 * 4 = 37
    header = [c.strip() for c in table[0].strip("|").split("|")]
    spikes = cells[next(i for i, h in enumerate(header) if h.startswith("grad spikes"))]
    assert "1 ± 0" in spikes or "1 ±" in spikes  # one grad spike in each hc run
    mhc2 = next(l for l in table if l.startswith("| mhc | 2 |"))
    assert "| 1 ± 0 |" in mhc2
    for png in ("bpb_vs_depth", "amax_vs_depth", "amax_over_training", "amax_vs_layer", "grad_norm", "val_bpb_curves"):
        assert (out / f"{png}.png").stat().st_size > 5000
    text = rep.read_text()
    assert "mhc compare --experiment grid" in text and "hand-written text" in text and "](results/amax_vs_depth.png)" in text


def test_report_names_missing_group_tags(mlflow_uri, tmp_path, capsys):
    make_runs(mlflow_uri)
    with pytest.raises(SystemExit) as exc:
        main(["report", "--experiment", "grid", "--group-by", "variant,depth", "--tracking-uri", mlflow_uri,
              "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    assert "depth" in capsys.readouterr().err
