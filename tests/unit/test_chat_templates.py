"""Chat templates (model/chat_template.py): a template that does not compile or fails to render
ends `rlfusion train` in one line naming the template's file and line (exit 2), before any
weight is read; `{% generation %}` renders as transformers renders it and marks the same
assistant tokens as transformers' `return_assistant_tokens_mask`."""

import json
import shutil
from pathlib import Path

import pytest

from hf_helpers import CHATML, make_tokenizer
from rlfusion import cli
from rlfusion.model.config import ModelConfig
from rlfusion.model.transformer import MoETransformer

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

# ChatML with the assistant's turns inside {% generation %}, as hub templates mark them
GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
              "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
              "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? Ünïcode ok"},
        {"role": "assistant", "content": "4, I think."}, {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes: 4"}]
TRAIN = ["data.prompt_field=question", "data.chat_template=true", "data.num_heldout=2", "deploy.backend=local",
         "max_steps=1", "eval_problems=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "threads=1"]
BAD = {  # template, the line it is wrong on, what jinja says
    "syntax_error": ("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}", 2, "unexpected '}'"),
    "unknown_tag": ("{% for m in messages %}\n{% assistant %}{{ m['content'] }}\n{% endfor %}", 2,
                    "unknown tag 'assistant'"),
    "unclosed_generation": ("{% for m in messages %}\n{% generation %}{{ m['content'] }}\n{% endfor %}", 3,
                            "endgeneration"),
}


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny llama folder written by `save_hf` (no transformers needed) and a prompt set."""
    from rlfusion.model.hf import save_hf

    cfg = ModelConfig(vocab_size=320, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                      num_dense_layers=1, dense_ffn_dim=64, num_experts=0, top_k=0, expert_ffn_dim=0,
                      num_shared_experts=0)
    root = tmp_path_factory.mktemp("chat")
    save_hf(MoETransformer(cfg), root / "llama", family="llama")
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _with_template(hf_base: Path, tmp_path: Path, template: str, jinja_file: bool = False) -> Path:
    base = tmp_path / "base"
    shutil.copytree(hf_base / "llama", base)
    make_tokenizer(base, None if jinja_file else template)
    if jinja_file:  # transformers 4.43+ saves the template beside tokenizer_config.json
        (base / "chat_template.jinja").write_text(template)
    return base


def _train_error(capsys, hf_base: Path, tmp_path: Path, base: Path) -> str:
    capsys.readouterr()
    rc = cli.main(["train", f"base={base}", f"data.path={hf_base / 'prompts.jsonl'}", *TRAIN,
                   f"out_dir={tmp_path / 'runs'}", "run_name=r"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlfusion train: error: "), err
    assert not (tmp_path / "runs" / "r" / "checkpoint").exists()
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD))
def test_template_that_does_not_compile_is_one_line_naming_file_and_line(case, hf_base, tmp_path, capsys):
    template, line, says = BAD[case]
    base = _with_template(hf_base, tmp_path, template)
    (base / "model.safetensors").write_bytes(b"not read: the template is checked first")
    err = _train_error(capsys, hf_base, tmp_path, base)
    assert f"{base / 'tokenizer_config.json'}: chat_template line {line}: " in err and says in err, err


def test_template_file_is_named_with_its_line(hf_base, tmp_path, capsys):
    base = _with_template(hf_base, tmp_path, BAD["unknown_tag"][0], jinja_file=True)
    err = _train_error(capsys, hf_base, tmp_path, base)
    assert f"{base / 'chat_template.jinja'} line 2: " in err and "unknown tag 'assistant'" in err, err


@pytest.mark.parametrize("template, line, says", [
    ("{% for m in messages %}\n{{ raise_exception('System role not supported') }}\n{% endfor %}", 2,
     "raise_exception: System role not supported"),
    ("{% for m in messages %}\n\n{{ m['content'] + 1 }}{% endfor %}", 3, "TypeError"),
    ("{{ messages.append(1) }}", 1, "SecurityError"),  # sandboxed: a template cannot change its input
], ids=["raise_exception", "type_error", "sandbox"])
def test_template_that_fails_to_render_is_one_line_naming_file_and_line(template, line, says, hf_base,
                                                                        tmp_path, capsys):
    base = _with_template(hf_base, tmp_path, template)
    err = _train_error(capsys, hf_base, tmp_path, base)
    assert f"tokenizer_config.json: chat_template line {line}: {says}" in err, err


def test_checkpoint_template_is_named_by_the_checkpoint_config():
    from rlfusion.model.hf_tokenizer import tokenizer_from_dict

    d = {"kind": "hf", "tokenizer_json": _tokenizer_json(), "special": {"eos_token": "<|im_end|>"},
         "chat_template": "a\nb\n{% endif %}"}
    with pytest.raises(ValueError, match=r"^ckpt/config.json: chat_template line 3: TemplateSyntaxError: "):
        tokenizer_from_dict(d, "ckpt/config.json")


def _tokenizer_json() -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        make_tokenizer(Path(tmp))
        return (Path(tmp) / "tokenizer.json").read_text()


def test_generation_template_trains_through_the_cli(hf_base, tmp_path, capsys):
    base = _with_template(hf_base, tmp_path, GENERATION)
    rc = cli.main(["train", f"base={base}", f"data.path={hf_base / 'prompts.jsonl'}", *TRAIN,
                   f"out_dir={tmp_path / 'runs'}", "run_name=r"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "runs" / "r" / "checkpoint").is_dir()


# ---- the same text and assistant tokens as transformers ------------------------------------

def _both(tmp_path: Path, template: str, bos: str | None = None):
    """Our tokenizer and transformers' fast tokenizer of one folder."""
    transformers = pytest.importorskip("transformers")
    from rlfusion.model.hf_tokenizer import HFTokenizer

    make_tokenizer(tmp_path / "tok", template)
    if bos:
        config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    return HFTokenizer.from_dir(tmp_path / "tok"), transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")


@pytest.mark.parametrize("turns", [2, 3, 5])
@pytest.mark.parametrize("prompt", [False, True])
def test_generation_tag_renders_and_masks_like_transformers(turns, prompt, tmp_path):
    ours, theirs = _both(tmp_path, GENERATION)
    chat = CHAT[:turns]
    text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
    out = theirs.apply_chat_template(chat, tokenize=True, return_dict=True, add_generation_prompt=prompt,
                                     return_assistant_tokens_mask=True)
    rendered = ours.render_chat(chat, add_generation_prompt=prompt)
    ids, mask = ours.chat_tokens(chat, add_generation_prompt=prompt)
    assert rendered.text == text
    assert ids == list(out["input_ids"]) and mask == list(out["assistant_masks"])
    said = [m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]
    assert [text[a:b] for a, b in rendered.assistant_spans] == said
    assert ours.decode([i for i, m in zip(ids, mask) if m], skip_special=False) == "".join(said)


def test_template_without_generation_tag_masks_nothing_and_renders_as_before(tmp_path):
    ours, theirs = _both(tmp_path, CHATML)
    ids, mask = ours.chat_tokens(CHAT)
    assert ours.render_chat(CHAT).text == theirs.apply_chat_template(CHAT, tokenize=False)
    assert len(ids) == len(mask) and not any(mask)
    assert ours.apply_chat_template(CHAT[:2]) == theirs.apply_chat_template(CHAT[:2], tokenize=False,
                                                                            add_generation_prompt=True)


def test_leading_bos_is_dropped_with_its_token(tmp_path):
    """The project's convention: the rollout puts bos_id first, so the rendered text starts after
    a BOS string the template writes; the mask loses that one token and nothing else."""
    ours, theirs = _both(tmp_path, "{{ bos_token }}" + GENERATION, bos="<|endoftext|>")
    text = theirs.apply_chat_template(CHAT, tokenize=False)
    out = theirs.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = ours.chat_tokens(CHAT)
    assert ours.render_chat(CHAT).text == text.removeprefix("<|endoftext|>")
    assert ids == list(out["input_ids"])[1:] and mask == list(out["assistant_masks"])[1:]


def test_tojson_renders_like_transformers(tmp_path):
    """Hub templates write tool calls with `tojson`: transformers' filter (no HTML escaping, keys
    in order), not jinja's."""
    template = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    ours, theirs = _both(tmp_path, template)
    chat = [{"role": "user", "content": "<b> & 'é'", "zeta": 1, "alpha": [1, 2]}]
    assert ours.render_chat(chat).text == theirs.apply_chat_template(chat, tokenize=False)
