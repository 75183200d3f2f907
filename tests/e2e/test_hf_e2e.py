"""README "Your own model and data", end to end: RL-train a local Hugging Face MoE checkpoint on
a local JSONL prompt set with the `rlfusion` command, then export the result back to HF."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import make_hf_model  # noqa: E402
from rlfusion.cli import main  # noqa: E402
from rlfusion.obs.metrics import read_metrics  # noqa: E402

# The README commands, with sizes cut down so two steps take seconds on 2 CPU cores.
TINY = ["max_steps=2", "eval_problems=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "threads=1", "deploy.backend=local"]


def write_prompts(path, n: int = 12):
    rows = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many apples now?",
             "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_readme_own_model_and_data(tmp_path, capsys):
    import transformers

    make_hf_model("qwen2_moe", tmp_path / "my-moe")
    write_prompts(tmp_path / "prompts.jsonl")
    rc = main(["train", f"base={tmp_path / 'my-moe'}", f"data.path={tmp_path / 'prompts.jsonl'}",
               "data.prompt_field=question", "data.answer_rule=after_hashes",
               "data.chat_template=true", "data.system_prompt=Answer with a number.",
               "data.num_heldout=4", f"out_dir={tmp_path / 'runs'}", "run_name=mine", *TINY])
    assert rc == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "mine"
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["generated_tokens"] > 0 for r in steps)
    assert json.loads((run / "config.json").read_text())["data"]["answer_rule"] == "after_hashes"

    rc = main(["export-hf", str(run / "final"), str(tmp_path / "my-moe-rl")])
    assert rc == 0, capsys.readouterr().err
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "my-moe-rl").eval()
    from rlfusion.model.checkpoint import load_checkpoint

    ours, tok, _ = load_checkpoint(run / "final")
    ids = torch.tensor([[tok.bos_id] + tok.encode("Tom has 3 apples")])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "my-moe-rl" / "config.json").read_text())["model_type"] == "qwen2_moe"


def test_bad_data_config_is_one_error_line(tmp_path, capsys):
    make_hf_model("qwen3_moe", tmp_path / "m")
    capsys.readouterr()  # the model writer's progress bar
    rc = main(["train", f"base={tmp_path / 'm'}", f"data.path={tmp_path / 'missing.jsonl'}",
               f"out_dir={tmp_path / 'runs'}", *TINY])
    err = capsys.readouterr().err
    assert rc == 2 and "missing.jsonl' does not exist" in err and err.count("\n") == 1
