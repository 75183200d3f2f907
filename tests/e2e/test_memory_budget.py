"""A phase that goes above its device's budget during a run (`deploy.device_memory_mb`) stops the
run in one line naming the device, the phase, the bytes and the budget, with the last checkpoint
to resume from; a budget the run keeps to shows in its metrics beside the phase peaks."""

import pytest

from rlfusion.cli import main
from rlfusion.fusion.switch import DeviceSwitch
from rlfusion.obs.metrics import read_metrics
from rlfusion.runtime import run_state

MIB = 2**20
SMALL = ["max_steps=2", "checkpoint_every=25", "eval_every=25", "eval_problems=2", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_num_seqs=4", "collapse_patience=0",
         "threads=1", "deploy.backend=local", "reward=reward_fns:length_reward"]  # rewards that differ: updates


def _budget_on_the_switch(monkeypatch, budget: int) -> None:
    """A budget on the switch alone, with none in the config: the check before the first step
    passes (as it would for bytes it did not foresee), so the run-time stop is what acts."""
    init = DeviceSwitch.__init__

    def with_budget(self, *args, **kw):
        init(self, *args, **{**kw, "budget_bytes": budget})

    monkeypatch.setattr(DeviceSwitch, "__init__", with_budget)


def _last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]  # before it: the progress bar


def test_a_train_phase_over_the_budget_stops_with_a_checkpoint_to_resume(base, tmp_path, capsys, monkeypatch):
    """tiny on one device: weights, the reference and 4 KV rows (15.2 MiB) fit 20 MiB, so the
    base evaluation and the first rollout run; the first update's gradients and moments (33 MiB
    in all) do not."""
    _budget_on_the_switch(monkeypatch, 20 * MIB)
    args = [f"base={base}", f"out_dir={tmp_path}", "run_name=over", *SMALL]
    assert main(["train", *args]) == 2
    line = _last_line(capsys)
    assert line.startswith("rlfusion train: error: device 0: the train phase holds 33.0 MiB on the device "
                           "(weights 13.2 MiB, grads 6.6 MiB, optimizer 13.2 MiB), more than its budget "
                           "deploy.device_memory_mb=20 (20.0 MiB); the run stopped at step 0: its last "
                           "checkpoint (step 0) is in "), line
    assert line.endswith(f"`rlfusion train --resume {tmp_path / 'over'}` continues from it"), line
    assert run_state.has_checkpoint(tmp_path / "over")
    monkeypatch.undo()  # the same run, resumed where nothing holds it to the budget, goes on
    assert main(["train", "--resume", str(tmp_path / "over")]) == 0
    assert max(r["step"] for r in read_metrics(tmp_path / "over" / "metrics.jsonl")) == 2


def test_a_run_within_its_budget_reports_the_peaks_against_it(base, tmp_path, capsys):
    assert main(["train", f"base={base}", f"out_dir={tmp_path}", "run_name=within", "deploy.device_memory_mb=40",
                 *SMALL]) == 0
    rows = [r for r in read_metrics(tmp_path / "within" / "metrics.jsonl") if "reward_mean" in r]
    assert rows and all(r["memory_budget_mb"] == 40 for r in rows)
    for r in rows:
        for phase in ("rollout", "switch", "train"):
            if f"memory_peak_{phase}_mb" in r:  # (a step whose update kept no rows has no train phase)
                assert r[f"memory_budget_used_{phase}"] == pytest.approx(r[f"memory_peak_{phase}_mb"] / 40)
    trained = [r for r in rows if r["trained"]]
    assert trained and all(0 < r["memory_budget_used_rollout"] < r["memory_budget_used_train"] <= 1 for r in trained)
