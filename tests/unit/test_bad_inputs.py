"""Bad input to `rlfusion train` — config files, override values, prompt sets — ends in one
`rlfusion train: error: ...` line (exit 2) that names the file or key, the value and what is
allowed. Each case runs the real CLI in-process; all fail at config load or right after the
tiny base model loads, so none trains."""

import json

import pytest

from rlfusion.cli import main
from rlfusion.config import load_config
from rlfusion.model.checkpoint import SHIPPED_BASE
from rlfusion.runtime.train_config import TrainConfig

# Sizes that keep a run that got past validation short (none should).
TINY = ["deploy.backend=local", "max_steps=1", "eval_problems=2", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "threads=1"]


def train_error(capsys, tmp_path, *args: str) -> str:
    """Run `rlfusion train ARGS`; assert it failed with exactly one stderr line and return it."""
    files = [a for a in args if "=" not in a]  # a TOML path goes first, overrides after TINY's
    overrides = [a for a in args if "=" in a]
    capsys.readouterr()
    rc = main(["train", *files, f"base={SHIPPED_BASE}", f"out_dir={tmp_path / 'runs'}", *TINY, *overrides])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("rlfusion train: error: ")
    return lines[0]


def write_prompts(path, rows=None, extra: bytes = b""):
    """A prompt set the shipped base's tokenizer (digits, + = ; #) can encode, then `extra`."""
    rows = rows if rows is not None else [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]
    path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode() + extra)
    return path


# ---- 1. config files ----

def test_non_utf8_toml_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"seed = 1\n# caf\xe9\n")  # Latin-1, as an old editor saves it
    err = train_error(capsys, tmp_path, str(bad))
    assert f"config file {bad} is not UTF-8 text (byte 0xe9 on line 2)" in err


def test_toml_with_a_bom_loads(tmp_path):
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbfseed = 4\n")
    assert load_config(TrainConfig, tmp_path / "bom.toml").seed == 4


# ---- 2-4. prompt sets ----

def test_non_utf8_jsonl_names_the_file_and_line(tmp_path, capsys):
    path = write_prompts(tmp_path / "x.jsonl", extra=b'{"prompt": "1+\xe9=", "answer": "1"}\n')
    err = train_error(capsys, tmp_path, f"data.path={path}", "data.num_heldout=2")
    assert f"{path}:7: not UTF-8 text (byte 0xe9 at column 15)" in err


def test_directory_as_data_path_says_what_is_expected(tmp_path, capsys):
    err = train_error(capsys, tmp_path, f"data.path={tmp_path}", "data.format=jsonl")
    assert f"data.path='{tmp_path}' is a directory; allowed: a .jsonl or .parquet file" in err


def test_unknown_character_names_the_row(tmp_path, capsys):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"},
            {"prompt": "2+é=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    path = write_prompts(tmp_path / "x.jsonl", rows)
    err = train_error(capsys, tmp_path, f"data.path={path}", "data.num_heldout=2")
    assert f"{path}:3: prompt has character 'é' the tokenizer does not know; allowed: '0123456789+=;#'" in err


def test_unknown_character_in_the_system_prompt_names_the_key(tmp_path, capsys):
    path = write_prompts(tmp_path / "x.jsonl")
    err = train_error(capsys, tmp_path, f"data.path={path}", "data.num_heldout=2", "data.system_prompt=Hi")
    assert "data.system_prompt has character 'H' the tokenizer does not know" in err


def test_not_a_parquet_file_is_one_line(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    path = write_prompts(tmp_path / "x.parquet")
    err = train_error(capsys, tmp_path, f"data.path={path}", "data.num_heldout=2")
    assert f"data.path='{path}' is not a readable Parquet file" in err and "data.format=jsonl" in err


# ---- 5. non-finite and out-of-range numbers ----

@pytest.mark.parametrize("override, message", [
    ("algo.kl_coef=inf", "config key 'algo.kl_coef' must be a finite number, got inf"),
    ("rollout.temperature=inf", "config key 'rollout.temperature' must be a finite number, got inf"),
    ("rollout.temperature=nan", "config key 'rollout.temperature' must be a finite number, got nan"),
    ("optim.lr=-inf", "config key 'optim.lr' must be a finite number, got -inf"),
    ("time_budget_s=inf", "'time_budget_s' must be a finite number, got inf (for no limit give a large value"),
    ("algo.kl_coef=1e400", "'algo.kl_coef' must be a finite number, got inf"),  # overflows to inf
    ("time_budget_s=1" + "0" * 400, "'time_budget_s' must be a finite number, got an integer of 401 digits"),
    ("seed=18446744073709551616", "config key 'seed' must be a 64-bit integer, got 18446744073709551616"),
])
def test_non_finite_or_huge_numbers_are_refused(tmp_path, capsys, override, message):
    assert message in train_error(capsys, tmp_path, override)


def test_non_finite_number_in_a_toml_table(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("[algo]\nkl_coef = nan\n")
    err = train_error(capsys, tmp_path, str(tmp_path / "run.toml"))
    assert "config key 'algo.kl_coef' must be a finite number, got nan" in err


# ---- 6. StaleSync keys without StaleSync ----

@pytest.mark.parametrize("override", ["stalesync.max_staleness=2", "stalesync.overdue=drop",
                                      "stalesync.rollout_finish_threshold=0.5"])
def test_stalesync_keys_without_enabled_are_refused(tmp_path, capsys, override):
    err = train_error(capsys, tmp_path, override)
    key, value = override.split("=")
    assert f"{key}=" in err and "has no effect unless stalesync.enabled=true" in err


def test_stalesync_keys_with_enabled_load():
    cfg = load_config(TrainConfig, None, ["stalesync.enabled=true", "stalesync.max_staleness=2"])
    assert cfg.stalesync.max_staleness == 2


# ---- 7. eval_problems above the held-out set ----

def test_eval_problems_above_a_prompt_sets_heldout_rows(tmp_path, capsys):
    path = write_prompts(tmp_path / "x.jsonl")
    capsys.readouterr()
    rc = main(["train", f"data.path={path}", "data.num_heldout=2", f"out_dir={tmp_path}",
               "deploy.backend=local", "eval_problems=3"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines == [f"rlfusion train: error: eval_problems=3 is more than the 2 held-out "
                                 f"problems of data.path='{path}'; allowed: 1 to 2 (or raise data.num_heldout)"]


def test_eval_problems_above_the_builtin_heldout(tmp_path, capsys):
    err = train_error(capsys, tmp_path, "eval_problems=501")
    assert "eval_problems=501 is more than the 500 held-out problems of the built-in task" in err


def test_default_eval_problems_lowers_to_a_prompt_sets_heldout(tmp_path):
    cfg = load_config(TrainConfig, None, [f"data.path={tmp_path / 'x.jsonl'}", "data.num_heldout=4"])
    assert cfg.eval_problems == 4  # the built-in task's default (500) would be more than exist
