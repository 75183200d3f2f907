"""`rlfusion train` runs the config `rlfusion plan --emit-config` wrote: the planner's layout for
2 CPU devices (experts split over both, sharded data parallel), one step of the tiny model."""

from __future__ import annotations

import json

from rlfusion.cli import main

SMALL = ["max_steps=1", "checkpoint_every=25", "eval_every=25", "eval_problems=2", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=8", "collapse_patience=0", "algo.dynamic_sampling=false"]


def test_train_runs_the_emitted_config(base, tmp_path, ray_session, capsys):
    path = tmp_path / "plan.toml"
    assert main(["plan", "--model", "tiny", "--cluster", "cpu:2", "--seq", "128", "--global-batch", "8",
                 "--top", "1", "--layout", "ep2", "--emit-config", str(path)]) == 0
    assert main(["train", str(path), f"base={base}", f"out_dir={tmp_path}", "run_name=planned", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "the actor trains as tp1 x ep2 x fsdp2" in out  # the planned layout, as the run placed it
    (step,) = [json.loads(line) for line in (tmp_path / "planned" / "metrics.jsonl").read_text().splitlines()
               if "ep_a2a_mb" in line]
    assert step["ep_a2a_mb"] > 0 and step["ep_a2a_hierarchical"] == 0.0  # one node
