"""Config loading: TOML + key=value overrides into typed dataclasses, with one-line errors."""

import pytest

from rlfusion.cli import main
from rlfusion.config import load_config
from rlfusion.pretrain import PretrainConfig
from rlfusion.runtime.train_config import TrainConfig


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('seed = 3\n[rollout]\ngroup_size = 4\n[algo]\nclip_high = 0.28\n')
    cfg = load_config(TrainConfig, path, ["rollout.group_size=6", "optim.lr=1e-4", "run_name=nan"])
    assert cfg.seed == 3 and cfg.rollout.group_size == 6 and cfg.algo.clip_high == 0.28
    assert cfg.optim.lr == 1e-4 and cfg.run_name == "nan"  # string keys keep the text verbatim
    assert cfg.rollout.prompts_per_step == TrainConfig().rollout.prompts_per_step


@pytest.mark.parametrize("override, message", [
    ("seeds=1", "unknown config key 'seeds'"),
    ("rollout.groupsize=2", "unknown config key 'rollout.groupsize'"),
    ("seed=1.5", "config key 'seed' must be int"),
    ("algo.dynamic_sampling=3", "config key 'algo.dynamic_sampling' must be bool"),
    ("rollout=3", "config key 'rollout' must be a table"),
    ("rollout.group_size=1", "rollout.group_size=1 is invalid"),
    ("novalue", "not of the form key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_config(TrainConfig, None, [override])


def test_bad_toml_file(tmp_path):
    (tmp_path / "bad.toml").write_text("seed = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(PretrainConfig, tmp_path / "bad.toml")
    with pytest.raises(ValueError, match="does not exist"):
        load_config(PretrainConfig, tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="cannot be read"):
        load_config(PretrainConfig, tmp_path)  # a run folder given where a TOML file goes


def test_cli_info_prints_param_counts(capsys):
    assert main(["info", "--model", "pangu-ultra-moe-718b"]) == 0
    out = capsys.readouterr().out
    assert "719,093" in out.replace(" ", "") or "719.09B" in out
    assert main(["info", "--model", "nope"]) == 2
    assert "allowed: tiny" in capsys.readouterr().err


def test_cli_eval_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["eval", "--ckpt", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and len(err.strip().splitlines()) == 1


def test_train_has_no_pretraining_keys(tmp_path, capsys):
    assert "pretrain" not in TrainConfig.__dataclass_fields__  # `rlfusion pretrain` owns them
    (tmp_path / "run.toml").write_text("[pretrain]\nseed = 2\n")
    for args in (["pretrain.seed=1"], [str(tmp_path / "run.toml")]):
        assert main(["train", *args, f"out_dir={tmp_path / 'runs'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "unknown config key 'pretrain'" in err
        assert "rlfusion pretrain" in err
    assert not (tmp_path / "runs").exists()


def test_train_without_a_base_names_rlfusion_pretrain(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rlfusion.model.checkpoint.find_base", lambda model="tiny": None)
    assert main(["train", "max_steps=1", f"out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no base model" in err and "`rlfusion pretrain`" in err
    assert not (tmp_path / "runs").exists()


def test_max_num_seqs_has_one_default():
    """Every layer with the knob takes the engine scheduler's `MAX_NUM_SEQS`; `rlfusion train`'s
    (`rollout.max_num_seqs`) is 128."""
    import inspect

    from rlfusion.engine.engine import EngineConfig
    from rlfusion.engine.scheduler import MAX_NUM_SEQS, SchedulerConfig
    from rlfusion.engine.vllm_backend import VLLMEngine
    from rlfusion.evaluate import evaluate
    from rlfusion.measure import calibrate
    from rlfusion.sim.rl_config import RLSimConfig

    signature_default = lambda fn: inspect.signature(fn).parameters["max_num_seqs"].default
    assert TrainConfig().rollout.max_num_seqs == MAX_NUM_SEQS == 128
    assert {EngineConfig().max_num_seqs, SchedulerConfig().max_num_seqs, RLSimConfig().max_num_seqs,
            signature_default(VLLMEngine.__init__), signature_default(evaluate),
            signature_default(calibrate.engine_step_times)} == {MAX_NUM_SEQS}
